"""Location coding: sorted unique flat indices <-> bytes, the smallest of several encodings.

Encodings (wire codes in docs/format.md; all integers little-endian):

1. ``GAPS`` (1): ``u8 width | u64 first | planes(gap - 1, width)``: differences of consecutive
   indices minus one, at the minimal width in {1, 2, 4, 8}, split into byte planes (most
   significant plane first) so zstd sees long runs of zero high bytes.
2. ``RANGES`` (2): ``u8 ws | u8 wl | u64 runs | planes(start gaps, ws) | planes(len - 1, wl)``:
   maximal runs of consecutive indices; the first start is absolute, later ones are the gap after
   the previous run's end minus one.
3. ``BITMAP`` (3): ``u64 base | u64 span | bits``: one bit per position in ``[base, base+span)``
   (numpy packbits, little bit order), for dense changes.
4. ``PLAIN_GAPS`` (4): ``u32[count]``: the first index then plain gaps, the paper's stream (kept
   for comparison; only valid when every value fits in 32 bits).
5. ``SPLIT_GAPS`` (5): ``u8 bits | u8 width | u64 first | low[count-1] | planes(high, width)``:
   each gap minus one split at bit `bits` (1..7) into its low bits (one byte each) and the rest
   (byte planes at the minimal width). For sparse changes (mean gap >= 60) the high byte plane
   of ``GAPS`` is mostly zero but not zero enough for zstd's LZ runs, and its Huffman literals
   cannot cost less than one bit: at a 1% uniform change it costs ~2x its entropy. Splitting
   lower, where the high part has a mean of ~8 (`split_bits`), leaves two planes zstd codes
   within ~1-2% of the gaps' entropy (``dcr bench codec``: payload / entropy bound).
6. ``SPARSE_GAPS`` (6, format v2): ``u8 width | u64 first | splanes(gap - 1, width)``: ``GAPS``
   with sparse byte planes (planes.py): a high plane with at most 1/32 of its bytes nonzero is
   written as the positions and values of those bytes. At a 3% change the high byte plane of
   the gaps has ~0.2% nonzero bytes, which zstd codes with one LZ sequence each.

`encode_locations` picks the encoding with the fewest raw bytes (paper mode: PLAIN_GAPS when
representable); between the two gap codings, which have about the same raw size, `split_bits`
decides from the mean gap, and ``GAPS`` becomes ``SPARSE_GAPS`` when one of its planes is
sparse (not in paper mode). `encode_location_parts` returns the section as its parts (head, byte
planes), which the payload encoder compresses as separate zstd blocks (compression.py).
`decode_locations` validates every length and value before use and returns a strictly
increasing int64 array with all indices < numel, or raises ValueError naming the field.

Limitations:
1. The choice uses raw sizes and the mean gap, not compressed sizes (one pass, no trial
   compression): gaps far from geometric (clustered changes) may split worse than planes.
2. ``SPLIT_GAPS`` was added to format v1 on 2026-12-04; an older decoder rejects a payload
   using it with ``PayloadError`` (unknown location encoding), never misreads it.
   ``SPARSE_GAPS`` exists from format v2 on (2026-12-04); a v1 payload naming it is rejected.
3. ``SPLIT_GAPS`` has no sparse variant: its high part (mean ~8) is never sparse.
"""

from __future__ import annotations

import numpy as np

from shared_codec.planes import (  # noqa: F401 (plane helpers re-exported)
    decode_splanes,
    from_planes,
    min_width,
    plane_parts,
    splane_parts,
    to_planes,
)

GAPS = 1
RANGES = 2
BITMAP = 3
PLAIN_GAPS = 4
SPLIT_GAPS = 5
SPARSE_GAPS = 6

NAMES = {
    GAPS: "gaps",
    RANGES: "ranges",
    BITMAP: "bitmap",
    PLAIN_GAPS: "plain_gaps",
    SPLIT_GAPS: "split_gaps",
    SPARSE_GAPS: "sparse_gaps",
}
#: Mean gap (minus one) from which gaps are split below the byte boundary (`split_bits`).
SPLIT_MIN_MEAN = 60.0


