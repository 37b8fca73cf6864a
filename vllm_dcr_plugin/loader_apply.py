"""Apply a batch of items through the native loader: one ``model.load_weights`` call under the
write-intercepting mode, every intercepted write turned into an exact in-place update (the
apply half of intercept.py).

`apply_batch` gives each item of a batch its own region of the scratch buffer, runs
``model.load_weights`` once over all of them (a generator: the loader pulls item after item)
under `WriteInterceptMode` with an `ApplyHandler`, and checks what the loader did against what it
reported. The handler finds an intercepted copy's item from the copy source's position in the
scratch buffer. See intercept.py for the direct (XOR or overwrite, O(entries)) and masked
(overwrite through transformed copies) paths, and for the rule on writes that do not come from
an item. One ``load_weights`` call per batch instead of per item matters: building vLLM's
``AutoWeightsLoader`` walks every module on each call (~1 ms for a 166M model), more than the
scatter of a small item.

Batches (`plan_batches`): consecutive direct-path items whose 64-byte-aligned sizes fit in the
scratch buffer together; a masked-path item (a tensor prewarm found behind a transformed or cast
copy) is always a batch of its own, because a transformed copy's source is a temporary that
cannot be traced back to an item. Every copy of a masked item goes through the masked path,
the plain ones from scratch too: the first copy into a view sets that view's active mask, which
later transformed copies into it reuse. A loader that post-processes the whole parameter in
place after loading (vLLM's ``composed_weight_loader``: Nemotron-H's ``A`` is loaded from
``A_log``, then ``param.data.copy_(-exp(param))``) so writes only the active positions twice,
and positions the item does not change keep their bits (a direct first copy left no mask, and
the transform was written everywhere: ``-exp`` applied twice where ``A_log`` had not changed).

Scratch invariant: outside `apply_batch` the scratch buffer is all zero bits (the XOR
placeholder). Direct-path items are not materialised in scratch: the loader sees an all-zero
view and the intercepted copy's geometry maps the item's entries straight to destination
offsets, which is what scattering masks into a zero scratch and XORing the copied view would do,
without touching inactive positions (O(entries) instead of O(tensor)). Masked-path items fill
their region with the overwrite placeholder, scatter their values, and re-zero it afterwards.

Limitations:
1. Masked path: floating dtypes use NaN as the placeholder, so overwrite values that are NaN
   cannot pass a transformed loader path (the item fails with LoaderConditionError); integer
   dtypes use a bit pattern absent from the item's values.
2. A failure inside a batch fails the attempt with every item of the batch reported as possibly
   partial (the receiver is then dirty; an overwrite retry repairs it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shared_codec.errors import LoaderConditionError
from shared_codec.records import DeltaItem, Kind
from vllm_dcr_plugin.intercept import (
    COPY_OPS,
    ViewGeom,
    WriteInterceptMode,
    flat_storage_bits,
    int_view,
    storage_key,
    tensors_in,
    would_change,
)
from vllm_dcr_plugin.scatter import NP_INT, Check, ItemResult, count_mismatches, scatter_direct


@dataclass
class Slot:
    """One item of a batch: its region of the scratch buffer and what applying it did."""

    item: DeltaItem
    start: int  # byte offset of the region in the scratch buffer
    masked: bool
    placeholder_bits: int | None = None
    result: ItemResult = field(init=False)
    masks: dict[tuple[str, ViewGeom], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.result = ItemResult(name=self.item.name, entries=self.item.count)
        if self.masked:
            self.result.path = "masked"

    @property
    def nbytes(self) -> int:
        return self.item.numel * self.item.dtype_info.itemsize


@dataclass
class ApplyHandler:
    """Turns the intercepted writes of one batch's load into exact in-place updates."""

    slots: list[Slot]
    model_storages: dict[int, str]
    scratch_key: int
    scratch_ptr: int
    verify: bool
    _checks: list[Check] = field(default_factory=list)

    def _slot_of(self, src: torch.Tensor) -> Slot:
        pos = int(src.data_ptr()) - self.scratch_ptr
        for slot in self.slots:  # batches are short; regions do not overlap
            if slot.start <= pos < slot.start + max(1, slot.nbytes):
                return slot
        raise LoaderConditionError(f"a copy reads scratch byte {pos}, outside every item's region")

    def __call__(self, func: Any, args: tuple, kwargs: dict, dests: list[torch.Tensor]) -> Any:
        names = ", ".join(sl.item.name for sl in self.slots)
        if len(dests) != 1:
            raise LoaderConditionError(
                f"{names}: {func.__name__} writes {len(dests)} model tensors at once"
            )
        dest = dests[0]
        param = self.model_storages[storage_key(dest)]
        if func in COPY_OPS and dest is args[0]:
            src = args[1]
            if storage_key(src) == self.scratch_key:
                slot = self._slot_of(src)
                slot.result.dest_params.add(param)
                slot.result.copies += 1
                item = slot.item
                if (
                    not slot.masked  # a masked item's first copy sets the view's active mask
                    and src.dtype == dest.dtype
                    and tuple(src.shape) == tuple(dest.shape)
                    and ViewGeom.of(src).nested()
                    and ViewGeom.of(dest).nested()
                ):
                    self._direct(slot, src, dest)
                    return dest
                if item.kind == Kind.XOR:
                    raise LoaderConditionError(
                        f"{item.name}: XOR item reached a non-direct copy into {param}"
                    )
                if not slot.masked:
                    raise LoaderConditionError(
                        f"{item.name}: a non-direct copy into {param} that prewarm did not see "
                        "(re-run dcr_prewarm)"
                    )
            else:  # a transformed copy: its source is a temporary, only single-item batches
                if len(self.slots) != 1:
                    raise LoaderConditionError(
                        f"{names}: a transformed copy into {param} inside a batch (prewarm "
                        "classified these tensors as direct; re-run dcr_prewarm)"
                    )
                slot = self.slots[0]
                slot.result.dest_params.add(param)
                slot.result.copies += 1
                if slot.item.kind == Kind.XOR:
                    raise LoaderConditionError(
                        f"{slot.item.name}: XOR item reached a transformed copy into {param}; "
                        "this tensor needs overwrite entries (see the prewarm report)"
                    )
            self._masked(slot, param, src, dest)
            return dest
        sources = [t for t in tensors_in(args, kwargs) if t is not dest]
        if any(storage_key(t) == self.scratch_key for t in sources):
            raise LoaderConditionError(
                f"{names}: unsupported write {func.__name__} from an item into {param}"
            )
        if would_change(func, args, kwargs, dest):
            raise LoaderConditionError(
                f"{names}: {func.__name__} into {param} does not come from an item and "
                "would change resident bits"
            )
        for slot in self.slots:
            slot.result.noop_writes += 1
        return args[0] if args and isinstance(args[0], torch.Tensor) else None

    def _direct(self, slot: Slot, src: torch.Tensor, dest: torch.Tensor) -> None:
        g = ViewGeom.of(src)  # offsets relative to the item's region (its flat indices)
        g = ViewGeom(g.offset - slot.start // src.element_size(), g.shape, g.stride)
        slot.result.elements_written += scatter_direct(
            slot.item, g, flat_storage_bits(dest), ViewGeom.of(dest), self._checks, self.verify
        )

    def _masked(self, slot: Slot, param: str, src: torch.Tensor, dest: torch.Tensor) -> None:
        slot.result.path = "masked"
        key = (param, ViewGeom.of(dest))
        src = src.expand_as(dest) if tuple(src.shape) != tuple(dest.shape) else src
        mask = slot.masks.get(key)
        if mask is None:  # the active mask is taken at the first copy into each view
            if src.dtype.is_floating_point:
                mask = ~torch.isnan(src)
            elif (
                slot.placeholder_bits is not None and src.dtype == slot.item.dtype_info.torch_dtype
            ):
                mask = int_view(src) != slot.placeholder_bits
            else:
                raise LoaderConditionError(
                    f"{slot.item.name}: cannot find active positions of a {src.dtype} copy into "
                    f"{param} (placeholder not recognisable after the loader's transform)"
                )
            # on the destination's device: a transformed source may be a host temporary
            # (scratch lives in host memory) copied into a device parameter
            slot.masks[key] = mask = mask.to(dest.device)
        values = src.to(device=dest.device, dtype=dest.dtype)
        dest[mask] = values[mask]
        n = int(mask.sum())
        slot.result.elements_written += n
        if self.verify:
            flat = flat_storage_bits(dest)
            offs = torch.from_numpy(ViewGeom.of(dest).offsets()).to(dest.device)
            sel = mask.reshape(-1)
            self._checks.append((flat, offs[sel], int_view(values.contiguous()).reshape(-1)[sel]))

    def check(self) -> int:
        """Post-apply check: re-read every written element; returns the mismatch count."""
        return count_mismatches(self._checks)


_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_batches(
    items: list[DeltaItem], scratch_bytes: int, masked: set[str]
) -> list[list[DeltaItem]]:
    """Split `items` (in order) into load_weights batches (see the module docstring)."""
    batches: list[list[DeltaItem]] = []
    cur: list[DeltaItem] = []
    used = 0
    for item in items:
        size = _aligned(item.numel * item.dtype_info.itemsize)
        if item.name in masked or (cur and used + size > scratch_bytes):
            if cur:
                batches.append(cur)
            cur, used = [], 0
        if item.name in masked:
            batches.append([item])
            continue
        cur.append(item)
        used += size
    if cur:
        batches.append(cur)
    return batches


def _placeholder_for(item: DeltaItem) -> tuple[int | None, float | None]:
    """(integer placeholder bits, float placeholder) for the masked path of an overwrite item."""
    d = item.dtype_info
    if d.is_float:
        as_float = torch.from_numpy(item.values.view(NP_INT[d.itemsize]).copy())
        if torch.isnan(as_float.view(d.torch_dtype).float()).any():
            raise LoaderConditionError(
                f"{item.name}: NaN overwrite values cannot pass a transformed loader path"
            )
        return None, float("nan")
    present = set(np.unique(item.values.view(NP_INT[d.itemsize])).tolist())
    for candidate in (0, -1, 1, 2 ** (8 * d.itemsize - 1) - 1):
        if candidate not in present:
            return candidate, None
    for candidate in range(-(2 ** (8 * d.itemsize - 1)), 2 ** (8 * d.itemsize - 1)):
        if candidate not in present:
            return candidate, None
    raise LoaderConditionError(f"{item.name}: every bit pattern is a value; no placeholder left")


def apply_batch(
    model: torch.nn.Module,
    items: list[DeltaItem],
    *,
    scratch: torch.Tensor,
    model_storages: dict[int, str],
    masked: set[str],
    verify: bool,
    load_weights: Callable[[Any], Any] | None = None,
    before_item: Callable[[DeltaItem], None] | None = None,
) -> list[ItemResult]:
    """Apply one batch (from `plan_batches`) through one call of the model's native loader.

    `scratch` is the reserved 1-D uint8 buffer (all zero on entry and on return); `masked`:
    tensors prewarm found behind a transformed path (their region holds the overwrite
    placeholder). `before_item` runs as the loader pulls each item (apply.ItemCounter). Raises
    LoaderConditionError (the attempt fails) on any violated loader condition; the caller then
    reports every item of the batch as possibly partial."""
    slots: list[Slot] = []
    pos = 0
    for item in items:
        nbytes = item.numel * item.dtype_info.itemsize
        if pos + nbytes > scratch.numel():
            raise LoaderConditionError(
                f"{item.name}: {nbytes} bytes do not fit the reserved scratch at offset {pos}"
            )
        slots.append(Slot(item=item, start=pos, masked=item.name in masked))
        pos += _aligned(nbytes)
    if any(sl.masked for sl in slots) and len(slots) > 1:
        raise LoaderConditionError("a masked-path item must be a batch of its own")
    views: list[torch.Tensor] = []
    for sl in slots:
        d = sl.item.dtype_info
        view = scratch[sl.start : sl.start + sl.nbytes].view(d.torch_dtype).view(sl.item.shape)
        views.append(view)
        if sl.masked:
            if sl.item.kind == Kind.XOR:
                raise LoaderConditionError(
                    f"{sl.item.name}: XOR item for an overwrite-only loader path"
                )
            bits = int_view(view).reshape(-1)
            sl.placeholder_bits, placeholder = _placeholder_for(sl.item)
            if placeholder is not None:
                view.fill_(placeholder)
            else:
                bits.fill_(int(sl.placeholder_bits))  # type: ignore[arg-type]
            bits[torch.from_numpy(sl.item.indices)] = torch.from_numpy(
                sl.item.values.view(NP_INT[d.itemsize])
            )
    handler = ApplyHandler(
        slots, model_storages, storage_key(scratch), int(scratch.data_ptr()), verify
    )
    loader: Any = load_weights or getattr(model, "load_weights")  # noqa: B009

    def weights() -> Any:
        for sl, view in zip(slots, views, strict=True):
            if before_item is not None:
                before_item(sl.item)
            yield sl.item.name, view

    try:
        with WriteInterceptMode(model_storages, handler):
            loaded = loader(weights())
    finally:
        for sl in slots:
            if sl.masked:
                scratch[sl.start : sl.start + sl.nbytes].zero_()
    results = [sl.result for sl in slots]
    if loaded is not None:
        check_loader_report(", ".join(sl.item.name for sl in slots), set(loaded), results)
    if verify:
        bad = handler.check()
        for r in results:  # mismatches are counted per batch; attribute them to its first item
            r.mismatches = 0
        results[0].mismatches = bad
    return results


def check_loader_report(names: str, reported: set[str], results: list[ItemResult]) -> None:
    """The tensors the loader reports as loaded must match the intercepted copies."""
    copies = sum(r.copies for r in results)
    dest_params: set[str] = set().union(*(r.dest_params for r in results))
    if reported and copies == 0:
        raise LoaderConditionError(
            f"{names}: loader reports {sorted(reported)} loaded but no write was intercepted"
        )
    unreported = dest_params - reported
    if copies and unreported:
        raise LoaderConditionError(
            f"{names}: loader wrote {sorted(unreported)} without reporting them as loaded"
        )
