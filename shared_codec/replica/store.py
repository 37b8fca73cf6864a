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

Discipline of `stage` (a write-ahead log with redo: every step is durable before the next
starts, except the slot's own writes, which the log redoes; a crash at any point leaves the
committed version readable and `recover` finishes the rest):
1. decode and validate every payload, read the committed bits: nothing written yet;
2. make the committed slot durable if its commit left it unsynced (`sync_committed`), take
   the shadow's write lock (waits for its leases, `LeaseHeld` past the timeout), repair a
   dirty shadow and catch up a lagging one (durably: msync + fsync);
3. write the log record (the attempt's payloads as received, log.py) to a temporary file,
   fsync, rename, fsync ``log/``;
4. replace ``STATE.json`` (temporary, fsync, rename, fsync root): shadow `dirty`, naming the
   records that may now write it;
5. write the shadow in place through memory maps: undo a previously staged attempt (the
   committed slot's bits copied at the elements its record names), then the attempt's new
   bits; no msync: what reached the page cache may not have reached the disk;
6. replace ``STATE.json``: shadow `staged` (version, attempt), `touched` naming the attempts
   whose writes may not be durable; stage returns after this, so its ACK is durable: a replica
   restarted before the commit redoes the writes from the log (`_redo`: the committed slot's
   bits at every element those records name, then the attempt's new bits computed again from
   the committed ones; msync + fsync) and can still commit the attempt.
`commit(v)` is one ``STATE.json`` replacement (the shadow becomes the committed slot, with the
`touched` of its stage; the old one holds v - 1 and is its redo base), then, unless
``sync=False`` (the receiver's: off the refit's critical path), `sync_committed`: fsync the
slot's files, and ``STATE.json`` says it is durable. Leases of a committed version wait until
it is durable; nothing writes the redo base before. `catch_up` (the receiver runs it after
each commit, in the background) syncs, then brings the lagging slot to the committed version.
`abort`, the catch-up and the repair of a `dirty` slot mark it dirty, copy the committed bits
at every element the records name, fsync, and mark it clean at the committed version. A record
that is missing or torn when a repair needs it makes the repair copy the committed slot's files
over the shadow's instead (each file atomically), which is always right.

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
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from shared_codec.checkpoint import combined_digest
from shared_codec.errors import ArgumentError, ProtocolError, ReplicaError
from shared_codec.replica import durable, leases
from shared_codec.replica.bootstrap import copy_initial
from shared_codec.replica.crash import CRASH_POINTS
from shared_codec.replica.crash import at as _at
from shared_codec.replica.digests import DigestCache, slot_reader
from shared_codec.replica.layout import SlotFiles, TensorLoc, read_layout
from shared_codec.replica.log import LogCorrupt, Touched, write_record
from shared_codec.replica.recovery import SlotRecovery, unsynced
from shared_codec.replica.state import (
    STATE_FILE,
    ReplicaState,
    ReplicaStatus,
    SlotState,
    SlotStatus,
    slot_dir,
)
from shared_codec.replica.transition import (
    AttemptDecoder,
    Change,
    StageResult,
)
from shared_codec.replica.transition import nonneg as _nonneg

log = logging.getLogger("dcr.replica")


class ReplicaStore(SlotRecovery):
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

    def decoder(self, version: int, attempt: int) -> AttemptDecoder:
        """An `AttemptDecoder` for the next version's attempt against this store's committed
        version: fed payload by payload as they arrive (decoding, validating and computing the
        staged bits of each), then passed to `stage` (``stage(v, a, decoder.payloads,
        decoded=decoder)``), which then decodes nothing again. Close it (``with``)."""
        st = self._need()
        layout = self._layout_of(st)
        return AttemptDecoder(
            version=_nonneg(version, "decoder: version"),
            attempt=_nonneg(attempt, "decoder: attempt"),
            base_version=st.committed,
            layout=layout,
            key=self.key,
            committed=SlotFiles(slot_dir(self.root, st.committed_slot), layout, write=False),
        )

    def stage(
        self,
        version: int,
        attempt: int,
        payloads: Sequence[bytes],
        *,
        decoded: AttemptDecoder | None = None,
        lease_timeout_s: float | None = None,
    ) -> StageResult:
        """Stage attempt `attempt` of `version` (= committed + 1) from its payloads into the
        shadow slot (fsync discipline: module docstring). A new attempt of a staged version
        (an overwrite retry) first undoes the staged one. `decoded`: the payloads already
        decoded as they arrived (`decoder`; they must be `payloads`).

        Refusals change nothing: `ArgumentError` for a version that is not the next one or a
        bad attempt (or a `decoded` of another attempt or base), `ProtocolError` for an attempt
        already staged, `PayloadError` for a payload refused (transition.py), `LeaseHeld` when
        the shadow stays leased past `lease_timeout_s` (default: the store's)."""
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
        if decoded is None:
            decoded = AttemptDecoder(
                version=version, attempt=attempt, base_version=st.committed, layout=layout,
                key=self.key,
            )  # fmt: skip
            for data in payloads:
                decoded.add(data)
        elif (decoded.version, decoded.attempt, decoded.base_version) != (
            version, attempt, st.committed
        ) or len(decoded.payloads) != len(payloads):  # fmt: skip
            raise ArgumentError(
                f"stage: decoded payloads of v{decoded.version}/a{decoded.attempt} over "
                f"v{decoded.base_version} ({len(decoded.payloads)}), not of v{version}/"
                f"a{attempt} over v{st.committed} ({len(payloads)}); nothing changed"
            )
        with SlotFiles(slot_dir(self.root, st.committed_slot), layout, write=False) as old:
            changes = decoded.changes(old)
        what = f"stage({version}, {attempt})"
        self.sync_committed()  # the shadow is the committed slot's redo base until then
        with self._writing(st.shadow, lease_timeout_s, what):
            if self._need().slots[st.shadow].status == SlotStatus.DIRTY:
                self._repair()
            if self._lags():  # no catch-up ran since the commit: do it first, durably
                self._catch_up_locked()
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
            prev = unsynced(sh) if sh.status == SlotStatus.STAGED else ()
            dirty = SlotState(
                status=SlotStatus.DIRTY, version=sh.version, target=version,
                touched=(*prev, attempt),
            )  # fmt: skip
            self._save(st.with_slot(st.shadow, dirty), "dirty")
            self._write_shadow(st, dirty, changes)
            staged = SlotState(
                status=SlotStatus.STAGED, version=st.committed, target=version, attempt=attempt,
                touched=dirty.touched,
            )  # fmt: skip
            self._save(st.with_slot(st.shadow, staged), "staged")
            self._prune()
        self._digests.staged(version, attempt, (c.name for c in changes))
        return StageResult(
            version=version,
            attempt=attempt,
            base_version=st.committed,
            payloads=len(decoded.payloads),
            tensors=len(changes),
            elements=sum(int(c.indices.shape[0]) for c in changes),
            seconds=time.perf_counter() - t0,
        )

    def _write_shadow(
        self, st: ReplicaState, dirty: SlotState, changes: tuple[Change, ...]
    ) -> None:
        """Undo a previously staged attempt in the dirty shadow (or copy the committed slot
        when its record is unusable), write the attempt's staged bits; not synced (the log
        redoes them: `_redo_staged`)."""
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
        _at("slot_written")

    def abort(self, version: int, attempt: int, *, lease_timeout_s: float | None = None) -> bool:
        """Undo attempt `attempt` of `version` in the shadow (the committed bits copied back)
        and mark the shadow clean at the committed version. True when something was undone;
        False (nothing changed) when that attempt is not staged."""
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

    def commit(self, version: int, attempt: int | None = None, *, sync: bool = True) -> bool:
        """Make the staged `version` (of `attempt`, when given) the committed one: one atomic
        ``STATE.json`` replacement, then (`sync`) `sync_committed`. With ``sync=False`` the
        slot's files are made durable later (`sync_committed`, `catch_up`, the next stage, or
        recovery's redo from the log); leases of the version wait for it. True when it
        committed; False when `version` is already committed (a repeated commit).
        `ProtocolError` (nothing changed) when it is not staged."""
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
        ).with_slot(
            st.shadow, SlotState(status=SlotStatus.CLEAN, version=version, touched=sh.touched)
        )
        self._save(new, "committed")
        self._digests.committed(version, sh.attempt)
        self._prune()
        if sync:
            self.sync_committed()
        return True

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
