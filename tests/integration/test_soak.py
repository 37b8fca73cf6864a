"""`dcr soak`: the growth arithmetic and the table (pure, synthetic samples), argument errors,
and in the slow lane a reduced soak (60 refits per transport with engine kills) on the real
cluster that must be bit-exact at every refit and flat after warm-up.

The reduced soak (slow lane) is here; the analysis units in tests/unit/test_soak.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dcr_tools.procs import PYTHON, REPO, base_env, kill_group


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.s3
@pytest.mark.zmq
@pytest.mark.timeout(3000)
def test_reduced_soak_is_bit_exact_and_flat(tmp_path: Path) -> None:
    """60 refits per transport (relay tree, S3 on moto), the rollout engine killed mid-apply at
    refits 15 and 45, samples every 10 refits, growth from refit 20 to 60 within 5 %."""
    out, log = tmp_path / "soak", tmp_path / "soak.log"
    args = [
        PYTHON, "-m", "dcr_tools.cli", "soak", "--refits", "60", "--transports", "relay,s3",
        "--kill-every", "30", "--sample-every", "10", "--warmup", "20", "--assert-flat",
        "--out", str(out),
    ]  # fmt: skip
    with open(log, "w") as log_f:
        proc = subprocess.Popen(
            args, cwd=REPO, env=base_env(), stdout=log_f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=2900)
        finally:
            kill_group(proc)
    text = log.read_text(errors="replace")
    report = json.loads((out / "soak.json").read_text())
    grown: dict[str, list[str]] = {}
    for t in ("relay", "s3"):
        run = report["transports"][t]
        res = run["result"]
        assert not run["error"], f"{t}: {run['error']}\n{text[-4000:]}"
        assert res["refits_done"] == 60 and res["all_bit_exact"], text[-4000:]
        assert res["kills"] == 2 and not res["kills_not_two_attempts"], res
        assert not res["unkilled_retries"], res
        assert len({r["digest"] for r in run["refits"]}) == 60  # every refit changed weights
        # every process of the cluster is sampled, from the first sample to the last
        names = set(res["rows"])
        assert {"coordinator", "trainer/rank0", "trainer/rank1", "rollout", "reference"} <= names
        assert ({"relay-root", "relay-rollout0"} if t == "relay" else {"moto"}) <= names
        assert any(n.startswith("rollout/VLLM::Worker") for n in names), names
        grown[t] = [
            f"{n}.{m}"
            for n, row in res["rows"].items()
            for m, mm in row["metrics"].items()
            if not mm["pass"]
        ]
        assert f"== {t}: growth from refit 20 to refit 60" in text
    for t in ("relay", "s3"):  # retention everywhere: relay spools and delivered sets too
        assert not grown[t], f"{t} rows grew more than 5 %: {grown[t]}\n{text[-6000:]}"
    assert proc.returncode == 0, text[-4000:]
