"""zstd compression of payload bodies, with hard bounds on decompressed size.

Bodies are compressed with zstd level 1 (the paper's setting) as one frame that records its
content size. `compress_parts` ends a zstd block at the boundaries of the body's larger parts
(byte planes of >= `BLOCK_MIN` bytes), so each plane gets its own literal (Huffman) table instead
of one table over a 128 KiB block that mixes near-uniform low planes with mostly-zero high
planes: at a 1% change that mix costs ~11% of the payload (``dcr bench codec``), with fixed
parameters (`PARTS_PARAMS`) instead of level 1's size-dependent choice. Block boundaries and
parameters are the encoder's choice: the frame is an ordinary zstd frame, decoded as before. Decompression first checks the frame's declared content size against the size the
payload header declares and against a global cap, so a crafted payload cannot make a receiver
allocate more than it agreed to (no decompression bombs).
"""

from __future__ import annotations

import threading

import zstandard

LEVEL = 1

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    return c


#: What `compress_parts` uses: zstd level 1's parameters for inputs over 256 KiB (window 2^19,
#: minimum match 7, fast strategy), whatever the body's size, with a hash table of 2^12 entries
#: instead of 2^14. Level 1 picks a minimum match of 6 for bodies under 256 KiB, which finds
#: spurious matches in the near-uniform low planes (larger and slower: +0.6% on a one-item 5%
#: payload), and the smaller table finds fewer of them too (-0.2% at 1-5%, ``dcr bench codec``).
PARTS_PARAMS = dict(
    window_log=19,
    chain_log=13,
    hash_log=12,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstandard.STRATEGY_FAST,
)


def _parts_compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "p", None)
    if c is None:
        params = zstandard.ZstdCompressionParameters(**PARTS_PARAMS, write_content_size=True)
        c = _local.p = zstandard.ZstdCompressor(compression_params=params)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def compress(data: bytes | memoryview) -> bytes:
    """zstd level-1 frame of `data` (thread-safe; the GIL is released while compressing)."""
    return _compressor().compress(data)


#: Parts of at least this many bytes are compressed as zstd blocks of their own.
BLOCK_MIN = 1024


def compress_parts(parts: list[bytes]) -> bytes:
    """One zstd frame of ``b"".join(parts)`` (level 1 with `PARTS_PARAMS`) that ends a block
    before and after every part of at least `BLOCK_MIN` bytes (smaller neighbours share
    blocks). A body without such a part is compressed as `compress` does, byte for byte (small
    payloads, golden files)."""
    if not any(len(p) >= BLOCK_MIN for p in parts):
        return compress(b"".join(parts))
    total = sum(len(p) for p in parts)
    cobj = _parts_compressor().compressobj(size=total)
    out: list[bytes] = []
    pending = 0  # bytes in the open block
    for part in parts:
        big = len(part) >= BLOCK_MIN
        if big and pending:
            out.append(cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
            pending = 0
        out.append(cobj.compress(part))
        pending += len(part)
        if big:
            out.append(cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
            pending = 0
    out.append(cobj.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
    return b"".join(out)


def decompress_exact(frame: bytes | memoryview, expected: int, cap: int) -> bytes:
    """Decompress one frame that must expand to exactly `expected` bytes (<= `cap`).

    The frame's declared content size is checked against `expected` and `cap` before anything
    is allocated, and decompression itself is bounded (``max_output_size``), so the
    output buffer is never larger than `expected`. Raises ValueError (with the reason) for a
    size mismatch, a frame without a content size, a size over the cap, trailing bytes after
    the frame, or corrupt or truncated data.
    """
    if expected > cap:
        raise ValueError(f"declared size {expected} exceeds the cap of {cap} bytes")
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise ValueError(f"not a zstd frame: {e}") from None
    if declared != expected:
        raise ValueError(f"frame declares {declared} bytes, header declares {expected}")
    if expected == 0:
        return _decompress_empty(frame)
    try:
        out = _decompressor().decompress(frame, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ValueError(f"corrupt, truncated or trailing zstd data: {e}") from None
    if len(out) != expected:
        raise ValueError(f"frame expanded to {len(out)} bytes, expected {expected}")
    return out


def _decompress_empty(frame: bytes | memoryview) -> bytes:
    """A frame declaring 0 bytes: zstandard's one-shot call returns b"" without reading such a
    frame, so it is streamed (zstd refuses blocks past the declared size; output is at most one
    block) and must end exactly at the frame's end."""
    dobj = _decompressor().decompressobj()
    try:
        out = dobj.decompress(frame)
    except zstandard.ZstdError as e:
        raise ValueError(f"corrupt zstd frame: {e}") from None
    if not dobj.eof:
        raise ValueError("truncated zstd frame")
    if dobj.unused_data:
        raise ValueError(f"{len(dobj.unused_data)} bytes after the zstd frame")
    if out:
        raise ValueError(f"frame expanded to {len(out)} bytes, expected 0")
    return b""
