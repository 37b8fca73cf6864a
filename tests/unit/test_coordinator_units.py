"""The coordinator's state machine with FAKE participants (no trainer ranks, no engines).

`FakeOwners` and `FakeEngine` stand in for the owner service and for `vllm serve` engines: they
record every call in one shared event log and fail on cue. The control records (commit record,
attempt reservations) live in a real `DirectoryStore` under ``tmp_path``, so every assertion on
the protocol's durable state reads what the coordinator really wrote. The real-process version
of these scenarios is tests/integration/test_coordinator.py.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shared_codec.coordination.commit import CommitConflict, CommitLog
from shared_codec.coordination.coordinator import (
    Coordinator,
    CoordinatorConfig,
    RefitFailed,
)
from shared_codec.errors import CandidateChanged
from shared_codec.transport.objects import attempt_prefix
from shared_codec.transport.store import DirectoryStore

# -- fakes ---------------------------------------------------------------------------------------


class Events:
    """The shared, ordered log of every call the fakes received (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.log: list[tuple[Any, ...]] = []

    def add(self, *event: Any) -> None:
        with self._lock:
            self.log.append(event)

    def of(self, who: str, what: str | None = None) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[0] == who and (what is None or e[1] == what)]

    def index(self, *event: Any) -> int:
        return self.log.index(event)


class Crash(Exception):
    """What a fake raises to play a coordinator dying mid-call."""


