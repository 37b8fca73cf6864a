"""Residual conversion (paper step 2, residual path) and the residual baseline.

Residual tasks are those no affine map expresses (fused QKV of some layouts, tied or padded
embeddings, anything a mapping class transforms): their changes are found by converting the
changed tasks with megatron-bridge and comparing the canonical tensors with the residual
baseline. The baseline holds each canonical tensor once in the job, on the rank that the
canonical-name hash picks (`ownership.residual_owner`), as a contiguous host copy.

Call order (every rank of ``groups.world``, same order, collectives inside):
1. ``ResidualBaseline(tasks, chunks, groups)`` converts every task: the committed baseline.
2. Per build: `select(flags)` (flags: 1 for each task a rank saw change, or must convert
   anyway) all-reduces the flags and adds the tasks of a grouped export (every expert stacked
   in one HF tensor) another flagged task writes; `convert(selected)` converts them (every
   rank, remote tasks included: the mapping's collectives need them); `overwrite(name, new)`
   compares one converted tensor this rank holds with its baseline.
3. On commit: `advance(converted)` copies the build's converted tensors into the baseline.

Guarantees: records are overwrites with the new stored bits at the changed flat indices
(bit comparison), so they are exact whatever the receiver holds there.

Limitations:
1. A flagged task is converted whole: cost scales with the changed tasks, not elements.
2. The baseline is host memory: one copy of each residual canonical tensor per job (split
   over the ranks by the name hash, not by size).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_dcr_hooks.collectives import all_reduce
from megatron_dcr_hooks.conversion import GroupedExports, megatron_to_hf, num_experts_of
from megatron_dcr_hooks.groups import ParallelGroups
from megatron_dcr_hooks.ownership import residual_owner
from megatron_dcr_hooks.tasks import Task
from shared_codec.dtypes import dtype_of, tensor_bits
from shared_codec.kernels import changed_indices
from shared_codec.records import DeltaItem, Kind, make_item


class ResidualBaseline:
    """The residual tasks of one rank and the canonical tensors it holds (module docstring)."""

    def __init__(self, tasks: list[Task], chunks: list[Any], groups: ParallelGroups) -> None:
        self.tasks = tasks
        self._chunks = chunks
        self._world = groups.cpu_world  # same ranks as the world, takes CPU tensors
        self.tensors: dict[str, torch.Tensor] = self.convert(tasks)

    def convert(self, tasks: list[Task]) -> dict[str, torch.Tensor]:
        """Canonical tensors of `tasks` via the bridge (collective), kept if this rank holds
        them (`residual_owner`): contiguous host copies."""
        mine: dict[str, torch.Tensor] = {}
        grouped = GroupedExports(num_experts_of(self._chunks))
        with torch.no_grad():
            for t in tasks:
                shard = t.param.detach() if t.local else None
                out = grouped.add(t.param_task, megatron_to_hf(t.param_task, shard))
                for name, tensor in out.items():
                    if residual_owner(name, self._world.size) == self._world.rank:
                        mine[name] = tensor.detach().to("cpu").contiguous().clone()
        grouped.finish()
        return mine

    def select(self, flags: torch.Tensor) -> list[Task]:
        """The tasks to convert: flagged on any rank (`flags`, int32, one per task, all-reduced
        here with MAX; collective), plus every task of a grouped export a flagged task writes
        (such an export converts all its experts)."""
        flags = all_reduce(flags, self._world.group, op=dist.ReduceOp.MAX)
        hit = {n for i, t in enumerate(self.tasks) if flags[i] for n in t.hf_shapes}
        return [
            t
            for i, t in enumerate(self.tasks)
            if flags[i] or (t.param_task.mapping_grouped and not hit.isdisjoint(t.hf_shapes))
        ]

    def overwrite(
        self, name: str, new: torch.Tensor, *, owner: int
    ) -> tuple[int, DeltaItem | None]:
        """(changed elements, the overwrite record or None when nothing changed) of the
        converted canonical tensor `name` against this rank's baseline of it."""
        nb, ob = tensor_bits(new), tensor_bits(self.tensors[name])
        idx: np.ndarray = changed_indices(nb, ob)
        if not idx.size:
            return 0, None
        kind = Kind.OVERWRITE
        item = make_item(
            name, dtype_of(new.dtype).name, tuple(new.shape), owner, kind, idx, nb[idx]
        )
        return int(idx.size), item

    def advance(self, converted: Mapping[str, torch.Tensor]) -> None:
        """Copy a committed build's converted tensors into the baseline, in place."""
        with torch.no_grad():
            for name, new in converted.items():
                self.tensors[name].copy_(new)

    def nbytes(self) -> int:
        """Host memory of this rank's part of the residual baseline."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
