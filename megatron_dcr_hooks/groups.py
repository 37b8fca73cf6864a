"""The process groups the owner hook uses, passed in explicitly.

`ParallelGroups` is a frozen bundle of the trainer job's process groups and this rank's
position in each: the job-wide group (every reduction of the hook and the owner service, the
payload owner id, the residual-baseline owner), the tensor-, data-, expert- and
expert-data-parallel groups (ownership: who holds bitwise-identical copies of a shard; the
EP-global expert index) and the pipeline group (the other stages' parameter names; the
bridge's pipeline broadcasts). `enable_dcr` / `DCRHook` take
one (``groups=``); the default, `ParallelGroups.from_megatron()`, reads megatron-core's
``parallel_state`` once, in the hook's constructor. Nothing below the constructor calls the
``parallel_state`` getters or uses the default process group implicitly, so a job that runs
DCR on groups of its own (a sub-world, a separate gloo group for CPU reductions) passes them in.

Backends: `host` is the group DCR's own CPU reductions over the job run on (counts, flags, the
owner service's requests). It is the world group when that takes CPU tensors (gloo, or
``cpu:gloo,cuda:nccl``); on an NCCL world the hook's constructor creates a gloo group over the
same ranks (`collectives.with_host`), or uses the one passed as ``host=``. collectives.py has
the rule for every other collective DCR issues.

Limitations:
1. megatron-bridge's mapping classes run their own TP/EP gathers on megatron-core's
   ``parallel_state`` groups (inside ``megatron_to_hf``); the TP and EP groups given here must
   be the same groups (`from_megatron` guarantees it).
2. Data-parallel ranks are taken *with* context parallelism (``with_context_parallel=True``):
   context-parallel ranks hold bitwise-identical copies of every non-expert shard, exactly as
   data-parallel replicas do (megatron reduces gradients over the DP x CP group). Expert-data-
   parallel groups already span the context-parallel ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class RankGroup:
    """One process group and this rank's position in it.

    `group`: the ``torch.distributed`` process group handle (``None`` only in in-process unit
    tests that never reduce over it); `rank`: this rank's index in the group; `size`: its size.
    """

    group: Any
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"RankGroup rank {self.rank} outside a group of size {self.size}")


def takes_host_tensors(group: Any) -> bool:
    """True when collectives on `group` accept CPU tensors.

    ``None`` (an in-process one-rank group that never reduces) and a bare gloo backend do; a
    ``ProcessGroup`` does when a backend is registered for the CPU device type (gloo, MPI, a
    ``cpu:gloo,...`` backend string); an NCCL group does not."""
    import torch.distributed as dist

    if group is None or isinstance(group, dist.ProcessGroupGloo):
        return True
    devices = getattr(group, "_device_types", None)  # ProcessGroup: its backends' device types
    if devices is not None:
        return torch.device("cpu") in devices
    backend = str(dist.get_backend(group))
    return "gloo" in backend or "mpi" in backend


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelGroups:
    """The trainer job's process groups as the owner hook needs them (module docstring).

    `world`: every rank of the job (reductions, owner ids = ``world.rank``); `tp`: tensor
    parallel; `dp`: data parallel x context parallel (holders of identical non-expert shards); `ep`: expert model parallel;
    `expert_dp`: expert data parallel (holders of identical expert shards); `pp`: pipeline;
    `host`: the world's ranks on a backend that takes CPU tensors (module docstring): defaults
    to `world` when its backend does, else stays ``None`` until `collectives.with_host`.
    """

    world: RankGroup
    tp: RankGroup
    dp: RankGroup
    ep: RankGroup
    expert_dp: RankGroup
    pp: RankGroup
    host: RankGroup | None = None

    def __post_init__(self) -> None:
        if self.host is None and takes_host_tensors(self.world.group):
            object.__setattr__(self, "host", self.world)
        if self.host is not None and (
            self.host.rank != self.world.rank or self.host.size != self.world.size
        ):
            raise ValueError(
                f"ParallelGroups host group (rank {self.host.rank} of {self.host.size}) does "
                f"not span the world (rank {self.world.rank} of {self.world.size})"
            )

    @property
    def cpu_world(self) -> RankGroup:
        """The group DCR's CPU reductions over the job run on (`host`, resolved)."""
        if self.host is None:
            raise ValueError(
                "the world group takes no CPU tensors (NCCL) and no host group is set: "
                "build the hook (it creates one) or pass ParallelGroups(host=<gloo group>)"
            )
        return self.host

    def replace(self, **changes: Any) -> ParallelGroups:
        """A copy with `changes` (a new `world` resets `host` unless it is given too)."""
        if "world" in changes and "host" not in changes:
            changes["host"] = None
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_megatron() -> ParallelGroups:
        """The groups megatron-core's ``parallel_state`` initialized (every rank calls after
        ``initialize_model_parallel``; no collectives)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not dist.is_initialized() or not ps.model_parallel_is_initialized():
            raise ValueError(
                "ParallelGroups.from_megatron() needs torch.distributed and megatron-core's "
                "parallel_state initialized (initialize_model_parallel); or pass groups="
            )
        return ParallelGroups(
            world=RankGroup(
                group=dist.group.WORLD, rank=dist.get_rank(), size=dist.get_world_size()
            ),
            tp=RankGroup(
                group=ps.get_tensor_model_parallel_group(),
                rank=ps.get_tensor_model_parallel_rank(),
                size=ps.get_tensor_model_parallel_world_size(),
            ),
            dp=RankGroup(
                group=ps.get_data_parallel_group(with_context_parallel=True),
                rank=ps.get_data_parallel_rank(with_context_parallel=True),
                size=ps.get_data_parallel_world_size(with_context_parallel=True),
            ),
            ep=RankGroup(
                group=ps.get_expert_model_parallel_group(),
                rank=ps.get_expert_model_parallel_rank(),
                size=ps.get_expert_model_parallel_world_size(),
            ),
            expert_dp=RankGroup(
                group=ps.get_expert_data_parallel_group(),
                rank=ps.get_expert_data_parallel_rank(),
                size=ps.get_expert_data_parallel_world_size(),
            ),
            pp=RankGroup(
                group=ps.get_pipeline_model_parallel_group(),
                rank=ps.get_pipeline_model_parallel_rank(),
                size=ps.get_pipeline_model_parallel_world_size(),
            ),
        )

    @staticmethod
    def single() -> ParallelGroups:
        """One rank, no parallelism, no process groups: for in-process unit tests of the pure
        parts (ownership, affine maps) that never reduce."""
        one = RankGroup(group=None, rank=0, size=1)
        return ParallelGroups(world=one, tp=one, dp=one, ep=one, expert_dp=one, pp=one)


__all__ = ["ParallelGroups", "RankGroup", "takes_host_tensors"]
