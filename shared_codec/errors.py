"""The DCR exception hierarchy: every exception DCR raises on a product path is defined here.

Every error says what state a failure leaves behind, so callers know whether a retry is safe.
User errors in configuration objects are `ValueError` (a config that cannot be built); errors at
an RPC or wire boundary are `ProtocolError` / `PayloadError`.

    DCRError
    ├── PayloadError          a payload failed validation (nothing staged or applied)
    ├── ProtocolError         a call out of order or with bad arguments (nothing changed)
    ├── LoaderConditionError  the loader path cannot apply exactly (refused at prewarm, or the
    │                         attempt failed and needs an overwrite retry)
    ├── CompatibilityError    a dependency version the compatibility layers were not checked on
    ├── TransportError        a transport operation failed after its retries
    │   └── RelayMessageError a malformed relay message (refused, not acted on)
    ├── CommitConflict        the commit compare-and-set lost
    ├── EngineUnreachable     a rollout engine did not answer
    ├── RefitFailed           every attempt of a transition failed
    ├── OwnerBuildError       the owners could not build or hand off an attempt
    │   └── CandidateChanged  the trainer's weights moved after the build (nothing committed)
    └── ReplicaError          the canonical replica's store refused or could not do an operation
        └── LeaseHeld         a slot a stage must write is leased by a reader (nothing changed)
"""


class DCRError(Exception):
    """Base class of every DCR error."""


class PayloadError(DCRError):
    """A payload could not be decoded or failed validation.

    State left behind: nothing. Decoding never writes outside its own output, and a payload that
    raises this error is never staged or applied.
    """


class ProtocolError(DCRError):
    """An RPC or control-plane call was made out of order or with inconsistent arguments.

    State left behind: the call changed nothing (it is rejected before any side effect).
    """


class ArgumentError(ProtocolError, ValueError):
    """An argument of a DCR entry point was refused (a version that is not the next one, a
    value out of range); the message names it. Also a ValueError, the user error. State left
    behind: nothing changed."""


class LoaderConditionError(DCRError):
    """The serving runtime's loader path cannot be used for exact in-place application.

    Raised at prewarm (before any write) or during an attempt; in the latter case the attempt is
    reported failed and must be retried with overwrites.
    """


class CompatibilityError(DCRError):
    """An installed dependency has a version this project's compatibility layer was not checked on,
    or the process cannot take the layer (the Megatron CPU layer in a process that imported vLLM).

    State left behind: nothing was patched.
    """


class TransportError(DCRError):
    """A transport operation failed after its retries. State left behind: objects already
    written stay (uploads are idempotent by key); the attempt must be failed and retried."""


class RelayMessageError(TransportError):
    """A relay message was malformed (not JSON, unknown kind, missing or mistyped field). State
    left behind: the message was not acted on; a node answers `Refused` and keeps serving."""


class CommitConflict(DCRError):
    """The compare-and-set failed: another coordinator committed first (or the expected
    version is not the current one). State left behind: the winner's record; nothing of ours."""


class EngineUnreachable(DCRError):
    """The engine did not answer (connection refused or reset, timeout, HTTP error): it may be
    dead. State left behind: unknown on that engine (it may hold a partial apply); the
    coordinator fails the attempt and restores the engine to the committed version."""


class RefitFailed(DCRError):
    """Every attempt of a transition failed. State left behind: the committed version is
    unchanged in the commit record and on the owners; engines may be dirty (a later
    overwrite retry or a dense load of the committed version repairs them)."""


class OwnerBuildError(DCRError):
    """The owner side could not construct or hand off an attempt's payloads: the payload sink
    (transport) raised, a trainer rank failed its part of the build, the relay tree did not
    acknowledge the attempt, or a changed element fell outside its affine map.

    State left behind: the attempt is incomplete (some payloads may have been delivered) and
    must be fenced; the owners' committed baseline is unchanged (only a commit advances it), so
    an overwrite retry rebuilds the complete changed set.
    """


class CandidateChanged(OwnerBuildError):
    """The trainer's parameters changed after the attempt was built (for example an optimizer
    step between build and commit): the payloads no longer describe them, so the owners refuse
    to commit or to re-emit the attempt as an overwrite retry (paper Proposition 1 assumes the
    candidate stays fixed until the commit).

    State left behind: nothing committed; the owners keep the committed baseline; engines that
    applied the attempt are dirty until a later attempt or a dense load repairs them. Build the
    version again from the current weights (a new attempt 0) once the trainer holds still.
    """


class ReplicaError(DCRError):
    """The rollout cluster's canonical replica store (`shared_codec.replica`) refused an
    operation (a root holding another checkpoint, a commit of a version that is not staged, a
    version no slot holds) or found its files unusable. State left behind: a refusal changed
    nothing; the committed version stays readable and bit-exact (docs/replica.md)."""


class LeaseHeld(ReplicaError):
    """A stage or abort needed to write a slot that a reader leases (`ReplicaStore.lease`) and
    the lease was not released within the timeout; the message names the lease holders. State
    left behind: nothing changed (no log written, no slot touched)."""


def error_class(name: str) -> type[DCRError]:
    """The class of the DCR error tree named `name` (how a typed error reply names its
    exception across a process boundary); `DCRError` for any other name."""
    todo: list[type[DCRError]] = [DCRError]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    return DCRError
