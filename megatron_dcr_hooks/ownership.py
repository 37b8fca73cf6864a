"""Ownership: exactly one owner per unique source element, by a stable name hash.

Ranks that hold bitwise-identical copies of a shard form its *holder group*: the data-parallel
ranks for tensor-parallel shards, the data-parallel x tensor-parallel ranks for replicated
tensors (norms, routers), the expert-data-parallel ranks for expert shards. The owner is the
member at position ``stable_hash(task name) % group size``; the choice depends only on names
and layout, so it is fixed across attempts and identical on every rank.

Pure functions of a task and the `ParallelGroups` the hook was given: no process-group getters,
no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dcr_hooks.groups import ParallelGroups
from megatron_dcr_hooks.tasks import Task
from shared_codec.scan import stable_hash


@dataclass(frozen=True, slots=True)
class Holders:
    """This rank's position in a holder group and the group's size."""

    index: int
    size: int


def holders_of(task: Task, groups: ParallelGroups) -> Holders:
    """The holder group of `task`'s shard on this rank."""
    if task.expert:
        return Holders(groups.expert_dp.rank, groups.expert_dp.size)
    dp = groups.dp
    if task.replicated:
        return Holders(groups.tp.rank * dp.size + dp.rank, groups.tp.size * dp.size)
    return Holders(dp.rank, dp.size)


def owns(task: Task, groups: ParallelGroups) -> bool:
    """Whether this rank owns `task`'s shard (one owner among its holders)."""
    h = holders_of(task, groups)
    return stable_hash(task.name) % h.size == h.index


def residual_owner(canonical_name: str, world_size: int) -> int:
    """Job rank (in ``groups.world``) holding the residual baseline of a canonical tensor."""
    return stable_hash("residual:" + canonical_name) % world_size
