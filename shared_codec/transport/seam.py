"""The transport seam: one payload sink interface for the trainer side, one payload source
interface for the rollout side, each opened from one spec dict whatever the transport.

Who calls what, per attempt (version v, attempt a):

1. Every owner (trainer rank r): ``sink = open_sink(spec, version=v, attempt=a, owner=r)``,
   ``sink.send(payload)`` per payload while building, ``report = sink.finish()`` (every payload
   is durable at the transport's first hop: uploaded, or queued by the relay root).
2. The party that closes the attempt (rank 0 of the owners, after every owner finished):
   ``sink.seal(Seal(base_version=, owners=, payload_ids=))`` - the object-store manifest, or the
   relay tree's manifest, which returns once every node holds every payload (TransportError
   naming the failed nodes otherwise). Or, when the owners failed, the coordinator:
   ``open_sink(spec, version=v, attempt=a).abandon(reason)`` (no owner: it sends nothing), so
   that sources streaming the attempt stop at once.
3. Everyone: ``sink.close()`` (also a context manager).
   Retention (the coordinator, after a commit): ``forget(spec, before_version)`` removes every
   payload of older versions from the transport (object-store objects of every attempt, or
   every relay node's spool files and delivered sets).
4. Every rollout node: ``source = open_source(spec, key=...)``; ``source.fetch(v, a)`` yields
   every payload after the seal (waiting for it); ``source.stream(v, a, cancelled=...)`` yields
   payloads as they arrive, before the seal, and ends at the seal; both raise TransportError
   when the attempt was abandoned, when a payload is missing or not listed by the seal, or at
   their timeout. ``source.sealed(v, a)`` returns what the seal names (`SealedAttempt`: the
   payload ids, and the base version the seal names), waiting for it: receivers apply exactly
   that set (docs/protocol.md, "Exactly once") and refuse a seal on another base version.

Spec (a dict, or its JSON text), by ``"kind"``:

- ``{"kind": "dir", "root": PATH}``: a local or shared directory (sink and source).
- ``{"kind": "s3", "bucket": B, "endpoint_url": URL, "prefix": P, "region": R}``: any
  S3-compatible store (sink and source); either may add ``"bandwidth_bytes_per_s"``
  (`store.open_store`).
- ``{"kind": "relay", "root": ADDRESS, "timeout_s": 60, "window": 16}`` plus, for CURVE,
  ``"public"``, ``"secret"`` (this sender's key pair) and ``"root_public"`` (Z85 strings):
  owners and the coordinator send to a relay tree's root (sink only).
- ``{"kind": "spool", "root": DIR}``: a relay node's spool on the rollout node (source only).

Limitations:
1. A relay sink opens its own connection to the root (one per sink); sinks are per attempt.
2. `fetch` of a spool reads the node's local copy: the tree's completion acknowledgement
   (the relay seal) is what says every node has it, and the spool's manifest notice follows it.
3. A relay manifest from a sender that does not name the base version (``Manifest.base_version``
   None) gives ``base_version=None`` in `sealed` of a spool (receivers still check every
   payload's base version when staging).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

SINK_KINDS = ("dir", "s3", "relay")
SOURCE_KINDS = ("dir", "s3", "spool")


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


def parse_spec(spec: str | Mapping[str, Any], kinds: tuple[str, ...]) -> dict[str, Any]:
    """`spec` as a dict whose ``"kind"`` is one of `kinds`; ValueError otherwise."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"transport spec is not JSON: {e}") from None
    if not isinstance(spec, Mapping):
        raise ValueError(f"transport spec must be a JSON object, got {type(spec).__name__}")
    if spec.get("kind") not in kinds:
        raise ValueError(f"transport spec kind must be one of {kinds}, got {spec.get('kind')!r}")
    if not spec.get("root") and spec["kind"] != "s3":
        raise ValueError(f"transport spec of kind {spec['kind']!r} needs 'root'")
    return dict(spec)


def open_sink(
    spec: str | Mapping[str, Any], *, version: int, attempt: int, owner: int | None = None
) -> PayloadSink:
    """The sink of (`version`, `attempt`) for `owner` (None: the coordinator, which only
    seals or abandons) on the transport `spec` names (kinds: dir, s3, relay)."""
    s = parse_spec(spec, SINK_KINDS)
    if s["kind"] == "relay":
        from shared_codec.transport.relay.sender import RelaySink

        return RelaySink(s, version=version, attempt=attempt, owner=owner)
    from shared_codec.transport.objects import ObjectSink
    from shared_codec.transport.store import open_store

    return ObjectSink(open_store(s), version=version, attempt=attempt, owner=owner)


def forget(spec: str | Mapping[str, Any], before_version: int, timeout_s: float = 10.0) -> int:
    """Retention on the transport `spec` names (sink kinds): remove every payload, manifest and
    abandon notice of versions below `before_version`. Returns the number removed (object
    store: objects; relay tree: the root's spool files - the root forwards the message to
    every node, best effort, and a node that missed one catches up with the next)."""
    s = parse_spec(spec, SINK_KINDS)
    if s["kind"] == "relay":
        from shared_codec.transport.relay.sender import sender_for

        sender = sender_for(s, timeout_s)
        try:
            return sender.forget(int(before_version), timeout_s).removed
        finally:
            sender.close()
    from shared_codec.transport.objects import forget as forget_objects
    from shared_codec.transport.store import open_store

    return forget_objects(open_store(s), int(before_version))


def open_source(spec: str | Mapping[str, Any], *, key: bytes | None = None) -> PayloadSource:
    """A rollout node's source on the transport `spec` names (kinds: dir, s3, spool). `key`:
    the payload authentication key, when configured (object stores verify digests on fetch;
    spooled payloads are verified when staged)."""
    s = parse_spec(spec, SOURCE_KINDS)
    if s["kind"] == "spool":
        from shared_codec.transport.relay.spool import SpoolSource

        return SpoolSource(str(s["root"]))
    from shared_codec.transport.objects import ObjectFetcher
    from shared_codec.transport.store import open_store

    return ObjectFetcher(open_store(s), key=key)
