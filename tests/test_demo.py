"""`dcr demo` in reduced form (the README's main command): a short RL loop with real Megatron
policy-gradient steps, a `vllm serve` rollout engine refit by DCR after every step (killed
mid-apply every other step), checked bit for bit against a dense-loaded reference engine; and the
same loop with dense refits: identical per-step rewards and final weights (paper section 8.4 in
miniature)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcr_tools.procs import PYTHON, base_env, run_program


def _demo(tmp: Path, name: str, *extra: str, steps: int) -> dict:
    out = tmp / name
    run_program(
        [
            PYTHON,
            "-m",
            "dcr_tools.cli",
            "demo",
            "--steps",
            str(steps),
            "--out",
            str(out),
            *extra,
        ],
        timeout=1200,
        env=base_env(),
        log=tmp / f"{name}.log",
    )
    return json.loads((out / "report.json").read_text())


def _check_same_run(dcr: dict, dense: dict, steps: int) -> None:
    assert dcr["all_bit_exact"] and len(dcr["rows"]) == steps
    assert all(r["bit_exact"] for r in dcr["rows"])
    assert all(0 < r["payload_pct"] < 10.0 for r in dcr["rows"]), [
        r["payload_pct"] for r in dcr["rows"]
    ]
    assert all(r["element_change_rate"] > 0 for r in dcr["rows"])
    killed = [r for r in dcr["rows"] if r["killed"]]
    assert killed and all(r["attempts"] == 2 for r in killed)
    assert all(r["attempts"] == 1 for r in dcr["rows"] if not r["killed"])
    # the same RL run with dense refits: same rewards at every step, same final weights
    assert [r["rewards"] for r in dcr["rows"]] == [r["rewards"] for r in dense["rows"]]
    assert dcr["final_digest"] == dense["final_digest"]
    assert len({r["digest"] for r in dcr["rows"]}) == steps  # every step changed the weights


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_demo_rl_loop_with_kills_matches_dense_refits(tmp_path: Path) -> None:
    steps = 4
    dcr = _demo(tmp_path, "dcr", "--kill-every", "2", steps=steps)
    dense = _demo(tmp_path, "dense", "--refit", "dense", steps=steps)
    _check_same_run(dcr, dense, steps)
    assert (tmp_path / "dcr" / "report.png").stat().st_size > 1000
    assert "data:image/png;base64," in (tmp_path / "dcr" / "report.html").read_text()


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.s3
@pytest.mark.timeout(3600)
def test_demo_ten_steps_over_s3_with_kills_matches_dense_refits(tmp_path: Path) -> None:
    steps = 10
    dcr = _demo(tmp_path, "dcr", "--transport", "s3", "--kill-every", "3", steps=steps)
    dense = _demo(tmp_path, "dense", "--refit", "dense", steps=steps)
    _check_same_run(dcr, dense, steps)
