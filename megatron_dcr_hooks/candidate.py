"""The owner's versions: the committed version, the built candidate, and the state between them.

A successful build records a `Candidate` (frozen): the version it built, the attempt, and what
it built from per owned shard: the guard records (`checks`) the candidate guard compares the
shards with, the changed indices and new stored bits of every changed tracked shard
(`delta`, which the commit scatters into the trackers) and the converted residual tensors
this rank holds (`residual`, which the commit copies into the residual baseline).
`OwnerLedger` holds it with the `OwnerState` and moves both along the transitions below.

States (`OwnerState`) and their transitions ("plain build": not a retry; a transition not
listed is an invariant violation and asserts):
- IDLE: nothing built since the last commit (or ever). build -> OPEN; abort -> IDLE; commit
  raises `ProtocolError` ("commit without a built candidate").
- OPEN: a candidate built, its attempt open (no commit or abort since). Plain build of the
  same version (a wrapped optimizer step) -> REBUILT; any other build -> OPEN;
  abort -> ABORTED; guard refusal -> STALE.
- REBUILT: OPEN, and its version was built again by a plain build: the engines may hold
  either build, so the guard refuses it ("built again"). As OPEN, but abort ->
  REBUILT_ABORTED.
- ABORTED: the attempt was aborted; the guard records stay for the retry's guard, the
  converted residual tensors are dropped. Any build -> OPEN; guard refusal -> STALE.
- REBUILT_ABORTED: REBUILT, then aborted: the retry's guard still refuses it. Any build ->
  OPEN; guard refusal -> STALE.
- STALE: the guard refused the candidate (its shards moved, or it was built again): no guard
  record is left, so verifying it is a `ProtocolError` and a retry builds from the current
  weights without verifying first. Any build -> OPEN.
Abort keeps an ABORTED, REBUILT_ABORTED or STALE state; every state but IDLE commits -> IDLE
(the committed version becomes the candidate's). A failed build leaves the state and the
candidate as they were. Only the guard refuses, and only a candidate that holds guard records
(not IDLE or STALE).

Limitations:
1. The ledger checks transitions, not shards: whether a candidate still matches the weights
   is the guard's question (`guard`).
2. `Candidate` is frozen and its mappings read-only, but the numpy arrays and tensors inside
   are shared with the ledger, not copied: callers must not write into them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

import numpy as np
import torch

from shared_codec.errors import ProtocolError


class OwnerState(StrEnum):
    """Where an owner stands between two commits (module docstring)."""

    IDLE = "idle"
    OPEN = "open"
    REBUILT = "rebuilt"
    ABORTED = "aborted"
    REBUILT_ABORTED = "rebuilt-aborted"
    STALE = "stale"


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """What one successful build on this rank built from (module docstring).

    `checks`: task index -> guard record of each owned shard the guard checks: b"" (checked
    against `delta`: same changed indices, same new bits) or, without a tracker (mode F), a
    20-byte fingerprint of the whole shard; empty with ``candidate_guard=False``.
    `delta`: task index -> (changed flat local indices, their new stored bits) of each owned
    tracked shard that changed. `residual`: canonical name -> converted tensor this rank holds
    in the residual baseline (every tensor the build converted, changed or not)."""

    version: int
    attempt: int
    base_version: int
    retry: bool = False
    checks: Mapping[int, bytes] = field(default_factory=dict)
    delta: Mapping[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    residual: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("checks", "delta", "residual"):
            value = getattr(self, name)
            if not isinstance(value, MappingProxyType):
                object.__setattr__(self, name, MappingProxyType(dict(value)))


#: the states that hold a candidate with guard records to verify against
_HELD = frozenset(
    {OwnerState.OPEN, OwnerState.REBUILT, OwnerState.ABORTED, OwnerState.REBUILT_ABORTED}
)
_S = OwnerState
#: state -> event -> next state (module docstring); commit is legal from every state but IDLE
_NEXT: dict[OwnerState, dict[str, OwnerState]] = {
    _S.IDLE: {"build": _S.OPEN, "abort": _S.IDLE},
    _S.OPEN: {"build": _S.OPEN, "rebuild": _S.REBUILT, "abort": _S.ABORTED, "refuse": _S.STALE},
    _S.REBUILT: {
        "build": _S.OPEN,
        "rebuild": _S.REBUILT,
        "abort": _S.REBUILT_ABORTED,
        "refuse": _S.STALE,
    },
    _S.ABORTED: {"build": _S.OPEN, "abort": _S.ABORTED, "refuse": _S.STALE},
    _S.REBUILT_ABORTED: {"build": _S.OPEN, "abort": _S.REBUILT_ABORTED, "refuse": _S.STALE},
    _S.STALE: {"build": _S.OPEN, "abort": _S.STALE},
}


class OwnerLedger:
    """The committed version, the candidate and the `OwnerState` of one rank's owner."""

    def __init__(self) -> None:
        self.committed_version = 0
        self.state = OwnerState.IDLE
        self.candidate: Candidate | None = None

    def _move(self, event: str) -> None:
        nxt = _NEXT[self.state].get(event)
        assert nxt is not None, f"owner state {self.state}: no transition on {event}"
        self.state = nxt

    # -- questions -------------------------------------------------------------------------
    def holds(self, version: int) -> bool:
        """Is there a candidate of `version` with guard records to verify against?"""
        c = self.candidate
        return self.state in _HELD and c is not None and c.version == version

    def rebuilt(self, version: int) -> bool:
        """Was the candidate of `version` built again while its attempt was open?"""
        c = self.candidate
        rebuilt = self.state in (OwnerState.REBUILT, OwnerState.REBUILT_ABORTED)
        return rebuilt and c is not None and c.version == version

    def last_built(self) -> int | None:
        """The version of the candidate the guard could verify (None when there is none)."""
        return self.candidate.version if self.state in _HELD and self.candidate else None

    # -- transitions -----------------------------------------------------------------------
    def built(self, candidate: Candidate) -> None:
        """A build succeeded: `candidate` replaces any earlier one. A plain build (not a
        retry) of the open candidate's version is a rebuild."""
        plain_again = (
            not candidate.retry
            and self.state in (OwnerState.OPEN, OwnerState.REBUILT)
            and self.candidate is not None
            and self.candidate.version == candidate.version
        )
        self._move("rebuild" if plain_again else "build")
        self.candidate = candidate

    def aborted(self) -> None:
        """The attempt failed: the candidate stays (for the retry's guard) without its
        converted residual tensors (the retry converts again)."""
        self._move("abort")
        if self.candidate is not None and self.candidate.residual:
            self.candidate = dataclasses.replace(self.candidate, residual={})

    def refused(self) -> None:
        """The guard refused the candidate: its records are stale."""
        self._move("refuse")

    def to_commit(self) -> Candidate:
        """The candidate a commit advances to; ProtocolError when nothing was built."""
        if self.state is OwnerState.IDLE or self.candidate is None:
            raise ProtocolError("commit without a built candidate")
        return self.candidate

    def committed(self) -> None:
        """The candidate was committed (its records applied to the baseline): -> IDLE."""
        c = self.to_commit()
        self.committed_version = c.version
        self.state, self.candidate = OwnerState.IDLE, None
