"""The coordinator: drives one refit transition (committed v-1 -> v) through owners and
engines to a joint commit, retrying failed attempts with overwrites.

Who calls what (the coordinator is the only caller; owners and engines are handles that fan
out to every trainer rank / every engine rank behind them):

1. ``prepare``: read the commit record (the committed version c; the target is c+1) and reserve
   an attempt id with a create-only attempt record ``attempts/v<v>/a<a>.json`` in the control
   store. Attempt 0 of a version is the normal mixed XOR/overwrite delta; any later attempt
   (after a failure, or after a coordinator restart that finds earlier attempts) is a retry:
   overwrites of the complete changed set from the same candidate weights.
2. ``owners.build(v, a, retry)``: owners construct and publish the attempt's payloads and the
   manifest. A failure here fails the attempt.
3. ``open_apply``: every required engine gets the attempt delivered (fetched / streamed and
   staged) and applies it (``dcr_apply``), concurrently, each within its deadline. An ACK that is
   not ok, a raised error, or a missed deadline fails the attempt and names the engine.
   Pipelined (the default when the coordinator can abandon an attempt: given the owners'
   `transport` spec): the engines' apply calls start together with ``owners.build``, so
   engines fetch and apply payload l while owners still build l + 1 (the paper's Figure 8);
   if the build fails, the coordinator abandons the attempt through a sink of that transport
   (`TransportSpec.open_sink(...).abandon`: a marker in the store, or an abandon message down
   the relay tree) so waiting engines stop at once (their partial applies make them dirty; the fence and
   the overwrite retry repair that).
4. Joint commit: only when every required engine ACKed ok and the owners' candidate guard
   (``owners.verify``: the trainer's weights still are what the attempt was built from; it
   runs as soon as the build returned, while the engines finish applying) passed, the
   coordinator compare-and-sets the commit record (version, baseline id, attempt, engines,
   per-engine digests). Then engines and owners are told to commit (owners advance their
   baselines in place to the built candidate, which is what the engines hold: a trainer step
   after the guard is not lost, the next version ships it).
5. Retention (retention.py, on a background thread once the commit notifications are out, so
   deleting objects is never part of a refit's latency; the next `refit`, `resume` or
   `initialize` waits for it first, and `wait_retention` does on demand): payloads, attempt
   records and engine reports of versions older than the newest ``keep_versions`` committed
   ones are removed; commit records stay.

Failure handling: a failed attempt is fenced on every reachable engine (``abort``: its staged
and late payloads are refused by attempt id) and on the owners; engines that failed are
restored to the committed version with a dense load (restarting them where the handle can);
one whose restore fails leaves the membership (``evict``; never a ``required`` receiver such as
the replica, whose failed restore fails the transition), so a dead engine never blocks a commit
past its deadline; then the next attempt (a retry) starts. After
``max_attempts`` the transition raises `RefitFailed` and leaves the committed version in force
(engines that applied part of it are dirty until a later retry or dense load repairs them).

Membership: `join` restores an engine to the committed version (a dense load from its
``checkpoint_for``: the rollout cluster's replica, shared_codec/replica) and includes it from
the next transition; `leave` removes one. Both run between transitions; the commit record's
``receivers`` lists each version's members.

`CandidateChanged` (from the guard, or from a retry's build) ends the transition at once:
the attempt is fenced, every engine is restored to the committed version (dense load) and
`RefitFailed` says so; nothing is committed. The next `refit` builds from the current weights.

A new coordinator calls `resume()`: if the commit record is ahead of the participants (the old
coordinator died after the compare-and-set), it finishes the commit on them; otherwise the next
`refit` reserves the next attempt id, which is a retry, so nothing is committed twice and no
version is lost. Two coordinators racing on the record: exactly one compare-and-set wins, the
other gets `CommitConflict` and tells nobody to commit.

Limitations:
1. One transition at a time per control store (attempt ids are reserved create-only, so two
   coordinators never share an attempt, but they would still race on the participants).
2. Deadlines are enforced by the coordinator; an engine that misses one keeps running the call
   until its handle gives up (handles should pass the deadline on as their own timeout).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from shared_codec.coordination.commit import CommitConflict, CommitLog, CommitRecord
from shared_codec.coordination.participants import Engine, Owners, required
from shared_codec.coordination.protocol import BuildReply, EngineAck, VerifyReply
from shared_codec.coordination.retention import ATTEMPTS, Retention
from shared_codec.errors import ArgumentError, CandidateChanged, DCRError, RefitFailed
from shared_codec.transport.base import ObjectStore
from shared_codec.transport.spec import Role, TransportSpec

_log = logging.getLogger("dcr.coordinator")


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    """`max_attempts` per transition; `ack_timeout_s`: deadline for each engine's delivery +
    apply; `record_digests`: read every engine's digest into the commit record (a full hash of
    the weights on every rank: cheap for small models, seconds for large ones); `pipeline`: overlap
    the engines' delivery + apply with the owners' build (module docstring, step 3);
    `keep_versions`: retention after each commit (`Coordinator.retain`; 0 keeps everything);
    `evict`: an engine whose restore fails leaves the membership (module docstring)."""

    max_attempts: int = 3
    ack_timeout_s: float = 600.0
    record_digests: bool = True
    pipeline: bool = True  # start engines with the build (needs a way to abandon attempts)
    keep_versions: int = 2  # retention: versions older than the newest N committed go (0: keep)
    evict: bool = True  # never a `required` receiver: its failed restore fails the refit


@dataclass
class AttemptResult:
    """One attempt: what the owners built (`owners`, None when the build failed) and how the
    guard answered (`guard`), every engine's checked ACK, what failed and why."""

    attempt: int
    retry: bool
    ok: bool
    owners: BuildReply | None = None
    guard: str = ""
    acks: dict[str, EngineAck] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    unreachable: set[str] = field(default_factory=set)  # raised or missed the deadline
    evicted: dict[str, str] = field(default_factory=dict)  # left the membership: why
    seconds: dict[str, float] = field(default_factory=dict)
    candidate_changed: bool = False  # the owners' weights moved after the build


