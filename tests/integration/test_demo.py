"""`dcr demo` in reduced form (the README's main command): a short RL loop with real Megatron
policy-gradient steps, a `vllm serve` rollout engine refit by DCR after every step (killed
mid-apply every other step and restored from the rollout cluster's replica), checked bit for
bit against a dense-loaded reference engine (and the replica against the trainer's export); and
the same loop with dense refits: identical per-step rewards and final weights (paper section 8.4
in miniature)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from dcr_tools.demo_report import TABLE_NOTE, table_header
from dcr_tools.procs import PYTHON, REPO, base_env, kill_group

# one printed table line: step, reward, changed %, payload bytes, % ckpt, 4 stage seconds,
# tries, exact
ROW = re.compile(
    r" *\d+ +-?\d+\.\d{3} +\d+\.\d{2}% +\d+ +\d+\.\d{2}%( +-?\d+\.\d{2}){4} +\d+ +(yes|NO)"
)


def _demo(tmp: Path, name: str, *extra: str, steps: int) -> dict:
    """Run ``dcr demo`` (stdout and stderr to separate files, the process group killed at the
    end), check that its stdout holds nothing but its known lines, return report.json."""
    out = tmp / name
    stdout, stderr = tmp / f"{name}.stdout", tmp / f"{name}.log"
    args = [PYTHON, "-m", "dcr_tools.cli", "demo", "--steps", str(steps), "--out", str(out)]
    with open(stdout, "w") as out_f, open(stderr, "w") as err_f:
        proc = subprocess.Popen(
            [*args, *extra],
            cwd=REPO,
            env=base_env(),
            stdout=out_f,
            stderr=err_f,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=1200)
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_group(proc)
    text = stdout.read_text()
    assert proc.returncode == 0, (
        f"dcr demo {' '.join(extra)} exited {proc.returncode}:\n{text[-4000:]}\n"
        f"stderr:\n{stderr.read_text(errors='replace')[-4000:]}"
    )
    _check_printed(text, steps)
    return json.loads((out / "report.json").read_text())


def _check_printed(text: str, steps: int) -> None:
    """Every stdout line is a ``[demo]`` log line, the table's note, header or a step row: no
    stray values (a bare ``True`` once appeared)."""
    lines = text.splitlines()
    stray = [ln for ln in lines if ln.strip() in ("True", "False", "None", "")]
    assert not stray, f"stray lines in the demo's output: {stray}"
    unknown = [
        ln
        for ln in lines
        if not (ln.startswith("[demo] ") or ln in (TABLE_NOTE, table_header()) or ROW.fullmatch(ln))
    ]
    assert not unknown, f"unexpected lines in the demo's output: {unknown}"
    assert lines.count(table_header()) == 1
    assert sum(1 for ln in lines if ROW.fullmatch(ln)) == steps
    assert lines[-1].startswith("[demo] All ") and "bit-exact" in lines[-1], lines[-1]


def _check_same_run(dcr: dict, dense: dict, steps: int) -> None:
    assert dcr["all_bit_exact"] and len(dcr["rows"]) == steps
    assert all(r["bit_exact"] for r in dcr["rows"])
    assert all(0 < r["payload_pct"] < 10.0 for r in dcr["rows"]), [
        r["payload_pct"] for r in dcr["rows"]
    ]
    assert all(r["element_change_rate"] > 0 for r in dcr["rows"])
    killed = [r for r in dcr["rows"] if r["killed"]]
    assert killed and all(r["attempts"] == 2 for r in killed)
    # the replica was a required receiver: its checkpoint is the export's bits at every step;
    # the rollout engine restored from it (v0, then after every kill), never from the trainer
    assert dcr["replica"] and all(r["replica_exact"] for r in dcr["rows"])
    assert dcr["replica_served"]["leases"] == 1 + len(killed), dcr["replica_served"]
    assert dcr["replica_served"]["bytes"] >= (1 + len(killed)) * dcr["checkpoint_bytes"]
    assert all(r["attempts"] == 1 for r in dcr["rows"] if not r["killed"])
    # the same RL run with dense refits: same rewards at every step, same final weights
    assert [r["rewards"] for r in dcr["rows"]] == [r["rewards"] for r in dense["rows"]]
    assert dcr["final_digest"] == dense["final_digest"]
    assert len({r["digest"] for r in dcr["rows"]}) == steps  # every step changed the weights
    # every rollout token came from the version committed before its step (vLLM's own
    # weight_versions, one whole span per sample), in both runs: the switch at each commit
    for run in (dcr, dense):
        assert [r["rollout_versions"] for r in run["rows"]] == [[str(s)] for s in range(steps)]
        assert all(r["rollout_spans_whole"] for r in run["rows"])


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_demo_rl_loop_with_kills_matches_dense_refits(tmp_path: Path) -> None:
    # three steps, one kill (step 2); the slow lane's S3 demo runs ten steps with three kills
    steps = 3
    dcr = _demo(tmp_path, "dcr", "--kill-every", "2", steps=steps)
    dense = _demo(tmp_path, "dense", "--refit", "dense", steps=steps)
    _check_same_run(dcr, dense, steps)
    # retention through the relay tree (keep_versions=2): both nodes' spools hold only the
    # newest two committed versions' files
    for node in ("root", "rollout0"):
        spool = tmp_path / "dcr" / "work" / f"spool-{node}"
        found = (re.match(r"(?:[a-z]+-)?v(\d{12})", f.name) for f in spool.iterdir())
        assert {int(m.group(1)) for m in found if m} == {steps - 1, steps}, node
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
