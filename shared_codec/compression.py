"""zstd compression of payload bodies, with hard bounds on decompressed size.

Bodies are compressed with zstd level 1 (the paper's setting) as one frame that records its
content size. Decompression first checks the frame's declared content size against the size the
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


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def compress(data: bytes | memoryview) -> bytes:
    """zstd level-1 frame of `data` (thread-safe; the GIL is released while compressing)."""
    return _compressor().compress(data)


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
