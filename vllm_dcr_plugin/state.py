"""The receiver state machine: states, the events that move a receiver, and one transition table.

Contract: `advance(state, event)` returns the state after `event`, or raises `ProtocolError`
when the table has no entry for (event, state); the caller checks before any side effect and
assigns after it (see `vllm_dcr_plugin.receiver.Receiver`). State values are the status strings
the RPC replies carry (``dcr_status``'s ``state``), so ``ReceiverState.DIRTY == "dirty"``.

States (one rank's weights relative to its committed version):

- ``clean``: weights are exactly the committed version. XOR and overwrite items accepted.
- ``applying``: a pipelined attempt (``dcr_fetch`` with ``apply``) has applied the payloads that
  arrived so far, consistently; more of the same attempt may follow (XOR still accepted for it).
  Aborting it or applying another attempt makes the receiver ``dirty``.
- ``applied``: an attempt for (committed -> target) applied completely; awaiting ``commit``.
- ``dirty``: an attempt failed part-way; weights are a mixture. Only overwrite items (a retry of
  the complete changed set) are accepted until an attempt succeeds.

`check_apply` holds the data-dependent refusals of an apply (which target, XOR or not);
`check_next` the version a fetch may ask for (the next one: versions are consecutive).

Limitations:
1. The table says which events a state admits; the commit's version and one target version
   per attempt are checked by the caller (receiver.py).
2. An apply that changed nothing (no staged payloads and no pipelined attempt in flight) is no
   event: the receiver keeps its state.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from shared_codec.errors import ProtocolError


class ReceiverState(StrEnum):
    """Where one rank's weights stand (see the module docstring)."""

    CLEAN = "clean"
    APPLYING = "applying"
    APPLIED = "applied"
    DIRTY = "dirty"


class Event(StrEnum):
    """What happened to the receiver."""

    PREWARM = "prewarm"  # tensors registered, loader traced
    DENSE_LOAD = "dense_load"  # a dense load of some committed version
    COMMIT = "commit"  # the coordinator committed the applied target
    PART_APPLIED = "part_applied"  # a pipelined part applied; more of the attempt may follow
    APPLIED = "applied"  # the attempt applied completely
    FAILED = "failed"  # an apply failed after touching weights (or while applying)
    INTERRUPTED = "interrupted"  # the applying attempt was aborted, or another attempt applied


_S = ReceiverState
_ANY = tuple(ReceiverState)

#: event -> {state it is allowed in: state after it}
TRANSITIONS: Mapping[Event, Mapping[ReceiverState, ReceiverState]] = {
    Event.PREWARM: {_S.CLEAN: _S.CLEAN},
    Event.DENSE_LOAD: {s: _S.CLEAN for s in _ANY},
    Event.COMMIT: {_S.APPLIED: _S.CLEAN},
    Event.PART_APPLIED: {s: _S.APPLYING for s in _ANY},
    Event.APPLIED: {s: _S.APPLIED for s in _ANY},
    Event.FAILED: {s: _S.DIRTY for s in _ANY},
    Event.INTERRUPTED: {_S.APPLYING: _S.DIRTY},
}

_REFUSED: Mapping[Event, str] = {
    Event.PREWARM: "prewarm during a transition; commit or dense-load first",
    Event.COMMIT: "only an applied attempt can be committed",
}


def advance(state: ReceiverState, event: Event) -> ReceiverState:
    """The state after `event` in `state`; `ProtocolError` (nothing changed) if not allowed."""
    after = TRANSITIONS[event].get(state)
    if after is None:
        why = _REFUSED.get(event, "not allowed")
        raise ProtocolError(f"{event.value} in state {state.value}: {why}")
    return after


def check_apply(
    state: ReceiverState,
    *,
    attempt: int,
    applying_attempt: int | None,
    target: int | None,
    target_version: int | None,
    has_xor: bool,
) -> None:
    """Refuse (`ProtocolError`, before any write) an apply of `attempt` for `target` in `state`:
    while an applied or applying version awaits commit, only the same target; XOR items only
    when the weights are exactly the committed version (``clean``) or already hold part of the
    same pipelined attempt (``applying`` it)."""
    if state in (_S.APPLIED, _S.APPLYING) and target not in (None, target_version):
        raise ProtocolError(
            f"receiver holds an applied, uncommitted version {target_version}; commit it "
            f"before applying version {target}"
        )
    same = state == _S.APPLYING and applying_attempt == attempt
    if has_xor and not (state == _S.CLEAN or same):
        raise ProtocolError(
            f"attempt {attempt} has XOR items but this receiver is {state} (weights are "
            "not exactly the committed version); retry with overwrites of the complete set"
        )


def check_next(version: int, committed: int, what: str) -> None:
    """`ProtocolError` naming `what` when `version` is not the next one after `committed`: a
    stale request (payloads of an old version are refused at staging anyway, and once
    retention removed them a fetch would only wait out its timeout), or one beyond the next
    (nothing is ever published for it before the next commits: the fetch would wait out its
    whole timeout)."""
    if version <= committed:
        raise ProtocolError(
            f"{what}: version {version} is not after this receiver's committed version "
            f"{committed} (a stale request); nothing fetched"
        )
    if version != committed + 1:
        raise ProtocolError(
            f"{what}: version {version} is not the next one after this receiver's committed "
            f"version {committed} (versions are consecutive); nothing fetched"
        )
