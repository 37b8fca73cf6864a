"""Placement plan: the native loader's recorded copies, replayed without calling it.

Prewarm traces ``model.load_weights`` once per canonical tensor (capability.py). For a tensor on
the direct path (every write from the item is a same-dtype, same-shape, nested-view ``copy_``;
every other write provably leaves resident bits unchanged) the trace already says where each
element goes: one (source view over the item, destination view over a parameter's storage) pair
per intercepted copy. `build_plan` keeps those pairs as a `PlacementPlan`; `replay_items` applies
direct-path items through them, O(entries) per item, with no ``load_weights`` call (vLLM's
``AutoWeightsLoader`` walks every module and the dispatch mode intercepts every op on each call,
which costs more than scattering a small delta).

Placement still comes only from the native loader: a plan entry is a copy the loader made, never
a DCR-written rule. What is not replayed (it keeps going through the loader, apply.py):

1. tensors on the masked path (``overwrite_only``: transformed, cast or overlapping copies) and
   skipped or unsupported tensors;
2. tensors whose trace has a non-copy write (e.g. a padding ``fill_``) whose extent meets a copy
   destination in the same parameter: skipping that write is only exact while nothing else writes
   its region (checked conservatively by extents);
3. tensors whose parameters changed storage or geometry since the trace (`PlacementPlan.stale`:
   storage pointer and size, dtype, shape, stride, storage offset, checked at every apply): the
   loader path places them against the current storage; each such fall back is counted in the
   receiver metrics and logged (``dcr_placement_fallbacks_total{reason="stale"}``) until a new
   prewarm or ``dcr_verify_plan`` records a new plan.

`verify_plan` (receiver.py, ``dcr_verify_plan``) re-traces the loader and compares the fresh
plan with the kept one entry by entry.

`Placement` is what a receiver holds: its `PlacementMode` (``plan``: replay the recorded plan,
the default; ``loader``: every item through ``load_weights``, each direct-path one counted as a
``loader_mode`` fall back) and the plan its latest trace recorded. The start-up mode comes from
the receiver's config (``DCR_PLACEMENT``, config.py); ``dcr_set_placement`` changes it.

Limitations:
1. The trace is per tensor, in isolation (capability.py, limitation 1); so is the replay.
2. A loader whose placement depends on the item's values (the trace and the loader path both
   see an all-zero item) is outside both paths' contract.
3. The geometry check cannot see a parameter whose storage was freed and re-allocated at the same
   address with the same size and geometry but a different layout convention; re-verify
   (``dcr_verify_plan``) after anything that reloads or re-processes weights outside DCR.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from shared_codec.records import DeltaItem
from vllm_dcr_plugin.intercept import INT_DTYPES, ViewGeom, WriteRecord, tensors_of


class PlacementMode(StrEnum):
    """How direct-path items are placed: replayed from the plan, or through the loader."""

    PLAN = "plan"
    LOADER = "loader"

    @classmethod
    def parse(cls, value: str, what: str) -> PlacementMode:
        """`value` as a mode; `ValueError` naming `what` (where it came from) otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"placement mode {value!r} ({what}): expected one of {MODES}"
            ) from None


MODES = tuple(m.value for m in PlacementMode)  # the plain strings the RPCs take


@dataclass(frozen=True, slots=True)
class TensorGeom:
    """What must not change under a planned parameter: storage address and size, dtype,
    shape, stride and storage offset."""

    storage_ptr: int
    storage_nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorGeom:
        s = t.untyped_storage()
        return cls(
            int(s.data_ptr()),
            int(s.nbytes()),
            t.dtype,
            tuple(int(x) for x in t.shape),
            tuple(int(x) for x in t.stride()),
            int(t.storage_offset()),
        )


@dataclass(frozen=True, slots=True)
class PlanEntry:
    """One recorded copy: the item's elements at `src` (offsets = flat canonical indices) go to
    `dest` (element offsets in `itemsize`-byte words of `param`'s storage)."""

    param: str
    src: ViewGeom
    dest: ViewGeom
    itemsize: int


@dataclass
class PlacementPlan:
    """Per canonical tensor, its recorded copies; per planned parameter, its geometry."""

    tensors: dict[str, tuple[PlanEntry, ...]] = field(default_factory=dict)
    params: dict[str, TensorGeom] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)  # direct tensors kept on the loader

    def stale(self, current: dict[str, torch.Tensor | None]) -> dict[str, str]:
        """Planned tensors whose parameters changed since the trace -> why (empty: all valid).
        `current`: name -> the tensor now (None: gone) of the planned parameters to check
        (`current_tensors`); parameters not in `current` are not checked."""
        bad: dict[str, str] = {}
        for name, t in current.items():
            geom = self.params.get(name)
            if geom is None:
                continue
            if t is None:
                bad[name] = "no longer in the model"
            elif TensorGeom.of(t) != geom:
                bad[name] = "storage or geometry changed since the trace"
        if not bad:
            return {}
        return {
            tensor: f"{e.param}: {bad[e.param]}"
            for tensor, entries in self.tensors.items()
            for e in entries
            if e.param in bad
        }

    def params_of(self, tensors: Iterable[str]) -> set[str]:
        """The parameters the planned ones among `tensors` write."""
        return {e.param for t in tensors for e in self.tensors.get(t, ())}

    def differences(self, fresh: PlacementPlan) -> dict[str, str]:
        """Tensors whose entries (or presence) differ between this plan and `fresh`."""
        out: dict[str, str] = {}
        for name in sorted(set(self.tensors) | set(fresh.tensors)):
            mine, theirs = self.tensors.get(name), fresh.tensors.get(name)
            if mine is None or theirs is None:
                out[name] = "planned in only one of the two traces"
            elif mine != theirs:
                out[name] = "recorded copies differ"
            elif any(self.params[e.param] != fresh.params[e.param] for e in mine):
                out[name] = "parameter storage or geometry differs"
        return out


