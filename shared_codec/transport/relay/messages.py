"""Relay wire messages: one frozen dataclass per kind, keyed by (version, attempt).

Every message is a JSON header frame (``{"type": <kind>, ...fields}``, UTF-8); a `Payload`
message is followed by exactly one more frame, the payload bytes. `encode` writes the header
frame; `decode` parses one and validates it (known kind, every required field present and of
its type, no unknown fields) before any node or sender acts on it, raising `RelayMessageError`
otherwise.

Kinds and who sends them (the module docstring of the package tells the protocol):

- `Payload` (sender -> node, node -> child) and its `PayloadAck` (queueing acknowledgement);
- `Manifest` (the attempt's payload ids: the party closing the attempt -> root -> children) and
  its `ManifestAck` (completion acknowledgement, aggregated up the tree);
- `Abandon` (the coordinator gave the attempt up; root -> children) and its `AbandonAck`;
- `Forget` (retention: the coordinator -> root -> children, after a commit: drop everything of
  versions below `before_version`) and its `ForgetAck`;
- `Refused` (a node could not parse a message: the sender learns why instead of timing out).

Validation bounds (each failure is a `RelayMessageError`, never another exception): a frame
must be bytes-like and at most `MAX_FRAME` bytes of UTF-8 JSON (too deep a nesting or an
integer literal past Python's digit limit is refused, not raised through); integers are in ``[0, 2**64)``; payload ids are 32 lowercase hex digits (BLAKE2b-128, as
`shared_codec.format` writes them); `timeout_s` is finite and in ``(0, MAX_TIMEOUT_S]``.

Limitations:
1. The field sets are version 1 of the relay protocol; peers of one tree run the same code
   (there is no negotiation). New fields must get defaults.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, ClassVar

from shared_codec.errors import RelayMessageError


class Kind(StrEnum):
    PAYLOAD = "payload"
    PAYLOAD_ACK = "payload_ack"
    MANIFEST = "manifest"
    MANIFEST_ACK = "manifest_ack"
    ABANDON = "abandon"
    ABANDON_ACK = "abandon_ack"
    FORGET = "forget"
    FORGET_ACK = "forget_ack"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class Payload:
    """Header of a payload frame: the payload's (version, attempt) and id (hex)."""

    KIND: ClassVar[Kind] = Kind.PAYLOAD
    version: int
    attempt: int
    payload_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadAck:
    """A node queued (`ok`) or refused a payload; `duplicate`: it had it already."""

    KIND: ClassVar[Kind] = Kind.PAYLOAD_ACK
    payload_id: str
    ok: bool
    node: str
    duplicate: bool = False
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """Every payload id of (version, attempt), and the committed version the attempt is a delta
    on (`base_version`; None from a sender that does not say); a node answers within
    `timeout_s`."""

    KIND: ClassVar[Kind] = Kind.MANIFEST
    version: int
    attempt: int
    payload_ids: tuple[str, ...]
    timeout_s: float = 30.0
    base_version: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestAck:
    """The subtree under `node` holds every listed payload (`complete`) or names `failed`."""

    KIND: ClassVar[Kind] = Kind.MANIFEST_ACK
    version: int
    attempt: int
    complete: bool
    failed: tuple[str, ...]
    node: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Abandon:
    """The coordinator gave (version, attempt) up for `reason`."""

    KIND: ClassVar[Kind] = Kind.ABANDON
    version: int
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AbandonAck:
    KIND: ClassVar[Kind] = Kind.ABANDON_ACK
    version: int
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Forget:
    """Retention: drop every payload, delivered id and notice of versions < `before_version`,
    and refuse their late payloads (the coordinator, once newer versions are committed)."""

    KIND: ClassVar[Kind] = Kind.FORGET
    before_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ForgetAck:
    """`node` forgot versions < `before_version`: `removed` spool files, `keys` (version,
    attempt) delivered sets."""

    KIND: ClassVar[Kind] = Kind.FORGET_ACK
    before_version: int
    node: str
    removed: int
    keys: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """`node` could not parse a message (`error` says why)."""

    KIND: ClassVar[Kind] = Kind.REFUSED
    node: str
    error: str


