"""Receiver observers: an optional object a receiver tells about each fetch and apply as it runs.

The product ships no observer. A caller passes one to `Receiver(observer=...)`, or names a
factory in the receiver's config (``DCR_RECEIVER_OBSERVER=package.module:attr``, config.py),
which `load_observer` imports and calls with no arguments when the receiver is created: that is
how an engine started by a test gets the test-only fault plan (``dcr_tools.faults:FaultPlan``)
without any product module importing it.

Call points (the receiver of each rank calls them on its worker thread, in this order):

1. `ReceiverObserver.begin(rank, call, role)` once per call: at the start of each ``apply``,
   and for a ``fetch`` after its payload source is open (a plain fetch: after the attempt's
   seal was read). `role`: the receiver's model, ``"base"`` or ``"draft"`` (a speculative
   draft's receiver). It returns the call's `CallObserver`, or None to watch nothing more of this call.
2. `CallObserver.before_payload(index, data)` before the receiver stages each fetched payload
   (`index`: the payloads of this call staged before it).
3. `CallObserver.before_item(item)` before the placement plan or the native loader pulls each
   item of an apply (every part of a pipelined fetch included, in order).

Effects: an observer may end the process (a receiver dying), or raise from `before_item` to
fail the apply as a loader failure would: a `RuntimeError` (or a `LoaderConditionError`) is
reported in the ACK as ``"<type name>: <message>"`` and the receiver is then dirty; as it is
raised before the item is pulled, every item pulled before it is complete (no
``partial_item``). Anything else an observer raises propagates out of the call.

Limitations:
1. Observers run inline: a slow observer slows the apply it watches.
2. Not part of the protocol (docs/protocol.md does not mention it); for tests and diagnostics.
"""

from __future__ import annotations

import importlib
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from shared_codec.records import DeltaItem


class Call(StrEnum):
    """The kind of call an observer is told about."""

    FETCH = "fetch"  # a plain fetch: stages the attempt's payloads
    APPLY = "apply"  # applies what is staged
    PIPELINED = "pipelined"  # a fetch that applies payloads as they arrive


class CallObserver(Protocol):
    """Watches one fetch or apply (see the module docstring)."""

    def before_payload(self, index: int, data: bytes) -> None: ...

    def before_item(self, item: DeltaItem) -> None: ...


class ReceiverObserver(Protocol):
    """Watches a receiver: returns a `CallObserver` per call, or None."""

    def begin(self, rank: int, call: Call, role: str = "base") -> CallObserver | None: ...


def load_observer(path: str | None) -> ReceiverObserver | None:
    """The observer the factory at `path` (``package.module:attr``) makes, called with no
    arguments; None for no path. `ValueError` when the path names nothing importable."""
    if path is None:
        return None
    module_name, _, attr = path.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"receiver observer {path!r}: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise ValueError(f"receiver observer {path!r} is not callable (a factory is expected)")
    observer = obj()
    if not callable(getattr(observer, "begin", None)):
        raise ValueError(f"receiver observer {path!r} made {observer!r}, which has no begin()")
    return observer  # type: ignore[no-any-return]
