"""Deadlines with a real worker death (issue: an in-process TP engine whose worker dies
mid-apply must not hang its caller): `DCRClient` raises `EngineUnreachable` naming the call
well within its deadline, refuses later calls at once, and the overwrite retry on a restarted
engine is bit-exact with a dense load and gives the same greedy tokens. The engine program is
deadline_program.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcr_tools.fixtures import perturb_checkpoint, write_tiny_model
from dcr_tools.procs import PYTHON, REPO, base_env, run_program
from tests.integration.vllm.test_receiver import TP2_ENV

DEADLINE_S = 60.0


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_worker_killed_mid_apply_fails_within_the_deadline_and_the_retry_repairs(
    tmp_path: Path,
) -> None:
    v0 = write_tiny_model("qwen3", tmp_path / "v0", seed=0)
    perturb_checkpoint(v0, tmp_path / "v1", seed=1)
    out = tmp_path / "report.json"
    run_program(
        [
            PYTHON,
            str(REPO / "tests/integration/vllm/deadline_program.py"),
            "--versions",
            json.dumps([str(v0), str(tmp_path / "v1")]),
            "--deadline",
            str(DEADLINE_S),
            "--out",
            str(out),
        ],
        timeout=840,
        env=base_env(**TP2_ENV),
        log=tmp_path / "engine.log",
    )
    r = json.loads(out.read_text())
    assert r["ref_digests"] != r["d0"] and r["staged"][0] > 0 and r["staged"][0] == r["staged"][1]
    # the worker's death is an error naming the call, well before the deadline
    assert r["apply_error"] is not None and r["apply_error"].startswith(
        "EngineUnreachable: dcr_apply"
    ), r["apply_error"]
    assert r["apply_seconds"] < DEADLINE_S, r["apply_seconds"]
    # later calls are refused at once instead of waiting on a dead engine
    assert "dead to this client" in r["after_error"] and r["after_seconds"] < 1.0
    # the restarted engine, on the committed version, is repaired by the overwrite retry
    assert r["restart_d0"] == r["d0"]
    assert all(n > 0 for n in r["retry_staged"])
    assert all(a["ok"] and a["post_apply_mismatches"] == 0 for a in r["retry_acks"])
    assert r["retry_digests"] == r["ref_digests"]
    assert r["retry_tokens"] == r["ref_tokens"]
