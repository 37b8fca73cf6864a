"""End to end: real Megatron optimizer steps (2 gloo ranks, TP=2, the owner hook in mode X)
produce payloads; a real vLLM engine holding v0 stages and applies them; its digest equals the
digest of a dense load of the bridge's v1 export, and greedy tokens match. One case per verified
family (Qwen2 and Qwen3-MoE with EP=2 in the slow lane)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcr_tools.procs import PYTHON, REPO, base_env, run_program, run_torchrun


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.parametrize(
    ("kind", "tp", "ep"),
    [
        ("qwen3", 2, 1),
        ("llama", 2, 1),  # Llama-3 style: untied, no QK-norm
        # ~65 s each: one new family in the default lane, the others in the slow lane
        pytest.param("qwen2", 2, 1, marks=pytest.mark.slow),  # QKV biases
        pytest.param("qwen3-moe", 1, 2, marks=pytest.mark.slow),
    ],
)
def test_training_step_refit_is_bit_exact_on_vllm(
    kind: str, tp: int, ep: int, tiny_models, tmp_path: Path
) -> None:
    exports = tmp_path / "exports"
    run_torchrun(
        REPO / "tests/megatron/worker_owner.py",
        ["--ckpt", str(tiny_models[kind]), "--tp", str(tp), "--ep", str(ep), "--dir", str(tmp_path / "p"),
         "--report", str(tmp_path / "owner.json"), "--save-exports", str(exports)],
        tmp=tmp_path,
    )  # fmt: skip
    out = tmp_path / "engine.json"
    run_program(
        [
            PYTHON,
            str(REPO / "tests/vllm/stage_files_program.py"),
            "--v0",
            str(exports / "v0"),
            "--v1",
            str(exports / "v1"),
            "--payloads",
            str(tmp_path / "p" / "v1_X"),
            "--out",
            str(out),
        ],
        timeout=480,
        env=base_env(),
        log=tmp_path / "engine.log",
    )
    r = json.loads(out.read_text())
    assert r["prewarm"][0]["overwrite_only"] == {} and r["prewarm"][0]["unsupported"] == {}
    assert len(r["stage"][0]["staged"]) == r["n_payloads"] > 1
    ack = r["ack"][0]
    assert ack["ok"] and ack["post_apply_mismatches"] == 0, ack
    assert r["digest_delta"] == r["digest_dense"] != r["digest_v0"]
    assert r["tokens_delta"] == r["tokens_dense"]
