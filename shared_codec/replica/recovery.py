"""The replica store's recovery and slot repair (`SlotRecovery`, a base of `ReplicaStore`):
everything that writes a slot from the log rather than from an arriving attempt.

- `_undo` / `_repair`: a dirty (or aborted staged) shadow back to clean at the committed
  version, the committed slot's bits copied at every element the records name (or, when a
  record is unusable, the committed slot's files copied whole);
- `catch_up`: the slot that lags one version brought to the committed one (a receiver runs it
  after each commit, in the background);
- `sync_committed`: the committed slot's files made durable when its commit left them unsynced;
- `_redo`: a staged or committed attempt whose writes may not have reached the disk, written
  again from its record (the base slot's bits at every element, then its new bits computed
  again);
- `recover`: all of the above as a restart needs them, then `_prune` (records no state names).

store.py's docstring has the discipline (what is durable when); docs/replica.md the crash table.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared_codec.errors import ProtocolError, ReplicaError
from shared_codec.replica import durable, leases
from shared_codec.replica.bootstrap import LOG_DIR
from shared_codec.replica.crash import at as _at
from shared_codec.replica.digests import DigestCache
from shared_codec.replica.layout import SlotFiles, TensorLoc, read_layout
from shared_codec.replica.log import LogCorrupt, Touched, prune_records
from shared_codec.replica.state import (
    ReplicaState,
    ReplicaStatus,
    SlotState,
    SlotStatus,
    load_state,
    save_state,
    slot_dir,
)
from shared_codec.replica.transition import build_changes, read_decoded, read_touched

log = logging.getLogger("dcr.replica")


def unsynced(slot: SlotState) -> tuple[int, ...]:
    """The attempts whose writes a staged slot's files may not hold durably (a state written
    before the writes were left unsynced names none: its staged attempt, to be safe)."""
    assert slot.attempt is not None
    return slot.touched or (slot.attempt,)


def _copy_at(
    files: SlotFiles, src: SlotFiles, touched: tuple[Touched, ...], point: str | None
) -> None:
    """Copy `src`'s bits at every element `touched` names into `files` (the crash point
    `point` fires after the first tensor)."""
    for i, t in enumerate(touched):
        files.put(t.name, t.indices, src.read(t.name, t.indices))
        if i == 0 and point is not None:
            _at(point)


class SlotRecovery:
    """Recovery and repair of `ReplicaStore` (module docstring); not used on its own."""

    root: Path
    key: bytes | None
    lease_timeout_s: float
    copies: int
    _state: ReplicaState | None
    _layout: dict[str, TensorLoc] | None
    _digests: DigestCache
    _recent: dict[tuple[int, int], tuple[Touched, ...]]

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
            _copy_at(files, committed, self._touched(slot.target, a), point)
        if slot.version < st.committed:
            assert st.committed_attempt is not None, "a lagging slot at the bootstrap version"
            touched = self._touched(st.committed, st.committed_attempt)
            _copy_at(files, committed, touched, "catchup_partial")

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
            sh = SlotState(
                status=SlotStatus.DIRTY, version=sh.version, target=sh.target,
                touched=unsynced(sh),
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

    def sync_committed(self) -> bool:
        """Make the committed slot's files durable when its stage left writes unsynced (fsync
        every tensor file of the slot, then record it in ``STATE.json``). Until then the other
        slot is its redo base and is not written. True when it synced."""
        st = self._need()
        if not st.slots[st.committed_slot].touched:
            return False
        d = slot_dir(self.root, st.committed_slot)
        for file in sorted({loc.file for loc in self._layout_of(st).values()}):
            durable.fsync_file(d / file)
        synced = SlotState(status=SlotStatus.CLEAN, version=st.committed)
        self._save(st.with_slot(st.committed_slot, synced), "synced")
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
        self.sync_committed()
        if not self._lags():
            return False
        with self._writing(self._need().shadow, lease_timeout_s, "catch_up"):
            self._catch_up_locked()
        return True

    def _lags(self) -> bool:
        st = self._need()
        sh = st.slots[st.shadow]
        return sh.status == SlotStatus.CLEAN and sh.version < st.committed

    def _catch_up_locked(self) -> None:
        """`catch_up` with the shadow's write lock held and the committed slot synced."""
        st = self._need()
        sh = st.slots[st.shadow]
        dirty = SlotState(status=SlotStatus.DIRTY, version=sh.version, target=st.committed + 1)
        self._save(st.with_slot(st.shadow, dirty), "dirty")
        self._repair()

    def _redo(self, slot: int, base: int, version: int, attempts: tuple[int, ...]) -> None:
        """Write `slot` again from the log (the writes of `attempts` of `version` may not have
        reached the disk): the `base` slot's bits at every element those attempts touched,
        then the last attempt's staged bits computed from the base's; fsync. The caller holds
        `slot`'s write lock. `LogCorrupt` when a record is unusable (the files may be partly
        written: the base's bits or the staged ones)."""
        st = self._need()
        layout = self._layout_of(st)
        with (
            SlotFiles(slot_dir(self.root, slot), layout, write=True) as files,
            SlotFiles(slot_dir(self.root, base), layout, write=False) as old,
        ):
            for a in attempts:
                _copy_at(files, old, self._touched(version, a), None)
            for i, c in enumerate(
                build_changes(
                    read_decoded(self.log_dir, version, attempts[-1], layout, self.key),
                    attempt=attempts[-1], committed=old,
                )
            ):  # fmt: skip
                files.put(c.name, c.indices, c.new)
                if i == 0:
                    _at("redo_partial")
            files.sync()

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
        wait = max(self.lease_timeout_s, 5.0)  # recovery waits out readers, stages need not
        c = st.slots[st.committed_slot]
        if c.touched:  # committed, its writes maybe not durable (a reboot may have lost them)
            assert st.committed_attempt is not None
            with self._writing(st.committed_slot, wait, "recover"):
                try:
                    self._redo(st.committed_slot, st.shadow, st.committed, c.touched)
                except LogCorrupt as e:  # only damage from outside removes a kept record
                    raise ReplicaError(
                        f"{self.root}: committed version {st.committed} cannot be redone ({e}); "
                        "its slot may not be durable: bootstrap the replica again"
                    ) from None
            self.sync_committed()
        st = self._need()
        sh = st.slots[st.shadow]
        if sh.status == SlotStatus.DIRTY:
            # a lease on a dirty slot is refused as soon as its holder reads STATE.json: wait
            # out such a reader even when stages do not wait
            with self._writing(st.shadow, wait, "recover"):
                self._repair()
        elif sh.status == SlotStatus.STAGED and sh.touched:  # staged, maybe not durable
            assert sh.target is not None
            with self._writing(st.shadow, wait, "recover"):
                try:
                    self._redo(st.shadow, st.committed_slot, sh.target, sh.touched)
                    durable_staged = SlotState(
                        status=SlotStatus.STAGED, version=sh.version, target=sh.target,
                        attempt=sh.attempt,
                    )  # fmt: skip
                    self._save(st.with_slot(st.shadow, durable_staged), "staged")
                except LogCorrupt as e:  # the attempt is lost: back to the committed version
                    log.warning("%s: staged attempt %s: %s; undoing it", self.root, sh.attempt, e)
                    self._repair()
        self._prune()
        for slot in (0, 1):
            leases.holders(self.root, slot)  # sweeps the files of dead lease holders
        return self.status()

    def _prune(self) -> None:
        """Remove the records no state names: keep the committed transition's (the lagging
        slot replays it) and the shadow's staged or touched attempts."""
        st = self._need()
        keep = {(st.committed, a) for a in st.slots[st.committed_slot].touched}
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
