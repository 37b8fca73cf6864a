"""The direct-path scatter shared by both ways of applying an item: one intercepted (or
recorded) copy's share of an item XORed into, or stored over, the destination's resident bits,
O(entries); and the post-apply check that re-reads what a verified apply wrote.

`scatter_direct` is called by the loader path (loader_apply.ApplyHandler) for every direct copy
it intercepts and by plan replay (placement.replay_items) for every recorded copy; with
``verify`` it records the expected bits, and `count_mismatches` re-reads them.

Limitations:
1. Devices other than the host scatter through torch indexing (no compiled kernel); the host
   path uses shared_codec.kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shared_codec.kernels import set_scatter, xor_scatter
from shared_codec.records import DeltaItem, Kind
from vllm_dcr_plugin.intercept import ViewGeom, dense_block, map_through_view

NP_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
Check = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (storage words, offsets, expected)


@dataclass
class ItemResult:
    """What applying one item did on this rank."""

    name: str
    entries: int
    elements_written: int = 0
    copies: int = 0
    noop_writes: int = 0
    dest_params: set[str] = field(default_factory=set)
    mismatches: int = 0
    path: str = "direct"


def count_mismatches(checks: list[Check]) -> int:
    """Re-read every element a verified apply wrote; the number that differ from expected.

    An element written more than once is held to its last write: a loader that post-processes
    what it loaded in place (vLLM's ``composed_weight_loader``: Nemotron-H's ``A`` is loaded from
    ``A_log``, then ``param.data.copy_(-exp(param))``) writes the raw value first and the
    transformed one over it, and only the last one is meant to stay."""
    by_storage: dict[tuple[int, torch.dtype, str], list[Check]] = {}
    for c in checks:
        flat = c[0]
        by_storage.setdefault((flat.data_ptr(), flat.dtype, str(flat.device)), []).append(c)
    bad = 0
    for group in by_storage.values():
        flat = group[0][0]
        if len(group) == 1:
            _, idx, expected = group[0]
        else:  # keep each offset's last expected value (group order is write order)
            idx = torch.cat([c[1].to(flat.device) for c in reversed(group)])
            expected = torch.cat([c[2].to(flat.device) for c in reversed(group)])
            uniq, inverse = torch.unique(idx, return_inverse=True)
            first = torch.full((uniq.numel(),), idx.numel(), dtype=torch.long, device=idx.device)
            first.scatter_reduce_(
                0, inverse, torch.arange(idx.numel(), device=idx.device), reduce="amin"
            )
            idx, expected = uniq, expected[first]
        bad += int((flat[idx] != expected).sum())
    return bad


def scatter_direct(
    item: DeltaItem,
    src: ViewGeom,
    flat: torch.Tensor,
    dest: ViewGeom,
    checks: list[Check],
    verify: bool,
) -> int:
    """One direct-path copy's share of `item`: the item's flat indices inside the copy's source
    view `src` (offsets relative to the item) are mapped to offsets of the destination view
    `dest` over `flat` (the destination storage as integer words) and XORed in (XOR items) or
    stored (OVERWRITE items). With `verify`, the expected bits go to `checks`. Returns the
    elements written. Shared by the loader path (ApplyHandler) and plan replay (placement.py).

    Dense source and destination blocks on the host without `verify` (the common case: a
    whole canonical tensor, or a row block of it, into a block of a parameter) scatter the
    item's index and value slices as they are into the storage shifted by the blocks' offset:
    no mask, no offset array, no value copy."""
    block = dense_block(item.indices, src, dest) if flat.device.type == "cpu" else None
    if block is not None and not verify:
        lo, hi, shift = block
        if hi <= lo:
            return 0
        words = flat.numpy()
        offsets = item.indices[lo:hi]
        if shift >= 0:
            words = words[shift:]
        else:
            offsets = offsets + shift
        bits = item.values[lo:hi].view(NP_INT[flat.element_size()])
        (xor_scatter if item.kind == Kind.XOR else set_scatter)(words, offsets, bits)
        return hi - lo
    valid, dst_off = map_through_view(item.indices, src, dest)
    if not dst_off.size:
        return 0
    vals_np = item.values[valid] if not valid.all() else item.values
    vals_np = vals_np.view(NP_INT[flat.element_size()])
    xor = item.kind == Kind.XOR
    if flat.device.type == "cpu":  # compiled one-pass scatter (shared_codec.kernels)
        arr = flat.numpy()
        if verify:  # compute the expected bits explicitly, re-read them in count_mismatches
            new_np = arr[dst_off] ^ vals_np if xor else vals_np.copy()
            set_scatter(arr, dst_off, new_np)
            checks.append((flat, torch.from_numpy(dst_off), torch.from_numpy(new_np)))
        elif xor:
            xor_scatter(arr, dst_off, vals_np)
        else:
            set_scatter(arr, dst_off, vals_np)
    else:
        idx = torch.from_numpy(dst_off).to(flat.device)
        vals = torch.from_numpy(vals_np).to(flat.device)
        new = flat[idx] ^ vals if xor else vals
        flat[idx] = new
        if verify:
            checks.append((flat, idx, new.clone()))
    return int(dst_off.size)
