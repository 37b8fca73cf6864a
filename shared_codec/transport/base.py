"""The transport interfaces: one payload sink for the trainer side, one payload source for the
rollout side, the object store they may run on, and the sealed-set records they exchange.
Implementations: `objects.py` (``dir`` / ``s3``), `relay/` (``relay`` sinks, ``spool``
sources); `spec.py` opens them from a `TransportSpec`.

Who calls what, per attempt (version v, attempt a):

1. Every owner (trainer rank r): ``sink = spec.open_sink(version=v, attempt=a, owner=r)``,
   ``sink.send(payload)`` per payload while building, ``report = sink.finish()`` (every payload
   is durable at the transport's first hop: uploaded, or queued by the relay root).
2. The party that closes the attempt (rank 0 of the owners, after every owner finished):
   ``sink.seal(Seal(base_version=, owners=, payload_ids=))`` - the object-store manifest, or the
   relay tree's manifest, which returns once every node holds every payload (TransportError
   naming the failed nodes otherwise). Or, when the owners failed, the coordinator:
   ``spec.open_sink(version=v, attempt=a).abandon(reason)`` (no owner: it sends nothing), so
   that sources streaming the attempt stop at once.
3. Everyone: ``sink.close()`` (also a context manager).
   Retention (the coordinator, after a commit): ``spec.forget(before_version)`` removes every
   payload of older versions from the transport (object-store objects of every attempt, or
   every relay node's spool files and delivered sets).
4. Every rollout node: ``source = spec.open_source(key=...)``; ``source.fetch(v, a)`` yields
   every payload after the seal (waiting for it); ``source.stream(v, a, cancelled=...)`` yields
   payloads as they arrive, before the seal, and ends at the seal; both raise TransportError
   when the attempt was abandoned, when a payload is missing or not listed by the seal, or at
   their timeout. ``source.sealed(v, a)`` returns what the seal names (`SealedAttempt`: the
   payload ids, and the base version the seal names), waiting for it: receivers apply exactly
   that set (docs/protocol.md, "Exactly once") and refuse a seal on another base version.

Limitations:
1. A relay sink opens its own connection to the root (one per sink); sinks are per attempt.
2. `fetch` of a spool reads the node's local copy: the tree's completion acknowledgement
   (the relay seal) is what says every node has it, and the spool's manifest notice follows it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol


class ObjectStore(Protocol):
    """The narrow interface the object-storage transport needs (`store.py`): ``put`` (whole
    object, overwriting), ``put_if_absent`` (create-only; False when the key exists), ``get``
    (KeyError when absent), ``exists``, ``list`` (keys under a prefix) and ``delete``."""

    def put(self, key: str, data: bytes) -> None: ...
    def put_if_absent(self, key: str, data: bytes) -> bool: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SinkReport:
    """What one owner's sink carried for the attempt (from `PayloadSink.finish`)."""

    payload_ids: tuple[str, ...]
    bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Seal:
    """What closes an attempt: the committed version it is a delta on, every owner, and every
    owner's payload ids (object stores check the owners' lists, relays list the ids)."""

    base_version: int
    owners: tuple[int, ...]
    payload_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SealedAttempt:
    """What a source read from an attempt's seal: every payload id it names, in listing order
    (duplicates kept, so a receiver can compare the count), and the base version (None where
    the seal did not name it: a relay manifest from a sender that does not say)."""

    version: int
    attempt: int
    base_version: int | None
    payload_ids: tuple[str, ...]


class PayloadSink(Protocol):
    """Where one attempt's payloads go (module docstring: call order and callers)."""

    version: int
    attempt: int

    def send(self, payload: bytes) -> None:
        """Hand one payload over (may return before it is durable; bounded in flight)."""
        ...

    def finish(self) -> SinkReport:
        """Wait until every sent payload is durable at the first hop; owners only."""
        ...

    def seal(self, seal: Seal) -> None:
        """Close the attempt: after it, sources' `fetch` returns every listed payload."""
        ...

    def abandon(self, reason: str) -> None:
        """Give the attempt up: sources waiting on it raise TransportError naming `reason`."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> PayloadSink: ...

    def __exit__(self, *exc: object) -> None: ...


class PayloadSource(Protocol):
    """Where a rollout node reads attempts from (module docstring)."""

    def fetch(self, version: int, attempt: int, timeout_s: float = 60.0) -> Iterator[bytes]:
        """Every payload of the sealed attempt (waits for the seal up to `timeout_s`)."""
        ...

    def stream(
        self,
        version: int,
        attempt: int,
        timeout_s: float = 60.0,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[bytes]:
        """Payloads as they arrive, each once, until the seal (checked against what was
        yielded); `cancelled()` true ends it quietly at the next poll."""
        ...

    def sealed(self, version: int, attempt: int, timeout_s: float = 60.0) -> SealedAttempt:
        """What the attempt's seal names (waits for the seal up to `timeout_s`; raises
        TransportError when the attempt was abandoned or at the timeout)."""
        ...
