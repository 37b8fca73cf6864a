"""`dcr bench refit`'s arithmetic on synthetic numbers (labelled as such; no timing, no
processes): lower bound, ideal speedup and its share, fleet-critical latency, the median / min-max
aggregation of rounds, and the CPU split of the two-cluster emulation."""

from __future__ import annotations

import math

import pytest

from dcr_tools.bench.refit import (
    FIGURES,
    derive,
    fleet_critical,
    ideal_speedup,
    lower_bound,
    split_cpus,
    summarize_rows,
)
from dcr_tools.bench.stats import aggregate, summarize

GBIT = 1e9 / 8  # bytes per second of a 1 Gbit/s link


def test_lower_bound_is_the_larger_of_construction_and_transfer() -> None:
    # synthetic: 12.5 MB at 1 Gbit/s is 0.1 s
    assert lower_bound(0.3, 12.5e6, GBIT) == pytest.approx(0.3)  # compute-bound
    assert lower_bound(0.05, 12.5e6, GBIT) == pytest.approx(0.1)  # link-bound
    assert lower_bound(0.05, 12.5e6, GBIT / 4) == pytest.approx(0.4)  # 0.25 Gbit/s
    with pytest.raises(ValueError):
        lower_bound(0.1, 1.0, 0.0)


def test_ideal_speedup_is_the_smaller_of_byte_and_compute_ratios() -> None:
    # synthetic: 332 MB checkpoint, 5.64 MB payload (58.9x by bytes), reference 5.7 s,
    # construction 0.25 s (22.8x by compute)
    assert ideal_speedup(332e6, 5.64e6, 5.7, 0.25) == pytest.approx(5.7 / 0.25)
    # a slow link: same bytes ratio, reference 30 s -> 120x by compute, bytes win
    assert ideal_speedup(332e6, 5.64e6, 30.0, 0.25) == pytest.approx(332 / 5.64)
    assert ideal_speedup(332e6, 0, 5.7, 0.25) == pytest.approx(5.7 / 0.25)  # empty delta
    assert math.isinf(ideal_speedup(332e6, 0, 5.7, 0.0))


def test_fleet_critical_is_the_slowest_engine() -> None:
    assert fleet_critical([0.41, 0.73, 0.52]) == 0.73  # synthetic ACK times
    assert fleet_critical([0.4]) == 0.4
    with pytest.raises(ValueError):
        fleet_critical([])


def _round() -> list[dict]:
    # synthetic round of one rate: the sequential build is the faster one (0.25 s)
    common = {"gbit": 1.0, "rate": "3%", "v_payload_bytes": 5e6, "reference_s": 6.0}
    return [
        {**common, "mode": "pipelined", "dcr_s": 0.5, "construct_s": 0.35},
        {**common, "mode": "sequential", "dcr_s": 0.6, "construct_s": 0.25},
    ]


def test_derive_uses_the_faster_build_of_the_round() -> None:
    rows = _round()
    derive(rows, checkpoint_bytes=300e6, bytes_per_s=GBIT)
    p, q = rows
    assert p["bound_construct_s"] == q["bound_construct_s"] == 0.25
    # 5 MB / 125 MB/s = 0.04 s < 0.25 s: the bound is the construction
    assert p["lower_bound_s"] == pytest.approx(0.25)
    assert p["latency_vs_lower_bound"] == pytest.approx(2.0)
    assert q["latency_vs_lower_bound"] == pytest.approx(2.4)
    assert p["speedup"] == pytest.approx(12.0)
    # ideal = min(300 / 5 = 60, 6.0 / 0.25 = 24) = 24
    assert p["ideal_speedup"] == pytest.approx(24.0)
    assert p["speedup_vs_ideal"] == pytest.approx(0.5)
    assert q["speedup_vs_ideal"] == pytest.approx(10.0 / 24.0)


def test_aggregation_is_median_and_spread_of_the_per_round_values() -> None:
    assert summarize([3.0, 1.0, 2.0]) == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "runs": [3.0, 1.0, 2.0],
    }
    assert summarize([1.0, 4.0])["median"] == 2.5  # even count: mean of the middle two
    # the median of ratios, not the ratio of medians (synthetic rounds)
    runs = [{"a": 1.0, "b": 4.0}, {"a": 2.0, "b": 1.0}, {"a": 9.0, "b": 2.0}]
    for r in runs:
        r["ratio"] = r["a"] / r["b"]
    agg = aggregate(runs, ["a", "ratio"])
    assert agg == {"a": 2.0, "a_min": 1.0, "a_max": 9.0, "ratio": 2.0, "ratio_min": 0.25,
                   "ratio_max": 4.5}  # fmt: skip
    with pytest.raises(AssertionError):
        summarize([])


def test_summarize_rows_reports_every_figure() -> None:
    rounds = []
    for k, dcr in enumerate((0.5, 0.7, 0.4, 0.6, 0.55)):  # synthetic: 5 rounds
        row = {key: 1.0 for key in FIGURES}
        row.update({"gbit": 0.25, "rate": "1%", "mode": "pipelined", "dcr_s": dcr, "round": k})
        rounds.append(row)
    out = summarize_rows(rounds)
    assert (out["gbit"], out["rate"], out["mode"], out["repeats"]) == (0.25, "1%", "pipelined", 5)
    assert (out["dcr_s"], out["dcr_s_min"], out["dcr_s_max"]) == (0.55, 0.4, 0.7)
    assert all(k in out and f"{k}_min" in out and f"{k}_max" in out for k in FIGURES)
    assert [r["round"] for r in out["runs"]] == [0, 1, 2, 3, 4]


def test_split_cpus_halves_the_allowed_set() -> None:
    assert split_cpus({0, 1}) == ({0}, {1})
    assert split_cpus({2, 3, 5, 7}) == ({2, 3}, {5, 7})
    assert split_cpus({0, 1, 2}) == ({0}, {1, 2})
    with pytest.raises(ValueError):
        split_cpus({0})
