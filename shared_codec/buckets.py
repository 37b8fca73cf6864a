"""Buckets: pack delta items into payloads of bounded raw size, compressed in a thread pool.

Raw size is counted in raw record bytes (an int64 index plus the stored value per entry, see
`DeltaItem.raw_bytes`). An item larger than the space left in a bucket is split by index range,
so no payload exceeds the bound by more than one entry's record. Each full bucket is encoded and
zstd-compressed as one payload; buckets of at least `parallel_min_bytes` are encoded in a thread
pool (numpy and zstandard release the GIL) while the caller keeps adding items, and payloads are
returned strictly in sequence order.

Taper: a caller that knows roughly how many record bytes are still to come (`add(item,
after=...)`) gets buckets that shrink towards the end: a bucket is closed once it holds half of
itself plus everything still to come, never below `min_bucket_bytes`. The buckets halve down to
that floor, so the last payload of a build is small: what a pipelined receiver still has to move
and apply after the build ends is one small bucket, not a full one (about log2(bucket_bytes /
min_bucket_bytes) more payloads per build).

Call order (one owner, one attempt): ``enc = BucketEncoder(meta, config)``, then ``enc.add(item)``
for each item (returns the payloads completed so far), then ``enc.finish()`` (returns the rest).
Sequence numbers start at ``meta.sequence`` and increase by one per payload.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from shared_codec.format import PayloadMeta, encode_payload
from shared_codec.records import DeltaItem

#: Default bucket bound: 32 MiB of raw records (~3.3M bf16 entries) per payload.
DEFAULT_BUCKET_BYTES = 32 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketConfig:
    """How items become payloads.

    `bucket_bytes`: raw record bytes per payload (default 32 MiB). `paper`: use the paper's plain
    streams (XOR words + plain u32 gaps) instead of byte planes. `key`: shared secret for keyed
    digests. `threads`: thread-pool size for encoding large buckets (0 = inline).
    `parallel_min_bytes`: buckets smaller than this are encoded inline. `max_in_flight`: bound on
    buckets queued in the pool (back-pressure on `add`). `min_bucket_bytes`: the smallest bucket
    the taper closes (module docstring; at most `bucket_bytes`).
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    paper: bool = False
    key: bytes | None = None
    threads: int = 2
    parallel_min_bytes: int = 4 << 20
    max_in_flight: int = 4
    min_bucket_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        if self.bucket_bytes < 64:
            raise ValueError("bucket_bytes must be at least 64")
        if self.min_bucket_bytes < 64:
            raise ValueError("min_bucket_bytes must be at least 64")


class BucketEncoder:
    """Incremental bucket packer and encoder for one (attempt, owner); see the module docstring."""

    def __init__(self, meta: PayloadMeta, config: BucketConfig | None = None) -> None:
        self.meta = meta
        self.config = config or BucketConfig()
        self._seq = meta.sequence
        self._items: list[DeltaItem] = []
        self._bytes = 0
        self._pending: deque[Future[bytes] | bytes] = deque()
        self._pool = (
            ThreadPoolExecutor(max_workers=self.config.threads, thread_name_prefix="dcr-encode")
            if self.config.threads > 0
            else None
        )
        self.payload_count = 0
        self.raw_bytes = 0
        self.stored_bytes = 0

    def _emit_bucket(self) -> None:
        if not self._items:
            return
        items, size = self._items, self._bytes
        self._items, self._bytes = [], 0
        meta = replace(self.meta, sequence=self._seq)
        self._seq += 1
        self.raw_bytes += size
        key, paper = self.config.key, self.config.paper
        if self._pool is not None and size >= self.config.parallel_min_bytes:
            self._pending.append(
                self._pool.submit(encode_payload, items, meta, key=key, paper=paper)
            )
        else:
            self._pending.append(encode_payload(items, meta, key=key, paper=paper))

    def _collect(self, wait: bool) -> list[bytes]:
        out: list[bytes] = []
        while self._pending:
            head = self._pending[0]
            if isinstance(head, Future):
                must_wait = wait or len(self._pending) > self.config.max_in_flight
                if not head.done() and not must_wait:
                    break
                data = head.result()
            else:
                data = head
            self._pending.popleft()
            self.payload_count += 1
            self.stored_bytes += len(data)
            out.append(data)
        return out

    @property
    def open_bytes(self) -> int:
        """Raw record bytes added but not yet in an emitted bucket."""
        return self._bytes

    def _bound(self, rest: int | None) -> int:
        """The size at which the current bucket closes; `rest`: record bytes still to come
        after it (None: unknown, no taper)."""
        full = self.config.bucket_bytes
        if rest is None:
            return full
        floor = min(self.config.min_bucket_bytes, full)
        return min(full, max(floor, (self._bytes + rest) // 2))

    def add(self, item: DeltaItem, *, after: int | None = None) -> list[bytes]:
        """Add one item (split across buckets as needed); return payloads completed so far.

        `after`: about how many raw record bytes the caller will add after this item (an
        estimate is enough; None: unknown). With it the buckets taper (module docstring).
        """
        if item.owner != self.meta.owner:
            raise ValueError(
                f"item {item.name}: owner {item.owner} != encoder owner {self.meta.owner}"
            )
        if after is not None and after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        per_entry = 8 + item.dtype_info.itemsize
        start = 0
        while start < item.count or (item.count == 0 and start == 0):
            rest = None if after is None else (item.count - start) * per_entry + after
            bound = self._bound(rest)
            room = max((bound - self._bytes) // per_entry, 0)
            if room == 0 and self._items:
                self._emit_bucket()
                continue
            take = max(room, 1) if item.count else 0
            stop = min(item.count, start + take)
            part = (
                item
                if (start == 0 and stop == item.count)
                else replace(item, indices=item.indices[start:stop], values=item.values[start:stop])
            )
            self._items.append(part)
            self._bytes += part.raw_bytes
            start = stop if item.count else 1
            if self._bytes >= bound:
                self._emit_bucket()
        return self._collect(wait=False)

    def finish(self) -> list[bytes]:
        """Emit the last partial bucket and wait for all payloads (in sequence order)."""
        self._emit_bucket()
        out = self._collect(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        return out


def encode_items(
    items: Iterable[DeltaItem], meta: PayloadMeta, config: BucketConfig | None = None
) -> list[bytes]:
    """Encode all `items` of one owner into payloads (convenience over BucketEncoder)."""
    enc = BucketEncoder(meta, config)
    out: list[bytes] = []
    for item in items:
        out += enc.add(item)
    return out + enc.finish()
