"""`dcr soak`: the growth arithmetic and the table (pure, synthetic samples), argument errors,
and in the slow lane a reduced soak (60 refits per transport with engine kills) on the real
cluster, and a short one of a quantized (INT8 W8A8) cluster, each bit-exact at every refit and
flat after warm-up.

The reduced soak (slow lane) is here; the analysis units in tests/unit/test_soak.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dcr_tools.procs import PYTHON, REPO, base_env, kill_group


def _soak(tmp: Path, *args: str, timeout_s: float) -> tuple[dict, str, int]:
    """Run ``dcr soak ARGS --out TMP/soak`` (output to a log; the process group killed at the
    end); returns soak.json, the log's text and the exit status."""
    out, log = tmp / "soak", tmp / "soak.log"
    with open(log, "w") as log_f:
        proc = subprocess.Popen(
            [PYTHON, "-m", "dcr_tools.cli", "soak", *args, "--out", str(out)],
            cwd=REPO, env=base_env(), stdout=log_f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=timeout_s)
        finally:
            kill_group(proc)
    text = log.read_text(errors="replace")
    return json.loads((out / "soak.json").read_text()), text, proc.returncode


def _check_run(report: dict, t: str, text: str, refits: int, kills: int) -> list[str]:
    """The checks of every soak run of transport `t`; returns the rows' metrics that grew."""
    run = report["transports"][t]
    res = run["result"]
    assert not run["error"], f"{t}: {run['error']}\n{text[-4000:]}"
    assert res["refits_done"] == refits and res["all_bit_exact"], text[-4000:]
    assert res["kills"] == kills and not res["kills_not_two_attempts"], res
    assert not res["unkilled_retries"], res
    assert len({r["digest"] for r in run["refits"]}) == refits  # every refit changed weights
    # every process of the cluster is sampled, from the first sample to the last
    names = set(res["rows"])
    assert {"coordinator", "trainer/rank0", "trainer/rank1", "rollout", "reference"} <= names
    assert ({"relay-root", "relay-rollout0"} if t == "relay" else {"moto"}) <= names
    assert any(n.startswith("rollout/VLLM::Worker") for n in names), names
    return [
        f"{n}.{m}" for n, row in res["rows"].items() for m, mm in row["metrics"].items()
        if not mm["pass"]
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.s3
@pytest.mark.zmq
@pytest.mark.timeout(3000)
def test_reduced_soak_is_bit_exact_and_flat(tmp_path: Path) -> None:
    """60 refits per transport (relay tree, S3 on moto), the rollout engine killed mid-apply at
    refits 15 and 45, samples every 10 refits, growth from refit 20 to 60 within 5 %."""
    report, text, rc = _soak(
        tmp_path, "--refits", "60", "--transports", "relay,s3", "--kill-every", "30",
        "--sample-every", "10", "--warmup", "20", "--assert-flat", timeout_s=2900,
    )  # fmt: skip
    grown: dict[str, list[str]] = {}
    for t in ("relay", "s3"):
        grown[t] = _check_run(report, t, text, refits=60, kills=2)
        assert f"== {t}: growth from refit 20 to refit 60" in text
    for t in ("relay", "s3"):  # retention everywhere: relay spools and delivered sets too
        assert not grown[t], f"{t} rows grew more than 5 %: {grown[t]}\n{text[-6000:]}"
    assert rc == 0, text[-4000:]


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.zmq
@pytest.mark.timeout(2400)
def test_short_quantized_soak_is_bit_exact_and_flat(tmp_path: Path) -> None:
    """A short soak of a quantized rollout cluster (issue 32): both engines serve INT8 W8A8
    (compressed-tensors), the trainer job sends quantized deltas, the replica keeps the
    quantized checkpoint. 30 refits over the relay tree, the rollout engine killed mid-apply at
    refits 10 and 30 (each restored from the replica and retried with overwrites), every refit
    bit-exact with a dense load of the library's quantized checkpoint of the export (kernel
    tensors and checkpoint-format tensors alike), growth from refit 10 to 30 within 5 %."""
    report, text, rc = _soak(
        tmp_path, "--refits", "30", "--transports", "relay", "--kill-every", "20",
        "--sample-every", "5", "--warmup", "10", "--assert-flat",
        "--quantization", "int8-channel", timeout_s=2300,
    )  # fmt: skip
    assert report["settings"]["quantization"] == "int8-channel"
    grown = _check_run(report, "relay", text, refits=30, kills=2)
    assert "== relay: growth from refit 10 to refit 30" in text
    assert not grown, f"rows grew more than 5 %: {grown}\n{text[-6000:]}"
    assert rc == 0, text[-4000:]