#: Largest header frame accepted (a manifest of ~1M payload ids fits).
MAX_FRAME = 64 << 20
#: Longest `timeout_s` accepted (a day); longer, NaN or infinite deadlines would never expire.
MAX_TIMEOUT_S = 86400.0
_ID_CHARS = frozenset("0123456789abcdef")
_ID_LEN = 32
_ID_FIELDS = frozenset({"payload_id", "payload_ids"})

Message = (
    Payload
    | PayloadAck
    | Manifest
    | ManifestAck
    | Abandon
    | AbandonAck
    | Forget
    | ForgetAck
    | Refused
)

_CLASSES: dict[str, type] = {
    c.KIND.value: c
    for c in (
        Payload,
        PayloadAck,
        Manifest,
        ManifestAck,
        Abandon,
        AbandonAck,
        Forget,
        ForgetAck,
        Refused,
    )
}
# JSON type accepted for each annotated field type (bool is not an int here)
_CHECKS: dict[str, Any] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "int | None": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "tuple[str, ...]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


def encode(msg: Message) -> bytes:
    """The header frame of `msg`."""
    body: dict[str, Any] = {"type": msg.KIND.value}
    for f in fields(msg):
        v = getattr(msg, f.name)
        body[f.name] = list(v) if isinstance(v, tuple) else v
    return json.dumps(body).encode()


def _seconds_ok(v: float) -> bool:
    try:
        return math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S
    except OverflowError:  # an integer too large for a float
        return False


def _is_id(v: str) -> bool:
    return len(v) == _ID_LEN and set(v) <= _ID_CHARS


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one header frame; raises `RelayMessageError` on malformed input
    (including a non-bytes frame, see the module docstring for every bound)."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise RelayMessageError(f"relay frame must be bytes, got {type(frame).__name__}")
    raw = bytes(frame)
    if len(raw) > MAX_FRAME:
        raise RelayMessageError(f"relay message of {len(raw)} bytes exceeds {MAX_FRAME}")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError: JSONDecodeError and integer literals past the int-string digit limit;
        # RecursionError: nesting deeper than the C scanner's recursion limit
        raise RelayMessageError(f"relay message is not JSON: {e}"[:300]) from None
    if not isinstance(body, dict):
        raise RelayMessageError(f"relay message must be a JSON object, got {type(body).__name__}")
    kind = body.pop("type", None)
    cls = _CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RelayMessageError(f"unknown relay message type {kind!r:.80}")
    known = {f.name: f for f in fields(cls)}
    extra = sorted(set(body) - set(known))
    if extra:
        raise RelayMessageError(f"relay {kind} message has unknown fields {extra!r:.200}")
    args: dict[str, Any] = {}
    for name, f in known.items():
        if name not in body:
            if f.default is f.default_factory:  # both MISSING: a required field
                raise RelayMessageError(f"relay {kind} message lacks {name!r}")
            continue
        v = body[name]
        if not _CHECKS[str(f.type)](v):
            raise RelayMessageError(
                f"relay {kind} message: {name!r} must be {f.type}, got {v!r:.80}"
            )
        if str(f.type).startswith("int") and v is not None and not 0 <= v < 1 << 64:
            raise RelayMessageError(f"relay {kind} message: {name!r} must be in [0, 2**64)")
        if str(f.type) == "float" and not _seconds_ok(v):
            raise RelayMessageError(
                f"relay {kind} message: {name!r} must be in (0, {MAX_TIMEOUT_S}], got {v!r}"
            )
        if name in _ID_FIELDS and not all(_is_id(x) for x in ([v] if name == "payload_id" else v)):
            raise RelayMessageError(
                f"relay {kind} message: {name!r} must be {_ID_LEN} lowercase hex digits"
            )
        args[name] = tuple(v) if isinstance(v, list) else v
    return cls(**args)  # type: ignore[no-any-return]
