"""Which layers the receiver's quantized module captures (vllm_dcr_plugin/quantized.py), on
fakes (labelled: plain modules whose scheme / MoE method classes carry compressed-tensors'
class names; the real layers run in tests/integration/vllm/test_quantized.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_dcr_plugin import quantized  # noqa: E402


def _fake(name: str, **attrs: object) -> object:
    """An instance of a fake class called `name` (what `format_of` reads: the class name)."""
    return type(name, (), attrs)()


def test_format_of_linear_schemes_and_moe_methods() -> None:
    int8 = _fake("CompressedTensorsW8A8Int8", strategy="channel")
    block = _fake("CompressedTensorsW8A8Fp8", strategy=SimpleNamespace(value="block"))
    moe = _fake(
        "CompressedTensorsW8A8Int8MoEMethod", weight_quant=SimpleNamespace(strategy="channel")
    )
    moe_block = _fake(
        "CompressedTensorsW8A8Fp8MoEMethod", weight_quant=SimpleNamespace(strategy="block")
    )
    assert [quantized.format_of(s) for s in (int8, block, moe, moe_block)] == [
        "int8-channel", "fp8-block", "int8-channel", "fp8-block",
    ]  # fmt: skip
    assert quantized.format_of(_fake("CompressedTensorsWNA16", strategy="group")) is None
    assert quantized.format_of(_fake("CompressedTensorsW8A8Int8MoEMethod")) is None  # no args


def test_capture_takes_linear_layers_and_fused_experts_not_others() -> None:
    model = torch.nn.Module()
    linear = torch.nn.Linear(4, 4)
    linear.quant_method = object()  # type: ignore[assignment]
    linear.scheme = _fake("CompressedTensorsW8A8Int8", strategy="channel")  # type: ignore[assignment]
    experts = torch.nn.Module()
    experts.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 4, dtype=torch.int8), False)
    experts.quant_method = _fake(  # type: ignore[assignment]
        "CompressedTensorsW8A8Int8MoEMethod", weight_quant=SimpleNamespace(strategy="channel")
    )
    plain = torch.nn.Linear(4, 4)
    plain.quant_method = _fake("UnquantizedLinearMethod")  # type: ignore[assignment]
    for name, m in (("linear", linear), ("experts", experts), ("plain", plain)):
        model.add_module(name, m)
    quantized.capture(model)
    layers = quantized.layers_of(model)
    assert sorted(layers) == ["experts", "linear"]
    assert layers["experts"].checkpoint["w13_weight"] is experts.w13_weight
    assert layers["experts"].scheme == "CompressedTensorsW8A8Int8MoEMethod"


@pytest.mark.parametrize(
    ("param", "weight"),
    [("weight", True), ("w13_weight", True), ("w2_weight", True), ("weight_scale", False),
     ("w13_weight_scale", False), ("input_scale", False), ("bias", False)],
)  # fmt: skip
def test_quantized_weight_parameters(param: str, weight: bool) -> None:
    assert quantized._is_weight(param) is weight


def test_quantized_layers_of_other_schemes_refuse_their_tensors() -> None:
    """A quantized layer DCR does not capture (here a W4A16 scheme, and a GPTQ-style method
    without a scheme) refuses every canonical tensor whose loader writes it; unquantized layers
    and attention's KV-cache scale method do not."""
    model = torch.nn.Module()

    def layer(method: str, scheme: str | None = None) -> torch.nn.Module:
        m = torch.nn.Linear(4, 4)
        m.quant_method = _fake(method)  # type: ignore[assignment]
        if scheme is not None:
            m.scheme = _fake(scheme, strategy="group")  # type: ignore[assignment]
        return m

    model.add_module("w4", layer("CompressedTensorsLinearMethod", "CompressedTensorsWNA16"))
    model.add_module("gptq", layer("GPTQLinearMethod"))
    model.add_module("plain", layer("UnquantizedLinearMethod"))
    model.add_module("attn", layer("CompressedTensorsKVCacheMethod"))
    quantized.capture(model)
    writes = {
        "a.weight": frozenset({"w4.weight"}),
        "b.weight": frozenset({"gptq.weight", "plain.weight"}),
        "c.weight": frozenset({"plain.weight"}),
        "d.k_scale": frozenset({"attn.weight"}),
    }
    refused = quantized.unsupported_tensors(model, writes)
    assert sorted(refused) == ["a.weight", "b.weight"]
    assert "CompressedTensorsWNA16" in refused["a.weight"] and "w4" in refused["a.weight"]
    assert "GPTQLinearMethod" in refused["b.weight"]
    assert quantized.report(model)["unsupported_layers"] == {
        "gptq": "GPTQLinearMethod", "w4": "CompressedTensorsWNA16",
    }  # fmt: skip
