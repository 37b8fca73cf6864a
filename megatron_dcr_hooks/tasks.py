"""Conversion tasks and their affine maps, derived from megatron-bridge's mapping classes.

A conversion task is one Megatron parameter of this rank plus the bridge mapping that converts
it (``conversion.conversion_tasks``). A task is *affine* when its conversion only places source
elements (each canonical element is one source element, bits unchanged): Replicated, Column- and
RowParallel, AutoMapping resolved to those, GatedMLP halves, QKV, expert shards with their
EP-global index. Everything else is *residual* (converted with the bridge when it changes).

The affine maps are not written per mapping class: they are measured from the bridge itself.
`probe_affine` runs every task's ``megatron_to_hf`` (the same collectives as an export) on a
tensor of unique integer ids (``(rank + 1) << 40 | local flat index``) and reads back where each
of this rank's ids landed in the canonical tensors. A second probe with doubled ids must give
doubled outputs, so arithmetic conversions (scales, offsets) are classified residual. The map of
each task is stored as runs (local start, canonical tensor, canonical start, length): one run per
contiguous row segment, so its memory is negligible next to the shard.

Under pipeline parallelism the task list also holds *remote* tasks (parameters of other stages,
``conversion.py``): a rank probes them too, because the bridge broadcasts the owning stage's ids
across the pipeline group, but none of their ids are its own, so they get no map here and are
never owned. The classification is agreed job-wide (a task residual anywhere is residual
everywhere), so every rank walks the same residual conversions.

Limitations:
1. Probing allocates int64 copies of each canonical tensor transiently (one task at a time).
2. A conversion that changes dtype is residual (XOR masks would not carry over).
3. A task is *replicated* (owned among the TP x DP ranks) when its parameter lacks megatron's
   ``tensor_model_parallel`` attribute and its probe shows no other rank's ids in the canonical
   output. megatron-core 0.19.2's local ``DotProductAttention`` creates the learnable softmax
   offsets (GPT-OSS's attention sinks) per TP partition of the heads without that attribute
   (``transformer/dot_product_attention.py`` lines 126-136); the bridge gathers them over TP, so
   the probe classifies them as split.
4. A grouped export (``conversion.grouped_expert``: one HF tensor stacking every expert) maps
   expert ``e``'s slice to canonical flat indices ``e * slice size + i`` of the stacked tensor,
   whose shape (experts first) is the task's ``hf_shapes``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from megatron_dcr_hooks.conversion import (
    ParamTask,
    conversion_tasks,
    grouped_expert,
    megatron_to_hf,
)
from megatron_dcr_hooks.groups import ParallelGroups
from shared_codec.errors import OwnerBuildError

ID_SHIFT = 40


class TaskKind(StrEnum):
    """How a conversion task's changes reach canonical coordinates."""

    AFFINE = "affine"  # projected through the measured affine map (no conversion)
    RESIDUAL = "residual"  # converted with the bridge and compared with the residual baseline


