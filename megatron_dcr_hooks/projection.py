"""Projection (paper step 2, affine path): changed local indices -> canonical delta records.

`project(task, local, new, base, ...)` maps the changed flat local indices of one owned affine
shard through its measured `AffineMap` (tasks.py) straight to canonical coordinates (the HF
tensor name plus the flat row-major index) and returns one `DeltaItem` per canonical tensor
the changes land in (one for most tasks; per name for a fused layout such as QKV or
gate/up), in ascending canonical order. No conversion runs and no other rank takes part.

Record kinds: XOR of the new and the tracker's bits where `xor_ok` (mode X, not a retry) and
the receivers take XOR for that tensor (not in `overwrite_only`); otherwise an overwrite with
the new bits. Either way the records take the committed canonical bits to the new ones
exactly (the affine map is a bijection of the shard's elements onto canonical elements).

Limitations:
1. Only affine tasks (``task.amap`` set); residual tasks go through `residual`.
2. The caller's `new` array is never handed to an item (items get copies): it stays the
   build's recorded change, which the commit scatters into the tracker.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import numpy as np

from megatron_dcr_hooks.tasks import Task
from shared_codec.dtypes import dtype_of
from shared_codec.records import DeltaItem, Kind, make_item


def project(
    t: Task,
    local: np.ndarray,
    new: np.ndarray,
    base: np.ndarray,
    *,
    xor_ok: bool,
    overwrite_only: AbstractSet[str],
    owner: int,
) -> list[DeltaItem]:
    """Changed local indices of an affine task (`new`: their stored bits now; `base`: the
    tracker's bits of the whole shard) -> one item per canonical tensor, from `owner`."""
    assert t.amap is not None
    name_idx, hf = t.amap.project(local)
    names = t.amap.names
    # one canonical tensor (most tasks): no grouping; a fused one (QKV, gate/up): per name
    parts: list[tuple[int, np.ndarray | None]] = (
        [(0, None)] if len(names) == 1 else [(int(j), name_idx == j) for j in np.unique(name_idx)]
    )
    vals_xor: np.ndarray | None = None
    items = []
    for j, sel in parts:
        name = names[j]
        h = hf if sel is None else hf[sel]
        # canonical order; affine runs usually keep the local order, then no sort is needed
        order = None if bool((h[1:] > h[:-1]).all()) else np.argsort(h, kind="stable")
        kind = Kind.XOR if xor_ok and name not in overwrite_only else Kind.OVERWRITE
        if kind == Kind.XOR:
            if vals_xor is None:
                vals_xor = new ^ base[local]
            vals = vals_xor
        else:
            vals = new
        if sel is not None:
            vals = vals[sel]
        if order is not None:
            h, vals = h[order], vals[order]
        if vals is new:  # `new` stays the build's recorded change (the commit scatters it)
            vals = new.copy()
        items.append(
            make_item(name, dtype_of(t.param.dtype).name, t.hf_shapes[name], owner, kind, h, vals)
        )
    return items