def current_tensors(model: torch.nn.Module, names: Iterable[str]) -> dict[str, torch.Tensor | None]:
    """Name -> the parameter or buffer registered under that name now (None when gone),
    resolved through the module tree on every call (a replaced module or parameter is seen),
    O(names) instead of a walk over every parameter."""
    out: dict[str, torch.Tensor | None] = {}
    for name in names:
        path, _, attr = name.rpartition(".")
        try:
            mod = model.get_submodule(path) if path else model
        except AttributeError:
            out[name] = None
            continue
        t = mod._parameters.get(attr)
        out[name] = t if t is not None else mod._buffers.get(attr)
    return out


def _extent(v: ViewGeom) -> tuple[int, int]:
    """[first, last] storage offsets a view can touch (strides are non-negative here)."""
    if not v.numel:
        return (v.offset, v.offset - 1)
    return (v.offset, v.offset + sum((sz - 1) * st for sz, st in zip(v.shape, v.stride)))


def _meets(a: ViewGeom, b: ViewGeom) -> bool:
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    return a0 <= b1 and b0 <= a1


def build_plan(
    traces: dict[str, list[WriteRecord]],
    direct: Iterable[str],
    model: torch.nn.Module,
) -> PlacementPlan:
    """The plan of the `direct` tensors from their prewarm `traces` (capability.probe: records
    of each tensor's isolated trace). Tensors with a non-copy write whose extent meets any
    copy destination into the same parameter stay on the loader path (`excluded`)."""
    current = dict(tensors_of(model))
    direct = list(direct)
    copies: dict[str, list[ViewGeom]] = {}
    for name in direct:
        for r in traces[name]:
            if r.op.startswith("copy_"):
                copies.setdefault(r.param, []).append(r.dest)
    plan = PlacementPlan()
    for name in direct:
        entries = []
        why = None
        for r in traces[name]:
            if not r.op.startswith("copy_"):
                if any(_meets(r.dest, d) for d in copies.get(r.param, [])):
                    why = f"{r.op} into {r.param} meets a copy destination"
                continue
            # capability.classify admitted only same-dtype, same-shape nested copies from the item
            assert r.src is not None and r.src_dtype == r.dest_dtype
            itemsize = torch.empty(0, dtype=getattr(torch, r.dest_dtype)).element_size()
            entries.append(PlanEntry(param=r.param, src=r.src, dest=r.dest, itemsize=itemsize))
        if why is not None:
            plan.excluded[name] = why
            continue
        plan.tensors[name] = tuple(entries)
        for e in entries:
            plan.params[e.param] = TensorGeom.of(current[e.param])
    return plan


def storage_words(t: torch.Tensor, itemsize: int) -> torch.Tensor:
    """1-D integer view over the whole storage of `t`, in `itemsize`-byte words."""
    storage = t.untyped_storage()
    out = torch.empty(0, dtype=INT_DTYPES[itemsize], device=t.device)
    return out.set_(storage, 0, (storage.nbytes() // itemsize,), (1,))


def replay_items(
    plan: PlacementPlan,
    items: list[DeltaItem],
    current: dict[str, torch.Tensor | None],
    scatter: Callable[[DeltaItem, ViewGeom, torch.Tensor, ViewGeom], int],
    before_item: Callable[[DeltaItem], None] | None = None,
    words: dict[tuple[str, int], torch.Tensor] | None = None,
) -> list[tuple[int, set[str]]]:
    """Apply `items` (all planned, plan not stale) through their recorded copies in order.
    `scatter(item, src, words, dest)` writes one copy's share (apply.scatter_direct) and returns
    the elements written. `words`: integer views over parameter storages made by earlier calls
    of the same attempt (filled here). Returns (elements written, destination parameters) per
    item."""
    out = []
    words = words if words is not None else {}
    for item in items:
        if before_item is not None:
            before_item(item)
        n = 0
        params: set[str] = set()
        for e in plan.tensors[item.name]:
            key = (e.param, e.itemsize)
            w = words.get(key)
            if w is None:
                t = current[e.param]
                assert t is not None  # stale tensors never reach the replay
                w = words[key] = storage_words(t, e.itemsize)
            n += scatter(item, e.src, w, e.dest)
            params.add(e.param)
        out.append((n, params))
    return out


@dataclass(slots=True)
class Placement:
    """A receiver's placement: the mode and the plan of its latest loader trace (None before
    prewarm). Replayed only in mode ``plan`` (`replayed`)."""

    mode: PlacementMode = PlacementMode.PLAN
    plan: PlacementPlan | None = None

    def replayed(self) -> PlacementPlan | None:
        """The plan applies replay (None: every item through the loader)."""
        return self.plan if self.mode is PlacementMode.PLAN else None

    def set_mode(self, mode: PlacementMode) -> PlacementMode:
        """Switch to `mode`; returns the previous mode."""
        previous, self.mode = self.mode, mode
        return previous

    def report(self) -> dict[str, Any]:
        """The plan counts of the prewarm and ``dcr_verify_plan`` replies (plain values)."""
        plan = self.plan or PlacementPlan()
        return {
            "placement": self.mode.value,
            "planned": len(plan.tensors),
            "plan_entries": sum(len(e) for e in plan.tensors.values()),
            "plan_excluded": dict(sorted(plan.excluded.items())),
        }
