"""Bounded decode (issue 19 item 7): a payload's header bounds everything its decode allocates.

A crafted payload of a few KB that declares a huge body is rejected before decompression, with
a small peak; a payload declaring more entries than its destination tensor holds is rejected
before decompression; malformed inputs and keys (wrong type or length) are a PayloadError, never
a ValueError or TypeError."""

from __future__ import annotations

import hashlib
import struct
import time
import tracemalloc

import numpy as np
import pytest
import zstandard

from shared_codec import compression, locations
from shared_codec import format as fmt
from shared_codec.decode import decode_payload
from shared_codec.errors import PayloadError
from shared_codec.format import PayloadMeta, encode_payload, peek_header
from shared_codec.records import Kind, make_item

META = PayloadMeta(version=2, base_version=1, attempt=0, owner=1, sequence=0)


def craft(entries: list[tuple], body_raw_len: int, stored: bytes, *, zstd: bool = True) -> bytes:
    """A sealed v1 payload with a hand-written item table (valid id and digest).

    Each entry: (name, dtype code, kind, shape, count, loc code, loc_len, val code, val_len).
    """
    table = b""
    for name, dcode, kind, shape, count, lc, ll, vc, vl in entries:
        table += struct.pack("<H", len(name)) + name.encode()
        table += struct.pack("<BBB", dcode, kind, len(shape)) + struct.pack(
            f"<{len(shape)}Q", *shape
        )
        table += struct.pack("<QBQBQ", count, lc, ll, vc, vl)
    head = fmt.HEAD.pack(
        2, 1, 0, b"\0" * 16, 1, 0, b"\0" * 16, body_raw_len, len(stored), len(entries)
    )
    header = head + table
    flags = fmt.FLAG_ZSTD if zstd else 0
    out = bytearray(fmt.PREFIX.pack(fmt.MAGIC, fmt.VERSION, flags, len(header)) + header + stored)
    out[fmt.ID_OFFSET : fmt.ID_OFFSET + fmt.ID_SIZE] = hashlib.blake2b(
        bytes(out), digest_size=fmt.ID_SIZE
    ).digest()
    return bytes(out + fmt._digest(bytes(out), None))


def zeros_frame(n: int) -> bytes:
    """A zstd frame of `n` zero bytes that records its content size, built in 1 MiB chunks."""
    c = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=n)
    chunk = bytes(1 << 20)
    parts = [c.compress(chunk[: min(len(chunk), n - i)]) for i in range(0, n, len(chunk))]
    return b"".join(parts) + c.flush()


