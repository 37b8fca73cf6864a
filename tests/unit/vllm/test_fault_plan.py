"""The test-only fault plan (vllm_dcr_plugin.faults) with a FAKE loader (pure unit test; the
recovery tests on real engines are test_receiver.py and test_coordinator.py): inert without
``DCR_FAULT_PLAN``; a plan fires once per rank on the first call that can fire it, only on the
rank it names; an armed ``fail_after_items`` fails an apply part-way as a loader error would."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcr_tools import faults
from shared_codec.buckets import encode_items
from shared_codec.format import PayloadMeta
from shared_codec.records import Kind, diff_tensors
from tests.unit.vllm.test_receiver_units import CANON, FakeLoaderModel, _canonical, _dense
from vllm_dcr_plugin.receiver import Receiver


def test_inert_without_the_variable(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.arm(tmp_path / "plan.json", kill_after_items=0)
    assert faults.take(0, "pipelined") == faults.NO_FAULTS
    monkeypatch.setenv(faults.ENV, str(tmp_path / "absent.json"))
    assert faults.take(0, "pipelined") == faults.NO_FAULTS


def test_plan_fires_once_per_rank_on_a_call_that_can_fire_it(monkeypatch, tmp_path) -> None:
    plan = tmp_path / "plan.json"
    monkeypatch.setenv(faults.ENV, str(plan))
    faults.arm(plan, fail_after_items=2)
    assert faults.take(0, "fetch") == faults.NO_FAULTS  # a plain fetch stages only: still armed
    assert faults.take(0, "apply") == faults.Faults(fail_after_items=2)
    assert faults.take(0, "apply") == faults.NO_FAULTS  # consumed on rank 0
    assert faults.take(1, "pipelined") == faults.Faults(fail_after_items=2)  # rank 1: its own
    faults.arm(plan, kill_after_payloads=1, rank=1)  # re-armed, for rank 1 only
    assert faults.take(0, "fetch") == faults.NO_FAULTS
    assert faults.take(1, "fetch") == faults.Faults(kill_after_payloads=1)
    assert faults.take(1, "fetch") == faults.NO_FAULTS
    with pytest.raises(ValueError, match="names one or more"):
        faults.arm(plan, fail_after=3)
    # the parts of a pipelined fetch count items already applied; its tail is never killed
    f = faults.Faults(fail_after_items=5, kill_after_items=3)
    assert f.remaining(4) == faults.Faults(fail_after_items=1, kill_after_items=0)
    assert f.remaining(1, kill=False) == faults.Faults(fail_after_items=4)


def test_armed_failure_leaves_a_partial_apply(monkeypatch, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    monkeypatch.setenv(faults.ENV, str(plan))
    model = FakeLoaderModel()
    v0, v1 = _canonical(0), _canonical(1)
    _dense(model, v0)
    rx = Receiver(model, rank={"rank": 0})
    report = rx.prewarm([[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()])
    items = [
        diff_tensors(n, v0[n], v1[n], owner=0, kind=Kind.OVERWRITE)
        for n in ("d.weight", "t.weight", "c.weight")
    ]
    assert set(report["overwrite_only"]) == {"t.weight", "c.weight"}
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    assert rx.stage(encode_items(items, meta))["staged"]
    faults.arm(plan, fail_after_items=1)
    ack = rx.apply(0)
    assert not ack["ok"] and "injected failure after 1 items" in ack["error"], ack
    assert ack["items"] == 1 and ack["partial_item"] is None
    assert rx.status()["state"] == "dirty"
    # the retry of the complete set (overwrites, a new attempt) is not faulted again
    meta = PayloadMeta(version=1, base_version=0, attempt=1, owner=0, sequence=0)
    assert rx.stage(encode_items(items, meta))["staged"]
    ack = rx.apply(1, verify=True)
    assert ack["ok"] and ack["items"] == 3, ack
    assert rx.status()["state"] == "applied"
