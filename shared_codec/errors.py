"""The DCR exception hierarchy.

Every error says what state a failure leaves behind, so callers know whether a retry is safe.
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


class OwnerBuildError(DCRError):
    """The owner side could not construct or hand off an attempt's payloads: the payload sink
    (transport) raised, a trainer rank failed its part of the build, the relay tree did not
    acknowledge the attempt, or a changed element fell outside its affine map.

    State left behind: the attempt is incomplete (some payloads may have been delivered) and
    must be fenced; the owners' committed baseline is unchanged (only a commit advances it), so
    an overwrite retry rebuilds the complete changed set.
    """
