"""SkyRL drives DCR (issue 33 item 3): SkyRL 0.4.0's own weight sync (``build_trainer_engine``,
``MegatronWeightSource``, ``SkyrlWeightSyncClient``), patched only at its closed backend switch
(`vllm_dcr_plugin.frameworks.skyrl`), refits a ``vllm serve`` started with backend ``dcr`` from a
real two-rank megatron-core job (TP=2, gloo). The trainer ranks run on the SkyRL environment
(.venv-skyrl: SkyRL --no-deps over the rollout environment; ``make setup`` builds it).

Oracle: after every step, vLLM's own ``/weight_checker`` checksums of the refit engine equal
those after a dense load of the same Megatron export (tests/integration/frameworks/skyrl_program.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.frameworks._harness import run_framework

pytestmark = [pytest.mark.vllm, pytest.mark.megatron]


def test_skyrl_weight_sync_refits_a_dcr_server(tmp_path: Path) -> None:
    check_syncs(run_framework(tmp_path, ".venv-skyrl", "skyrl_program.py"))


@pytest.mark.slow
def test_skyrl_server_killed_mid_apply_rejoins(tmp_path: Path) -> None:
    """The same syncs, then the server SIGKILLed mid-apply (slow lane: a second engine start)."""
    r = run_framework(tmp_path, ".venv-skyrl", "skyrl_program.py", chaos=True)
    check_syncs(r)
    n = len(r["steps"])
    killed = r["killed"]  # the server died mid-apply: evicted, the version committed without it
    assert killed["version"] == n + 3 and killed["retries"] >= 1
    assert killed["receivers"] == [] and killed["members"] == []
    back = r["rejoined"]  # restarted: joined at the committed version, then refit
    assert back["version"] == n + 4 and back["members"] == ["engine0"]
    assert back["after"] == back["dense"]


def check_syncs(r: dict) -> None:
    """Every step bit-exact; the refused streams; the empty version."""
    assert r["engine"] == "DCRTrainerWeightTransferEngine" and r["receive_backend"] == "dcr"
    assert r["source"] == "MegatronWeightSource" and r["client"] == "SkyrlWeightSyncClient"
    assert len(r["patches"]) == 3
    for step, s in enumerate(r["steps"], start=1):
        assert s["version"] == step and s["retries"] == 0
        assert 0 < s["change_rate"] < 1 and s["payload_bytes"] > 0
        assert s["after"] == s["dense"], f"step {step}: refit != dense load"
    # bad input through SkyRL's own path: refused on every rank, the engine untouched
    assert "no canonical tensor" in r["unknown_name"]["error"]
    assert "torch.float32" in r["wrong_dtype"]["error"]
    for case in ("unknown_name", "wrong_dtype"):
        assert r[case]["unchanged"] and r[case]["committed"] == len(r["steps"])
    assert r["rank_errors"] == [True, True]
    after = r["after_refusals"]
    assert after["version"] == len(r["steps"]) + 1 and after["after"] == after["dense"]
    same = r["unchanged_step"]  # no training in between: a version with nothing to send
    assert same["version"] == len(r["steps"]) + 2 and same["change_rate"] == 0
    assert same["after"] == same["dense"]
