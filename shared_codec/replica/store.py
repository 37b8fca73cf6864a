"""`ReplicaStore`: the rollout cluster's canonical checkpoint on local disk, kept current by
applying the refit payloads in canonical coordinates, with a write-ahead log and two slots.

Layout under the root (docs/replica.md has the full picture):
```
slot0/, slot1/    two complete checkpoint directories: the initial checkpoint's safetensors
                  files (same names, same tensor-to-file mapping) and its other files
log/              v<version>-a<attempt>.dcrlog: one record per staged attempt (log.py)
leases/           flock files of the slots and the writer, lease holder files (leases.py)
STATE.json        committed version and slot, per slot what it holds (state.py)
```
One slot holds the committed version and is never written while it does; the other (the
shadow) is where an attempt is staged, in place, O(changed elements) per version.

Call order (one writer process per root; the coordinator's calls arrive in this order):
``store = ReplicaStore(root)`` (takes the writer lock, then `recover`), once ``bootstrap(dir)``,
then per transition ``stage(v, a, payloads)`` (again with a new attempt for an overwrite retry),
then ``commit(v)`` or ``abort(v, a)``. Readers use ``with lease(root, v) as path:`` from any
process, or `ReplicaStore.lease`.

Fsync discipline of `stage` (every step durable before the next starts; a crash at any point
leaves the committed slot untouched and `recover` finishes the rest):
1. decode and validate every payload, read the committed bits: nothing written yet;
2. take the shadow's write lock (waits for its leases, `LeaseHeld` past the timeout);
3. write the log record (the attempt's payloads as received, log.py) to a temporary file,
   fsync, rename, fsync ``log/``;
4. replace ``STATE.json`` (temporary, fsync, rename, fsync root): shadow `dirty`, naming the
   records that may now write it;
5. write the shadow in place through memory maps: undo a previously staged attempt and, when
   the shadow lags one version, catch up (both: the committed slot's bits copied at the
   elements the records name), then the attempt's new bits; msync + fsync every written file;
6. replace ``STATE.json``: shadow `staged` (version, attempt); stage returns after this, so its
   ACK is durable: a replica restarted before the commit can still commit the attempt.
`commit(v)` is one ``STATE.json`` replacement (the shadow becomes the committed slot; the old
one holds v - 1 and catches up at the next stage). `abort` and the repair of a `dirty` slot
mark it dirty, copy the committed bits at every element the records name, fsync, and mark it
clean at the committed version. A record that is missing or torn when a repair needs it makes the repair copy the
committed slot's files over the shadow's instead (each file atomically), which is always right.

What each crash point leaves, and what `recover` does, is the table in docs/replica.md; the
points are named in `CRASH_POINTS` and tests/integration/shared_codec/test_replica_kill.py kills
a writer at each of them.

Limitations:
1. Digests are hashed on demand (digests.py): the first `digest` after opening a root reads
   every committed tensor once (O(model)); later ones hash only the tensors a transition
   changed (whole tensors: a change anywhere in a tensor re-hashes all of it).
2. One writer per root (a second `ReplicaStore` on it is refused); readers are unbounded.
3. The store is a library: the receiver and the HTTP service around it are receiver.py and
   service.py.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from shared_codec.checkpoint import combined_digest
from shared_codec.errors import ArgumentError, ProtocolError, ReplicaError
from shared_codec.replica import durable, leases
from shared_codec.replica.bootstrap import LOG_DIR, copy_initial
from shared_codec.replica.crash import CRASH_POINTS
from shared_codec.replica.crash import at as _at
from shared_codec.replica.digests import DigestCache, slot_reader
from shared_codec.replica.layout import SlotFiles, TensorLoc, read_layout
from shared_codec.replica.log import LogCorrupt, Touched, prune_records, write_record
from shared_codec.replica.state import (
    STATE_FILE,
    ReplicaState,
    ReplicaStatus,
    SlotState,
    SlotStatus,
    load_state,
    save_state,
    slot_dir,
)
from shared_codec.replica.transition import (
    Change,
    StageResult,
    build_changes,
    decode_attempt,
    read_touched,
)
from shared_codec.replica.transition import nonneg as _nonneg

log = logging.getLogger("dcr.replica")


class ReplicaStore:
    """The canonical replica's storage (module docstring). Not thread-safe: one caller."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        key: bytes | None = None,
        lease_timeout_s: float = 0.0,
    ) -> None:
        """Open (creating) `root`, take its writer lock (`ReplicaError` when another process
        holds it) and `recover`. `key`: the payload secret (keyed digests). `lease_timeout_s`:
        how long a stage or abort waits for the leases of the slot it must write."""
        self.root = Path(root).resolve()
        self.key = key
        self.lease_timeout_s = float(lease_timeout_s)
        (self.root / leases.LEASE_DIR).mkdir(parents=True, exist_ok=True)
        self._writer = os.open(self.root / leases.LEASE_DIR / "writer.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self._writer, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._writer)
            raise ReplicaError(f"{self.root}: another process holds this replica store") from None
        self._state: ReplicaState | None = None
        self._layout: dict[str, TensorLoc] | None = None
        self._digests = DigestCache()  # per tensor, committed and staged, on demand
        # what the records this store wrote (and still keeps) touch: repairs read the log only
        # after a restart
        self._recent: dict[tuple[int, int], tuple[Touched, ...]] = {}
        #: how often a repair copied the committed slot because a log record was unusable
        self.copies = 0
        try:
            self.recover()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the writer lock (the store's state is durable at every point)."""
        if self._writer >= 0:
            fcntl.flock(self._writer, fcntl.LOCK_UN)
            os.close(self._writer)
            self._writer = -1

    def __enter__(self) -> ReplicaStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- paths and state -------------------------------------------------------------------

    @property
    def log_dir(self) -> Path:
        return self.root / LOG_DIR

    def _need(self) -> ReplicaState:
        if self._state is None:
            raise ProtocolError(f"{self.root}: the replica is not bootstrapped (call bootstrap)")
        return self._state

    def _save(self, state: ReplicaState, point: str) -> None:
        save_state(self.root, state, before_rename=lambda: _at(f"{point}_tmp"))
        self._state = state
        _at(point)

    def _layout_of(self, state: ReplicaState) -> dict[str, TensorLoc]:
        if self._layout is None:
            self._layout = read_layout(slot_dir(self.root, state.committed_slot))
        return self._layout

    def status(self) -> ReplicaStatus:
        return ReplicaStatus.of(self.root, self._need())

    # -- bootstrap ---------------------------------------------------------------------------

    def bootstrap(self, initial: str | os.PathLike[str], version: int = 0) -> ReplicaStatus:
        """Copy the initial checkpoint directory `initial` (the one the rollout cluster already
        has, never the trainer's) into both slots durably and commit it as `version`.

        On a root bootstrapped from the same checkpoint (same files, same bytes) and version it
        does nothing; a root holding another checkpoint, or other files, is refused
        (`ReplicaError`, nothing changed)."""
        version = _nonneg(version, "bootstrap: version")
        src = Path(initial).resolve()
        if not src.is_dir():
            raise ReplicaError(f"bootstrap: {src} is not a checkpoint directory")
        layout = read_layout(src)  # refuses what the store cannot hold in place
        identity = durable.checkpoint_identity(src)
        st = self._state
        if st is not None:
            if st.bootstrap.identity == identity and st.bootstrap.version == version:
                return self.status()
            raise ReplicaError(
                f"bootstrap: {self.root} already holds a replica bootstrapped from "
                f"{st.bootstrap.source} at version {st.bootstrap.version} (identity "
                f"{st.bootstrap.identity}), not {src} at version {version} (identity {identity});"
                " use another root"
            )
        state = copy_initial(self.root, src, version, identity)
        self._layout = layout
        self._save(state, "bootstrapped")
        return self.status()

    # -- stage / abort / commit ----------------------------------------------------------------

    def stage(
        self,
        version: int,
        attempt: int,
        payloads: Sequence[bytes],
        *,
        lease_timeout_s: float | None = None,
    ) -> StageResult:
        """Stage attempt `attempt` of `version` (= committed + 1) from its payloads into the
        shadow slot (fsync discipline: module docstring). A new attempt of a staged version
        (an overwrite retry) first undoes the staged one.

        Refusals change nothing: `ArgumentError` for a version that is not the next one or a
        bad attempt, `ProtocolError` for an attempt already staged, `PayloadError` for a
        payload refused (transition.py), `LeaseHeld` when the shadow stays leased past
        `lease_timeout_s` (default: the store's)."""
        t0 = time.perf_counter()
        st = self._need()
        version = _nonneg(version, "stage: version")
        attempt = _nonneg(attempt, "stage: attempt")
        if version != st.committed + 1:
            raise ArgumentError(
                f"stage: version {version} is not the next one after the replica's committed "
                f"version {st.committed}; nothing changed"
            )
        sh = st.slots[st.shadow]
        if sh.status == SlotStatus.STAGED and sh.attempt == attempt:
            raise ProtocolError(
                f"stage: attempt {attempt} of version {version} is already staged (a retry "
                "needs a new attempt id); nothing changed"
            )
        layout = self._layout_of(st)
        decoded = decode_attempt(
            list(payloads), version=version, attempt=attempt, base_version=st.committed,
            layout=layout, key=self.key,
        )  # fmt: skip
        with SlotFiles(slot_dir(self.root, st.committed_slot), layout, write=False) as old:
            changes = build_changes(decoded, attempt=attempt, committed=old)
        what = f"stage({version}, {attempt})"
        with self._writing(st.shadow, lease_timeout_s, what):
            if self._need().slots[st.shadow].status == SlotStatus.DIRTY:
                self._repair()
            st = self._need()
            sh = st.slots[st.shadow]
            write_record(
                self.log_dir, version, st.committed, attempt, payloads,
                before_rename=lambda: _at("log_tmp"),
            )  # fmt: skip
            # durable: later undo / catch-up from memory
            self._recent[(version, attempt)] = tuple(
                Touched(name=c.name, indices=c.indices) for c in changes
            )
            _at("log")
            prev = (
                (sh.attempt,) if sh.status == SlotStatus.STAGED and sh.attempt is not None else ()
            )
            dirty = SlotState(
                status=SlotStatus.DIRTY, version=sh.version, target=version,
                touched=(*prev, attempt),
            )  # fmt: skip
            self._save(st.with_slot(st.shadow, dirty), "dirty")
            self._write_shadow(st, dirty, changes)
            staged = SlotState(
                status=SlotStatus.STAGED, version=st.committed, target=version, attempt=attempt
            )
            self._save(st.with_slot(st.shadow, staged), "staged")
            self._prune()
        self._digests.staged(version, attempt, (c.name for c in changes))
        return StageResult(
            version=version,
            attempt=attempt,
            base_version=st.committed,
            payloads=len(decoded),
            tensors=len(changes),
            elements=sum(int(c.indices.shape[0]) for c in changes),
            seconds=time.perf_counter() - t0,
        )

    def _write_shadow(
        self, st: ReplicaState, dirty: SlotState, changes: tuple[Change, ...]
    ) -> None:
        """Bring the dirty shadow to the committed version (undo a previously staged attempt,
        catch up; or copy the committed slot when a record is unusable), write the attempt's
        staged bits, fsync."""
        layout = self._layout_of(st)
        with (
            SlotFiles(slot_dir(self.root, st.shadow), layout, write=True) as files,
            SlotFiles(slot_dir(self.root, st.committed_slot), layout, write=False) as committed,
        ):
            try:
                self._undo(files, committed, st, dirty, dirty.touched[:-1], "undo_partial")
            except LogCorrupt as e:
                files.close()
                self._copy_committed(st, e)
            for i, c in enumerate(changes):
                files.put(c.name, c.indices, c.new)
                if i == 0:
                    _at("apply_partial")
            files.sync()
        _at("slot_written")

    def _touched(self, version: int, attempt: int) -> tuple[Touched, ...]:
        """What the record of (`version`, `attempt`) may have written: from memory when this
        store wrote it, else read back from the log (`LogCorrupt` when unusable)."""
        got = self._recent.get((version, attempt))
        if got is not None:
            return got
        return read_touched(
            self.log_dir, version, attempt, layout=self._layout_of(self._need()), key=self.key
        )

    def _undo(
        self,
        files: SlotFiles,
        committed: SlotFiles,
        st: ReplicaState,
        slot: SlotState,
        attempts: tuple[int, ...],
        point: str,
    ) -> None:
        """Overwrite everything that may differ from the committed version in a shadow in state
        `slot` with the committed slot's bits: the elements `attempts` of its target touched,
        then, when it lags one version, those the committed transition changed. Idempotent
        (copies of committed bits only); `LogCorrupt` when a record it needs is unusable (the
        files may be partly written)."""
        for a in attempts:
            assert slot.target is not None
            for i, t in enumerate(self._touched(slot.target, a)):
                files.put(t.name, t.indices, committed.read(t.name, t.indices))
                if i == 0:
                    _at(point)
        if slot.version < st.committed:
            assert st.committed_attempt is not None, "a lagging slot at the bootstrap version"
            for i, t in enumerate(self._touched(st.committed, st.committed_attempt)):
                files.put(t.name, t.indices, committed.read(t.name, t.indices))
                if i == 0:
                    _at("catchup_partial")

    def _copy_committed(self, st: ReplicaState, why: LogCorrupt) -> None:
        """Make the shadow's files the committed slot's, file by file, each atomically (the
        allowed fallback when a record is unusable: logged and counted in `copies`)."""
        src, dst = slot_dir(self.root, st.committed_slot), slot_dir(self.root, st.shadow)
        self.copies += 1
        log.warning(
            "%s: %s; copying slot %d over slot %d", self.root, why, st.committed_slot, st.shadow
        )
        for rel in durable.files_of(src):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            durable.copy_file(src / rel, dst / rel)

    def _repair(self) -> None:
        """Bring a dirty (or, for abort, staged) shadow back to clean at the committed version;
        the caller holds the shadow's write lock."""
        st = self._need()
        sh = st.slots[st.shadow]
        if sh.status == SlotStatus.STAGED:
            assert sh.attempt is not None
            sh = SlotState(
                status=SlotStatus.DIRTY, version=sh.version, target=sh.target,
                touched=(sh.attempt,),
            )  # fmt: skip
            self._save(st.with_slot(st.shadow, sh), "dirty")
        layout = self._layout_of(st)
        with (
            SlotFiles(slot_dir(self.root, st.shadow), layout, write=True) as files,
            SlotFiles(slot_dir(self.root, st.committed_slot), layout, write=False) as committed,
        ):
            try:
                self._undo(files, committed, st, sh, sh.touched, "repair_partial")
                files.sync()
            except LogCorrupt as e:
                files.close()
                self._copy_committed(st, e)
        clean = SlotState(status=SlotStatus.CLEAN, version=st.committed)
        self._save(st.with_slot(st.shadow, clean), "clean")
        self._digests.unstaged()
        self._prune()

    def abort(self, version: int, attempt: int, *, lease_timeout_s: float | None = None) -> bool:
        """Undo attempt `attempt` of `version` in the shadow (the committed bits copied back)
        and mark the shadow clean at the committed version. True when something was undone; False (nothing
        changed) when that attempt is not staged."""
        version = _nonneg(version, "abort: version")
        attempt = _nonneg(attempt, "abort: attempt")
        st = self._need()
        sh = st.slots[st.shadow]
        mine = sh.target == version and (
            sh.attempt == attempt if sh.status == SlotStatus.STAGED else attempt in sh.touched
        )
        if sh.status == SlotStatus.CLEAN or not mine:
            return False
        with self._writing(st.shadow, lease_timeout_s, f"abort({version}, {attempt})"):
            self._repair()
        return True

    def commit(self, version: int, attempt: int | None = None) -> bool:
        """Make the staged `version` (of `attempt`, when given) the committed one: one atomic
        ``STATE.json`` replacement. True when it committed; False when `version` is already
        committed (a repeated commit). `ProtocolError` (nothing changed) when it is not staged."""
        version = _nonneg(version, "commit: version")
        st = self._need()
        if version == st.committed and attempt in (None, st.committed_attempt):
            return False
        sh = st.slots[st.shadow]
        if (
            sh.status != SlotStatus.STAGED
            or sh.target != version
            or (attempt is not None and sh.attempt != attempt)
        ):
            raise ProtocolError(
                f"commit: version {version}"
                + (f" attempt {attempt}" if attempt is not None else "")
                + f" is not staged (committed {st.committed}; shadow slot {st.shadow} is "
                f"{sh.status.value}, target {sh.target}, attempt {sh.attempt}); nothing changed"
            )
        new = ReplicaState(
            committed=version,
            committed_slot=st.shadow,
            committed_attempt=sh.attempt,
            bootstrap=st.bootstrap,
            slots=st.slots,
        ).with_slot(st.shadow, SlotState(status=SlotStatus.CLEAN, version=version))
        self._save(new, "committed")
        self._digests.committed(version, sh.attempt)
        self._prune()
        return True

    def catch_up(self, *, lease_timeout_s: float | None = None) -> bool:
        """Bring a shadow that lags one version to the committed version now, what the next
        `stage` would do first (the committed slot's bits copied at the elements the committed
        transition changed; dirty, written, fsynced, clean), so that stage writes only its own
        attempt. A receiver calls it after a commit, off the refit's critical path. True when
        it caught up; False (nothing changed) when the shadow does not lag. The version the
        shadow held (committed - 1) is no longer held afterwards: `LeaseHeld` while a lease
        on it outlasts `lease_timeout_s` (default: the store's)."""
        st = self._need()
        sh = st.slots[st.shadow]
        if sh.status != SlotStatus.CLEAN or sh.version == st.committed:
            return False
        with self._writing(st.shadow, lease_timeout_s, "catch_up"):
            dirty = SlotState(status=SlotStatus.DIRTY, version=sh.version, target=st.committed + 1)
            self._save(st.with_slot(st.shadow, dirty), "dirty")
            self._repair()
        return True

    # -- recovery and housekeeping ---------------------------------------------------------------

    def recover(self) -> ReplicaStatus | None:
        """Make the root consistent after a crash at any point: remove temporaries, repair a
        dirty shadow (undo from the log, or copy the committed slot), keep a staged one (its
        commit may still come), remove records nothing needs. None for a root that was never
        bootstrapped. The committed slot is only read."""
        durable.remove_temporaries(self.root)
        self._state = load_state(self.root)
        self._layout = None
        self._digests.reset()
        self._recent = {}
        st = self._state
        if st is None:
            return None
        if st.slots[st.shadow].status == SlotStatus.DIRTY:
            # a lease on a dirty slot is refused as soon as its holder reads STATE.json: wait
            # out such a reader even when stages do not wait
            with self._writing(st.shadow, max(self.lease_timeout_s, 5.0), "recover"):
                self._repair()
        self._prune()
        for slot in (0, 1):
            leases.holders(self.root, slot)  # sweeps the files of dead lease holders
        return self.status()

    def _prune(self) -> None:
        """Remove the records no state names: keep the committed transition's (the lagging
        slot replays it) and the shadow's staged or touched attempts."""
        st = self._need()
        keep = set()
        if st.committed_attempt is not None:
            keep.add((st.committed, st.committed_attempt))
        sh = st.slots[st.shadow]
        if sh.target is not None:
            keep.update((sh.target, a) for a in (*sh.touched, sh.attempt) if a is not None)
        self._recent = {k: r for k, r in self._recent.items() if k in keep}
        prune_records(self.log_dir, keep)

    @contextmanager
    def _writing(self, slot: int, timeout_s: float | None, what: str) -> Iterator[None]:
        lock = leases.SlotWriteLock(self.root, slot)
        lock.acquire(self.lease_timeout_s if timeout_s is None else float(timeout_s), what)
        try:
            yield
        finally:
            lock.release()

    # -- reads -------------------------------------------------------------------------------------

    def checkpoint_for(self, version: int) -> Path:
        """The directory holding `version` cleanly: the committed slot, or the other slot
        while it still holds committed - 1. `ReplicaError` for any other version. The path
        is not protected against later stages: read it under `lease`."""
        st = self._need()
        slot = st.holding(_nonneg(version, "checkpoint_for: version"))
        if slot is None:
            raise ReplicaError(
                f"checkpoint_for: version {version} is not held (committed {st.committed}; "
                f"slots: {[f'{s.status.value} {s.version}' for s in st.slots]})"
            )
        return slot_dir(self.root, slot)

    def lease(
        self, version: int, *, timeout_s: float = 5.0, holder: str = ""
    ) -> AbstractContextManager[Path]:
        """`leases.lease` on this root: ``with store.lease(v) as path:`` holds `version`'s slot
        unchanged (a stage that must write it waits, then raises `LeaseHeld`)."""
        return leases.lease(self.root, version, timeout_s=timeout_s, holder=holder)

    def digest(self, version: int | None = None) -> str:
        """The combined digest of the committed version (default) or of the staged one
        (digests.py: hashed on demand, only what a transition changed)."""
        st = self._need()
        names = self._layout_of(st)
        committed = slot_reader(slot_dir(self.root, st.committed_slot), names)
        if version is None or version == st.committed:
            return combined_digest(self._digests.of_committed(names, committed))
        sh = st.slots[st.shadow]
        if sh.status != SlotStatus.STAGED or sh.target != version or sh.attempt is None:
            raise ReplicaError(f"digest: version {version} is neither committed nor staged here")
        shadow = slot_reader(slot_dir(self.root, st.shadow), names)
        return combined_digest(
            self._digests.of_staged(version, sh.attempt, names, committed, shadow)
        )


__all__ = ["CRASH_POINTS", "STATE_FILE", "ReplicaStatus", "ReplicaStore", "StageResult"]
