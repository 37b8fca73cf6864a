"""From a build's delta records to the payload sink: encoder, the one bounded queue, its thread.

`PayloadStream(meta, buckets, sink, depth)` is what a build writes into (a context manager,
one per build, one thread): `add` each `DeltaItem` (packed into bounded buckets and encoded by
`shared_codec.buckets.BucketEncoder`), `finish` once all are added (the last buckets), and
leaving the ``with`` block drains the queue and joins the thread, also when the build failed.
Finished payloads go through `SinkThread`: one daemon thread (``dcr-sink``) handing them, in
order, to `sink` (a callable taking the payload bytes: a transport's ``send``, a list's
``append``).

Guarantees:
1. Back-pressure: the queue holds at most `depth` payloads (at least one); `add` blocks while
   it is full, so construction never runs more than `depth` payloads ahead of the transport.
   It is the only queue between the build and the sink (the encoder itself keeps at most its
   config's ``max_in_flight`` buckets being compressed).
2. The first exception the sink raises is kept: later payloads are dropped (never sent), the
   next `add` raises `OwnerBuildError`, and so does leaving the ``with`` block.
3. The counters (`items`, `entries`, `xor_entries`, `payload_count`, `stored_bytes`) describe
   what was handed on, for the build's report.

Limitations:
1. A sink that blocks forever blocks `add` (once the queue is full) and the exit: the
   transport must bound its own waits.
2. One stream (and one thread) per build; it cannot be reopened.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from types import TracebackType

from shared_codec.buckets import BucketConfig, BucketEncoder
from shared_codec.errors import OwnerBuildError
from shared_codec.format import PayloadMeta
from shared_codec.records import DeltaItem, Kind

Sink = Callable[[bytes], None]


class SinkThread:
    """The bounded queue in front of the sink (the transport), and the thread draining it."""

    def __init__(self, sink: Sink, depth: int) -> None:
        self.q: queue.Queue[bytes | None] = queue.Queue(maxsize=max(1, depth))
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, args=(sink,), daemon=True, name="dcr-sink")
        self.t.start()

    def _run(self, sink: Sink) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is None:
                try:
                    sink(item)
                except BaseException as e:  # surfaced by put() and close()
                    self.error = e

    def put(self, payload: bytes) -> None:
        """Queue `payload` for the sink; blocks while the queue is full."""
        if self.error is not None:
            raise OwnerBuildError(f"DCR sink failed: {self.error}") from self.error
        self.q.put(payload)

    def close(self) -> None:
        """Drain the queue, join the thread; raise `OwnerBuildError` if the sink failed."""
        self.q.put(None)
        self.t.join()
        if self.error is not None:
            raise OwnerBuildError(f"DCR sink failed: {self.error}") from self.error


class PayloadStream:
    """Delta records -> bucketed payloads -> `SinkThread` (module docstring)."""

    def __init__(self, meta: PayloadMeta, buckets: BucketConfig, sink: Sink, depth: int) -> None:
        self.encoder = BucketEncoder(meta, buckets)
        self.writer = SinkThread(sink, depth)
        self.items = 0
        self.entries = 0
        self.xor_entries = 0

    def add(self, item: DeltaItem, *, after: int | None = None) -> None:
        """Encode `item` into the open bucket; hand on every payload that completes. `after`:
        record bytes still to come in this build (the buckets taper; None: unknown)."""
        self.items += 1
        self.entries += item.count
        if item.kind == Kind.XOR:
            self.xor_entries += item.count
        for payload in self.encoder.add(item, after=after):
            self.writer.put(payload)

    def finish(self) -> None:
        """Encode and hand on the last buckets (once, after the last `add`)."""
        for payload in self.encoder.finish():
            self.writer.put(payload)

    @property
    def buffered_bytes(self) -> int:
        """Raw record bytes added so far (emitted buckets and the open one)."""
        return self.encoder.raw_bytes + self.encoder.open_bytes

    @property
    def payload_count(self) -> int:
        return self.encoder.payload_count

    @property
    def stored_bytes(self) -> int:
        return self.encoder.stored_bytes

    def __enter__(self) -> PayloadStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.writer.close()