def split_bits(mean_gap: float) -> int:
    """Where `SPLIT_GAPS` splits gaps of this mean (gap minus one): the high part keeps a mean
    of ~8 (2^3) and the low part at least 4 bits (fewer: zstd-1 finds spurious matches in the
    small alphabet). 0: do not split (use ``GAPS``): below a mean of `SPLIT_MIN_MEAN` (the high
    byte plane is then almost all zero, which zstd codes well), and from 8 bits on, where the
    split is the byte boundary ``GAPS`` already has. Measured on uniform changes of 0.1-3%
    (2.5M-element tensors): within 1-2% of the gaps' entropy from a mean of 60 to 330, where
    ``GAPS`` is 3-10% above it."""
    if mean_gap < SPLIT_MIN_MEAN:
        return 0
    bits = max(4, round(float(np.log2(mean_gap + 1.0))) - 3)
    return bits if bits <= 7 else 0


def _u8(x: int) -> bytes:
    return x.to_bytes(1, "little")


def _u64(x: int) -> bytes:
    return int(x).to_bytes(8, "little")


def _gaps_parts(
    indices: np.ndarray, gaps_m1: np.ndarray, *, sparse: bool = True, gap_max: int | None = None
) -> tuple[int, list[bytes]]:
    if gap_max is None:
        gap_max = int(gaps_m1.max()) if gaps_m1.size else 0
    width = min_width(gap_max)
    head = _u8(width) + _u64(indices[0])
    if sparse and width > 1:
        mask, parts = splane_parts(gaps_m1, width)
        if mask:
            return SPARSE_GAPS, [head, *parts]
    return GAPS, [head, *plane_parts(gaps_m1, width)]


def _split_parts(indices: np.ndarray, gaps_m1: np.ndarray, bits: int) -> tuple[int, list[bytes]]:
    high = gaps_m1 >> bits
    width = min_width(int(high.max()))
    low = (gaps_m1 & ((1 << bits) - 1)).astype(np.uint8)
    head = _u8(bits) + _u8(width) + _u64(indices[0])
    return SPLIT_GAPS, [head, low.tobytes(), *plane_parts(high, width)]


def encode_locations(indices: np.ndarray, *, paper: bool = False) -> tuple[int, bytes]:
    """Encode strictly increasing int64 `indices`; returns (encoding code, section bytes)."""
    code, parts = encode_location_parts(indices, paper=paper)
    return code, b"".join(parts)


def encode_location_parts(indices: np.ndarray, *, paper: bool = False) -> tuple[int, list[bytes]]:
    """`encode_locations` with the section as its parts (head, then each byte plane).
    ValueError when `indices` are not strictly increasing."""
    n = int(indices.shape[0])
    if n == 0:
        return RANGES, [bytes([1, 1]) + (0).to_bytes(8, "little")]
    diffs = np.diff(indices)
    if n > 1 and int(diffs.min()) <= 0:
        raise ValueError("indices not strictly increasing")
    if paper:
        first = int(indices[0])
        if first < 1 << 32 and (n == 1 or int(diffs.max()) < 1 << 32):
            stream = np.empty(n, dtype="<u4")
            stream[0] = first
            stream[1:] = diffs
            return PLAIN_GAPS, [stream.tobytes()]
        return _gaps_parts(indices, diffs - 1, sparse=False)
    gaps_m1 = diffs - 1
    span = int(indices[-1]) - int(indices[0]) + 1
    gap_max = int(gaps_m1.max()) if n > 1 else 0
    gaps_size = 9 + (n - 1) * min_width(gap_max)
    bits = split_bits((span - n) / (n - 1)) if n > 1 else 0
    if bits:
        gaps_size = 10 + (n - 1) * (1 + min_width(gap_max >> bits))
    bitmap_size = 16 + (span + 7) // 8
    in_run = diffs == 1
    runs = n - int(np.count_nonzero(in_run))  # counted, not listed: listing costs ~5x more
    ranges_size = n * 16 + 19  # more than any other coding: ranges only pay for long runs
    if runs * 2 < n:
        breaks = np.flatnonzero(~in_run)
        run_starts_pos = np.concatenate(([0], breaks + 1))
        run_ends_pos = np.concatenate((breaks, [n - 1]))
        starts = indices[run_starts_pos]
        lengths_m1 = run_ends_pos - run_starts_pos
        start_gaps = np.empty(runs, dtype=np.int64)
        start_gaps[0] = starts[0]
        start_gaps[1:] = starts[1:] - indices[run_ends_pos[:-1]] - 2
        ws = min_width(int(start_gaps.max()))
        wl = min_width(int(lengths_m1.max()))
        ranges_size = 18 + runs * (ws + wl)
    best = min(gaps_size, bitmap_size, ranges_size)
    if best == gaps_size:
        if bits:
            return _split_parts(indices, gaps_m1, bits)
        return _gaps_parts(indices, gaps_m1, gap_max=gap_max)
    if best == bitmap_size:
        base = int(indices[0])
        bits_set = np.zeros(span, dtype=np.uint8)
        bits_set[indices - base] = 1
        head = np.array([base, span], dtype="<u8").tobytes()
        return BITMAP, [head, np.packbits(bits_set, bitorder="little").tobytes()]
    head = bytes([ws, wl]) + runs.to_bytes(8, "little")
    return RANGES, [head, *plane_parts(start_gaps, ws), *plane_parts(lengths_m1, wl)]


