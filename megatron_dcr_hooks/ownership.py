"""Ownership: exactly one owner per unique source element, by a stable name hash.

Ranks that hold bitwise-identical copies of a shard form its *holder group*: the data-parallel
ranks for tensor-parallel shards, the data-parallel x tensor-parallel ranks for replicated
tensors (norms, routers), the expert-data-parallel ranks for expert shards. The owner is the
member at position ``stable_hash(task name) % group size``; the choice depends only on names
and layout, so it is fixed across attempts and identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dcr_hooks.tasks import Task, stable_hash


@dataclass(frozen=True, slots=True)
class Holders:
    """This rank's position in a holder group and the group's size."""

    index: int
    size: int


def holders_of(task: Task) -> Holders:
    """The holder group of `task`'s shard on this rank."""
    from megatron.core import parallel_state as ps

    if task.expert:
        return Holders(ps.get_expert_data_parallel_rank(), ps.get_expert_data_parallel_world_size())
    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    if task.replicated:
        tp, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        return Holders(tp * dp_size + dp, tp_size * dp_size)
    return Holders(dp, dp_size)


def owns(task: Task) -> bool:
    """Whether this rank owns `task`'s shard (one owner among its holders)."""
    h = holders_of(task)
    return stable_hash(task.name) % h.size == h.index


def residual_owner(canonical_name: str, world_size: int) -> int:
    """Global rank holding the residual baseline of a canonical tensor."""
    return stable_hash("residual:" + canonical_name) % world_size
