"""The owner's state machine (`OwnerState` / `OwnerLedger`), the public `Candidate` record, and
the hook's transitions through them, in-process.

The ledger is checked against its transition table event by event (illegal transitions
assert; a commit with nothing built is a `ProtocolError`). The hook runs on the FAKE model of
tests/unit/megatron/test_hook_units.py (three bf16 parameters: one affine column layout, one
replicated norm, one residual padded embedding) on a one-rank gloo group that is not torch's
default group; the oracle for the commit is bitwise (trackers equal the parameters' stored
bits) and that the commit reads no shard (every scan site is made to fail).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import megatron_dcr_hooks.hook as hook_mod
import megatron_dcr_hooks.residual as residual_mod
import shared_codec.scan as scan_mod
from megatron_dcr_hooks import Candidate, OwnerState
from megatron_dcr_hooks.candidate import OwnerLedger
from megatron_dcr_hooks.groups import ParallelGroups, RankGroup
from megatron_dcr_hooks.hook import DCRHook
from megatron_dcr_hooks.tasks import classify_tasks
from shared_codec.errors import CandidateChanged, OwnerBuildError, ProtocolError
from tests.device_only import device_only_group
from tests.unit.megatron.test_hook_units import FakeModel, _config

S = OwnerState


def _cand(version: int = 1, *, retry: bool = False, **kw: Any) -> Candidate:
    return Candidate(version=version, attempt=0, base_version=version - 1, retry=retry, **kw)


# -- Candidate -----------------------------------------------------------------------------------


def test_candidate_is_a_frozen_keyword_only_record_with_read_only_mappings() -> None:
    delta = {3: (np.array([1, 2]), np.array([7, 8], dtype=np.uint16))}
    c = _cand(checks={3: b""}, delta=delta, residual={"emb.weight": torch.zeros(2)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.version = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        c.delta[4] = delta[3]  # type: ignore[index]
    with pytest.raises(TypeError):
        Candidate(1, 0, 0)  # type: ignore[misc]
    assert not hasattr(c, "__dict__")  # slotted
    delta[5] = delta[3]  # the caller's dict is copied, not shared
    assert set(c.delta) == {3} and c.checks == {3: b""} and list(c.residual) == ["emb.weight"]
    assert _cand().checks == {} and _cand().delta == {} and _cand().residual == {}
    assert dataclasses.replace(c, residual={}).residual == {} and c.residual


# -- OwnerLedger ---------------------------------------------------------------------------------


def _ledger_in(state: OwnerState) -> OwnerLedger:
    """A ledger driven into `state` through legal transitions only (candidate version 1)."""
    led = OwnerLedger()
    if state is S.IDLE:
        return led
    led.built(_cand())
    if state in (S.REBUILT, S.REBUILT_ABORTED):
        led.built(_cand())
    if state in (S.ABORTED, S.REBUILT_ABORTED):
        led.aborted()
    if state is S.STALE:
        led.refused()
    assert led.state is state
    return led


#: state -> (next after a plain build of v1, a retry of v1, a plain build of v2, abort, refuse)
_TABLE = {
    S.IDLE: (S.OPEN, S.OPEN, S.OPEN, S.IDLE, None),
    S.OPEN: (S.REBUILT, S.OPEN, S.OPEN, S.ABORTED, S.STALE),
    S.REBUILT: (S.REBUILT, S.OPEN, S.OPEN, S.REBUILT_ABORTED, S.STALE),
    S.ABORTED: (S.OPEN, S.OPEN, S.OPEN, S.ABORTED, S.STALE),
    S.REBUILT_ABORTED: (S.OPEN, S.OPEN, S.OPEN, S.REBUILT_ABORTED, S.STALE),
    S.STALE: (S.OPEN, S.OPEN, S.OPEN, S.STALE, None),
}


@pytest.mark.parametrize("state", list(OwnerState))
def test_ledger_moves_along_its_transition_table(state: OwnerState) -> None:
    plain, retry, other, abort, refuse = _TABLE[state]
    for cand, want in ((_cand(), plain), (_cand(retry=True), retry), (_cand(2), other)):
        led = _ledger_in(state)
        led.built(cand)
        assert led.state is want and led.candidate is cand
    led = _ledger_in(state)
    led.aborted()
    assert led.state is abort
    led = _ledger_in(state)
    if refuse is None:  # only a candidate with guard records can be refused
        with pytest.raises(AssertionError, match="no transition on refuse"):
            led.refused()
        assert led.state is state
    else:
        led.refused()
        assert led.state is refuse
    led = _ledger_in(state)
    if state is S.IDLE:
        with pytest.raises(ProtocolError, match="commit without a built candidate"):
            led.to_commit()
        with pytest.raises(ProtocolError):
            led.committed()
    else:
        assert led.to_commit().version == 1
        led.committed()
        assert (led.state, led.candidate, led.committed_version) == (S.IDLE, None, 1)


def test_ledger_answers_what_the_guard_asks() -> None:
    led = _ledger_in(S.OPEN)
    assert led.holds(1) and not led.holds(2) and not led.rebuilt(1) and led.last_built() == 1
    led = _ledger_in(S.REBUILT_ABORTED)
    assert led.holds(1) and led.rebuilt(1) and not led.rebuilt(2)
    led = _ledger_in(S.STALE)  # the candidate stays (a commit without verify may advance to it)
    assert not led.holds(1) and led.last_built() is None and led.candidate is not None


def test_abort_drops_the_converted_residual_and_keeps_the_guard_records() -> None:
    led = OwnerLedger()
    led.built(_cand(checks={0: b""}, residual={"emb.weight": torch.ones(3)}))
    led.aborted()
    assert led.candidate is not None and led.candidate.residual == {}
    assert led.candidate.checks == {0: b""} and led.holds(1)


# -- the hook's state ----------------------------------------------------------------------------


@pytest.fixture(params=["gloo", "device-only-world"])
def groups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ParallelGroups:
    """One-rank groups on a gloo group that is NOT torch's default group; the hook's tasks come
    from the FAKE model. "device-only-world": the world rejects CPU tensors as NCCL does (TEST
    DOUBLE, tests/device_only.py), so the hook and its owner service reduce elsewhere."""

    def fake_build_tasks(chunks: list[FakeModel], architecture: str, groups: ParallelGroups, **kw):
        return classify_tasks(chunks[0].param_tasks(), groups, **kw)

    monkeypatch.setattr(hook_mod, "build_tasks", fake_build_tasks)
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    one = RankGroup(group=pg, rank=0, size=1)
    if request.param == "gloo":
        return ParallelGroups(world=one, tp=one, dp=one, ep=one, expert_dp=one, pp=one)
    world = RankGroup(group=device_only_group(), rank=0, size=1)
    return ParallelGroups(world=world, tp=one, dp=one, ep=one, expert_dp=one, pp=one)


def test_hook_walks_the_owner_states(groups: ParallelGroups) -> None:
    model = FakeModel()
    hook = DCRHook([model], _config(), groups=groups)
    assert hook.state is S.IDLE and hook.candidate is None
    model.perturb(1)
    hook.build(1)
    c = hook.candidate
    assert hook.state is S.OPEN and c is not None
    assert (c.version, c.attempt, c.base_version, c.retry) == (1, 0, 0, False)
    assert set(c.checks) == {t.index for t in hook.owned} and set(c.residual) == {"emb.weight"}
    assert set(c.delta) == {t.index for t in hook.owned}  # every owned shard changed
    hook.build(1)  # a wrapped optimizer step builds the open version again
    assert hook.state is S.REBUILT
    hook.abort()
    assert hook.state is S.REBUILT_ABORTED and hook.candidate.residual == {}
    with pytest.raises(CandidateChanged, match="built again"):
        hook.build(1, 1, retry=True)
    assert hook.state is S.STALE
    hook.build(1, 2, retry=True)
    assert hook.state is S.OPEN and hook.candidate.retry and hook.candidate.attempt == 2
    hook.commit()
    assert hook.state is S.IDLE and hook.candidate is None and hook.committed_version == 1


def test_a_failed_build_leaves_state_and_candidate_as_they_were(groups: ParallelGroups) -> None:
    sent: list[bytes] = []
    broken = False

    def sink(payload: bytes) -> None:
        if broken:
            raise OSError("store unreachable")
        sent.append(payload)

    model = FakeModel()
    hook = DCRHook([model], _config(sink=sink), groups=groups)
    model.perturb(2)
    hook.build(1)
    before = hook.candidate
    broken = True
    model.perturb(3)
    with pytest.raises(OwnerBuildError, match="store unreachable"):
        hook.build(1, 1)
    assert hook.state is S.OPEN and hook.candidate is before


def test_commit_reads_no_shard_at_any_scan_site(
    groups: ParallelGroups, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``commit(verify=False)`` scatters the recorded change: every module that scans (the
    detection and the residual comparison) fails the test if it is asked to."""
    model = FakeModel()
    hook = DCRHook([model], _config(), groups=groups)
    model.perturb(4)
    hook.build(1)

    def no_scan(*a: Any) -> Any:
        raise AssertionError("commit scanned")

    with monkeypatch.context() as m:
        for mod in (scan_mod, residual_mod):
            m.setattr(mod, "changed_indices", no_scan)
        hook.commit(verify=False)
    params = {t.index: t.param for t in hook.tasks}
    assert hook.trackers and all(
        torch.equal(tr.view(torch.int16), params[i].detach().view(torch.int16))
        for i, tr in hook.trackers.items()
    )