def _width(byte: int, field: str) -> int:
    if byte not in (1, 2, 4, 8):
        raise ValueError(f"{field}: width {byte} not in (1, 2, 4, 8)")
    return byte


def _need(buf: memoryview, size: int, field: str) -> None:
    if len(buf) != size:
        raise ValueError(f"{field}: section is {len(buf)} bytes, expected {size}")


def _check_bounded(values: np.ndarray, numel: int, field: str) -> None:
    # Every gap/length is <= numel and their float sum is <= numel, so int64 sums cannot overflow.
    if values.size and (int(values.max()) > numel or float(values.sum(dtype=np.float64)) > numel):
        raise ValueError(f"{field}: values exceed the tensor size {numel}")


def _bitmap_indices(packed: np.ndarray, span: int, count: int) -> np.ndarray:
    """Set bit positions of a little-bit-order bitmap of `span` bits that must hold exactly
    `count` set bits. Only non-zero bytes are unpacked (each holds at least one set bit, so
    more than `count` of them is an error found before unpacking): memory is O(count), not
    O(span)."""
    nz = np.flatnonzero(packed)
    if nz.size > count:
        raise ValueError(f"locations.bitmap: more than {count} bits set, count is {count}")
    bits = np.unpackbits(packed[nz], bitorder="little").reshape(-1, 8)
    rows, cols = np.nonzero(bits)
    out = nz[rows].astype(np.int64) * 8 + cols
    if out.shape[0] != count:
        raise ValueError(f"locations.bitmap: {out.shape[0]} bits set, count is {count}")
    if count and int(out[-1]) >= span:
        raise ValueError("locations.bitmap: bits set beyond the span")
    return out


