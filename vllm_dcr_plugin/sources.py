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

`fetch_attempt` is the receiver's fetch loop over one attempt's payloads (the receiver's side
of each step is a `FetchSteps`): every payload is staged (a rejected one fails the fetch,
nothing of it applied); not streaming, the seal is read first and the staged set must be
exactly the sealed one; streaming (pipelined), what has arrived is applied whenever no further
payload is already waiting (so payload l is applied while l + 1 is still built or in flight),
and the closing part is applied once the stream ended at the seal.
The receiver's optional observer (observer.py) is told about the call and each payload.

A spec that `TransportSpec.parse` refuses raises `ProtocolError` (nothing fetched); the RPC
boundary validates specs before that (extension.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared_codec.errors import PayloadError, ProtocolError
from vllm_dcr_plugin.observer import Call, CallObserver, ReceiverObserver
from vllm_dcr_plugin.staging import SealedSet

if TYPE_CHECKING:
    from shared_codec.coordination.protocol import RankAck
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


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchSteps:
    """The receiver's side of `fetch_attempt`. `stage(payload)`: stage one payload, returning
    the staging result (``staged`` / ``duplicates`` / ``rejected`` lists); `seal(sealed)`:
    record the attempt's seal; `check_sealed()`: the attempt holds exactly its sealed set
    (`ProtocolError` otherwise, nothing applied); `apply(final, observer)`: pipelined only (None:
    a plain fetch), apply what is staged so far (``final``: the closing part) and return the
    part's ACK, telling `observer` about each item."""

    stage: Callable[[bytes], dict[str, Any]]
    seal: Callable[[SealedSet], None]
    check_sealed: Callable[[], object]
    apply: Callable[[bool, CallObserver | None], RankAck] | None = None


def fetch_attempt(
    source: PayloadSource,
    version: int,
    attempt: int,
    timeout_s: float,
    steps: FetchSteps,
    *,
    rank: int,
    observer: ReceiverObserver | None = None,
    role: str = "base",
) -> tuple[dict[str, Any], list[RankAck]]:
    """Fetch and stage every payload of (`version`, `attempt`) from `source` (see the module
    docstring); returns the counts (``payloads``, ``bytes``, ``staged``, ``duplicates``,
    ``fetch_seconds``) and the ACKs of the parts applied (pipelined; empty otherwise). A failed
    part ends the fetch: its ACK is the last one and nothing more is applied."""
    t0 = time.perf_counter()
    pipelined = steps.apply is not None
    # not pipelined: the seal first, so the set to apply is known before anything is staged
    sealed = None if pipelined else sealed_set(source, version, attempt, timeout_s)
    payloads = attempt_payloads(source, version, attempt, timeout_s, streaming=pipelined)
    call = Call.PIPELINED if pipelined else Call.FETCH
    watch = observer.begin(rank, call, role) if observer is not None else None
    out: dict[str, Any] = {"payloads": 0, "bytes": 0, "staged": 0, "duplicates": 0}
    acks: list[RankAck] = []
    arrived: Callable[[], bool] = getattr(payloads, "ready", lambda: False)

    def part(final: bool) -> bool:
        assert steps.apply is not None
        acks.append(steps.apply(final, watch))
        return acks[-1].ok

    for payload in payloads:
        if watch is not None:
            watch.before_payload(out["payloads"], payload)
        res = steps.stage(payload)
        if res["rejected"]:
            raise PayloadError(f"fetched payload rejected: {res['rejected'][0]['reason']}")
        out["payloads"] += 1
        out["bytes"] += len(payload)
        out["staged"] += len(res["staged"])
        out["duplicates"] += len(res["duplicates"])
        # batch what has arrived: apply once nothing more is waiting
        if pipelined and res["staged"] and not arrived() and not part(final=False):
            break
    out["fetch_seconds"] = time.perf_counter() - t0
    if sealed is None and (not acks or acks[-1].ok):  # the stream ended at the seal
        sealed = sealed_set(source, version, attempt, timeout_s)
    if sealed is not None:
        steps.seal(sealed)
        if not pipelined:
            steps.check_sealed()  # exactly the sealed set, or ProtocolError
    if pipelined and (not acks or acks[-1].ok):
        part(final=True)
    return out, acks


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
