"""Where a rank's payloads of one attempt come from: an object store or a relay node's spool.

Contract: `payload_source(spec, key=...)` opens the transport's payload source
(`shared_codec.transport.TransportSpec.open_source`: ``dir``, ``s3`` or a relay node's
``spool``);
`attempt_payloads(source, version, attempt, timeout_s, streaming=...)` returns an iterable of
payload bytes for the attempt. Not streaming: every payload of the attempt's seal (manifest, or
the node's manifest notice), waiting up to `timeout_s` for it. Streaming (pipelined fetch):
payloads as their objects or spool files appear, before the seal, read by a background thread
(`prefetched`) so the transport's waits overlap the caller's applies; its `Prefetched.ready` says
whether the next payload has already arrived. `sealed_set(source, ...)`
is the set the seal names, as staging's `SealedSet` (the receiver applies exactly that set).

A spec that `TransportSpec.parse` refuses raises `ProtocolError` (nothing fetched); the RPC boundary
validates specs before that (extension.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from shared_codec.errors import ProtocolError
from vllm_dcr_plugin.staging import SealedSet

if TYPE_CHECKING:
    from shared_codec.transport.base import PayloadSource


def payload_source(spec: Any, *, key: bytes | None) -> PayloadSource:
    """The source `spec` (a `TransportSpec` or its plain form) names; `ProtocolError` for a
    spec it refuses (nothing fetched)."""
    from shared_codec.transport.spec import Role, TransportSpec

    try:
        parsed = TransportSpec.parse(spec, role=Role.SOURCE, what="store")
    except (ValueError, TypeError) as e:  # a bad spec: nothing was fetched
        raise ProtocolError(f"bad store spec: {type(e).__name__}: {e}") from None
    return parsed.open_source(key=key)


def sealed_set(source: PayloadSource, version: int, attempt: int, timeout_s: float) -> SealedSet:
    """What the attempt's seal names (waits for it up to `timeout_s`), as a `SealedSet`."""
    s = source.sealed(version, attempt, timeout_s)
    return SealedSet.of(
        version=s.version,
        attempt=s.attempt,
        base_version=s.base_version,
        payload_ids=s.payload_ids,
    )


def attempt_payloads(
    source: PayloadSource,
    version: int,
    attempt: int,
    timeout_s: float,
    *,
    streaming: bool,
) -> Iterable[bytes]:
    """The payloads of (`version`, `attempt`) from `source` (see the module docstring)."""
    if streaming:  # in a thread: the link's (or the spool's) waits overlap applies
        return prefetched(
            lambda stop: source.stream(version, attempt, timeout_s, cancelled=stop.is_set)
        )
    return source.fetch(version, attempt, timeout_s)


class Prefetched(Iterator[bytes]):
    """The iterator `prefetched` returns: a generator (``next``, ``close``) plus `ready`."""

    def __init__(self, gen: Generator[bytes, None, None], q: queue.Queue[tuple[str, Any]]):
        self._gen, self._q = gen, q

    def __next__(self) -> bytes:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def ready(self) -> bool:
        """True when the next item (or the end, or an error) is already waiting: ``next`` will
        not block. The pipelined fetch stages what has arrived before it applies."""
        return not self._q.empty()


def prefetched(
    make_source: Callable[[threading.Event], Iterable[bytes]], depth: int = 4
) -> Prefetched:
    """Iterate ``make_source(stop)`` in a background thread, at most `depth` items ahead (I/O
    waits of the transport overlap the caller's work); its exception is re-raised in the caller.
    Closing the iterator early (a failed apply) sets `stop`, which the source polls, so the
    thread ends instead of waiting out the attempt."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def run() -> None:
        try:
            for item in make_source(stop):
                while not stop.is_set():
                    try:
                        q.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            if not stop.is_set():  # nobody reads the queue once the consumer has left
                q.put(("end", None))
        except BaseException as e:  # handed to the consumer
            if not stop.is_set():
                q.put(("error", e))

    def drain() -> Generator[bytes, None, None]:
        threading.Thread(target=run, name="dcr-prefetch", daemon=True).start()
        try:
            while True:
                kind, value = q.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            stop.set()

    return Prefetched(drain(), q)
