"""The CPU Gemma-3 build (dcr_tools/trainers/gemma3.py: megatron-bridge's Gemma3ModelProvider
settings and modules on megatron-core's local modules) is the model of the checkpoint: at TP=2
its logits on the tiny ``gemma3`` fixture equal transformers' ``Gemma3ForCausalLM`` up to bf16
rounding, over a sequence longer than the sliding window (so local and global layers, both RoPE
bases, the fused pre-norms, the post-norms and the zero-centred gammas are all in the path).
Removing the window from the reference moves its logits far more than that, so the comparison
sees the window. A numerical check of the trainer-side model, not of DCR's bit-exact path
(test_owner.py and test_end_to_end.py are). Rank program: worker_gemma3_reference.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcr_tools.procs import run_torchrun

WORKER = Path(__file__).with_name("worker_gemma3_reference.py")


@pytest.mark.megatron
def test_cpu_gemma3_matches_transformers(tiny_models, tmp_path: Path) -> None:
    from packaging.version import Version

    from tests.integration.megatron.test_owner import NEEDS_BRIDGE, _trainer_bridge_version

    oldest, why = NEEDS_BRIDGE["gemma3"]
    if Version(_trainer_bridge_version()) < Version(oldest):
        pytest.skip(why)
    report = tmp_path / "report.json"
    run_torchrun(
        WORKER, ["--ckpt", str(tiny_models["gemma3"]), "--report", str(report)], tmp=tmp_path
    )
    r = json.loads(report.read_text())
    assert r["shape"] == r["ref_shape"] == [1, 20, 512]
    # bf16 rounding: logits here are within +-0.7; one bf16 ulp at 0.5 is 2**-8
    # (no argmax comparison: on random weights near-tied logits flip with TP's reduction
    # order; at TP=2 one of 20 positions did)
    assert r["max_abs_diff"] < 0.05, r
    assert r["max_abs_diff_without_window"] > 10 * r["max_abs_diff"], r
