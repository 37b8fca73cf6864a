"""Leases: a reader holds a slot's files unchanged while it reads them (a restore loading
``checkpoint_for(v)``); the store's writes wait for the leases of the slot they would dirty.

Discipline (docs/replica.md, "Leases"):
1. A lease is a shared ``flock`` on ``leases/slot<i>.lock``; the store takes the exclusive lock
   of the shadow slot before it dirties it (stage, abort, the repair of a dirty slot) and keeps
   it until the slot's state is staged or clean again. The committed slot is written only by a
   restart's redo; a lease of it waits only while its commit is not durable yet (a receiver's
   commit syncs in the background), within the lease's timeout.
2. `lease(root, version)` finds the slot holding `version` cleanly in ``STATE.json``, takes the
   shared lock, then reads ``STATE.json`` again under the lock: the slot must still hold the
   version cleanly, or the lease is refused (`ReplicaError`). While the lease is held, the
   slot's files are exactly that version.
3. Locks belong to open file descriptions, so they work between processes and between the
   store and a lease in one process, and a killed holder's lock is released by the kernel (no
   stale lease survives a crash). Each lease also leaves ``leases/slot<i>.<pid>.<token>`` with
   its holder's name, so a stage that waits past its timeout can say who holds the slot
   (`LeaseHeld`); files of dead holders are ignored and swept.

Limitations:
1. Linux/POSIX ``flock`` on a local file system (not NFS).
2. Leases are advisory: a reader that opens slot files without a lease may see a slot being
   written (`ReplicaStore.checkpoint_for` returns a path without a lease).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared_codec.errors import LeaseHeld, ReplicaError
from shared_codec.replica.state import load_state, slot_dir

LEASE_DIR = "leases"
_POLL_S = 0.01


def lock_path(root: Path, slot: int) -> Path:
    return root / LEASE_DIR / f"slot{slot}.lock"


def _try_lock(fd: int, op: int, timeout_s: float) -> bool:
    """Take the flock `op` on `fd`, polling until `timeout_s` has passed; False if it did not."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holders(root: Path, slot: int) -> list[dict[str, object]]:
    """The live leases of `slot` as their holder files say (pid, version, holder, since);
    files of processes that no longer run are removed."""
    out: list[dict[str, object]] = []
    for f in sorted((root / LEASE_DIR).glob(f"slot{slot}.*.*")):
        if f.suffix == ".lock":
            continue
        try:
            info = json.loads(f.read_text())
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid):
            out.append(info)
        else:
            f.unlink(missing_ok=True)
    return out


class SlotWriteLock:
    """The store's exclusive lock of one slot (rule 1 of the module docstring)."""

    def __init__(self, root: Path, slot: int) -> None:
        self.root, self.slot = root, slot
        self.fd = -1

    def acquire(self, timeout_s: float, what: str) -> None:
        """Take the lock within `timeout_s`; `LeaseHeld` naming the holders otherwise."""
        t0 = time.monotonic()
        fd = os.open(lock_path(self.root, self.slot), os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(fd, fcntl.LOCK_EX, timeout_s):
            os.close(fd)
            who = holders(self.root, self.slot)
            named = "; ".join(
                f"pid {h.get('pid')} ({h.get('holder') or 'no name'}, version {h.get('version')})"
                for h in who
            )
            raise LeaseHeld(
                f"{what}: slot {self.slot} is leased ({named or 'holder unknown'}); waited "
                f"{time.monotonic() - t0:.2f} s of a {timeout_s:g} s lease timeout; nothing changed"
            )
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


@contextmanager
def lease(
    root: str | os.PathLike[str], version: int, *, timeout_s: float = 5.0, holder: str = ""
) -> Iterator[Path]:
    """Hold the slot holding `version` cleanly and yield its directory (module docstring).

    `ReplicaError` when no slot holds `version` (before or after taking the lock: the version
    moved on), or when it is not durable and the lock granted within `timeout_s` (a commit
    not synced yet; the slot being written).
    Any process may take a lease; it needs read access to the root and write access to
    ``leases/``.
    """
    root = Path(root)
    deadline = time.monotonic() + max(0.0, timeout_s)
    state = load_state(root)
    if state is None:
        raise ReplicaError(f"lease: {root} holds no replica (not bootstrapped)")
    slot = state.holding(version)
    while state is not None and slot is not None and state.slots[slot].touched:  # not durable
        if time.monotonic() >= deadline:
            raise ReplicaError(
                f"lease: version {version} of {root} is committed but its slot is not durable "
                f"yet (the replica syncs it after the commit, or redoes it when it restarts); "
                f"not granted within {timeout_s:g} s"
            )
        time.sleep(_POLL_S)
        state = load_state(root)
        slot = None if state is None else state.holding(version)
    if state is None:
        raise ReplicaError(f"lease: {root} holds no replica (not bootstrapped)")
    if slot is None:
        raise ReplicaError(
            f"lease: version {version} is not held by {root} (committed version "
            f"{state.committed}; slots: {[str(s) for s in state.slots]})"
        )
    fd = os.open(lock_path(root, slot), os.O_RDWR | os.O_CREAT, 0o644)
    tag = root / LEASE_DIR / f"slot{slot}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
    try:
        if not _try_lock(fd, fcntl.LOCK_SH, deadline - time.monotonic()):
            raise ReplicaError(
                f"lease: slot {slot} of {root} (version {version}) is being written; not granted "
                f"within {timeout_s:g} s"
            )
        again = load_state(root)
        if again is None or again.holding(version) != slot or again.slots[slot].touched:
            raise ReplicaError(
                f"lease: version {version} left slot {slot} of {root} before the lease was "
                f"granted (committed version {again.committed if again else None})"
            )
        info = {"pid": os.getpid(), "version": version, "holder": holder, "since": time.time()}
        tag.write_text(json.dumps(info))
        yield slot_dir(root, slot)
    finally:
        tag.unlink(missing_ok=True)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
