"""shared_codec: the part of DCR shared by owners (Megatron) and receivers (vLLM).

It imports neither vLLM nor Megatron. Optional dependencies (boto3, pyzmq, safetensors,
tokenizers) are imported inside the modules or functions that need them.
"""

from shared_codec.errors import (
    CommitConflict,
    CompatibilityError,
    DCRError,
    EngineUnreachable,
    LoaderConditionError,
    PayloadError,
    ProtocolError,
    RefitFailed,
    RelayMessageError,
    TransportError,
)

__version__ = "0.1.0"

#: Version of the payload container (docs/format.md). Bumped on any wire change.
FORMAT_VERSION = 2

__all__ = [
    "CommitConflict",
    "CompatibilityError",
    "DCRError",
    "EngineUnreachable",
    "RefitFailed",
    "RelayMessageError",
    "TransportError",
    "FORMAT_VERSION",
    "LoaderConditionError",
    "PayloadError",
    "ProtocolError",
    "__version__",
]
