"""Apply delta items in place: replayed placement, or through the native loader (the apply
half of intercept.py).

`apply_batch` gives each item of a batch its own region of the scratch buffer, runs
``model.load_weights`` once over all of them (a generator: the loader pulls item after item)
under `WriteInterceptMode` with an `ApplyHandler`, and checks what the loader did against what it
reported. The handler finds an intercepted copy's item from the copy source's position in the
scratch buffer. See intercept.py for the direct (XOR or overwrite, O(entries)) and masked
(overwrite through transformed copies) paths, and for the rule on writes that do not come from
an item. One ``load_weights`` call per batch instead of per item matters: building vLLM's
``AutoWeightsLoader`` walks every module on each call (~1 ms for a 166M model), more than the
scatter of a small item.

`apply_staged` runs the staged payloads of an attempt, counting into the ACK's `Tally` (ack.py)
and reporting how far a failure got: runs of items the placement plan holds go to
`replay_batch` (placement.py: the loader's recorded copies, no ``load_weights`` call; the same
`scatter_direct` as the loader path's direct writes), the others through `plan_batches` and
`apply_batch`.

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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shared_codec.errors import LoaderConditionError
from shared_codec.format import decode_payload
from shared_codec.kernels import set_scatter, xor_scatter
from shared_codec.records import DeltaItem, Kind
from vllm_dcr_plugin.ack import Tally
from vllm_dcr_plugin.faults import InjectedFailure, ItemFaults
from vllm_dcr_plugin.intercept import (
    COPY_OPS,
    ViewGeom,
    WriteInterceptMode,
    dense_block,
    flat_storage_bits,
    int_view,
    map_through_view,
    named_storages,
    param_snapshot,
    storage_key,
    tensors_in,
    would_change,
)
from vllm_dcr_plugin.placement import PlacementPlan, current_tensors, replay_items
from vllm_dcr_plugin.staging import StagedPayload, StagingArea

log = logging.getLogger(__name__)

_NP_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
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
        bits = item.values[lo:hi].view(_NP_INT[flat.element_size()])
        (xor_scatter if item.kind == Kind.XOR else set_scatter)(words, offsets, bits)
        return hi - lo
    valid, dst_off = map_through_view(item.indices, src, dest)
    if not dst_off.size:
        return 0
    vals_np = item.values[valid] if not valid.all() else item.values
    vals_np = vals_np.view(_NP_INT[flat.element_size()])
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
        as_float = torch.from_numpy(item.values.view(_NP_INT[d.itemsize]).copy())
        if torch.isnan(as_float.view(d.torch_dtype).float()).any():
            raise LoaderConditionError(
                f"{item.name}: NaN overwrite values cannot pass a transformed loader path"
            )
        return None, float("nan")
    present = set(np.unique(item.values.view(_NP_INT[d.itemsize])).tolist())
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
    placeholder). `before_item` runs as the loader pulls each item (fault injection). Raises
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
                sl.item.values.view(_NP_INT[d.itemsize])
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


@dataclass
class PlanChecks:
    """What the applies of one attempt have resolved about the placement plan: the planned
    parameters looked up so far (`current`), those found stale, and the integer views over their
    storages (`words`). `apply_staged` fills it; the receiver keeps one across the parts of one
    pipelined fetch, so each parameter is resolved and checked once per fetch instead of once per
    part (nothing else runs on the worker between the parts of a fetch, and a loader batch that
    rebinds a parameter fails the attempt), and a fresh one for every other apply."""

    current: dict[str, torch.Tensor | None] = field(default_factory=dict)
    stale: dict[str, str] = field(default_factory=dict)
    words: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)


def runs(
    items: list[DeltaItem], replayable: Callable[[str], bool]
) -> list[tuple[bool, list[DeltaItem]]]:
    """Split `items` (in order) into maximal runs of replayable / loader-path items."""
    out: list[tuple[bool, list[DeltaItem]]] = []
    for item in items:
        r = replayable(item.name)
        if out and out[-1][0] == r:
            out[-1][1].append(item)
        else:
            out.append((r, [item]))
    return out


def apply_staged(
    model: torch.nn.Module,
    staged: list[StagedPayload],
    tally: Tally,
    *,
    scratch: torch.Tensor,
    staging: StagingArea,
    skipped: set[str],
    masked: set[str],
    verify: bool,
    counter: ItemFaults,
    plan: PlacementPlan | None = None,
    checks: PlanChecks | None = None,
) -> None:
    """Apply `staged` payloads in order, counting into `tally` and marking each payload
    applied in `staging` once complete. Items `plan` holds (placement.py) are replayed through
    their recorded copies with no loader call; the others go through the loader batch by batch
    (`plan_batches`, `apply_batch`). `plan=None` (placement mode ``loader``) sends every item
    through the loader. Every direct-path item that does not replay is a fall back, counted by
    reason in ``tally.fallbacks`` (``loader_mode``, ``stale``: its parameters changed since the
    trace, ``not_planned``: excluded at prewarm) and logged; masked-path items are loader items
    by design, not fall backs.

    ``tally.touched`` says whether any batch reached the weights (they may have changed). On
    a failure the exception propagates with `tally` saying how far it got: items are applied in
    order, so items pulled before the failing one are complete and the last one pulled may be
    partial (``tally.partial_item``), except after an `InjectedFailure`, raised before the next
    item is pulled. `counter` is the per-item hook of both paths (it counts pulled items and
    fires the test-only item faults). `checks` (PlanChecks) carries the plan's resolved and
    checked parameters from earlier parts of the same attempt; None: a fresh one."""
    # model walks only when a loader batch runs; planned parameters are resolved by name
    storages: dict[int, str] | None = None
    before: dict[str, tuple[int, tuple[int, ...]]] | None = None
    checks = checks if checks is not None else PlanChecks()
    stale, current = checks.stale, checks.current

    def check_plan(items: list[DeltaItem]) -> None:
        assert plan is not None
        params = plan.params_of(it.name for it in items) - current.keys()
        if not params:
            return
        now = current_tensors(model, params)
        current.update(now)
        found = plan.stale(now)
        if found and not stale:
            first = next(iter(found.items()))
            log.warning(
                "placement plan stale for %d tensors (e.g. %s: %s); they go through "
                "load_weights until dcr_prewarm or dcr_verify_plan records a new plan",
                len(found),
                *first,
            )
        stale.update(found)

    def replayable(name: str) -> bool:
        return plan is not None and name in plan.tensors and name not in stale

    def fallback(name: str) -> str | None:
        if name in masked:
            return None
        if plan is None:
            return "loader_mode"
        return "stale" if name in stale else "not_planned"

    for sp in staged:
        t0 = time.perf_counter()
        payload = sp.decoded or decode_payload(sp.data, key=staging.key, max_body=staging.max_body)
        tally.decode_s += time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.thread_time()
        items = [it for it in payload.items if it.name not in skipped]
        tally.skipped_items += len(payload.items) - len(items)
        if plan is not None:
            check_plan(items)
        for replay, run in runs(items, replayable):
            batches = [run] if replay else plan_batches(run, scratch.numel(), masked)
            for batch in batches:
                tally.touched = True
                done = counter.pulled
                try:
                    if replay:
                        assert plan is not None
                        results = replay_batch(plan, batch, current, verify, counter, checks.words)
                    else:
                        if storages is None or before is None:
                            storages, before = named_storages(model), param_snapshot(model)
                        results = apply_batch(
                            model,
                            batch,
                            scratch=scratch,
                            model_storages=storages,
                            masked=masked,
                            verify=verify,
                            before_item=counter,
                        )
                except InjectedFailure:
                    tally.items += counter.pulled - done  # the batch finished what it pulled
                    raise
                except Exception:
                    tally.items += max(0, counter.pulled - done - 1)
                    tally.partial_item = batch[max(0, counter.pulled - done - 1)].name
                    raise
                tally.items += len(batch)
                if replay:
                    tally.plan_items += len(batch)
                else:
                    tally.loader_items += len(batch)
                    tally.batches += 1
                    for item in batch:
                        why = fallback(item.name)
                        if why is not None:
                            tally.fallbacks[why] = tally.fallbacks.get(why, 0) + 1
                for item, res in zip(batch, results, strict=True):
                    tally.elements_written += res.elements_written
                    tally.bytes += item.raw_bytes
                    if verify:
                        tally.mismatches += res.mismatches
        if before is not None and param_snapshot(model) != before:
            raise LoaderConditionError("the loader rebound parameters during apply")
        tally.apply_s += time.perf_counter() - t0
        tally.apply_cpu_s += time.thread_time() - c0
        tally.payloads += 1
        tally.compressed_bytes += len(sp.data)
        staging.mark_applied(tally.attempt, sp.header.payload_id)
    if tally.fallbacks:
        log.info("apply attempt %d: loader-path fall backs %s", tally.attempt, tally.fallbacks)


def replay_batch(
    plan: PlacementPlan,
    batch: list[DeltaItem],
    current: dict[str, torch.Tensor | None],
    verify: bool,
    before_item: Callable[[DeltaItem], None],
    words: dict[tuple[str, int], torch.Tensor] | None = None,
) -> list[ItemResult]:
    """Apply `batch` (planned items) through the plan's recorded copies (placement.py);
    `words` keeps the parameters' storage views across batches (PlanChecks.words)."""
    checks: list[Check] = []

    def scatter(item: DeltaItem, src: ViewGeom, words: torch.Tensor, dest: ViewGeom) -> int:
        return scatter_direct(item, src, words, dest, checks, verify)

    done = replay_items(plan, batch, current, scatter, before_item, words)
    results = []
    for item, (n, params) in zip(batch, done, strict=True):
        r = ItemResult(name=item.name, entries=item.count, path="plan")
        r.elements_written, r.dest_params = n, params
        r.copies = len(plan.tensors[item.name])
        results.append(r)
    if verify and results:
        results[0].mismatches = count_mismatches(checks)
    return results
