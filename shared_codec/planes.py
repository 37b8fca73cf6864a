"""Byte planes: unsigned words <-> one byte stream per byte position, dense or sparse.

`planes(x, w)` (docs/format.md) writes `w`-byte words as byte planes, most significant first, so
zstd sees the mostly-zero high bytes of small gaps and XOR masks as streams of their own.

`splanes(x, w)` (format v2: location code 6 and value code 2) stores each plane either densely
(its `n` bytes) or sparsely, as the positions of its nonzero bytes and those bytes:

    u8 sparse_mask | per plane, most significant first: dense: n bytes
                                                       | sparse: u64 nnz | u8 pw
                                                                | planes(d, pw) | nnz bytes

where `d` are the differences of consecutive positions minus one (the first position counts
from -1). A plane with a few nonzero bytes in many zeros (the high byte of BF16 XOR masks: only
exponent carries; the high byte of gaps at a 3% change) costs zstd one LZ sequence per nonzero
byte, about 3 bytes; the positions cost about log2(n / nnz) + 2 bits each (``dcr bench
codec``: the high planes at 1-5% change take ~0.4 of their zstd size).

Limitations:
1. The choice is made per plane from its raw share of nonzero bytes (`SPARSE_MAX_SHARE`), not
   from trial compression: one pass over each plane, no second zstd run.
2. Positions are plain gap planes, not split gaps: for the few hundred positions of a plane the
   difference is a few bytes, and the encoder stays one pass.
"""

from __future__ import annotations

import numpy as np

_U = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

#: A plane is stored sparse when at most this share of its bytes is nonzero (and it has at
#: least `SPARSE_MIN_BYTES` bytes: below that zstd's block overhead dominates either way).
SPARSE_MAX_SHARE = 1 / 32
SPARSE_MIN_BYTES = 1024


def min_width(max_value: int) -> int:
    """Smallest width in {1, 2, 4, 8} bytes holding `max_value` (>= 0)."""
    if max_value < 1 << 8:
        return 1
    if max_value < 1 << 16:
        return 2
    if max_value < 1 << 32:
        return 4
    return 8


def plane_matrix(values: np.ndarray, width: int) -> np.ndarray:
    """Unsigned `values` at `width` bytes as a (width, n) uint8 array, most significant first."""
    words = np.ascontiguousarray(values, dtype=_U[width])
    if width == 1:
        return words.reshape(1, -1)
    # shifts, not a transposed byte view: several times faster, and independent of byte order
    out = np.empty((width, words.shape[0]), dtype=np.uint8)
    for j in range(width):
        np.right_shift(words, 8 * (width - 1 - j), out=out[j], casting="unsafe")
    return out


def plane_parts(values: np.ndarray, width: int) -> list[bytes]:
    """`to_planes` as one bytes object per plane (most significant first); [] when empty."""
    if values.size == 0:
        return []
    m = plane_matrix(values, width)
    return [m[j].tobytes() for j in range(width)]


def to_planes(values: np.ndarray, width: int) -> bytes:
    """Unsigned `values` at `width` bytes, as byte planes (most significant plane first)."""
    return b"".join(plane_parts(values, width))


def join_planes(planes: list[np.ndarray], width: int) -> np.ndarray:
    """Words of `width` bytes from their planes (uint8 arrays of equal length, MS first)."""
    if width == 1:
        return planes[0].copy()
    out = planes[0].astype(_U[width])
    for j in range(1, width):
        out <<= np.uint8(8)
        out |= planes[j]
    return out


def from_planes(buf: memoryview | bytes, count: int, width: int) -> np.ndarray:
    """Inverse of `to_planes`: `count` unsigned words of `width` bytes (len(buf) must match)."""
    raw = np.frombuffer(buf, dtype=np.uint8, count=count * width)
    return join_planes(list(raw.reshape(width, count)), width)


def splane_parts(values: np.ndarray, width: int) -> tuple[int, list[bytes]]:
    """(sparse mask, parts) of `splanes(values, width)`: the mask byte, then per plane its
    bytes (dense) or its head, position planes and nonzero bytes (sparse). Mask 0: no plane
    is sparse enough; the caller then writes plain `planes` (the parts are still valid)."""
    n = int(values.shape[0])
    m = plane_matrix(values, width) if n else np.zeros((width, 0), np.uint8)
    mask = 0
    parts: list[bytes] = [b""]
    for j in range(width):
        plane = m[j]
        if n >= SPARSE_MIN_BYTES and np.count_nonzero(plane) <= n * SPARSE_MAX_SHARE:
            pos = np.flatnonzero(plane != 0)  # on bool: numpy's fast nonzero path (~3x)
            d = np.empty_like(pos)
            if pos.shape[0]:
                d[0] = pos[0]
                np.subtract(pos[1:], pos[:-1], out=d[1:])
                d[1:] -= 1
            pw = min_width(int(d.max())) if d.shape[0] else 1
            parts.append(pos.shape[0].to_bytes(8, "little") + bytes([pw]))
            parts += plane_parts(d, pw)
            parts.append(plane[pos].tobytes())
            mask |= 1 << j
        else:
            parts.append(plane.tobytes())
    parts[0] = bytes([mask])
    return mask, parts


def decode_splanes(buf: memoryview, count: int, width: int, field: str) -> np.ndarray:
    """Inverse of `splane_parts`: `count` words of `width` bytes from exactly `buf`.
    ValueError (naming `field`) for a bad mask, a sparse plane with more nonzero bytes than
    `count`, a position past `count`, or a section of the wrong length."""
    if len(buf) < 1:
        raise ValueError(f"{field}: section shorter than its mask byte")
    mask = buf[0]
    if mask >> width:
        raise ValueError(f"{field}.sparse_mask: {mask:#x} names planes beyond {width}")
    pos_in = 1
    planes: list[np.ndarray] = []
    for j in range(width):
        if not mask >> j & 1:
            if pos_in + count > len(buf):
                raise ValueError(f"{field}.planes[{j}]: truncated")
            planes.append(np.frombuffer(buf, np.uint8, count, pos_in))
            pos_in += count
            continue
        f = f"{field}.planes[{j}]"
        if pos_in + 9 > len(buf):
            raise ValueError(f"{f}: truncated sparse head")
        nnz = int.from_bytes(buf[pos_in : pos_in + 8], "little")
        pw = buf[pos_in + 8]
        pos_in += 9
        if nnz > count:
            raise ValueError(f"{f}.nnz: {nnz} nonzero bytes in a plane of {count}")
        if pw not in _U:
            raise ValueError(f"{f}.width: {pw} not in (1, 2, 4, 8)")
        if pos_in + nnz * (pw + 1) > len(buf):
            raise ValueError(f"{f}: truncated positions or bytes")
        d = from_planes(buf[pos_in : pos_in + nnz * pw], nnz, pw)
        pos_in += nnz * pw
        # every position difference is <= count and so is their sum: int64 cannot overflow
        if nnz and (int(d.max()) >= count or float(d.sum(dtype=np.float64)) + nnz > count):
            raise ValueError(f"{f}.positions: past the plane of {count} bytes")
        pos = np.cumsum(d.astype(np.int64) + 1) - 1
        if nnz and int(pos[-1]) >= count:
            raise ValueError(f"{f}.positions: past the plane of {count} bytes")
        plane = np.zeros(count, np.uint8)
        plane[pos] = np.frombuffer(buf, np.uint8, nnz, pos_in)
        pos_in += nnz
        planes.append(plane)
    if pos_in != len(buf):
        raise ValueError(f"{field}: section is {len(buf)} bytes, planes end at {pos_in}")
    return join_planes(planes, width)
