"""The replica as a required receiver of the real `Coordinator` (shared_codec/replica/receiver.py)
and the coordinator's membership (join, leave, eviction).

Real parts: the coordinator, its control store and the payload transport (directory stores),
the replica store on real files, payloads from the codec's own encoder published through real
sinks and seals. TEST DOUBLES (labelled): `LineageOwners` stands in for the trainer job's owner
service (it publishes the delta between two versions of a known lineage), `LoadingEngine` for a
vLLM engine (its restore dense-loads the checkpoint its handle's ``checkpoint_for`` gives, under
the replica's lease, and keeps the tensors, so the test compares stored bits).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

from shared_codec.checkpoint import combined_digest, load_checkpoint, state_digests
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.errors import ArgumentError, ReplicaError
from shared_codec.replica import ReplicaStore
from shared_codec.replica.receiver import ReplicaReceiver
from shared_codec.transport.store import DirectoryStore
from tests.unit.shared_codec.replica_cases import (
    LineageOwners,
    caught_up,
    lineage_of,
    same_bits,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def initial(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("replica-rx") / "initial")


@pytest.fixture(scope="module")
def lineage(initial) -> list[dict[str, torch.Tensor]]:
    return lineage_of(initial, 5)


def digest_of(tensors: dict[str, torch.Tensor]) -> str:
    return combined_digest(state_digests(tensors))


class LoadingEngine:
    """TEST DOUBLE of a vLLM engine: `restore(v)` dense-loads the directory its
    ``checkpoint_for(v)`` gives (a path, or the replica's lease) into `tensors`; apply takes the
    lineage's version (the double is not what is tested); `dead`: every call raises."""

    def __init__(self, name: str, checkpoint_for: Any, lineage: list) -> None:
        self.name, self.checkpoint_for, self.lineage = name, checkpoint_for, lineage
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = -1
        self.dead = False
        self.loaded_from: list[str] = []

    def _alive(self) -> None:
        if self.dead:
            raise ConnectionError(f"{self.name} unreachable")

    def apply(self, version: int, attempt: int, timeout_s: float) -> dict[str, Any]:
        self._alive()
        self.tensors = {k: v.clone() for k, v in self.lineage[version].items()}
        return {"ok": True}

    def commit(self, version: int) -> None:
        self._alive()
        self.version = version

    def abort(self, attempt: int) -> None:
        self._alive()

    def digest(self) -> str:
        self._alive()
        return digest_of(self.tensors)

    def restore(self, version: int) -> None:
        self._alive()
        got = self.checkpoint_for(version)
        held = got if isinstance(got, AbstractContextManager) else nullcontext(got)
        with held as path:
            self.loaded_from.append(str(path))
            self.tensors = load_checkpoint(path)
        self.version = version


class Rig:
    """A bootstrapped replica root, its receiver, the owners double, the coordinator."""

    def __init__(self, tmp: Path, initial: Path, lineage: list, **config: Any) -> None:
        with ReplicaStore(tmp / "replica") as s:
            s.bootstrap(initial)
        self.spec = {"kind": "dir", "root": str(tmp / "payloads")}
        self.replica = ReplicaReceiver(tmp / "replica", self.spec)
        self.owners = LineageOwners(lineage, self.spec)
        self.control = DirectoryStore(tmp / "control")
        self.engines: list[Any] = [self.replica]
        self.config = CoordinatorConfig(**{"ack_timeout_s": 20.0, **config})
        self.coord = Coordinator(
            self.control, self.owners, self.engines, self.config,
            log=lambda _m: None, transport=self.spec,
        )  # fmt: skip
        self.coord.initialize("lineage-v0")


@pytest.fixture
def rig(tmp_path, initial, lineage):
    r = Rig(tmp_path, initial, lineage)
    yield r
    r.replica.close()


def test_replica_commits_each_version_bit_exact(rig, lineage) -> None:
    assert rig.coord.commits.current().digests == {"replica": digest_of(lineage[0])}
    for v in (1, 2, 3):
        res = rig.coord.refit()
        assert res.version == v and res.retries == 0
        ack = res.attempts[0].acks["replica"]
        assert ack.ok and ack.payloads > 2 and ack.elements_written > 0
        assert res.record.digests == {"replica": digest_of(lineage[v])}
        assert res.record.receivers == ("replica",)
        with rig.replica.checkpoint_for(v) as path:
            assert same_bits(load_checkpoint(path), lineage[v]) == []
        assert rig.replica.committed_version() == v
    # after the commit the lagging slot catches up in the background: both slots hold v3
    assert [same_bits(t, lineage[3]) for t in caught_up(rig.replica.root, 3)] == [[], []]
    with pytest.raises(ReplicaError, match="version 2 is not held"), rig.replica.checkpoint_for(2):
        pass


def test_lost_payload_fails_the_attempt_and_the_overwrite_retry_repairs(
    tmp_path, initial, lineage
) -> None:
    # not pipelined: the replica starts reading after the build, when the object is gone (a
    # streaming reader started with the build could read it before the double deletes it)
    rig = Rig(tmp_path, initial, lineage, pipeline=False)
    rig.owners.drop.add((1, 0))
    res = rig.coord.refit()
    first = res.attempts[0]
    assert not first.ok and "fetch" in first.failed["replica"], first.failed
    assert res.retries == 1 and res.record.attempt == 1
    assert res.record.digests == {"replica": digest_of(lineage[1])}
    # the failed attempt, delivered late, is refused (a stale version now) and changes nothing
    late = rig.replica.apply(1, 0, 5.0)
    assert not late.ok and "not the next one" in (late.error or "")
    assert rig.replica.digest() == digest_of(lineage[1])
    rig.replica.close()


def test_staged_attempt_is_undone_by_abort_and_a_late_apply_is_refused(rig, lineage) -> None:
    rig.owners.build(1, 0, False)
    assert rig.replica.apply(1, 0, 5.0).ok  # staged, not committed
    rig.replica.abort(0)
    st = rig.replica.status()
    assert st.committed == 0 and st.slots[1 - st.committed_slot].status.value == "clean"
    assert not rig.replica.apply(1, 0, 5.0).ok  # fenced
    assert rig.replica.digest() == digest_of(lineage[0])
    # a bad argument is a failed ACK that changes nothing
    bad = rig.replica.apply(3, 0, 0.5)
    assert not bad.ok and bad.error
    assert rig.replica.digest() == digest_of(lineage[0])


def test_restore_finishes_a_commit_the_coordinator_did_not_deliver(rig, lineage) -> None:
    attempt, retry = rig.coord.prepare(1)
    assert rig.coord._attempt(1, attempt, retry).ok  # staged on the replica
    # the coordinator died after its compare-and-set, before telling the replica
    rig.replica.restore(1)
    assert rig.replica.committed_version() == 1
    assert rig.replica.digest() == digest_of(lineage[1])
    with pytest.raises(ReplicaError, match="holds committed version 1, not 3"):
        rig.replica.restore(3)


def test_join_leave_and_eviction(rig, lineage) -> None:
    rig.coord.refit()
    # join: restored from the replica under its lease, included from the next transition
    e0 = LoadingEngine("e0", rig.replica.checkpoints(), lineage)
    rig.coord.join(e0)
    assert e0.version == 1 and same_bits(e0.tensors, lineage[1]) == []
    assert e0.loaded_from == [str(rig.replica.root / f"slot{rig.replica.status().committed_slot}")]
    with pytest.raises(ArgumentError, match="already a member"):
        rig.coord.join(e0)
    res = rig.coord.refit()
    assert res.record.receivers == ("replica", "e0")
    assert res.record.digests["e0"] == res.record.digests["replica"] == digest_of(lineage[2])
    # a second engine joins; then e0 dies and cannot be restored: it leaves, the retry commits
    e1 = LoadingEngine("e1", rig.replica.checkpoints(), lineage)
    rig.coord.join(e1)
    e0.dead = True
    res = rig.coord.refit()
    assert res.attempts[0].unreachable == {"e0"} and "e0" in res.attempts[0].evicted
    assert res.record.version == 3 and res.record.receivers == ("replica", "e1")
    assert rig.coord.members == ("replica", "e1")
    # leave: e1 is removed between transitions; the next version's members are the replica only
    assert rig.coord.leave("e1") is e1
    with pytest.raises(ArgumentError, match="not a member"):
        rig.coord.leave("e1")
    res = rig.coord.refit()
    assert res.record.receivers == ("replica",) and e1.version == 3
    # a join restores from the replica at the committed version
    rig.coord.join(e1)
    assert e1.version == 4 and same_bits(e1.tensors, lineage[4]) == []


def test_a_required_replica_is_never_evicted(rig, monkeypatch) -> None:
    """The replica's host is gone: its apply does not answer and its restore fails. It is not
    evicted (it is required): the transition fails with the restore's error, nothing
    committed."""

    def gone(*_a: Any) -> None:
        raise ConnectionError("replica host unreachable")

    def cannot(version: int) -> None:
        raise ReplicaError("restore failed for the test")

    monkeypatch.setattr(rig.replica, "apply", gone)
    monkeypatch.setattr(rig.replica, "restore", cannot)
    with pytest.raises(ReplicaError, match="restore failed for the test"):
        rig.coord.refit()
    assert rig.coord.members == ("replica",) and rig.coord.committed_version() == 0


def test_join_refuses_before_initialize(tmp_path, initial, lineage) -> None:
    coord = Coordinator(DirectoryStore(tmp_path / "c"), LineageOwners(lineage, {}), [],
                        log=lambda _m: None)  # fmt: skip
    with pytest.raises(Exception, match="no commit record"):
        coord.join(LoadingEngine("e0", lambda v: "", lineage))
    assert coord.members == ()


def test_eviction_off_fails_the_transition(tmp_path, initial, lineage) -> None:
    rig = Rig(tmp_path, initial, lineage, evict=False)
    try:
        e0 = LoadingEngine("e0", rig.replica.checkpoints(), lineage)
        rig.coord.join(e0)
        e0.dead = True
        with pytest.raises(ConnectionError):
            rig.coord.refit()
        assert rig.coord.members == ("replica", "e0")
    finally:
        rig.replica.close()
