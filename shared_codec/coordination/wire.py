"""`Message`: the base of every typed control-plane message (protocol.py), and how one is
checked where it arrives.

A message is a frozen, slotted, keyword-only dataclass whose field annotations are its schema.
`Message.parse(raw, what=...)` takes the plain JSON object that crossed a process (or a message
of the class itself, returned as it is) and checks every field against its annotation before
anything reads it; `Message.to_wire()` gives back the plain object. A failure raises
`ProtocolError` naming the message and the field (``"build reply: payloads must be an integer,
got str"``).

Types a field may have: ``bool``, ``int`` (never a bool), ``float`` (an int is accepted),
``str``, ``Any`` (any JSON value), ``X | None``, ``tuple[X, ...]`` (a JSON list), ``dict[str,
X]`` (a JSON object), a `StrEnum` (its value), or another `Message` (a nested object). A field
with a default may be absent; ``None`` is accepted only where the annotation allows it.

Read view: ``msg["field"]``, ``msg.get("field")``, ``"field" in msg`` read the wire value (not a
full mapping: a message may have a field named ``items``), for
code that treats results as the JSON it reports (benchmarks, reports); code of the protocol
itself reads the attributes.

Limitations:
1. Unknown keys are refused, except in a class with ``EXTRA = True``, which keeps them in its
   ``extra`` field (rank replies carry the receiver's free-form reports). Fields named in
   ``OMIT_NONE`` are left off the wire while None.
2. Unions other than ``X | None`` are not supported.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, ClassVar, Self

from shared_codec.errors import ProtocolError

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    got = _HINTS.get(cls)
    if got is None:
        got = _HINTS[cls] = typing.get_type_hints(cls)
    return got


class Message:
    """Base of the typed messages (module docstring). Subclasses are frozen, slotted,
    keyword-only dataclasses; `NAME` says what the message is in errors."""

    __slots__ = ()
    NAME: ClassVar[str] = "message"
    EXTRA: ClassVar[bool] = False  # keep unknown keys in ``extra`` instead of refusing them
    OMIT_NONE: ClassVar[tuple[str, ...]] = ()  # fields left off the wire while None

    @classmethod
    def parse(cls, raw: Any, *, what: str | None = None) -> Self:
        """`raw` checked against this message's fields (module docstring); a message of this
        class is returned as it is. `ProtocolError` naming `what` (default `NAME`) and the
        field otherwise."""
        if isinstance(raw, cls):
            return raw
        name = what or cls.NAME
        if not isinstance(raw, Mapping):
            raise ProtocolError(f"{name}: expected a JSON object, got {type(raw).__name__}")
        hints = _hints(cls)
        values: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in raw.items():
            if not isinstance(key, str):
                raise ProtocolError(f"{name}: a key is not a string: {key!r:.40}")
            if key == "extra" or key not in hints:
                if not cls.EXTRA:
                    known = sorted(k for k in hints if k != "extra")
                    raise ProtocolError(f"{name}: unknown field {key!r} (fields: {known})")
                extra[key] = value
                continue
            values[key] = _check(value, hints[key], f"{name}: {key}")
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in values or f.name == "extra":
                continue
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{name}: missing field {f.name!r}")
        if cls.EXTRA:
            values["extra"] = extra
        return cls(**values)

    def to_wire(self) -> dict[str, Any]:
        """The plain JSON object of this message (``extra`` merged in at the top level)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "extra":
                out.update(value)
            elif value is None and f.name in self.OMIT_NONE:
                continue
            else:
                out[f.name] = _plain(value)
        return out

    # -- read view ----------------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self.to_wire()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_wire().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.to_wire()


def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        return value.to_wire()
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check(value: Any, tp: Any, what: str) -> Any:
    """`value` as annotation `tp` allows it, or `ProtocolError` naming `what`."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if len(args) == len(typing.get_args(tp)):
                raise ProtocolError(f"{what} must not be null")
            return None
        if len(args) != 1:
            raise TypeError(f"{what}: unsupported annotation {tp}")
        return _check(value, args[0], what)
    if origin is tuple:
        item = typing.get_args(tp)[0]
        if not isinstance(value, list | tuple):
            raise ProtocolError(f"{what} must be a list, got {type(value).__name__}")
        return tuple(_check(v, item, f"{what}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _, vt = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise ProtocolError(f"{what} must be an object, got {type(value).__name__}")
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(f"{what} has a key that is not a string: {k!r:.40}")
            out[k] = _check(v, vt, f"{what}.{k}")
        return out
    if isinstance(tp, type) and issubclass(tp, Message):
        return tp.parse(value, what=what)
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        try:
            return tp(value)
        except ValueError:
            allowed = [m.value for m in tp]
            raise ProtocolError(f"{what} must be one of {allowed}, got {value!r:.40}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{what} must be a boolean, got {type(value).__name__}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{what} must be an integer, got {type(value).__name__}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{what} must be a number, got {type(value).__name__}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{what} must be a string, got {type(value).__name__}")
        return value
    raise TypeError(f"{what}: unsupported annotation {tp}")
