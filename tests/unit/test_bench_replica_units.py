"""`dcr bench replica`'s pure parts on synthetic numbers (labelled as such; no timing): the
per-round refit, throughput and restore figures, the goals' verdicts on the medians; the
benchmark's stand-in owners publishing versions a real replica receiver stages bit-exact
(tiny model, real codec, sinks, seal and coordinator; no vLLM); the subcommand's registration."""

from __future__ import annotations

import math

import pytest

from dcr_tools.bench.replica import (
    GOALS,
    REFIT_FIGURES,
    RESTORE_FIGURES,
    THROUGHPUT_FIGURES,
    refit_round,
    restore_round,
    throughput_round,
    verdicts,
)
from dcr_tools.bench.stats import aggregate


def test_refit_round_is_the_ratio_of_the_two_latencies() -> None:
    # synthetic: a refit with the replica of 0.63 s, one without of 0.60 s
    row = refit_round({"refit_s": 0.63}, {"refit_s": 0.60, "catchup_s": 0.2})
    assert row == pytest.approx(
        {"with_s": 0.63, "without_s": 0.60, "with_vs_without": 1.05, "catchup_s": 0.2}
    )
    assert set(row) == set(REFIT_FIGURES)


def test_throughput_round_is_changed_elements_per_second_of_each_receiver() -> None:
    # synthetic: 1.66M elements staged by the replica in 0.5 s, applied by the engine in 20 ms
    row = throughput_round(
        {
            "replica_elements": 1_660_000,
            "replica_apply_s": 0.5,
            "engine_elements": 1_660_000,
            "engine_work_s": 0.02,
        }
    )
    assert row["replica_elements_per_s"] == pytest.approx(3.32e6)
    assert row["engine_elements_per_s"] == pytest.approx(83e6)
    assert row["replica_vs_engine"] == pytest.approx(0.04)
    assert set(row) == set(THROUGHPUT_FIGURES)


def test_restore_round_compares_wall_times() -> None:
    # synthetic: the replica's load over HTTP is a download (1.1 s wall) then the same 40 ms
    # load; from its slot under a lease 0.052 s
    row = restore_round(
        {"wall_s": 0.05, "worker_s": 0.04},
        {"wall_s": 1.1, "worker_s": 0.04},
        {"wall_s": 0.052, "worker_s": 0.04},
    )
    assert row["replica_vs_local"] == pytest.approx(22.0)
    assert row["lease_vs_local"] == pytest.approx(1.04)
    assert (row["local_worker_s"], row["replica_worker_s"]) == (0.04, 0.04)
    assert set(row) == set(RESTORE_FIGURES)


def test_verdicts_judge_the_median_ratio_against_each_goal() -> None:
    # synthetic rounds: refit ratios 1.02 / 1.04 / 1.20 (median 1.04: met despite one outlier),
    # restore ratios 1.05 / 1.3 / 1.4 (median 1.3: not met)
    refits = [
        refit_round({"refit_s": r}, {"refit_s": 1.0, "catchup_s": 0.1}) for r in (1.02, 1.04, 1.2)
    ]
    restores = [
        restore_round(
            {"wall_s": 1.0, "worker_s": 1.0},
            {"wall_s": r, "worker_s": 1.0},
            {"wall_s": 1.0, "worker_s": 1.0},
        )
        for r in (1.05, 1.3, 1.4)
    ]
    out = verdicts(aggregate(refits, REFIT_FIGURES), aggregate(restores, RESTORE_FIGURES))
    refit, restore = out["refit_with_vs_without"], out["restore_replica_vs_local"]
    assert refit["ratio"] == pytest.approx(1.04) and refit["met"]
    assert (refit["min"], refit["max"]) == pytest.approx((1.02, 1.2))
    assert refit["at_most"] == GOALS["refit_with_vs_without"] == 1.05
    assert restore["ratio"] == pytest.approx(1.3) and not restore["met"]
    assert restore["at_most"] == GOALS["restore_replica_vs_local"] == 1.1
    assert out["restore_lease_vs_local"]["ratio"] == pytest.approx(1.0)
    assert out["restore_lease_vs_local"]["met"]
    # exactly at the goal is met
    edge = aggregate([{"with_vs_without": 1.05}], ["with_vs_without"])
    assert verdicts(edge, aggregate(restores, RESTORE_FIGURES))["refit_with_vs_without"]["met"]


def test_chain_owners_publish_versions_a_replica_stages_bit_exact(tmp_path) -> None:
    pytest.importorskip("safetensors")
    from dcr_tools.bench.replica import ChainOwners, derive_versions
    from dcr_tools.fixtures import write_tiny_model
    from shared_codec.checkpoint import tensor_table
    from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
    from shared_codec.replica import ReplicaStore
    from shared_codec.replica.receiver import ReplicaReceiver
    from shared_codec.transport.store import DirectoryStore

    v0 = write_tiny_model("qwen3", tmp_path / "v0")
    items, digests, last = derive_versions(v0, tmp_path, 3, 0.01, overwrite=set())
    assert sorted(items) == [1, 2, 3] and last == tmp_path / "v3"
    assert not (tmp_path / "v1").exists() and not (tmp_path / "v2").exists()  # removed once diffed
    spec = {"kind": "dir", "root": str(tmp_path / "payloads")}
    with ReplicaStore(tmp_path / "replica") as store:
        store.bootstrap(v0)
    rx = ReplicaReceiver(tmp_path / "replica", spec)
    numel = sum(math.prod(shape) for _, _, shape in tensor_table(v0))
    coord = Coordinator(
        DirectoryStore(tmp_path / "control"), ChainOwners(items, spec, numel), [rx],
        CoordinatorConfig(max_attempts=1, ack_timeout_s=30, record_digests=False),
        lambda _m: None, spec,
    )  # fmt: skip
    coord.initialize()
    try:
        for v in (1, 2, 3):
            res = coord.refit()
            assert res.version == v and rx.digest() == digests[v]
            built = res.attempts[-1].owners
            assert built is not None and built.payload_bytes > 0
            assert 0.005 < built.element_change_rate < 0.02
        with pytest.raises(RuntimeError, match="retry"):
            ChainOwners(items, spec, numel).build(1, 1, retry=True)
    finally:
        rx.close()


def test_bench_replica_is_registered() -> None:
    from dcr_tools import cli

    args = cli.build_parser().parse_args(["bench", "replica", "--size", "small", "--repeats", "3"])
    assert args.func is cli.cmd_bench_replica
    assert (args.size, args.repeats, args.json) == ("small", 3, None)
    default = cli.build_parser().parse_args(["bench", "replica"])
    assert (default.size, default.repeats) == ("medium", 5)
