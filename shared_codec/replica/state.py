"""The replica's durable state: ``STATE.json``, replaced atomically (`durable.atomic_write`).

It names the committed version, the slot holding it (and the attempt that produced it, whose
log record the other slot replays to catch up), the checkpoint the replica was bootstrapped
from, and per slot what its files hold:

| status | `version` | meaning |
|---|---|---|
| `clean` | the version held | the slot's files are exactly that version (committed or committed - 1); on the committed slot, a non-empty `touched` names the attempts of the committed version whose writes may not be durable yet (redone from the log, the other slot as the base, after a crash) |
| `staged` | committed | the files are `target` = committed + 1 as `attempt` wrote it, completely; `touched`: the attempts whose writes may not be durable yet (redone from the log after a crash), empty when they are |
| `dirty` | the clean version it was written from | the files are a mixture: the records of `target` named by `touched` (and, when `version` lags the committed one, the committed record's replay) may have written part of them |

Invariants (checked on every load, `ReplicaError` otherwise): the committed slot is `clean` at
the committed version; the other slot (the shadow) is `clean` at the committed version or one
before it, or `staged` / `dirty` towards committed + 1; while the committed slot is not
durable, the shadow is `clean` at committed - 1 (its redo base).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from shared_codec.errors import ReplicaError
from shared_codec.replica import durable

STATE_FILE = "STATE.json"
FORMAT = 1


def slot_dir(root: Path, slot: int) -> Path:
    """The checkpoint directory of slot 0 or 1."""
    return root / f"slot{slot}"


class SlotStatus(StrEnum):
    CLEAN = "clean"
    STAGED = "staged"
    DIRTY = "dirty"


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotState:
    """What one slot's files hold (module docstring's table)."""

    status: SlotStatus
    version: int
    target: int | None = None
    attempt: int | None = None
    touched: tuple[int, ...] = ()

    def holds(self, version: int) -> bool:
        """True when the slot's files are exactly `version` (clean)."""
        return self.status == SlotStatus.CLEAN and self.version == version