@dataclass
class RefitResult:
    """What one transition did: the commit record and every attempt."""

    version: int
    record: CommitRecord
    attempts: list[AttemptResult]

    @property
    def retries(self) -> int:
        return len(self.attempts) - 1


_NO_RECORD = (
    "no commit record yet in the control store: a new run calls Coordinator.initialize() for "
    "version 0; if the participants already hold a committed version, the control store was "
    "lost or replaced - do not initialize (the owners would refuse every build), restore it"
)


def _attempt_key(version: int, attempt: int) -> str:
    return f"{ATTEMPTS}v{version:012d}/a{attempt:06d}.json"


class Coordinator:
    """Runs transitions (see the module docstring for the protocol)."""

    def __init__(
        self,
        control: ObjectStore,
        owners: Owners,
        engines: list[Engine],
        config: CoordinatorConfig | None = None,
        log: Callable[[str], None] | None = None,
        transport: TransportSpec | str | Mapping[str, Any] | None = None,
    ) -> None:
        """`control`: where the commit and attempt records live. `transport`: the sink spec the
        owners send payloads to (`shared_codec.transport.spec`: kinds dir, s3, relay - the
        same spec the owner service is given); with it the coordinator can abandon an attempt
        (waiting engines stop at once), which pipelining needs."""
        names = [r.name for r in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.control = control
        self.commits = CommitLog(control)
        self.owners = owners
        self.engines = list(engines)
        self.config = config or CoordinatorConfig()
        self.log = log or _log.info
        self.transport = (
            None if transport is None else TransportSpec.parse(transport, role=Role.SINK)
        )
        self.retention = Retention(control, self.transport, self.config.keep_versions, self.log)

    @property
    def last_retention(self) -> dict[str, Any]:
        """The last retention pass: committed version, seconds, what it removed."""
        return self.retention.last

    def wait_retention(self, timeout_s: float | None = None) -> bool:
        """Wait for the retention pass the last commit started (module docstring, step 5);
        True once none is running."""
        return self.retention.wait(timeout_s)

    def retain(self, committed: int) -> dict[str, int]:
        """One retention pass after the commit of `committed` (`Retention.run`)."""
        return self.retention.run(committed)

    def abandon(self, version: int, attempt: int, reason: str) -> None:
        """Tell every source of (`version`, `attempt`) that it was given up (needs `transport`)."""
        if self.transport is None:
            raise ValueError("abandoning an attempt needs the coordinator's transport spec")
        with self.transport.open_sink(version=version, attempt=attempt) as sink:
            sink.abandon(reason)

    # -- state from the control store ---------------------------------------------------------
    def committed_version(self) -> int:
        cur = self.commits.current()
        if cur is None:
            raise DCRError(_NO_RECORD)
        return cur.version

    def initialize(self, baseline_id: str = "v0") -> CommitRecord:
        """Commit version 0 (the weights every participant starts from, e.g. dense-loaded from
        the initial checkpoint) unless a record exists; returns the current record."""
        self.wait_retention()
        cur = self.commits.current()
        if cur is not None:
            return cur
        digests = {r.name: r.digest() for r in self.engines} if self.config.record_digests else {}
        record = CommitRecord(
            version=0,
            base_version=0,
            baseline_id=baseline_id,
            attempt=0,
            receivers=tuple(r.name for r in self.engines),
            digests=digests,
        )
        try:
            return self.commits.commit(None, record)
        except CommitConflict:
            cur = self.commits.current()
            assert cur is not None
            return cur

    def attempts_of(self, version: int) -> list[int]:
        prefix = f"{ATTEMPTS}v{version:012d}/"
        return sorted(int(k[len(prefix) + 1 : -5]) for k in self.control.list(prefix))

    def resume(self) -> int:
        """A (new) coordinator's first call: finish a commit the record holds but participants
        may not have seen; returns the committed version."""
        self.wait_retention()
        cur = self.commits.current()
        if cur is None:
            raise DCRError(_NO_RECORD)
        for r in self.engines:
            r.commit(cur.version)
        self.owners.commit(cur.version)
        return cur.version

    def prepare(self, version: int) -> tuple[int, bool]:
        """Reserve the next attempt id of `version`; returns (attempt, retry)."""
        committed = self.committed_version()
        if version != committed + 1:
            raise ArgumentError(
                f"version: cannot refit version {version}: the committed version is "
                f"{committed}, so the next one is {committed + 1}"
            )
        attempt = max(self.attempts_of(version), default=-1) + 1
        while True:
            intent = {"version": version, "attempt": attempt, "time": time.time()}
            if self.control.put_if_absent(
                _attempt_key(version, attempt), json.dumps(intent).encode()
            ):
                return attempt, attempt > 0
            attempt += 1  # another coordinator reserved it first: never share an attempt

    # -- membership (between transitions) ------------------------------------------------------
    @property
    def members(self) -> tuple[str, ...]:
        """The receivers of the next transition (the commit record lists each version's)."""
        return tuple(r.name for r in self.engines)

    def join(self, engine: Engine) -> CommitRecord:
        """Add `engine` from the next transition on: restore it to the committed version (a
        dense load from its handle's ``checkpoint_for``, the rollout cluster's replica, then a
        prewarm), fence the attempts already reserved for the next version, then include it.
        Returns the current commit record. Nothing changes when the restore fails."""
        self.wait_retention()
        if engine.name in self.members:
            raise ArgumentError(f"engine: {engine.name!r} is already a member")
        cur = self.commits.current()
        if cur is None:
            raise DCRError(_NO_RECORD)
        self._restore(engine, cur.version)
        self.engines.append(engine)
        self.log(f"engine {engine.name} joined at committed version {cur.version}")
        return cur

    def leave(self, name: str) -> Engine:
        """Remove engine `name` from the next transition on (it keeps the weights it holds;
        nothing more is sent to it). Returns its handle."""
        self.wait_retention()
        for r in self.engines:
            if r.name == name:
                self.engines.remove(r)
                self.log(f"engine {name} left the membership")
                return r
        raise ArgumentError(f"engine: {name!r} is not a member (members: {list(self.members)})")

    # -- one transition ----------------------------------------------------------------------
    def refit(self, version: int | None = None) -> RefitResult:
        """Run the transition to `version` (default: committed + 1) to its joint commit.
        Returns once the record is durable and every participant was told; the retention it
        then starts runs on in the background (module docstring, step 5)."""
        self.wait_retention()
        t_start = time.perf_counter()
        committed = self.committed_version()
        version = committed + 1 if version is None else version
        attempts: list[AttemptResult] = []
        self._fence_earlier(version)
        for _ in range(self.config.max_attempts):
            attempt, retry = self.prepare(version)
            prepared = time.perf_counter() - t_start
            res = self._attempt(version, attempt, retry)
            res.seconds["prepare"] = prepared  # records read, earlier attempts fenced, reserved
            attempts.append(res)
            if res.ok:
                t0 = time.perf_counter()
                record = self._commit(version, committed, res)
                res.seconds["commit"] = time.perf_counter() - t0
                self.retention.start(version)
                return RefitResult(version=version, record=record, attempts=attempts)
            if res.candidate_changed:  # retries cannot help: every engine back to committed
                res.unreachable.update(r.name for r in self.engines)
                self._fence(version, res)
                raise RefitFailed(
                    f"refit to version {version} refused: {res.failed['owners']}; nothing "
                    f"committed, every engine restored to committed version {committed}"
                )
            self._fence(version, res)
            t_start = time.perf_counter()
        raise RefitFailed(
            f"refit to version {version} failed after {len(attempts)} attempts: "
            + "; ".join(f"attempt {a.attempt}: {a.failed}" for a in attempts)
        )

    def _attempt(self, version: int, attempt: int, retry: bool) -> AttemptResult:
        res = AttemptResult(attempt=attempt, retry=retry, ok=False)
        self.log(f"version {version} attempt {attempt}{' (retry: overwrites)' if retry else ''}")
        pipelined = self.config.pipeline and self.transport is not None
        timeout = self.config.ack_timeout_s
        pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)))
        futures: dict[str, Any] = {}
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout

        def open_apply() -> None:
            nonlocal deadline
            deadline = time.monotonic() + timeout
            for r in self.engines:
                futures[r.name] = pool.submit(r.apply, version, attempt, timeout)

        if pipelined:
            open_apply()
        try:
            res.owners = BuildReply.parse(self.owners.build(version, attempt, retry))
        except Exception as e:
            res.failed["owners"] = f"{type(e).__name__}: {e}"
            res.candidate_changed = isinstance(e, CandidateChanged)
            if pipelined:
                try:
                    self.abandon(version, attempt, res.failed["owners"])
                except Exception as e:  # engines then run into their deadline
                    self.log(f"version {version} attempt {attempt}: abandon failed: {e}")
                self._collect(res, futures, deadline)
            pool.shutdown(wait=False, cancel_futures=True)
            return res
        res.seconds["build"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        if not pipelined:
            open_apply()
        # the candidate guard runs on the owners while the engines finish their applies
        self._verify(version, res)
        res.seconds["verify"] = time.perf_counter() - t1
        self._collect(res, futures, deadline)
        pool.shutdown(wait=False, cancel_futures=True)
        # from the end of the build: the engines' tails and the guard, overlapped
        res.seconds["apply"] = time.perf_counter() - t1
        res.ok = not res.failed
        if not res.ok:
            self.log(f"version {version} attempt {attempt} failed: {res.failed}")
        return res

    def _verify(self, version: int, res: AttemptResult) -> None:
        """The owners' candidate guard (the build returned; engines may still be applying)."""
        try:
            reply = self.owners.verify(version)
            if reply is not None:
                res.guard = VerifyReply.parse(reply).guard.value
        except Exception as e:
            res.failed["owners"] = f"verify: {type(e).__name__}: {e}"
            res.candidate_changed = isinstance(e, CandidateChanged)
            self.log(f"version {version} attempt {res.attempt} not committed: {e}")

    def _collect(self, res: AttemptResult, futures: dict[str, Any], deadline: float) -> None:
        timeout = self.config.ack_timeout_s
        for name, fut in futures.items():
            try:
                ack = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                res.failed[name] = f"no ACK within {timeout:.0f}s"
                res.unreachable.add(name)
                continue
            except Exception as e:
                res.failed[name] = f"{type(e).__name__}: {e}"
                res.unreachable.add(name)
                continue
            try:
                checked = EngineAck.parse(ack, what=f"engine {name} ACK")
            except DCRError as e:
                res.failed[name] = str(e)
                continue
            res.acks[name] = checked
            if not checked.ok:
                res.failed[name] = str(checked.error or "ACK not ok")

    def _commit(self, version: int, committed: int, res: AttemptResult) -> CommitRecord:
        digests = {r.name: r.digest() for r in self.engines} if self.config.record_digests else {}
        record = CommitRecord(
            version=version,
            base_version=committed,
            baseline_id=res.owners.baseline_id if res.owners is not None else "",
            attempt=res.attempt,
            receivers=tuple(r.name for r in self.engines),
            digests=digests,
        )
        t0 = time.perf_counter()
        record = self.commits.commit(committed, record)  # CommitConflict: tell nobody to commit
        res.seconds["cas"] = time.perf_counter() - t0

        # the record is durable: tell every participant at once (a failure here is finished by
        # `resume`, where repeated commits are no-ops)
        def timed(fn: Callable[[int], Any]) -> float:
            t = time.perf_counter()
            fn(version)
            return time.perf_counter() - t

        with ThreadPoolExecutor(max_workers=len(self.engines) + 1) as pool:
            futures = [pool.submit(timed, r.commit) for r in self.engines]
            owners = pool.submit(timed, self.owners.commit)
            engines = [f.result() for f in futures]
            res.seconds["commit_owners"] = owners.result()
        res.seconds["commit_engines"] = max(engines, default=0.0)
        self.log(f"version {version} committed (attempt {res.attempt})")
        return record

    def _fence_earlier(self, version: int) -> None:
        """Attempts of `version` reserved by an earlier coordinator: refuse their late payloads
        (an engine that cannot be reached now fails the next attempt and is restored then)."""
        for a in self.attempts_of(version):
            for r in self.engines:
                try:
                    r.abort(a)
                except Exception as e:
                    self.log(f"could not fence attempt {a} on {r.name}: {e}")

    def _fence(self, version: int, res: AttemptResult) -> None:
        """Stop a failed attempt everywhere, then restore the engines that failed."""
        committed = version - 1
        for r in self.engines:
            if r.name in res.unreachable:
                continue
            try:
                r.abort(res.attempt)
            except Exception as e:  # unreachable now: it is restored below
                res.failed[r.name] = f"abort failed: {type(e).__name__}: {e}"
                res.unreachable.add(r.name)
        try:
            self.owners.abort(version, res.attempt)
        except Exception as e:  # say why the attempt failed too (e.g. a trainer rank died)
            raise RefitFailed(
                f"refit to version {version} failed: attempt {res.attempt}: {res.failed}; then "
                f"the owners could not abort it: {e}; nothing committed (committed version "
                f"{committed} stays)"
            ) from e
        # alive-but-failed engines are repaired by the overwrite retry; the required ones
        # (the replica) first, since the others may restore from it
        for r in sorted(self.engines, key=lambda r: not required(r)):
            if r.name in res.unreachable:
                self.log(f"restoring engine {r.name} to committed version {committed}")
                try:
                    self._restore(r, committed)
                except Exception as e:
                    if required(r) or not self.config.evict:
                        raise
                    why = res.evicted[r.name] = f"restore failed: {type(e).__name__}: {e}"
                    self.engines = [x for x in self.engines if x.name != r.name]
                    self.log(f"engine {r.name} left the membership ({why})")

    def _restore(self, engine: Engine, committed: int) -> None:
        """Dense-load `engine` at `committed`, then fence the attempts reserved for the next
        version (a restored engine forgot its fences)."""
        engine.restore(committed)
        for a in self.attempts_of(committed + 1):
            engine.abort(a)


__all__ = ["AttemptResult", "CommitConflict", "Coordinator", "CoordinatorConfig", "Owners"]
__all__ += ["Engine", "RefitFailed", "RefitResult"]
