"""Decoding a payload's body (format.py holds the container, its encoder and the validating
header reader `peek_header`; normative spec: docs/format.md): `decode_payload` (header, digest
and body), `decode_body` (the body of a header already read), `check_destinations` (the items
against the receiver's tensor sizes).

Every length, count, offset and index is checked before memory is touched; decompression is
bounded by the header and a global cap; a malformed input raises `PayloadError` naming the
payload and the field, never a ValueError or TypeError. Nothing outside the output is mutated.

Limitations:
1. Decoding memory is bounded by the header (format.py's docstring has the bound); the caller's
   `max_body` / `max_items` caps bound it further.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared_codec import compression, locations, values
from shared_codec.dtypes import dtype_of
from shared_codec.errors import PayloadError
from shared_codec.format import (
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_ITEMS,
    DIGEST_SIZE,
    FLAG_ZSTD,
    Payload,
    PayloadHeader,
    bytes_view,
    peek_header,
)
from shared_codec.records import DeltaItem


def decode_payload(
    data: bytes | memoryview,
    *,
    key: bytes | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    max_items: int = DEFAULT_MAX_ITEMS,
    destinations: Mapping[str, int] | None = None,
) -> Payload:
    """Validate and decode a whole payload. Raises PayloadError; never mutates its input.

    `destinations` (numel of each destination tensor, by name), when given, is checked against
    the header before the body is decompressed: an item naming another tensor, whose shape has
    another numel, or that declares more entries than the destination holds, is rejected.
    """
    header = peek_header(data, key=key, verify=True, max_items=max_items)
    if destinations is not None:
        check_destinations(header, destinations)
    return decode_body(data, header, max_body=max_body)


def check_destinations(header: PayloadHeader, destinations: Mapping[str, int]) -> None:
    """PayloadError unless every item names a tensor of `destinations` (numel by name) with
    the same numel and at most that many entries. Header only: call it before `decode_body`."""
    label = header.payload_id_hex
    for i, e in enumerate(header.items):
        f = f"items[{i}] ({e.name})"
        want = destinations.get(e.name)
        if want is None:
            raise PayloadError(f"payload {label}: field {f}.name: no such destination tensor")
        numel = _numel(e.shape)
        if numel != want or e.count > want:
            raise PayloadError(
                f"payload {label}: field {f}.count: {e.count} entries of a {numel}-element "
                f"item for a destination of {want} elements"
            )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def decode_body(
    data: bytes | memoryview, header: PayloadHeader, *, max_body: int = DEFAULT_MAX_BODY
) -> Payload:
    """Decode the body of `data`, whose header `peek_header` returned (verified) as `header`.

    Decompression is bounded by `header.body_raw_len` (itself bounded by the item table, see
    the module docstring) and by `max_body`, and so are the decoded values (count times item
    size over all items); PayloadError for anything malformed.
    """
    label = header.payload_id_hex
    buf = bytes_view(data)
    if len(buf) != header.total_len:
        raise PayloadError(f"payload {label}: field length: header is of another payload")
    # Sparse planes (v2) decode to more bytes than they store: the decoded values, which every
    # v1 body held raw, are held to the cap as well, so `count` cannot outgrow it either.
    decoded = sum(e.count * dtype_of(e.dtype).itemsize for e in header.items)
    if decoded > max_body:
        raise PayloadError(
            f"payload {label}: field items.count: {decoded} bytes of values exceeds the cap "
            f"{max_body}"
        )
    start = len(buf) - DIGEST_SIZE - header.body_stored_len
    stored = buf[start : len(buf) - DIGEST_SIZE]
    if header.flags & FLAG_ZSTD:
        try:
            raw = memoryview(compression.decompress_exact(stored, header.body_raw_len, max_body))
        except ValueError as err:
            raise PayloadError(f"payload {label}: field body: {err}") from None
    else:
        if header.body_raw_len > max_body:
            raise PayloadError(f"payload {label}: field body_raw_len: exceeds cap {max_body}")
        raw = stored
    items: list[DeltaItem] = []
    pos = 0
    for i, entry in enumerate(header.items):
        d = dtype_of(entry.dtype)
        numel = _numel(entry.shape)
        loc = raw[pos : pos + entry.loc_len]
        pos += entry.loc_len
        val = raw[pos : pos + entry.val_len]
        pos += entry.val_len
        try:
            idx = locations.decode_locations(entry.loc_encoding, loc, entry.count, numel)
            vals = values.decode_values(entry.val_encoding, val, entry.count, d.itemsize, d.bits_np)
        except ValueError as err:
            raise PayloadError(f"payload {label}: field items[{i}] ({entry.name}).{err}") from None
        items.append(
            DeltaItem(
                name=entry.name,
                dtype=entry.dtype,
                shape=entry.shape,
                owner=header.meta.owner,
                kind=entry.kind,
                indices=idx,
                values=np.ascontiguousarray(vals),
            )
        )
    return Payload(header=header, items=items)