def test_small_payload_declaring_a_huge_bitmap_is_rejected_fast_and_small() -> None:
    """Before the bound: one entry of a 2^32-element uint8 tensor, as a bitmap spanning the
    whole tensor, was a ~40 KB payload that decompressed to 512 MiB and unpacked to 4 GiB."""
    span = 1 << 32
    loc_len = 16 + span // 8
    frame = zeros_frame(loc_len + 1)
    data = craft(
        [("w", 17, int(Kind.OVERWRITE), (span,), 1, locations.BITMAP, loc_len, 0, 1)],
        loc_len + 1,
        frame,
    )
    assert len(data) < 64 << 10
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(PayloadError, match=r"items\[0\]\.loc_len"):
            decode_payload(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 1.0
    assert peak < 4 * len(data) + (1 << 20), peak


def test_declared_body_bound_is_the_item_table() -> None:
    """`loc_len <= 18 + 16 * count`: every encoding DCR writes fits, and the raw body is then at
    most the sum of ``18 + (16 + itemsize) * count`` over the items."""
    rng = np.random.default_rng(5)
    for n, numel in ((0, 10), (1, 10), (2, 1 << 40), (5000, 5000), (300, 1 << 20), (7, 7)):
        idx = np.sort(rng.choice(min(numel, 1 << 22), n, replace=False)).astype(np.int64)
        if n and numel > 1 << 22:
            idx[-1] = numel - 1
        for paper in (False, True):
            _, loc = locations.encode_locations(idx, paper=paper)
            assert len(loc) <= fmt.loc_bound(n), (n, numel, paper, len(loc))
    item = make_item(
        "a", "bfloat16", (1000,), 1, Kind.XOR, np.arange(0, 1000, 3), np.ones(334, np.uint16)
    )
    h = peek_header(encode_payload([item], META))
    assert h.body_raw_len <= 18 + (16 + 2) * item.count


def _spy_decompress(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = compression.decompress_exact

    def spy(frame, expected, cap):
        calls.append(expected)
        return real(frame, expected, cap)

    monkeypatch.setattr(compression, "decompress_exact", spy)
    return calls


def test_count_above_the_destination_is_rejected_before_decompression(monkeypatch) -> None:
    calls = _spy_decompress(monkeypatch)
    item = make_item(
        "w", "uint8", (4096,), 1, Kind.OVERWRITE, np.arange(4096), np.ones(4096, np.uint8)
    )
    data = encode_payload([item], META)
    with pytest.raises(PayloadError, match=r"destination of 1024 elements"):
        decode_payload(data, destinations={"w": 1024})
    with pytest.raises(PayloadError, match="no such destination"):
        decode_payload(data, destinations={"v": 4096})
    assert calls == []
    assert decode_payload(data, destinations={"w": 4096}).items[0].count == 4096
    assert calls == [peek_header(data).body_raw_len]


def test_count_above_the_declared_numel_is_rejected_before_decompression(monkeypatch) -> None:
    calls = _spy_decompress(monkeypatch)
    data = craft(
        [("w", 17, int(Kind.OVERWRITE), (8,), 9, locations.GAPS, 9 + 8, 0, 9)],
        26,
        compression.compress(bytes(26)),
    )
    with pytest.raises(PayloadError, match=r"count: 9 > numel 8"):
        decode_payload(data)
    assert calls == []


def test_bitmap_decode_unpacks_only_non_zero_bytes() -> None:
    """A bitmap of a wide span with few set bits decodes without a span-sized transient."""
    span = 1 << 24
    packed = np.zeros(span // 8, dtype=np.uint8)
    packed[[3, 1000, span // 8 - 1]] = [0b101, 0x80, 0x01]
    buf = np.array([100, span], dtype="<u8").tobytes() + packed.tobytes()
    tracemalloc.start()
    try:
        out = locations.decode_locations(locations.BITMAP, buf, 4, 100 + span)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.tolist() == [100 + 24, 100 + 26, 100 + 8007, 100 + span - 8]
    assert peak < span // 8, peak  # far below the 16 MiB an unpackbits of the span takes
    with pytest.raises(ValueError, match="more than 2 bits"):
        locations.decode_locations(locations.BITMAP, buf, 2, 100 + span)
    with pytest.raises(ValueError, match="3 bits set, count is 5"):
        locations.decode_locations(locations.BITMAP, buf[:-1] + b"\0", 5, 100 + span)
    odd = np.array([0, 3], dtype="<u8").tobytes() + bytes([0b1001])
    with pytest.raises(ValueError, match="beyond the span"):
        locations.decode_locations(locations.BITMAP, odd, 2, 10)


@pytest.mark.parametrize("data", ["DCRP", 7, None, [b"DCRP"], np.zeros(80, np.uint16)])
def test_malformed_inputs_are_payload_errors(data: object) -> None:
    with pytest.raises(PayloadError, match="field data"):
        decode_payload(data)  # type: ignore[arg-type]
    with pytest.raises(PayloadError, match="field data"):
        peek_header(data)  # type: ignore[arg-type]


def test_non_byte_views_are_read_as_bytes() -> None:
    good = encode_payload(
        [make_item("w", "uint8", (4,), 1, Kind.OVERWRITE, np.arange(4), np.ones(4, np.uint8))],
        META,
    )
    words = memoryview(good[: len(good) // 4 * 4]).cast("I")
    with pytest.raises(PayloadError, match="field (digest|body_stored_len)"):
        decode_payload(words)  # read as its bytes: a truncated payload, not a TypeError
    assert decode_payload(memoryview(bytearray(good))).items[0].count == 4


@pytest.mark.parametrize(
    "key, why",
    [
        ("secret", "must be bytes"),
        (12345, "must be bytes"),
        (["k"], "must be bytes"),
        (b"k" * 65, "at most 64"),
    ],
)
def test_malformed_keys_are_payload_errors(key: object, why: str) -> None:
    good = encode_payload(
        [make_item("w", "uint8", (4,), 1, Kind.OVERWRITE, np.arange(4), np.ones(4, np.uint8))],
        META,
        key=b"k" * 64,
    )
    with pytest.raises(PayloadError, match=f"field key: .*{why}"):
        decode_payload(good, key=key)  # type: ignore[arg-type]
    assert decode_payload(good, key=bytearray(b"k" * 64)).items


def test_empty_body_frames_are_exact() -> None:
    empty = compression.compress(b"")
    assert compression.decompress_exact(empty, 0, 10) == b""
    for bad, expected in ((empty + b"x", 0), (empty[:-1], 0), (compression.compress(b"ab"), 0)):
        with pytest.raises(ValueError):
            compression.decompress_exact(bad, expected, 10)
    frame = compression.compress(b"abc")
    for bad in (frame + b"x", frame[:-1]):
        with pytest.raises(ValueError):
            compression.decompress_exact(bad, 3, 10)