@dataclass(frozen=True, slots=True, kw_only=True)
class Bootstrap:
    """The initial checkpoint: its version, where it was copied from, and its identity (a
    digest over the relative path and bytes of every file: another checkpoint is refused)."""

    version: int
    source: str
    identity: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaState:
    """The content of ``STATE.json`` (module docstring)."""

    committed: int
    committed_slot: int
    committed_attempt: int | None
    bootstrap: Bootstrap
    slots: tuple[SlotState, SlotState]
    format: int = field(default=FORMAT)

    @property
    def shadow(self) -> int:
        """The slot that does not hold the committed version: the only one a stage writes."""
        return 1 - self.committed_slot

    def holding(self, version: int) -> int | None:
        """The slot whose files are exactly `version`, committed slot first; None if none."""
        for i in (self.committed_slot, self.shadow):
            if self.slots[i].holds(version):
                return i
        return None

    def with_slot(self, index: int, slot: SlotState) -> ReplicaState:
        slots = list(self.slots)
        slots[index] = slot
        return replace(self, slots=(slots[0], slots[1]))

    def check(self) -> ReplicaState:
        """`ReplicaError` unless the invariants of the module docstring hold; returns self."""
        c, s = self.slots[self.committed_slot], self.slots[self.shadow]
        bad = None
        if self.committed_slot not in (0, 1):
            bad = f"committed_slot {self.committed_slot}"
        elif not c.holds(self.committed):
            bad = f"committed slot {self.committed_slot} is {c}"
        elif c.touched and not (
            s.status == SlotStatus.CLEAN
            and s.version == self.committed - 1
            and c.touched[-1] == self.committed_attempt
        ):
            bad = f"committed slot {self.committed_slot} is not durable and its base is {s}"
        elif s.status == SlotStatus.CLEAN:
            if s.version not in (self.committed, self.committed - 1):
                bad = f"shadow slot holds version {s.version}"
        elif s.target != self.committed + 1:
            bad = f"shadow slot targets version {s.target}"
        elif s.status == SlotStatus.STAGED and (
            s.version != self.committed
            or s.attempt is None
            or (s.touched and s.touched[-1] != s.attempt)
        ):
            bad = f"shadow slot staged from version {s.version}, attempt {s.attempt}"
        elif s.status == SlotStatus.DIRTY and s.version not in (self.committed, self.committed - 1):
            bad = f"dirty shadow slot from version {s.version}"
        if bad:
            raise ReplicaError(f"{STATE_FILE}: inconsistent state ({bad}): not written by DCR?")
        return self

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["slots"] = [{**asdict(s), "touched": list(s.touched)} for s in self.slots]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> ReplicaState:
        try:
            if obj["format"] != FORMAT:
                raise ValueError(f"format {obj['format']}, this store reads {FORMAT}")
            slots = [
                SlotState(
                    status=SlotStatus(s["status"]),
                    version=int(s["version"]),
                    target=None if s["target"] is None else int(s["target"]),
                    attempt=None if s["attempt"] is None else int(s["attempt"]),
                    touched=tuple(int(a) for a in s["touched"]),
                )
                for s in obj["slots"]
            ]
            if len(slots) != 2:
                raise ValueError(f"{len(slots)} slots")
            b = obj["bootstrap"]
            st = cls(
                committed=int(obj["committed"]),
                committed_slot=int(obj["committed_slot"]),
                committed_attempt=(
                    None if obj["committed_attempt"] is None else int(obj["committed_attempt"])
                ),
                bootstrap=Bootstrap(
                    version=int(b["version"]), source=str(b["source"]), identity=str(b["identity"])
                ),
                slots=(slots[0], slots[1]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ReplicaError(f"{STATE_FILE}: malformed ({type(e).__name__}: {e})") from None
        return st.check()


def load_state(root: Path) -> ReplicaState | None:
    """The state under `root`; None when the root was never bootstrapped (no ``STATE.json``)."""
    try:
        text = (root / STATE_FILE).read_text()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReplicaError(f"{root / STATE_FILE}: not JSON ({e})") from None
    return ReplicaState.from_json(obj)


def save_state(
    root: Path, state: ReplicaState, *, before_rename: Callable[[], None] | None = None
) -> None:
    """Replace ``STATE.json`` with `state` atomically and durably (checked first)."""
    state.check()
    data = json.dumps(state.to_json(), indent=1, sort_keys=True).encode() + b"\n"
    durable.atomic_write(root / STATE_FILE, data, before_rename=before_rename)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaStatus:
    """What a replica root holds, as reported (`ReplicaStore.status`, `read_status`, ``dcr
    replica status``): committed version, slot and attempt, the bootstrap, each slot's state."""

    root: str
    committed: int
    committed_slot: int
    committed_attempt: int | None
    bootstrap_version: int
    bootstrap_source: str
    slots: tuple[SlotState, SlotState]

    @property
    def shadow(self) -> SlotState:
        """The state of the slot that does not hold the committed version."""
        return self.slots[1 - self.committed_slot]

    @property
    def staged(self) -> int | None:
        """The version the shadow holds staged (None when it is clean or dirty)."""
        sh = self.shadow
        return sh.target if sh.status == SlotStatus.STAGED else None

    @classmethod
    def of(cls, root: Path, st: ReplicaState) -> ReplicaStatus:
        return cls(
            root=str(root),
            committed=st.committed,
            committed_slot=st.committed_slot,
            committed_attempt=st.committed_attempt,
            bootstrap_version=st.bootstrap.version,
            bootstrap_source=st.bootstrap.source,
            slots=st.slots,
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["slots"] = [{**asdict(s), "touched": list(s.touched)} for s in self.slots]
        return out


def read_status(root: str | os.PathLike[str]) -> ReplicaStatus | None:
    """The status ``STATE.json`` records, read without the writer lock (so also while a replica
    runs) and without recovering; None for a root never bootstrapped. A `dirty` slot here is
    one a crash left, or one a running stage is writing."""
    path = Path(root).resolve()
    st = load_state(path)
    return None if st is None else ReplicaStatus.of(path, st)