def test_owner_service_reads_the_candidate_record(groups: ParallelGroups, tmp_path: Any) -> None:
    from megatron_dcr_hooks.service import OwnerService

    model = FakeModel()
    hook = DCRHook([model], _config(), groups=groups)
    svc = OwnerService(hook, {"kind": "dir", "root": str(tmp_path / "p")}, "inproc://unused")
    assert svc.handle({"op": "status"})["candidate"] is None
    model.perturb(5)
    assert svc.handle({"op": "build", "version": 1, "attempt": 0})["ok"]
    assert svc.handle({"op": "status"})["candidate"] == 1 == hook.candidate.version
    bad = svc.handle({"op": "commit", "version": 2})
    assert not bad["ok"] and "candidate 1" in bad["error"]
    assert svc.handle({"op": "commit", "version": 1})["committed_version"] == 1
    assert svc.handle({"op": "status"})["candidate"] is None


def test_owner_service_speaks_the_typed_protocol(groups: ParallelGroups, tmp_path: Any) -> None:
    """Requests are checked `OwnerRequest`s (a malformed one is a ``ProtocolError`` reply naming
    the field, and changes nothing); replies are `OwnerReply` envelopes around the op's typed
    reply, which the coordinator side parses back."""
    from megatron_dcr_hooks.service import OwnerService
    from shared_codec.coordination.protocol import BuildReply, OwnerReply, StatusReply

    model = FakeModel()
    hook = DCRHook([model], _config(), groups=groups)
    svc = OwnerService(hook, {"kind": "dir", "root": str(tmp_path / "p")}, "inproc://unused")
    model.perturb(7)
    for bad, says in (
        (
            {"op": "build", "version": "1", "attempt": 0},
            "owner request: version must be an integer",
        ),
        ({"op": "build", "attempt": 0}, "owner request 'build': missing field 'version'"),
        ({"op": "commit", "version": 1, "protocol": 2}, "protocol must be 1, got 2"),
        ({"op": 5}, "owner request: op must be a string"),
        ({"op": "nope"}, "unknown op 'nope'"),
    ):
        reply = OwnerReply.parse(svc.handle(bad))
        assert not reply.ok and says in str(reply.error), (bad, reply)
        assert reply.error_type in ("ProtocolError", "ValueError"), reply
    assert hook.candidate is None and hook.committed_version == 0  # nothing changed
    built = OwnerReply.parse(svc.handle({"op": "build", "version": 1, "attempt": 0}))
    assert built.ok and BuildReply.parse(built.extra).version == 1
    status = StatusReply.parse(OwnerReply.parse(svc.handle({"op": "status"})).extra)
    assert (status.committed_version, status.candidate, status.world) == (0, 1, 1)