class FakeDelivery:
    """FAKE payload channel between `FakeOwners` and pipelined `FakeEngine`s: an attempt is
    either published (the owners' build finished) or abandoned - the latter for real: the
    coordinator abandons through its transport, a real directory store (`spec`), and `wait`
    sees the store's ``abandoned.json`` marker."""

    def __init__(self, root: Path) -> None:
        self.spec = {"kind": "dir", "root": str(root)}
        self.store = DirectoryStore(root)
        self._cond = threading.Condition()
        self.state: dict[tuple[int, int], str] = {}
        self.abandoned: list[tuple[int, int, str]] = []

    def publish(self, version: int, attempt: int) -> None:
        with self._cond:
            self.state[(version, attempt)] = "published"
            self._cond.notify_all()

    def _abandon_reason(self, version: int, attempt: int) -> str | None:
        key = f"{attempt_prefix(version, attempt)}abandoned.json"
        if not self.store.exists(key):
            return None
        return str(json.loads(self.store.get(key)).get("reason", ""))

    def wait(self, version: int, attempt: int, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if (version, attempt) in self.state:
                    return self.state[(version, attempt)]
                reason = self._abandon_reason(version, attempt)
                if reason is not None:
                    self.abandoned.append((version, attempt, reason))
                    self.state[(version, attempt)] = "abandoned"
                    return "abandoned"
                left = deadline - time.monotonic()
                if left <= 0:
                    return "timeout"
                self._cond.wait(min(left, 0.05))


class FakeOwners:
    """FAKE owner group (stands in for the trainer job's owner service). `fail_builds`: attempt
    ids whose build raises; `crash_commit`: commit raises `Crash` (the coordinator dies before
    the owners hear of the commit); `on_build`: called inside every build (races)."""

    def __init__(self, events: Events, delivery: FakeDelivery | None = None) -> None:
        self.events = events
        self.delivery = delivery
        self.committed = 0
        self.fail_builds: set[int] = set()
        self.crash_commit = False
        self.moved: set[int] = set()  # versions whose candidate guard fails
        self.on_build: Callable[[int, int], None] | None = None

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        self.events.add("owners", "build", version, attempt, retry)
        if self.on_build is not None:
            self.on_build(version, attempt)
        if attempt in self.fail_builds:
            raise RuntimeError("owner rank 1 lost")
        if self.delivery is not None:
            self.delivery.publish(version, attempt)
        return {"baseline_id": f"owners-v{self.committed}", "payload_bytes": 10}

    def verify(self, version: int) -> None:
        if version in self.moved:
            self.events.add("owners", "verify-refused", version)
            raise CandidateChanged(f"rank 1: parameters changed after version {version}")

    def commit(self, version: int) -> None:
        if self.crash_commit:
            raise Crash("coordinator died before telling the owners")
        self.events.add("owners", "commit", version)
        self.committed = max(self.committed, version)

    def abort(self, version: int, attempt: int) -> None:
        self.events.add("owners", "abort", version, attempt)


class FakeEngine:
    """FAKE rollout engine (stands in for a `vllm serve` engine handle). `script[attempt]`:
    ``"ok"`` (default), ``"nack"`` (answers with a failed ACK), ``"raise"`` (unreachable),
    ``"hang"`` (misses the deadline). With `delivery` it behaves pipelined: `apply` waits
    until the attempt is published or abandoned. Its digest names what it holds."""

    def __init__(
        self,
        name: str,
        events: Events,
        control: DirectoryStore,
        delivery: FakeDelivery | None = None,
    ) -> None:
        self.name = name
        self.events = events
        self.control = control
        self.delivery = delivery
        self.script: dict[int, str] = {}
        self.committed = 0
        self.holds = "v0"
        self.record_at_commit: list[int | None] = []
        self.crash_commit = False

    def apply(self, version: int, attempt: int, timeout_s: float) -> dict[str, Any]:
        self.events.add(self.name, "apply", version, attempt)
        if self.delivery is not None:
            got = self.delivery.wait(version, attempt, timeout_s)
            if got != "published":
                self.holds = "dirty"
                return {"ok": False, "error": f"attempt {attempt} {got}"}
        what = self.script.get(attempt, "ok")
        if what == "raise":
            raise ConnectionError(f"{self.name} unreachable")
        if what == "hang":
            time.sleep(1.5)
            return {"ok": True}
        if what == "nack":
            self.holds = "dirty"
            return {"ok": False, "error": "apply failed on rank 1"}
        self.holds = f"v{version}a{attempt}"
        return {"ok": True, "elements_written": 3}

    def commit(self, version: int) -> None:
        if self.crash_commit:
            raise Crash("coordinator died before telling the engines")
        # what the durable record said when this participant was told to commit
        cur = CommitLog(self.control).current()
        self.record_at_commit.append(None if cur is None else cur.version)
        self.events.add(self.name, "commit", version)
        self.committed = max(self.committed, version)

    def abort(self, attempt: int) -> None:
        self.events.add(self.name, "abort", attempt)

    def digest(self) -> str:
        return f"{self.name}:{self.holds}"

    def restore(self, version: int) -> None:
        self.events.add(self.name, "restore", version)
        self.holds = f"v{version}"


# -- the one place a Coordinator is constructed --------------------------------------------------


def make_coordinator(
    control: DirectoryStore,
    owners: FakeOwners,
    engines: list[FakeEngine],
    *,
    delivery: FakeDelivery | None = None,
    **config: Any,
) -> Coordinator:
    """A Coordinator over the fakes; pipelined (engines start with the build) iff `delivery`
    is given, whose directory store is the coordinator's transport (where it abandons)."""
    return Coordinator(
        control,
        owners,
        engines,
        CoordinatorConfig(**{"ack_timeout_s": 10.0, **config}),
        log=lambda _msg: None,
        transport=delivery.spec if delivery is not None else None,
    )


class Setup:
    """A control store, the shared event log, owners and two engines, initialized at v0."""

    def __init__(self, root: Path, *, pipelined: bool = False, **config: Any) -> None:
        self.control = DirectoryStore(root / "control")
        self.events = Events()
        self.delivery = FakeDelivery(root / "payloads") if pipelined else None
        self.owners = FakeOwners(self.events, self.delivery)
        self.engines = [
            FakeEngine(n, self.events, self.control, self.delivery) for n in ("e0", "e1")
        ]
        self.coord = make_coordinator(
            self.control, self.owners, self.engines, delivery=self.delivery, **config
        )
        self.coord.initialize("ckpt-v0")
        self.events.log.clear()

    def commit_keys(self) -> list[str]:
        return sorted(self.control.list("commits/"))

    def attempt_keys(self, version: int) -> list[str]:
        return sorted(self.control.list(f"attempts/v{version:012d}/"))


def _commit_key(version: int) -> str:
    return f"commits/v{version:012d}.json"


# -- tests ---------------------------------------------------------------------------------------


def test_clean_refit_commits_once_after_every_ack(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    result = s.coord.refit()

    assert result.version == 1 and result.retries == 0
    rec = result.record
    assert (rec.version, rec.base_version, rec.attempt) == (1, 0, 0)
    assert rec.baseline_id == "owners-v0"
    assert rec.receivers == ("e0", "e1")
    assert rec.digests == {"e0": "e0:v1a0", "e1": "e1:v1a0"}
    assert s.commit_keys() == [_commit_key(0), _commit_key(1)]
    assert CommitLog(s.control).current() == rec
    assert s.attempt_keys(1) == ["attempts/v000000000001/a000000.json"]
    # not pipelined (no way to abandon): build, then every apply, then the commits
    build = s.events.index("owners", "build", 1, 0, False)
    applies = [s.events.index(e, "apply", 1, 0) for e in ("e0", "e1")]
    commits = [s.events.index(e, "commit", 1) for e in ("e0", "e1", "owners")]
    assert build < min(applies) and max(applies) < min(commits)
    # each participant told exactly once, and only after the record was durable
    for e in s.engines:
        assert s.events.of(e.name, "commit") == [(e.name, "commit", 1)]
        assert e.record_at_commit == [1]
        assert s.events.of(e.name, "abort") == [] and s.events.of(e.name, "restore") == []
    assert s.events.of("owners", "commit") == [("owners", "commit", 1)]
    assert s.events.of("owners", "abort") == []
    assert s.coord.committed_version() == 1


def test_failed_ack_fences_the_attempt_and_the_overwrite_retry_commits(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    s.engines[1].script[0] = "nack"
    result = s.coord.refit()

    a0, a1 = result.attempts
    assert not a0.ok and set(a0.failed) == {"e1"} and "apply failed" in a0.failed["e1"]
    assert a0.unreachable == set()
    assert a1.ok and a1.retry and result.record.attempt == 1
    assert s.events.of("owners", "build") == [
        ("owners", "build", 1, 0, False),
        ("owners", "build", 1, 1, True),  # the retry: overwrites of the complete changed set
    ]
    # fenced everywhere: every engine and the owners abort attempt 0, before the retry builds
    retry_build = s.events.index("owners", "build", 1, 1, True)
    for name in ("e0", "e1"):
        assert s.events.of(name, "abort") == [(name, "abort", 0)]
        assert s.events.index(name, "abort", 0) < retry_build
    assert s.events.of("owners", "abort") == [("owners", "abort", 1, 0)]
    assert s.events.index("owners", "abort", 1, 0) < retry_build
    # an engine that answered (alive, possibly partial) is repaired by the overwrite retry,
    # not by a dense restore
    assert s.events.of("e1", "restore") == []
    assert result.record.digests == {"e0": "e0:v1a1", "e1": "e1:v1a1"}
    assert s.attempt_keys(1) == [
        "attempts/v000000000001/a000000.json",
        "attempts/v000000000001/a000001.json",
    ]
    assert s.commit_keys() == [_commit_key(0), _commit_key(1)]
    assert s.events.of("owners", "commit") == [("owners", "commit", 1)]


@pytest.mark.parametrize("failure", ["raise", "hang"])
def test_unreachable_engine_is_restored_then_the_retry_commits(
    tmp_path: Path, failure: str
) -> None:
    s = Setup(tmp_path, ack_timeout_s=0.5)
    s.engines[0].script[0] = failure
    result = s.coord.refit()

    a0 = result.attempts[0]
    assert a0.unreachable == {"e0"} and set(a0.failed) == {"e0"}
    if failure == "hang":
        assert "no ACK within" in a0.failed["e0"]
    else:
        assert "ConnectionError" in a0.failed["e0"]
    # the unreachable engine is not asked to abort; it is restored to the committed version
    # and then fenced against every attempt of the version (a restart forgot the fences)
    assert s.events.of("e1", "abort") == [("e1", "abort", 0)]
    e0 = [e for e in s.events.of("e0") if e[1] != "apply"]
    assert e0[:2] == [("e0", "restore", 0), ("e0", "abort", 0)]
    assert s.events.of("e1", "restore") == []
    assert s.events.of("owners", "abort") == [("owners", "abort", 1, 0)]
    assert result.attempts[1].ok and result.record.attempt == 1
    assert result.record.digests == {"e0": "e0:v1a1", "e1": "e1:v1a1"}
    assert s.coord.committed_version() == 1


def test_every_attempt_failing_raises_and_leaves_the_commit_record(tmp_path: Path) -> None:
    s = Setup(tmp_path, max_attempts=3)
    before = s.control.get(_commit_key(0))
    s.engines[1].script.update({0: "nack", 1: "nack", 2: "nack"})
    with pytest.raises(RefitFailed, match="failed after 3 attempts"):
        s.coord.refit()

    assert s.commit_keys() == [_commit_key(0)]
    assert s.control.get(_commit_key(0)) == before  # byte for byte
    assert s.coord.committed_version() == 0
    assert len(s.attempt_keys(1)) == 3
    assert [e[3:] for e in s.events.of("owners", "build")] == [(0, False), (1, True), (2, True)]
    assert s.events.of("owners", "abort") == [("owners", "abort", 1, a) for a in range(3)]
    assert s.events.of("owners", "commit") == []
    for e in s.engines:
        assert s.events.of(e.name, "commit") == []
        assert s.events.of(e.name, "abort") == [(e.name, "abort", a) for a in range(3)]


def test_owners_gone_mid_build_raises_naming_the_build_failure(tmp_path: Path) -> None:
    """A trainer rank dies mid-build and the owner service goes down with it: the abort fails
    too, and `RefitFailed` names both (the build's error first), with nothing committed."""
    s = Setup(tmp_path)
    s.owners.fail_builds.add(0)

    def gone(version: int, attempt: int) -> None:
        raise ConnectionError("owner service at tcp://trainer: no reply to 'abort' in 30s")

    s.owners.abort = gone  # type: ignore[method-assign]
    with pytest.raises(RefitFailed) as err:
        s.coord.refit()
    msg = str(err.value)
    assert "attempt 0: {'owners': 'RuntimeError: owner rank 1 lost'}" in msg, msg
    assert "owners could not abort it: owner service" in msg and "version 0 stays" in msg, msg
    assert s.commit_keys() == [_commit_key(0)]


def test_candidate_moved_after_the_build_commits_nothing_and_restores_every_engine(
    tmp_path: Path,
) -> None:
    """The owners' candidate guard (run after the build, while the engines apply) fails: an
    optimizer step between build and commit. Every engine still ACKs; no compare-and-set, no
    retry, every engine back to the committed version, a RefitFailed naming the guard; the
    next refit builds afresh and commits."""
    s = Setup(tmp_path, max_attempts=3)
    before = s.control.get(_commit_key(0))
    s.owners.moved.add(1)
    with pytest.raises(RefitFailed, match="refused: verify: CandidateChanged.*nothing committed"):
        s.coord.refit()

    assert s.control.get(_commit_key(0)) == before and s.commit_keys() == [_commit_key(0)]
    assert len(s.attempt_keys(1)) == 1  # retries cannot help: none was tried
    assert s.events.index("owners", "build", 1, 0, False) < s.events.index(
        "owners", "verify-refused", 1
    )
    for e in ("e0", "e1"):  # each engine's apply was collected before it was restored
        assert s.events.index(e, "apply", 1, 0) < s.events.index(e, "restore", 0)
    for e in s.engines:
        assert s.events.of(e.name, "commit") == []
        assert s.events.of(e.name, "restore") == [(e.name, "restore", 0)]
        assert e.digest() == f"{e.name}:v0"
    assert s.events.of("owners", "abort") == [("owners", "abort", 1, 0)]
    assert s.events.of("owners", "commit") == []

    s.owners.moved.clear()  # the trainer holds still: the next refit commits (a retry)
    result = s.coord.refit()
    assert result.version == 1 and result.record.attempt == 1
    assert result.record.digests == {"e0": "e0:v1a1", "e1": "e1:v1a1"}


def test_a_new_coordinator_resumes_a_commit_the_old_one_did_not_announce(tmp_path: Path) -> None:
    s = Setup(tmp_path)
    for p in (s.owners, *s.engines):
        p.crash_commit = True  # the coordinator dies right after its compare-and-set
    with pytest.raises(Crash):
        s.coord.refit()
    record = CommitLog(s.control).current()
    assert record is not None and record.version == 1 and record.attempt == 0
    assert s.owners.committed == 0 and all(e.committed == 0 for e in s.engines)
    stored = s.control.get(_commit_key(1))

    for p in (s.owners, *s.engines):
        p.crash_commit = False
    s.events.log.clear()
    new = make_coordinator(s.control, s.owners, s.engines)
    assert new.resume() == 1
    assert s.owners.committed == 1 and all(e.committed == 1 for e in s.engines)
    assert sorted(e for e in s.events.log if e[1] == "commit") == [
        ("e0", "commit", 1),
        ("e1", "commit", 1),
        ("owners", "commit", 1),
    ]
    # nothing was built, applied or committed again: the record is the old coordinator's
    assert [e for e in s.events.log if e[1] != "commit"] == []
    assert s.commit_keys() == [_commit_key(0), _commit_key(1)]
    assert s.control.get(_commit_key(1)) == stored
    # and the next transition is version 2, attempt 0
    nxt = new.refit()
    assert nxt.version == 2 and nxt.record.attempt == 0 and nxt.record.base_version == 1


def test_two_racing_coordinators_one_commit_conflict(tmp_path: Path) -> None:
    a = Setup(tmp_path)
    # coordinator B: same control store, its own (fake) participants
    b_events = Events()
    b_owners = FakeOwners(b_events)
    b_engines = [FakeEngine(n, b_events, a.control) for n in ("e0", "e1")]
    b = make_coordinator(a.control, b_owners, b_engines)
    won: list[Any] = []

    def b_runs_while_a_builds(version: int, attempt: int) -> None:
        if not won:
            won.append(b.refit())

    a.owners.on_build = b_runs_while_a_builds
    with pytest.raises(CommitConflict):
        a.coord.refit()

    (b_result,) = won
    # B reserved its own attempt id (A holds attempt 0) and won the compare-and-set
    assert b_result.record.attempt == 1
    assert a.attempt_keys(1) == [
        "attempts/v000000000001/a000000.json",
        "attempts/v000000000001/a000001.json",
    ]
    assert a.commit_keys() == [_commit_key(0), _commit_key(1)]
    assert CommitLog(a.control).current() == b_result.record
    # the loser told nobody to commit; the winner told its participants once
    assert [e for e in a.events.log if e[1] == "commit"] == []
    assert sorted(e for e in b_events.log if e[1] == "commit") == [
        ("e0", "commit", 1),
        ("e1", "commit", 1),
        ("owners", "commit", 1),
    ]


def test_owner_build_failure_abandons_waiting_pipelined_engines(tmp_path: Path) -> None:
    s = Setup(tmp_path, pipelined=True, ack_timeout_s=30.0)
    assert s.delivery is not None
    both_waiting = threading.Event()

    def fail_after_engines_wait(version: int, attempt: int) -> None:
        # pipelined: both engines are already inside apply while the owners build
        deadline = time.monotonic() + 10
        while len([e for e in s.events.log if e[1:] == ("apply", version, attempt)]) < 2:
            assert time.monotonic() < deadline, "engines did not start with the build"
            time.sleep(0.005)
        both_waiting.set()

    s.owners.on_build = fail_after_engines_wait
    s.owners.fail_builds = {0}
    t0 = time.monotonic()
    result = s.coord.refit()
    elapsed = time.monotonic() - t0

    assert both_waiting.is_set()
    a0, a1 = result.attempts
    assert "owner rank 1 lost" in a0.failed["owners"]
    assert s.delivery.abandoned == [(1, 0, "RuntimeError: owner rank 1 lost")]
    assert {n: ack["error"] for n, ack in a0.acks.items()} == {
        "e0": "attempt 0 abandoned",
        "e1": "attempt 0 abandoned",
    }
    assert elapsed < 10  # the engines stopped at the abandon, not at their 30 s deadline
    # fenced on every engine and the owners; the retry commits
    for name in ("e0", "e1"):
        assert (name, "abort", 0) in s.events.log
    assert s.events.of("owners", "abort") == [("owners", "abort", 1, 0)]
    assert a1.ok and a1.retry and result.record.attempt == 1
    assert result.record.digests == {"e0": "e0:v1a1", "e1": "e1:v1a1"}


@pytest.mark.parametrize("keep", [2, 0])
def test_retention_removes_what_older_versions_left_and_keeps_the_commit_history(
    tmp_path: Path, keep: int
) -> None:
    """After each commit, payload objects (every attempt, real directory store), attempt
    records and engine reports of versions older than the newest `keep` committed ones are
    removed; commit records all stay; ``keep_versions=0`` keeps everything."""
    s = Setup(tmp_path, pipelined=True, keep_versions=keep)
    assert s.delivery is not None
    payloads = s.delivery.store

    def publish(version: int, attempt: int) -> None:  # what real owners and engines leave
        payloads.put(f"{attempt_prefix(version, attempt)}rank0_000000.dcrp", b"payload")
        payloads.put(f"{attempt_prefix(version, attempt)}manifest.json", b"{}")
        report = f"reports/e0/v{version:012d}/a{attempt:06d}/update/rank0.json"
        s.control.put(report, b"{}")

    s.owners.on_build = publish
    s.control.put("reports/e0/init/s0/rank0.json", b"{}")  # no version: kept
    for _ in range(4):
        s.coord.refit()
    s.engines[0].script[0] = "nack"  # version 5 needs a retry: both attempts are kept
    assert s.coord.refit().record.attempt == 1
    assert s.coord.wait_retention(timeout_s=30)  # the last commit's pass runs in the background
    assert s.coord.last_retention["committed"] == 5

    def versions(store: DirectoryStore, prefix: str) -> set[int]:
        found = (re.search(r"(?:^|/)v(\d{12})/", k) for k in store.list(prefix))
        return {int(m.group(1)) for m in found if m}

    kept = {4, 5} if keep == 2 else {1, 2, 3, 4, 5}
    assert versions(payloads, "v") == kept
    assert len(payloads.list(attempt_prefix(5, 0))) == len(payloads.list(attempt_prefix(5, 1))) == 2
    assert versions(s.control, "attempts/") == kept
    assert versions(s.control, "reports/e0/v") == kept
    assert s.control.exists("reports/e0/init/s0/rank0.json")
    assert s.commit_keys() == [_commit_key(v) for v in range(6)]
    assert s.coord.committed_version() == 5


def test_a_version_other_than_the_next_is_refused_naming_it(tmp_path: Path) -> None:
    """`refit(v)` / `prepare(v)` with v != committed + 1 raise `ArgumentError` (a DCR
    `ProtocolError`, also a `ValueError`) naming ``version``, before any record or call."""
    from shared_codec.errors import ArgumentError, ProtocolError

    s = Setup(tmp_path)
    for version in (0, 2, 7):
        for call in (s.coord.refit, s.coord.prepare):
            with pytest.raises(ArgumentError, match="^version: cannot refit version") as e:
                call(version)
            assert isinstance(e.value, ProtocolError) and isinstance(e.value, ValueError)
            assert "the next one is 1" in str(e.value)
    assert s.events.log == [] and s.attempt_keys(2) == [] and s.attempt_keys(1) == []
    assert s.coord.refit().version == 1  # the next version goes through


def test_an_ack_that_does_not_parse_fails_the_attempt_naming_the_field(tmp_path: Path) -> None:
    """What an engine handle returns is checked (`EngineAck.parse`): a malformed ACK fails that
    engine's attempt with the field named, and the retry commits."""
    s = Setup(tmp_path)
    real = s.engines[1].apply
    calls = {"n": 0}

    def bad_once(version: int, attempt: int, timeout_s: float) -> dict[str, Any]:
        calls["n"] += 1
        ack = real(version, attempt, timeout_s)
        return {**ack, "elements_written": "3"} if calls["n"] == 1 else ack

    s.engines[1].apply = bad_once  # type: ignore[method-assign]
    result = s.coord.refit()
    a0 = result.attempts[0]
    assert "engine e1 ACK: elements_written must be an integer" in a0.failed["e1"], a0.failed
    assert result.version == 1 and result.retries == 1
