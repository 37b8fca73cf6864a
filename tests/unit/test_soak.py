"""`dcr soak`: the growth arithmetic and the table (pure, synthetic samples), argument errors,
and in the slow lane a reduced soak (60 refits per transport with engine kills) on the real
cluster that must be bit-exact at every refit and flat after warm-up."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from dcr_tools.procs import PYTHON, REPO, base_env
from dcr_tools.soak import METRICS, analyse, dir_bytes, growth_pct, table


def test_growth_pct() -> None:
    assert growth_pct(100.0, 105.0) == pytest.approx(5.0)
    assert growth_pct(100.0, 90.0) == pytest.approx(-10.0)
    assert growth_pct(0.0, 0.0) == 0.0
    assert growth_pct(0.0, 1.0) == math.inf
    assert growth_pct(None, 1.0) is None and growth_pct(1.0, None) is None


def _run(values: dict[str, list[float]], refits: list[dict] | None = None) -> dict:
    """A synthetic run (pure test data): samples at refits 0, 10, 20, 30; each row's metrics
    all take the row's values."""
    samples = [
        {"refit": 10 * k, "rows": {n: dict.fromkeys(METRICS, v[k]) for n, v in values.items()}}
        for k in range(4)
    ]
    ok = {"killed": False, "attempts": 1, "bit_exact": True}
    return {"samples": samples, "refits": refits or [{"refit": 1, **ok}]}


def test_analyse_growth_after_warmup_and_pass() -> None:
    run = _run({"flat": [50.0, 100.0, 104.0, 105.0], "grows": [1.0, 100.0, 100.0, 106.0]})
    res = analyse(run, warmup=10, max_growth=5.0)
    # warm-up growth (50 -> 100) does not count: base is refit 10, last refit 30
    assert (res["growth_from_refit"], res["growth_to_refit"]) == (10, 30)
    assert res["rows"]["flat"]["pass"] and not res["rows"]["grows"]["pass"]
    g = res["rows"]["grows"]["metrics"]["rss_mib"]
    assert g["growth_pct"] == pytest.approx(6.0) and g["values"] == [1.0, 100.0, 100.0, 106.0]
    assert not res["flat"] and res["all_bit_exact"]
    text = table("relay", res)
    assert "grows" in text and "NO" in text and "6.0%" in text


def test_endpoint_rows_judge_only_stored_bytes() -> None:
    """The test S3 endpoint (moto) is not a DCR process: its memory may grow without failing
    the soak, the bytes it stores (DCR's retention) may not."""
    grows = [100.0, 100.0, 100.0, 120.0]
    run = _run({"moto": grows, "moto/python": grows})
    for s in run["samples"]:
        s["rows"]["moto/python"]["disk_kib"] = 0.0  # disk is on the endpoint's top row only
    res = analyse(run, warmup=10, max_growth=5.0)
    assert not res["rows"]["moto"]["pass"] and not res["flat"]  # moto's disk_kib grew 20 %
    assert not res["rows"]["moto"]["metrics"]["disk_kib"]["pass"]
    assert res["rows"]["moto"]["metrics"]["disk_kib"]["judged"]
    assert res["rows"]["moto/python"]["pass"]  # a child holds no disk: nothing judged grew
    run = _run({"moto": grows, "coordinator": grows})
    for s in run["samples"]:
        s["rows"]["moto"]["disk_kib"] = 64.0
    res = analyse(run, warmup=10, max_growth=5.0)
    assert res["rows"]["moto"]["pass"] and not res["rows"]["coordinator"]["pass"]
    rss = res["rows"]["moto"]["metrics"]["rss_mib"]
    assert rss["growth_pct"] == pytest.approx(20.0) and not rss["judged"]
    text = table("s3", res)
    assert "20.0*" in text and "reported, not judged" in text


def test_analyse_missing_row_and_refit_checks_fail() -> None:
    run = _run({"a": [1.0, 1.0, 1.0, 1.0]})
    del run["samples"][-1]["rows"]["a"]  # the process vanished: growth unknown, not a pass
    run["refits"] = [
        {"refit": 1, "killed": True, "attempts": 1, "bit_exact": True},
        {"refit": 2, "killed": False, "attempts": 2, "bit_exact": False},
    ]
    res = analyse(run, warmup=0, max_growth=5.0)
    assert res["rows"]["a"]["metrics"]["fds"]["growth_pct"] is None
    assert not res["rows"]["a"]["pass"] and not res["flat"]
    assert not res["all_bit_exact"]
    assert res["kills_not_two_attempts"] == [1] and res["unkilled_retries"] == [2]


def test_dir_bytes_separates_commit_history(tmp_path: Path) -> None:
    (tmp_path / "commits").mkdir()
    (tmp_path / "commits" / "v1.json").write_bytes(b"x" * 7)
    (tmp_path / "attempts").mkdir()
    (tmp_path / "attempts" / "a.json").write_bytes(b"y" * 5)
    assert dir_bytes(tmp_path) == (12, 7)
    assert dir_bytes(tmp_path / "missing") == (0, 0)


def test_soak_rejects_bad_arguments(tmp_path: Path) -> None:
    for args in (["--transports", "ftp"], ["--refits", "10", "--warmup", "10"]):
        r = subprocess.run(
            [PYTHON, "-m", "dcr_tools.cli", "soak", *args, "--out", str(tmp_path)],
            cwd=REPO,
            env=base_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and "dcr soak:" in r.stderr, (args, r.stderr)


def test_quantized_mode_arguments_and_oracle_paths(tmp_path: Path) -> None:
    """``--quantization``: only DCR's format names are taken; the oracle checkpoint of a version
    is the library's quantized one (``q<v>``) beside the trainer's BF16 export (``v<v>``)."""
    import argparse

    from dcr_tools.demo import Demo
    from dcr_tools.soak import build_parser

    r = subprocess.run(
        [PYTHON, "-m", "dcr_tools.cli", "soak", "--quantization", "int4", "--out", str(tmp_path)],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "--quantization: invalid choice: 'int4'" in r.stderr, r.stderr
    args = build_parser().parse_args(["--quantization", "int8-channel", "--out", str(tmp_path)])
    assert Path(Demo(args).ckpt(3)).name == "q3"
    plain = argparse.Namespace(**{**vars(args), "quantization": ""})
    assert Path(Demo(plain).ckpt(3)).name == "v3"
