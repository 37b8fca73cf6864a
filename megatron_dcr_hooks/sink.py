"""The one bounded queue between delta construction and the payload sink, and its thread.

`SinkThread(sink, depth)` starts one daemon thread (``dcr-sink``) that hands every payload
`put` into the queue to `sink` (a callable taking the payload bytes: a transport's ``send``,
or a list's ``append``), in order. Call order (the build, one thread): any number of `put`,
then `close` exactly once (also when the build failed: it drains and joins the thread).

Guarantees:
1. Back-pressure: `put` blocks while `depth` payloads (at least one) wait, so construction
   never runs more than `depth` payloads ahead of the transport. This is the only queue
   between the hook and its sink (the encoder's threads are bounded by the bucket config).
2. The first exception the sink raises is kept: later payloads are dropped (never sent),
   the next `put` raises `OwnerBuildError`, and `close` raises it after joining the thread.

Limitations:
1. A sink that blocks forever blocks `put` (once the queue is full) and `close`: the
   transport must bound its own waits.
2. One `SinkThread` per build; it cannot be reopened after `close`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from shared_codec.errors import OwnerBuildError

Sink = Callable[[bytes], None]


class SinkThread:
    """Bounded queue between construction and the sink (the transport); module docstring."""

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
