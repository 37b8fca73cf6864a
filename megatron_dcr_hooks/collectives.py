"""DCR's own collectives, each on the backend of the group it uses.

Megatron-LM and Megatron-Bridge jobs initialize ``torch.distributed`` with NCCL: the world
group and megatron-core's TP/PP/EP groups then take CUDA tensors only (a CPU tensor raises
"No backend type associated with device type cpu"). DCR's own reductions are small host
tensors (counts, flags, names, JSON requests), so the rule is:

1. Where DCR needs a CPU collective over the job (every reduction of the hook, the residual
   baseline, the task classification and the owner service), it runs it on
   ``ParallelGroups.host``: the world group itself when its backend takes CPU tensors (gloo,
   or ``cpu:gloo,cuda:nccl``), else a gloo group over the same ranks that `with_host`
   creates once, in the hook's constructor (megatron-core has gloo groups for data
   parallelism only, none over the job).
2. Every other collective DCR issues (the pipeline group's name gather in conversion.py) goes
   through `all_gather` / `all_reduce` / `broadcast` here, which put the tensor on the group's
   device (`group_device`: the host when the backend takes CPU tensors, else the current
   accelerator device) and hand back a host tensor.

So DCR runs unchanged on a world initialized with ``nccl``, with ``cpu:gloo,cuda:nccl`` and with
``gloo`` (docs/operations.md, "Process groups and backends").

Limitation: `host_group_for` creates the gloo group with ``torch.distributed.new_group``, which
every rank of the default group must enter, in the same order as its other group creations
(the hooks of a job are constructed on every rank). A job whose DCR world is a sub-world of an
NCCL default group passes ``ParallelGroups(host=...)`` a gloo group it made itself.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_dcr_hooks.groups import ParallelGroups, RankGroup, takes_host_tensors

_HOST = torch.device("cpu")


def group_device(group: Any) -> torch.device:
    """The device whose tensors `group`'s collectives take: the host when the backend takes CPU
    tensors, else the current accelerator device (``torch.accelerator``)."""
    if takes_host_tensors(group):
        return _HOST
    # a CUDA build of torch names an accelerator on a host without a device: ask if one is usable
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        raise RuntimeError(
            "a process group without a CPU backend (NCCL) and no accelerator on this host: "
            "initialize torch.distributed with gloo or 'cpu:gloo,cuda:nccl', or pass "
            "ParallelGroups(host=...) a gloo group"
        )
    return torch.device(acc.type, torch.accelerator.current_device_index())


def all_reduce(tensor: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """`tensor` all-reduced over `group` (on the group's device), as a host tensor."""
    t = tensor.to(group_device(group))
    dist.all_reduce(t, op=op, group=group)
    return t.to(_HOST)


def all_gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape and dtype on every rank) over `group`, as host tensors
    in rank order."""
    dev = group_device(group)
    t = tensor.to(dev)
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return [o.to(_HOST) for o in out]


def broadcast(tensor: torch.Tensor, group: Any, src: int = 0) -> torch.Tensor:
    """Group rank `src`'s `tensor` on every rank of `group` (every rank passes a tensor of the
    same shape and dtype), as a host tensor."""
    t = tensor.to(group_device(group))
    dist.broadcast(t, group=group, group_src=src)
    return t.to(_HOST)


def host_group_for(world: RankGroup) -> RankGroup:
    """A group over `world`'s ranks whose collectives take CPU tensors: `world` itself when its
    backend does, else a gloo group created here (collective over `world`'s ranks; a one-rank
    world gets a private one-rank gloo group, no rendezvous)."""
    if takes_host_tensors(world.group):
        return world
    if world.size == 1:
        group: Any = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(minutes=30))
    else:
        # every rank of the job calls (the hook is constructed on every rank); not
        # ``use_local_synchronization``: its group name hashes the number of groups each rank
        # belongs to, which megatron's TP/PP/EP groups make differ, so the ranks never meet
        ranks = dist.get_process_group_ranks(world.group)
        group = dist.new_group(ranks=ranks, backend="gloo")
    return RankGroup(group=group, rank=world.rank, size=world.size)


def with_host(groups: ParallelGroups) -> ParallelGroups:
    """`groups` with `ParallelGroups.host` resolved: unchanged when it is set (the world itself
    on gloo, or a group the caller passed), else a gloo group over the world's ranks
    (`host_group_for`; collective over the world's ranks)."""
    if groups.host is not None:
        return groups
    return groups.replace(host=host_group_for(groups.world))


__all__ = [
    "all_gather",
    "all_reduce",
    "broadcast",
    "group_device",
    "host_group_for",
    "with_host",
]
