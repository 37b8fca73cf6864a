"""SkyRL drives DCR (issue 33 item 3): SkyRL 0.4.0's own weight sync (``build_trainer_engine``,
``MegatronWeightSource``, ``SkyrlWeightSyncClient``), patched only at its closed backend switch
(`vllm_dcr_plugin.frameworks.skyrl`), refits a ``vllm serve`` started with backend ``dcr`` from a
real two-rank megatron-core job (TP=2, gloo). The trainer ranks run on the SkyRL environment
(.venv-skyrl: SkyRL --no-deps over the rollout environment; ``make setup`` builds it).

Oracle: after every step, vLLM's own ``/weight_checker`` checksums of the refit engine equal
those after a dense load of the same Megatron export (tests/integration/frameworks/skyrl_program.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dcr_tools.procs import REPO, base_env
from tests.integration.frameworks._harness import run_framework

pytestmark = [pytest.mark.vllm, pytest.mark.megatron]


#: configuration only: the variable SkyRL forwards to its workers (`{root}`: the test's tmp dir)
CONFIG = {
    "SKYRL_DCR_CONFIG": json.dumps(
        {
            "control": {"kind": "dir", "root": "{root}/store"},
            "transport": {"kind": "dir", "root": "{root}/store"},
            "checkpoint_for": "{root}/out/dense{version}",
            "verify": True,
        }
    )
}


def test_skyrl_weight_sync_refits_a_dcr_server(tmp_path: Path) -> None:
    check_syncs(run_framework(tmp_path, ".venv-skyrl", "skyrl_program.py", env=CONFIG))


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("not json", "SKYRL_DCR_CONFIG is not JSON"),
        ('["a list"]', "SKYRL_DCR_CONFIG must be a JSON object"),
    ],
)
def test_a_bad_skyrl_dcr_config_fails_skyrl_s_import_with_the_reason(
    value: str, error: str
) -> None:
    """The armed interpreter refuses a configuration it cannot read the moment SkyRL's weight
    sync is imported, naming the variable (not at the first sync, on some worker)."""
    python = REPO / ".venv-skyrl/bin/python"
    if not python.exists():
        pytest.skip("no framework environment (.venv-skyrl): `make setup` builds it")
    program = (  # the TypedDict alias: as in skyrl_program.py (SkyRL wants Python 3.12)
        "import typing, typing_extensions; typing.TypedDict = typing_extensions.TypedDict; "
        "import skyrl.backends.skyrl_train.weight_sync"
    )
    r = subprocess.run(
        [str(python), "-c", program],
        env=base_env(SKYRL_DCR_CONFIG=value),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and error in r.stderr


@pytest.mark.slow
def test_skyrl_server_killed_mid_apply_rejoins(tmp_path: Path) -> None:
    """The same syncs, then the server SIGKILLed mid-apply (slow lane: a second engine start)."""
    r = run_framework(tmp_path, ".venv-skyrl", "skyrl_program.py", chaos=True, env=CONFIG)
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
    armed = r["armed"]  # configuration only: the .pth armed the ranks, SkyRL's imports patched
    assert armed["installed_before_import"] == [] and armed["config"]["verify"] is True
    assert armed["validated_backend"] == "dcr" and armed["forwarded"]
    assert armed["by_name"] == "dcr"
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
