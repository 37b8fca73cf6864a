"""Argument validation at DCR's front doors (the ``dcr_*`` RPCs and the native weight-transfer
engine): every bad argument becomes a `ProtocolError` naming it, raised before anything changes.

Values arrive as Python objects (``collective_rpc``) or as JSON / decimal strings (vLLM's HTTP
``/collective_rpc`` and weight-transfer routes), so each parser accepts both spellings.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from shared_codec.errors import ProtocolError

ARG_ERRORS = (ValueError, TypeError, KeyError)


@contextlib.contextmanager
def arguments(method: str) -> Iterator[None]:
    """Argument parsing of one RPC: a bad-argument error (ValueError, TypeError, KeyError)
    becomes `ProtocolError` (the call changed nothing). Only argument parsing runs inside."""
    try:
        yield
    except ARG_ERRORS as e:
        raise ProtocolError(f"{method}: bad arguments: {type(e).__name__}: {e}") from None


def integer(v: Any, what: str) -> int:
    """A non-negative integer: ints, or decimal strings (vLLM's HTTP ``/collective_rpc``)."""
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise TypeError(f"{what} must be an integer, got {type(v).__name__}")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {v!r:.40}") from None
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
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


SPEC_KEYS = {"dir": ("root",), "spool": ("root",), "s3": ("bucket",)}


def store_spec(v: Any) -> dict[str, Any]:
    """A store spec (dict or its JSON text) of a known kind with its required fields."""
    spec = json.loads(v) if isinstance(v, str) else v
    if not isinstance(spec, dict):
        raise TypeError(f"store spec must be a JSON object, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind not in SPEC_KEYS:
        raise ValueError(f"store spec kind must be one of {sorted(SPEC_KEYS)}, got {kind!r}")
    for key in SPEC_KEYS[kind]:
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise KeyError(f"a {kind!r} store spec needs a non-empty string {key!r}")
    return dict(spec)


def apply_opts(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise TypeError(f"apply must be a dict or None, got {type(v).__name__}")
    unknown = set(v) - {"verify"}
    if unknown:
        raise ValueError(f"apply takes only 'verify', got {sorted(unknown)}")
    return {"verify": boolean(v.get("verify", False), "apply.verify")}


def payloads(v: Any) -> list[bytes]:
    if not isinstance(v, list | tuple) or not all(
        isinstance(p, bytes | bytearray | memoryview) for p in v
    ):
        raise TypeError("payloads must be a list of bytes")
    return list(v)


def directory(v: Any, what: str) -> str:
    if not isinstance(v, str) or not os.path.isdir(v):
        raise ValueError(f"{what} must name an existing directory, got {v!r:.200}")
    return v