@dataclass
class AffineMap:
    """local flat index -> (canonical tensor, flat index), as sorted runs."""

    names: list[str]
    local_start: np.ndarray  # int64, sorted
    name_idx: np.ndarray  # int32 into `names`
    hf_start: np.ndarray  # int64
    length: np.ndarray  # int64

    def project(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(name index, canonical flat index) of sorted local flat indices (all mapped)."""
        run = np.searchsorted(self.local_start, local, side="right") - 1
        if local.size and (
            (run < 0).any() or (local - self.local_start[run] >= self.length[run]).any()
        ):
            raise OwnerBuildError("a changed local index lies outside the task's affine map")
        return self.name_idx[run], self.hf_start[run] + (local - self.local_start[run])

    @property
    def covered(self) -> int:
        return int(self.length.sum())


@dataclass
class Task:
    """One conversion task with its classification and (if affine) its map on this rank."""

    index: int
    param_task: ParamTask
    kind: TaskKind
    amap: AffineMap | None = None
    hf_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    hf_dtype: torch.dtype | None = None
    replicated: bool = False
    expert: bool = False

    @property
    def name(self) -> str:
        return self.param_task.global_name

    @property
    def local(self) -> bool:
        """Whether this rank holds the parameter (False: another pipeline stage does)."""
        return self.param_task.param is not None

    @property
    def param(self) -> torch.Tensor:
        """This rank's shard (local tasks only): a parameter or a mapped persistent buffer."""
        p = self.param_task.param
        assert p is not None, f"{self.name} is held by another pipeline stage"
        return p


def _runs(local: np.ndarray, name_of: np.ndarray, hf: np.ndarray, names: list[str]) -> AffineMap:
    order = np.argsort(local, kind="stable")
    local, name_of, hf = local[order], name_of[order], hf[order]
    if local.size == 0:
        z = np.empty(0, dtype=np.int64)
        return AffineMap(names, z, np.empty(0, dtype=np.int32), z, z)
    brk = np.flatnonzero((np.diff(local) != 1) | (np.diff(hf) != 1) | (np.diff(name_of) != 0))
    starts = np.concatenate(([0], brk + 1))
    ends = np.concatenate((brk + 1, [local.size]))
    return AffineMap(
        names=names,
        local_start=local[starts].astype(np.int64),
        name_idx=name_of[starts].astype(np.int32),
        hf_start=hf[starts].astype(np.int64),
        length=(ends - starts).astype(np.int64),
    )


def _probe(pt: ParamTask, ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return megatron_to_hf(pt, ids)


def build_tasks(
    model: Any,
    architecture: str | Mapping[str, Any],
    groups: ParallelGroups,
    *,
    force_residual: tuple[str, ...] = (),
) -> list[Task]:
    """Classify every parameter of this rank and derive affine maps (collective: every rank
    calls with the same model structure; the bridge's gathers run inside). `force_residual`:
    mapping class names to treat as residual even when affine (e.g. ``("QKVMapping",)``
    reproduces the paper's 96% setting)."""
    return classify_tasks(
        conversion_tasks(model, architecture, groups), groups, force_residual=force_residual
    )


def classify_tasks(
    param_tasks: Sequence[ParamTask],
    groups: ParallelGroups,
    *,
    force_residual: tuple[str, ...] = (),
) -> list[Task]:
    """Probe each task's ``megatron_to_hf`` with unique ids and classify it (module docstring).

    Pure apart from the mappings themselves: ids are tagged with ``groups.world.rank``, and an
    id from outside ``1..groups.world.size`` makes a task residual. Collective exactly when the
    mappings are (the bridge's TP/EP gathers, the pipeline broadcast of remote tasks), plus one
    all-reduce over ``groups.world`` that agrees the classification job-wide."""
    rank = groups.world.rank
    tag = (rank + 1) << ID_SHIFT
    tasks: list[Task] = []
    configs = [getattr(pt.module, "config", None) for pt in param_tasks if pt.module is not None]
    num_experts = int(getattr(configs[0], "num_moe_experts", None) or 0) if configs else 0
    for i, pt in enumerate(param_tasks):
        p = pt.param
        ids = None
        if p is not None:
            # on the parameter's device: the bridge's TP/EP gathers run on megatron's groups
            # (NCCL in a GPU job) with the tensor it is given
            ids = (torch.arange(p.numel(), dtype=torch.int64, device=p.device) + tag).reshape(
                p.shape
            )
        with torch.no_grad():
            out = _probe(pt, ids)
            out2 = _probe(pt, ids * 2 if ids is not None else None)
            real = _probe(pt, p.detach() if p is not None else None)
        names = sorted(out)
        hf_shapes = {k: tuple(out[k].shape) for k in names}
        # a grouped export's output is expert e's slice [e] of the stacked HF tensor
        expert = grouped_expert(pt)
        offset = 0
        if expert is not None:
            hf_shapes = {k: (num_experts, *shape) for k, shape in hf_shapes.items()}
            if len({out[k].numel() for k in names}) > 1:
                raise OwnerBuildError(f"{pt.global_name}: grouped export of unequal slices")
        dtypes = {v.dtype for v in real.values()}
        affine = (
            type(pt.mapping).__name__ not in force_residual
            and set(out2) == set(out)
            and all(torch.equal(out2[k], out[k] * 2) for k in names)
            and len(dtypes) == 1
            and (p is None or dtypes == {p.dtype})
        )
        local_l, name_l, hf_l = [], [], []
        foreign = False  # ids of other ranks in the canonical output: a gathered (split) shard
        if affine and p is not None:
            n = p.numel()
            for j, k in enumerate(names):
                flat = out[k].reshape(-1)
                rank_of = flat >> ID_SHIFT
                if bool(((rank_of < 1) | (rank_of > groups.world.size)).any()):
                    affine = False  # not a pure placement of source ids
                    break
                mine = torch.nonzero(rank_of == rank + 1).reshape(-1)
                foreign = foreign or mine.numel() < flat.numel()
                if expert is not None:
                    offset = expert * flat.numel()
                local_l.append((flat[mine] - tag).cpu().numpy())  # the map lives on the host
                hf_l.append(mine.cpu().numpy().astype(np.int64) + offset)
                name_l.append(np.full(mine.numel(), j, dtype=np.int32))
        amap = None
        if affine and p is not None:
            local_all = np.concatenate(local_l) if local_l else np.empty(0, np.int64)
            amap = _runs(
                local_all,
                np.concatenate(name_l) if name_l else np.empty(0, np.int32),
                np.concatenate(hf_l) if hf_l else np.empty(0, np.int64),
                names,
            )
            if amap.covered != n or not each_once(local_all, n):
                affine, amap = False, None  # not every local element lands exactly once
        tasks.append(
            Task(
                index=i,
                param_task=pt,
                kind=TaskKind.AFFINE if affine else TaskKind.RESIDUAL,
                amap=amap,
                hf_shapes=hf_shapes,
                hf_dtype=next(iter(dtypes)) if len(dtypes) == 1 else None,
                # a shard the conversion gathers with other ranks' shards is split even without
                # megatron's attribute (the local attention's learnable softmax offsets)
                replicated=p is not None
                and not bool(getattr(p, "tensor_model_parallel", False))
                and not foreign,
                expert=p is not None and not bool(getattr(p, "allreduce", True)),
            )
        )
    _agree_kinds(tasks, groups)
    return tasks


def each_once(local: np.ndarray, n: int) -> bool:
    """True iff `local` holds every index ``0..n-1`` exactly once: ``n`` entries, all in range,
    none missing. O(n) with a bitmap (a sort-based ``np.unique`` took minutes per rank on a
    1.3B-parameter model)."""
    if local.size != n:
        return False
    if n == 0:
        return True
    if int(local.min()) < 0 or int(local.max()) >= n:
        return False
    seen = np.zeros(n, dtype=bool)
    seen[local] = True
    return bool(seen.all())


def _agree_kinds(tasks: list[Task], groups: ParallelGroups) -> None:
    """A task residual on any rank becomes residual on every rank (collective over
    ``groups.world``; task lists have the same length and order on every rank)."""
    if groups.world.size == 1 or groups.world.group is None:
        return
    import torch.distributed as dist

    from megatron_dcr_hooks.collectives import all_reduce

    flags = torch.tensor([t.kind is TaskKind.RESIDUAL for t in tasks], dtype=torch.int32)
    flags = all_reduce(flags, groups.cpu_world.group, op=dist.ReduceOp.MAX)
    for t, flag in zip(tasks, flags.tolist(), strict=True):
        if flag and t.kind is TaskKind.AFFINE:
            t.kind, t.amap = TaskKind.RESIDUAL, None


def affine_share(tasks: list[Task]) -> dict[str, float]:
    """Canonical weight bytes covered by affine tasks vs all (global, all-reduced)."""
    total = torch.zeros(2, dtype=torch.float64)
    seen: set[str] = set()
    for t in tasks:
        for name, shape in t.hf_shapes.items():
            if name in seen:
                continue
            seen.add(name)
            nbytes = float(np.prod(shape)) * (t.hf_dtype or torch.bfloat16).itemsize
            total[1] += nbytes
            if t.kind is TaskKind.AFFINE:
                total[0] += nbytes
    # every rank sees every canonical tensor (exports are all-gathers), so no reduction needed
    return {
        "affine_bytes": float(total[0]),
        "canonical_bytes": float(total[1]),
        "affine_share": float(total[0] / total[1]) if total[1] else 1.0,
    }
