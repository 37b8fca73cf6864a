"""Argument validation at DCR's front doors (the ``dcr_*`` RPCs and the native weight-transfer
engine): every bad argument becomes a `ProtocolError` naming it, raised before anything changes.

Values arrive as Python objects (``collective_rpc``) or as JSON / decimal strings (vLLM's HTTP
``/collective_rpc`` and weight-transfer routes), so each parser accepts both spellings. Every
parser's error message starts with the argument's name (``what``); `arguments` prefixes the
RPC's name, so a reply reads ``ProtocolError: dcr_fetch: bad arguments: ValueError: store: ...``.
The contract, per RPC and entry point, is the table in docs/protocol.md ("Errors").
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shared_codec.errors import ProtocolError
from shared_codec.format import MAX_KEY_SIZE
from shared_codec.transport.spec import Role, TransportSpec

ARG_ERRORS = (ValueError, TypeError, KeyError)
#: versions and attempts are unsigned 64-bit fields of the payload header (docs/format.md)
MAX_INTEGER = 2**63 - 1


@contextlib.contextmanager
def arguments(method: str) -> Iterator[None]:
    """Argument parsing of one RPC: a bad-argument error (ValueError, TypeError, KeyError, or a
    `ProtocolError` of a shared parser such as `staging.tensor_specs`) becomes `ProtocolError`
    prefixed with `method` (the call changed nothing). Only argument parsing runs inside."""
    try:
        yield
    except ProtocolError as e:
        raise ProtocolError(f"{method}: bad arguments: {e}") from None
    except ARG_ERRORS as e:
        # str(KeyError) quotes its message; the message itself is what the caller should read
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ProtocolError(f"{method}: bad arguments: {type(e).__name__}: {msg}") from None


def integer(v: Any, what: str) -> int:
    """A non-negative integer below 2**63: ints, or decimal strings (vLLM's HTTP
    ``/collective_rpc``)."""
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise TypeError(f"{what} must be an integer, got {type(v).__name__}")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {v!r:.40}") from None
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    if n > MAX_INTEGER:
        raise ValueError(f"{what} must be < 2**63, got {n}")
    return n


def boolean(v: Any, what: str) -> bool:
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "0", "false", "no", ""):
        return v.strip().lower() in ("1", "true", "yes")
    if isinstance(v, bool | int) and int(v) in (0, 1):
        return bool(v)
    raise ValueError(f"{what} must be a boolean, got {v!r:.40}")


def seconds(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise TypeError(f"{what} must be a number of seconds, got {type(v).__name__}")
    try:
        t = float(v)
    except ValueError:
        raise ValueError(f"{what} must be a number of seconds, got {v!r:.40}") from None
    if not t > 0:  # also NaN
        raise ValueError(f"{what} must be > 0, got {v!r}")
    return t


def json_object(v: Any, what: str) -> Any:
    """`v`, or the value of its JSON text (vLLM's HTTP routes may deliver objects as text)."""
    if not isinstance(v, str):
        return v
    try:
        return json.loads(v)
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def transport_spec(v: Any, what: str = "store", role: Role = Role.SOURCE) -> TransportSpec:
    """A transport spec (a `TransportSpec`, a JSON object or its text) whose kind plays `role`:
    `TransportSpec.parse` (kind, required fields, no unknown key, field types)."""
    return TransportSpec.parse(v, role=role, what=what)


def apply_opts(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise TypeError(f"apply must be a dict or None, got {type(v).__name__}")
    unknown = set(v) - {"verify"}
    if unknown:
        raise ValueError(f"apply takes only 'verify', got {sorted(map(str, unknown))}")
    return {"verify": boolean(v.get("verify", False), "apply.verify")}


def payloads(v: Any) -> list[bytes]:
    """A list of payloads (bytes); the first element that is not bytes is named."""
    if not isinstance(v, list | tuple):
        raise TypeError(f"payloads must be a list of bytes, got {type(v).__name__}")
    for i, p in enumerate(v):
        if not isinstance(p, bytes | bytearray | memoryview):
            raise TypeError(f"payloads[{i}] must be bytes, got {type(p).__name__}")
    return list(v)


_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def name(v: Any, what: str) -> str:
    """A name that may become a path component or a store key (an engine, a session, an
    adapter alias): 1-128 characters of [A-Za-z0-9-_.]."""
    if not isinstance(v, str) or not v or len(v) > 128 or not set(v) <= _NAME_CHARS:
        raise ValueError(f"{what} must be 1-128 characters of [A-Za-z0-9-_.], got {v!r:.60}")
    return v


def directory(v: Any, what: str) -> str:
    if not isinstance(v, str) or not os.path.isdir(v):
        raise ValueError(f"{what} must name an existing directory, got {v!r:.200}")
    return v


def checkpoint(v: Any, what: str) -> str:
    """A canonical checkpoint directory: at least one ``*.safetensors`` file, every file's
    header readable and consistent with its size (safetensors checks the offsets), so that a
    dense load does not stop part-way on a missing or truncated file."""
    from safetensors import safe_open

    path = directory(v, what)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{what}: no *.safetensors files in {path!r:.200}")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                sf.keys()
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ValueError(f"{what}: {f.name} is not a readable safetensors file: {e}") from None
    return path


def payload_key(v: Any, what: str) -> bytes:
    """A payload authentication key as hex text: 1 to `MAX_KEY_SIZE` bytes (a BLAKE2b key)."""
    if not isinstance(v, str):
        raise TypeError(f"{what} must be hex text, got {type(v).__name__}")
    try:
        key = bytes.fromhex(v)
    except ValueError:
        raise ValueError(f"{what} must be hex text, got {v[:8]!r}...") from None
    if not 1 <= len(key) <= MAX_KEY_SIZE:
        raise ValueError(f"{what} must be 1 to {MAX_KEY_SIZE} bytes, got {len(key)}")
    return key
