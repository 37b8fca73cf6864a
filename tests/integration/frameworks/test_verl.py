"""verl drives DCR (issue 33 item 2): verl 0.9.1's own registry, config, worker methods and
checkpoint-manager base run the ``dcr`` checkpoint engine (`vllm_dcr_plugin.frameworks.verl`)
from a real two-rank megatron-core job (TP=2, gloo) against a ``vllm serve`` with backend
``dcr``. The trainer ranks run on the verl environment (.venv-verl: verl --no-deps over the
rollout environment; ``make setup`` builds it); tests/integration/frameworks/verl_program.py
labels what stands in for Ray and GPUs.

Oracle: after every sync, vLLM's own ``/weight_checker`` checksums equal those after a dense
load of the same Megatron export.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.frameworks._harness import run_framework

pytestmark = [pytest.mark.vllm, pytest.mark.megatron]


def test_verl_checkpoint_engine_refits_a_dcr_server(tmp_path: Path) -> None:
    check_syncs(run_framework(tmp_path, ".venv-verl", "verl_program.py"))


@pytest.mark.slow
def test_verl_server_killed_mid_apply_rejoins(tmp_path: Path) -> None:
    """The same syncs, then the server SIGKILLed mid-apply (slow lane: a second engine start):
    evicted, the version commits without it; restarted, it joins again."""
    r = run_framework(tmp_path, ".venv-verl", "verl_program.py", chaos=True)
    check_syncs(r)
    killed = r["killed"]
    assert killed["metrics"]["dcr/version"] == len(r["steps"]) + 4
    assert killed["receivers"] == [] and killed["members"] == []
    assert killed["metrics"]["dcr/replicas_unreachable"] == 1  # the resume found it dead
    again = r["restarted"]
    assert again["metrics"]["dcr/version"] == len(r["steps"]) + 5
    assert again["members"] == ["replica0"] and again["after"] == again["dense"]


def check_syncs(r: dict) -> None:
    """Every step bit-exact; the refused streams; the retry; membership."""
    assert r["engine"] == "DCRCheckpointEngine"
    for step, s in enumerate(r["steps"], start=1):
        m = s["metrics"]
        assert m["dcr/version"] == step and m["dcr/retries"] == 0 and m["dcr/global_steps"] == step
        assert 0 < m["dcr/element_change_rate"] < 1 and m["dcr/payload_bytes"] > 0
        assert s["after"] == s["dense"], f"step {step}: refit != dense load"
    bad = r["unknown_name"]  # refused on both ranks through verl's worker calls
    assert "no canonical tensor" in bad["error"]
    assert '(0, "ArgumentError' in bad["error"] and '(1, "ArgumentError' in bad["error"]
    assert bad["unchanged"] and bad["committed"] == len(r["steps"])
    shape = r["wrong_shape"]
    assert "'model.norm.weight': got torch.bfloat16[63]" in shape["error"]
    assert '(0, "ArgumentError' in shape["error"] and '(1, "ArgumentError' in shape["error"]
    assert shape["unchanged"] and shape["committed"] == len(r["steps"])
    after = r["after_refusal"]  # failed part-way (a fault plan), repaired by the retry
    assert after["metrics"]["dcr/version"] == len(r["steps"]) + 1
    assert after["metrics"]["dcr/retries"] == 1 and after["after"] == after["dense"]
    # verl's abort before and resume after every sync, the failed one included
    assert r["replica_calls"] == ["abort", "resume"] * (len(r["steps"]) + 3)
    # membership follows verl's replicas (remove_replicas / add_replicas)
    gone = r["without_replica"]
    assert gone["metrics"]["dcr/version"] == len(r["steps"]) + 2
    assert gone["receivers"] == [] and gone["unchanged"]  # a version without the server
    back = r["rejoined"]  # joined by a dense load of the committed version, then refit
    assert back["metrics"]["dcr/version"] == len(r["steps"]) + 3 and back["members"] == ["replica0"]
    assert back["after"] == back["dense"]