def decode_locations(code: int, buf: memoryview | bytes, count: int, numel: int) -> np.ndarray:
    """Decode a location section; ValueError names the first field that fails validation."""
    buf = memoryview(buf)
    if count < 0 or count > numel:
        raise ValueError(f"locations.count: {count} entries for a tensor of {numel} elements")
    if code == GAPS:
        if len(buf) < 9:
            raise ValueError("locations.gaps: section shorter than its 9-byte head")
        width = _width(buf[0], "locations.gaps.width")
        if count == 0:
            raise ValueError("locations.gaps: empty items use the ranges encoding")
        _need(buf, 9 + (count - 1) * width, "locations.gaps")
        first = int.from_bytes(buf[1:9], "little")
        if first >= numel:
            raise ValueError(f"locations.gaps.first: {first} >= numel {numel}")
        gaps = from_planes(buf[9:], count - 1, width)
        _check_bounded(gaps, numel, "locations.gaps")
        out = np.empty(count, dtype=np.int64)
        out[0] = first
        np.cumsum(gaps.astype(np.int64) + 1, out=out[1:])
        out[1:] += first
    elif code == SPARSE_GAPS:
        if len(buf) < 9:
            raise ValueError("locations.sparse_gaps: section shorter than its 9-byte head")
        width = _width(buf[0], "locations.sparse_gaps.width")
        if count == 0:
            raise ValueError("locations.sparse_gaps: empty items use the ranges encoding")
        first = int.from_bytes(buf[1:9], "little")
        if first >= numel:
            raise ValueError(f"locations.sparse_gaps.first: {first} >= numel {numel}")
        gaps = decode_splanes(buf[9:], count - 1, width, "locations.sparse_gaps")
        _check_bounded(gaps, numel, "locations.sparse_gaps")
        out = np.empty(count, dtype=np.int64)
        out[0] = first
        np.cumsum(gaps.astype(np.int64) + 1, out=out[1:])
        out[1:] += first
    elif code == SPLIT_GAPS:
        if len(buf) < 10:
            raise ValueError("locations.split_gaps: section shorter than its 10-byte head")
        bits = buf[0]
        if not 1 <= bits <= 7:
            raise ValueError(f"locations.split_gaps.bits: {bits} not in 1..7")
        width = _width(buf[1], "locations.split_gaps.width")
        if count == 0:
            raise ValueError("locations.split_gaps: empty items use the ranges encoding")
        _need(buf, 10 + (count - 1) * (1 + width), "locations.split_gaps")
        first = int.from_bytes(buf[2:10], "little")
        if first >= numel:
            raise ValueError(f"locations.split_gaps.first: {first} >= numel {numel}")
        low = np.frombuffer(buf[10 : 9 + count], dtype=np.uint8)
        if low.size and int(low.max()) >> bits:
            raise ValueError(f"locations.split_gaps.low: a low part has more than {bits} bits")
        high = from_planes(buf[9 + count :], count - 1, width)
        # bound the high parts before the shift, so the int64 gaps cannot overflow
        if high.size and int(high.max()) > numel >> bits:
            raise ValueError(f"locations.split_gaps.high: values exceed the tensor size {numel}")
        gaps = (high.astype(np.int64) << bits) | low
        _check_bounded(gaps, numel, "locations.split_gaps")
        out = np.empty(count, dtype=np.int64)
        out[0] = first
        np.cumsum(gaps + 1, out=out[1:])
        out[1:] += first
    elif code == PLAIN_GAPS:
        _need(buf, 4 * count, "locations.plain_gaps")
        stream = np.frombuffer(buf, dtype="<u4", count=count).astype(np.int64)
        if count > 1 and int(stream[1:].min()) < 1:
            raise ValueError("locations.plain_gaps: zero gap (indices not strictly increasing)")
        _check_bounded(stream, numel, "locations.plain_gaps")
        out = np.cumsum(stream)
    elif code == RANGES:
        if len(buf) < 10:
            raise ValueError("locations.ranges: section shorter than its 10-byte head")
        ws = _width(buf[0], "locations.ranges.start_width")
        wl = _width(buf[1], "locations.ranges.length_width")
        runs = int.from_bytes(buf[2:10], "little")
        if runs > count or (runs == 0) != (count == 0):
            raise ValueError(f"locations.ranges.runs: {runs} runs for {count} entries")
        _need(buf, 10 + runs * (ws + wl), "locations.ranges")
        start_gaps = from_planes(buf[10 : 10 + runs * ws], runs, ws)
        lengths_m1 = from_planes(buf[10 + runs * ws :], runs, wl)
        _check_bounded(start_gaps, numel, "locations.ranges.starts")
        _check_bounded(lengths_m1, numel, "locations.ranges.lengths")
        lengths = lengths_m1.astype(np.int64) + 1
        if int(lengths.sum()) != count:
            raise ValueError(f"locations.ranges.lengths: sum {int(lengths.sum())} != count {count}")
        if count == 0:
            return np.empty(0, dtype=np.int64)
        # s_0 = g_0; s_i = s_{i-1} + L_{i-1} + 1 + g_i (runs are maximal, so gaps are >= 2)
        steps = start_gaps.astype(np.int64)
        steps[1:] += lengths[:-1] + 1
        starts = np.cumsum(steps)
        offsets = np.cumsum(lengths) - lengths  # position of each run's first entry in `out`
        out = np.repeat(starts - offsets, lengths) + np.arange(count, dtype=np.int64)
    elif code == BITMAP:
        if len(buf) < 16:
            raise ValueError("locations.bitmap: section shorter than its 16-byte head")
        base, span = (int(x) for x in np.frombuffer(buf[:16], dtype="<u8"))
        if span > numel or base > numel - span:
            raise ValueError(f"locations.bitmap: [{base}, {base}+{span}) outside numel {numel}")
        _need(buf, 16 + (span + 7) // 8, "locations.bitmap")
        out = _bitmap_indices(np.frombuffer(buf[16:], dtype=np.uint8), span, count) + base
    else:
        raise ValueError(f"locations.encoding: unknown code {code}")
    if count and (int(out[-1]) >= numel or int(out[0]) < 0):
        raise ValueError(f"locations: index {int(out[-1])} out of range for numel {numel}")
    return out
