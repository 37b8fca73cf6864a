"""Value coding: raw stored bits of one item's entries <-> bytes.

Encodings (wire codes in docs/format.md):

1. ``PLANES`` (1): words split into byte planes, most significant plane first. XOR masks of small
   updates have mostly-zero high bytes, and sign/exponent bytes of overwrites repeat, so zstd
   compresses the planes far better than interleaved words (ENVIRONMENT.md: XOR masks 2.9x
   smaller than overwrite words at a = 1e-4 and 1e-3).
2. ``PLAIN`` (0): little-endian words in entry order, the paper's stream (kept for comparison).
3. ``SPARSE_PLANES`` (2, format v2): ``splanes(values, item size)`` (planes.py): ``PLANES`` with
   each plane that has at most 1/32 of its bytes nonzero written as the positions and values of
   those bytes. The high byte of a BF16 XOR mask changes only on an exponent carry (~0.7% of the
   entries of a relative 1e-2 update); zstd codes such a plane with one LZ sequence per nonzero
   byte. Never longer than ``PLANES`` (the encoder falls back to it).

1-byte dtypes are the same in both encodings.
"""

from __future__ import annotations

import numpy as np

from shared_codec.planes import decode_splanes, from_planes, plane_parts, splane_parts

PLAIN = 0
PLANES = 1
SPARSE_PLANES = 2

NAMES = {PLAIN: "plain", PLANES: "planes", SPARSE_PLANES: "sparse_planes"}


def encode_values(values: np.ndarray, itemsize: int, *, paper: bool = False) -> tuple[int, bytes]:
    """Encode an unsigned `values` array of `itemsize`-byte words; returns (code, bytes)."""
    code, parts = encode_value_parts(values, itemsize, paper=paper)
    return code, b"".join(parts)


def encode_value_parts(
    values: np.ndarray, itemsize: int, *, paper: bool = False
) -> tuple[int, list[bytes]]:
    """`encode_values` with the section as its parts (one per byte plane; the whole stream in
    paper mode), which the payload encoder compresses as separate zstd blocks."""
    if paper:
        le = values.dtype.newbyteorder("<")
        return PLAIN, [np.ascontiguousarray(values).astype(le).tobytes()]
    if values.shape[0] == 0:
        return PLANES, []
    mask, parts = splane_parts(values, itemsize)
    if not mask:
        return PLANES, parts[1:]  # every plane dense: exactly `planes`
    if sum(len(p) for p in parts) <= values.shape[0] * itemsize:
        return SPARSE_PLANES, parts
    return PLANES, plane_parts(values, itemsize)


def decode_values(
    code: int, buf: memoryview | bytes, count: int, itemsize: int, bits_np: type
) -> np.ndarray:
    """Decode a value section into `count` words of `bits_np`; ValueError names the field."""
    if code == SPARSE_PLANES:
        if len(buf) > count * itemsize:
            raise ValueError(f"values: section is {len(buf)} bytes, at most {count * itemsize}")
        return decode_splanes(memoryview(buf), count, itemsize, "values.sparse_planes").view(
            bits_np
        )
    if len(buf) != count * itemsize:
        raise ValueError(f"values: section is {len(buf)} bytes, expected {count * itemsize}")
    if code == PLAIN:
        le = np.dtype(bits_np).newbyteorder("<")
        return np.frombuffer(buf, dtype=le, count=count).astype(bits_np)
    if code == PLANES:
        return from_planes(buf, count, itemsize).view(bits_np)
    raise ValueError(f"values.encoding: unknown code {code}")
