"""Location and value sections: exact bytes of the split-gaps coding (location code 5) and of
sparse byte planes (format v2: location code 6, value code 2), round trips of every location
coding, their rejections, and the block-per-plane zstd body."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from shared_codec import compression, locations, planes, values
from shared_codec.decode import decode_payload
from shared_codec.format import PayloadMeta, encode_payload, peek_header
from shared_codec.records import Kind, make_item

META = PayloadMeta(version=2, base_version=1, attempt=0, owner=0, sequence=0)


def test_split_gaps_exact_bytes() -> None:
    """gaps - 1 = 99, 194, 699 (mean 331: split at 5 bits): low 3, 2, 27; high 3, 6, 21."""
    idx = np.array([5, 105, 300, 1000], dtype=np.int64)
    assert locations.split_bits(331.0) == 5
    code, section = locations.encode_locations(idx)
    assert code == locations.SPLIT_GAPS
    want = bytes([5, 1]) + (5).to_bytes(8, "little") + bytes([3, 2, 27]) + bytes([3, 6, 21])
    assert section == want
    assert locations.decode_locations(code, want, 4, 1001).tolist() == idx.tolist()


def test_planes_exact_bytes() -> None:
    """Byte planes, most significant first (the shift-based coder writes what the spec says)."""
    words = np.array([0x0102, 0x0304, 0xA0B0], dtype=np.uint16)
    assert locations.to_planes(words, 2) == bytes([0x01, 0x03, 0xA0, 0x02, 0x04, 0xB0])
    w32 = np.array([0x01020304], dtype=np.uint32)
    assert locations.to_planes(w32, 4) == bytes([1, 2, 3, 4])
    for w, dt in ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64)):
        x = np.random.default_rng(w).integers(0, np.iinfo(dt).max, 1000, dtype=dt)
        assert np.array_equal(locations.from_planes(locations.to_planes(x, w), 1000, w), x)
        assert values.encode_values(x, w)[1] == locations.to_planes(x, w)


@pytest.mark.parametrize("rate", [0.0005, 0.002, 0.01, 0.015, 0.03, 0.3, 0.9])
@pytest.mark.parametrize("numel", [200_000, 1 << 40])
def test_location_codings_round_trip(rate: float, numel: int) -> None:
    rng = np.random.default_rng(int(rate * 1e4))
    span = 200_000
    idx = np.flatnonzero(rng.random(span) < rate).astype(np.int64)
    if numel > span:  # gaps past 2^32: wide planes
        idx[len(idx) // 2 :] += numel - span
    code, section = locations.encode_locations(idx)
    assert len(section) <= 18 + 16 * len(idx)
    assert np.array_equal(locations.decode_locations(code, section, len(idx), numel), idx)


def test_split_gaps_is_chosen_for_sparse_changes_only() -> None:
    assert [locations.split_bits(m) for m in (10, 59, 60, 130, 330, 1000, 1500, 10**6)] == [
        0,
        0,
        4,
        4,
        5,
        7,
        0,
        0,
    ]
    rng = np.random.default_rng(0)
    sparse = np.flatnonzero(rng.random(100_000) < 0.01).astype(np.int64)
    dense = np.flatnonzero(rng.random(100_000) < 0.05).astype(np.int64)
    assert locations.encode_locations(sparse)[0] == locations.SPLIT_GAPS
    assert locations.encode_locations(dense)[0] == locations.GAPS


def _split_section(bits: int, width: int, first: int, low: list[int], high: list[int]) -> bytes:
    hi = locations.to_planes(np.array(high, dtype=np.uint64), width) if width != 3 else b"\0"
    return bytes([bits, width]) + first.to_bytes(8, "little") + bytes(low) + hi


@pytest.mark.parametrize(
    ("section", "count", "numel", "field"),
    [
        (_split_section(0, 1, 0, [1], [1]), 2, 100, "split_gaps.bits"),
        (_split_section(8, 1, 0, [1], [1]), 2, 100, "split_gaps.bits"),
        (_split_section(4, 3, 0, [1], [1]), 2, 100, "width"),
        (_split_section(4, 1, 0, [1], [1])[:-1], 2, 100, "split_gaps: section"),
        (_split_section(4, 1, 100, [1], [1]), 2, 100, "split_gaps.first"),
        (_split_section(4, 1, 0, [16], [1]), 2, 100, "split_gaps.low"),
        (_split_section(7, 8, 0, [1], [2**63]), 2, 1 << 40, "split_gaps.high"),
        (_split_section(4, 1, 0, [15, 15], [5, 5]), 3, 100, "split_gaps: values exceed"),
        (_split_section(4, 1, 50, [0], [4]), 2, 100, "out of range"),
        (bytes([4, 1]) + bytes(8), 0, 100, "split_gaps: empty"),
        (bytes([4, 1]) + bytes(7), 1, 100, "shorter than"),
    ],
)
def test_split_gaps_rejections(section: bytes, count: int, numel: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        locations.decode_locations(locations.SPLIT_GAPS, section, count, numel)


def _blocks(frame: bytes) -> int:
    """Number of blocks in a single zstd frame (walks the block headers)."""
    params = zstandard.get_frame_parameters(frame)
    pos = 4 + 1  # magic, frame header descriptor
    fhd = frame[4]
    single = (fhd >> 5) & 1
    pos += (0 if single else 1) + [0, 1, 2, 4][fhd & 3]
    pos += [1 if single else 0, 2, 4, 8][fhd >> 6]
    assert params.content_size > 0
    n = 0
    while True:
        head = int.from_bytes(frame[pos : pos + 3], "little")
        last, kind, size = head & 1, (head >> 1) & 3, head >> 3
        pos += 3 + (1 if kind == 1 else size)
        n += 1
        if last:
            return n


def test_compress_parts_ends_a_block_per_plane() -> None:
    rng = np.random.default_rng(1)
    small = [b"head", bytes(10)]
    assert compression.compress_parts(small) == compression.compress(b"".join(small))
    parts = [
        b"\x05\x01" + bytes(8),
        bytes(rng.integers(0, 3, 5000, dtype=np.uint8)),
        bytes(rng.integers(0, 256, 5000, dtype=np.uint8)),
        b"tail",
    ]
    frame = compression.compress_parts(parts)
    raw = b"".join(parts)
    assert compression.decompress_exact(frame, len(raw), 1 << 20) == raw
    assert _blocks(frame) == 4  # head | plane | plane | tail + end of frame
    assert _blocks(compression.compress(raw)) == 1


def test_payload_with_split_gaps_and_plane_blocks_round_trips() -> None:
    rng = np.random.default_rng(2)
    idx = np.flatnonzero(rng.random(500_000) < 0.01).astype(np.int64)
    vals = rng.integers(0, 1 << 16, idx.size).astype(np.uint16)
    item = make_item("w", "bfloat16", (500, 1000), 0, Kind.XOR, idx, vals)
    data = encode_payload([item], META)
    assert peek_header(data).items[0].loc_encoding == locations.SPLIT_GAPS
    assert decode_payload(data).items[0].same_as(item)
    assert encode_payload([item], META) == data  # deterministic: same content, same id


def test_encoder_rejects_unordered_indices() -> None:
    """The encoder checks the order on the differences it codes (DeltaItem.validate(order=False))."""
    from dataclasses import replace

    item = make_item("w", "bfloat16", (10,), 0, Kind.XOR, np.array([1, 4]), np.ones(2, np.uint16))
    for bad in ([4, 1], [3, 3]):
        unordered = replace(item, indices=np.array(bad, dtype=np.int64))
        with pytest.raises(ValueError, match="item w: indices not strictly increasing"):
            encode_payload([unordered], META)


def test_sparse_planes_exact_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """splanes (format v2): the mask, then the sparse high plane as nnz, position width,
    position gaps (from -1, minus one) and its nonzero bytes, then the dense low plane."""
    monkeypatch.setattr(planes, "SPARSE_MIN_BYTES", 1)
    monkeypatch.setattr(planes, "SPARSE_MAX_SHARE", 0.5)
    words = np.array([0x0011, 0x0022, 0x0133, 0x0044, 0x0055, 0x0366], dtype=np.uint16)
    mask, parts = planes.splane_parts(words, 2)
    assert mask == 0b01
    # high plane 00 00 01 00 00 03: nonzero at 2 and 5 -> differences minus one 2, 2
    want = bytes([0b01]) + (2).to_bytes(8, "little") + bytes([1, 2, 2, 1, 3])
    want += bytes([0x11, 0x22, 0x33, 0x44, 0x55, 0x66])
    assert b"".join(parts) == want
    got = planes.decode_splanes(memoryview(want), 6, 2, "values.sparse_planes")
    assert got.tolist() == words.tolist()
    # longer than `planes` (20 > 12 bytes): the value coder falls back to plain planes
    assert values.encode_values(words, 2) == (values.PLANES, planes.to_planes(words, 2))


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("share", [0.0, 0.001, 0.02, 0.2])
def test_sparse_planes_round_trip(width: int, share: float) -> None:
    """Mostly-zero high planes (XOR masks of small updates) are written sparse, others dense;
    every combination decodes to the words, and the section is never longer than `planes`."""
    rng = np.random.default_rng(int(share * 1e4) + width)
    n = 20_000
    words = rng.integers(0, 256, n, dtype=np.uint64)  # low byte dense
    hot = rng.random(n) < share
    words[hot] |= rng.integers(1, 1 << (8 * width - 8), int(hot.sum()), dtype=np.uint64) << 8
    words = words.astype(planes._U[width])
    code, section = values.encode_values(words, width)
    assert len(section) <= n * width
    assert code == (values.SPARSE_PLANES if share <= planes.SPARSE_MAX_SHARE else values.PLANES)
    assert np.array_equal(values.decode_values(code, section, n, width, planes._U[width]), words)


def test_sparse_gaps_for_a_sparse_high_gap_plane() -> None:
    """A 3% change: gaps below 256 but for a few; their high plane is written sparse."""
    rng = np.random.default_rng(3)
    idx = np.flatnonzero(rng.random(2_000_000) < 0.024).astype(np.int64)
    code, section = locations.encode_locations(idx)
    assert code == locations.SPARSE_GAPS and section[0] == 2 and section[9] == 0b01
    assert len(section) < 9 + 2 * (len(idx) - 1)
    assert np.array_equal(locations.decode_locations(code, section, len(idx), 2_000_000), idx)
    code, section = locations.encode_locations(idx, paper=True)
    assert code == locations.PLAIN_GAPS  # the paper's streams stay as they are


def _sparse(n_planes_mask: int, planes_bytes: bytes) -> bytes:
    return bytes([n_planes_mask]) + planes_bytes


def _sp(nnz: int, pw: int, gaps: bytes, nz: bytes) -> bytes:
    return nnz.to_bytes(8, "little") + bytes([pw]) + gaps + nz


@pytest.mark.parametrize(
    ("section", "count", "field"),
    [
        (b"", 4, "shorter than its mask"),
        (_sparse(0b100, bytes(8)), 4, "sparse_mask"),
        (_sparse(0b01, _sp(5, 1, bytes(5), b"\1" * 5) + bytes(4)), 4, "nnz"),
        (_sparse(0b01, _sp(1, 3, b"\0", b"\1") + bytes(4)), 4, "width"),
        (_sparse(0b01, _sp(1, 1, b"", b"")), 4, "truncated positions"),
        (_sparse(0b01, _sp(1, 1, b"\4", b"\1") + bytes(4)), 4, "past the plane"),
        (_sparse(0b01, _sp(2, 1, b"\2\1", b"\1\1") + bytes(4)), 4, "past the plane"),
        (_sparse(0b01, _sp(1, 8, (2**64 - 1).to_bytes(8, "little"), b"\1") + bytes(4)), 4, "past"),
        (_sparse(0b01, _sp(0, 1, b"", b"") + bytes(3)), 4, "planes\\[1\\]: truncated"),
        (_sparse(0b00, bytes(9)), 4, "planes end at"),
        (_sparse(0b10, bytes(4) + _sp(0, 1, b"", b"")[:5]), 4, "truncated sparse head"),
    ],
)
def test_sparse_planes_rejections(section: bytes, count: int, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        planes.decode_splanes(memoryview(section), count, 2, "values.sparse_planes")


def test_sparse_planes_longer_than_planes_rejected() -> None:
    with pytest.raises(ValueError, match="at most 8"):
        values.decode_values(values.SPARSE_PLANES, bytes(9), 4, 2, np.uint16)


def test_sparse_gaps_rejections() -> None:
    ok = bytes([2]) + (0).to_bytes(8, "little") + _sparse(0b01, _sp(0, 1, b"", b"") + b"\1\1")
    assert locations.decode_locations(locations.SPARSE_GAPS, ok, 3, 10).tolist() == [0, 2, 4]
    cases = [
        (ok[:8], 3, 10, "shorter than"),
        (bytes([3]) + ok[1:], 3, 10, "width"),
        (ok, 0, 10, "empty"),
        (bytes([2]) + (10).to_bytes(8, "little") + ok[9:], 3, 10, "first"),
        (ok, 3, 4, "out of range"),
        (ok[:-1], 3, 10, "truncated"),
    ]
    for section, count, numel, field in cases:
        with pytest.raises(ValueError, match=field):
            locations.decode_locations(locations.SPARSE_GAPS, section, count, numel)


def test_v1_payload_with_a_v2_code_is_rejected() -> None:
    """Format v1 knows location codes 1-5 and value codes 0-1: a v1 payload naming a sparse
    coding is refused on its header (unknown code), as a v1 decoder refuses it."""
    import hashlib
    import struct

    from shared_codec import format as fmt
    from shared_codec.errors import PayloadError

    rng = np.random.default_rng(4)
    idx = np.flatnonzero(rng.random(100_000) < 0.03).astype(np.int64)
    vals = rng.integers(0, 256, idx.size).astype(np.uint16)
    data = bytearray(
        encode_payload([make_item("w", "bfloat16", (100_000,), 0, Kind.XOR, idx, vals)], META)
    )
    h = peek_header(bytes(data))
    assert h.format_version == 2
    assert (h.items[0].loc_encoding, h.items[0].val_encoding) == (6, 2)
    struct.pack_into("<H", data, 4, 1)
    body = data[: len(data) - fmt.DIGEST_SIZE]
    body[fmt.ID_OFFSET : fmt.ID_OFFSET + fmt.ID_SIZE] = bytes(fmt.ID_SIZE)
    body[fmt.ID_OFFSET : fmt.ID_OFFSET + fmt.ID_SIZE] = hashlib.blake2b(
        bytes(body), digest_size=fmt.ID_SIZE
    ).digest()
    resealed = bytes(body) + fmt._digest(bytes(body), None)
    with pytest.raises(PayloadError, match="encoding: unknown code .* format version 1"):
        decode_payload(resealed)
