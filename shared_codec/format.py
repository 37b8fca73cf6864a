"""Payload container, format version 2 (normative spec: docs/format.md).

A payload carries the delta items of one owner's bucket for one transition attempt:

    magic "DCRP" | u16 version | u16 flags | u32 header_len | header | body | digest[32]

The header holds the transition metadata (target version, base version, attempt, baseline id,
owner, sequence), the payload id, body sizes and the item table (name, dtype, kind, shape,
count, and the encoding and raw length of each item's location and value sections). The body is
the concatenation of all sections, zstd-compressed as one frame (flag bit 1). The digest is
BLAKE2b-256 over every byte before it, keyed with a shared secret when flag bit 0 is set.

The payload id is BLAKE2b-128 over every byte before the digest with the id field zeroed: a
content hash, identical for identical content, used by receivers to deduplicate.

`peek_header` (here) and `decode_payload` (decode.py) validate the magic, version, flags, every
length, count, offset and index before touching memory, bounds decompression by the header and a global cap, and raises
`PayloadError` naming the payload and the field; it never mutates anything outside its output.
No pickle anywhere.

Version 2 has the container and header of version 1 and adds two section encodings: sparse byte
planes (location code 6 ``sparse_gaps``, value code 2 ``sparse_planes``; planes.py). Encoders
write version 2; decoders accept both, and a version-1 payload naming a version-2 code is
rejected like any unknown code.

Decoding memory is bounded by the header, checked before decompression: every item's `count`
is at most its numel (and, given `destinations`, at most the destination tensor's numel), its
location section at most `loc_bound(count)` bytes and its value section at most `count` words, so
the raw body is at most the sum over items of ``18 + (16 + itemsize) * count`` bytes and every
transient array of the decode is a small multiple of the entries it yields (docs/format.md).
The decoded values (count times item size over all items) are held to the body cap as well:
sparse planes store fewer bytes than they decode to.
A malformed input or key (wrong type or length) is a `PayloadError` too, never a ValueError
or TypeError.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared_codec import FORMAT_VERSION, compression, locations, values
from shared_codec.dtypes import BY_CODE
from shared_codec.errors import PayloadError
from shared_codec.records import DeltaItem, Kind

MAGIC = b"DCRP"
VERSION = FORMAT_VERSION
#: Section encoding codes each format version admits: (location codes, value codes).
CODES = {
    1: (
        frozenset(
            {
                locations.GAPS,
                locations.RANGES,
                locations.BITMAP,
                locations.PLAIN_GAPS,
                locations.SPLIT_GAPS,
            }
        ),
        frozenset({values.PLAIN, values.PLANES}),
    ),
    2: (frozenset(locations.NAMES), frozenset(values.NAMES)),
}
FLAG_KEYED = 1
FLAG_ZSTD = 2
KNOWN_FLAGS = FLAG_KEYED | FLAG_ZSTD
DIGEST_SIZE = 32
ID_SIZE = 16
BASELINE_ID_SIZE = 16
PREFIX = struct.Struct("<4sHHI")  # magic, version, flags, header_len
HEAD = struct.Struct("<QQQ16sII16sQQI")  # version.. n_items (see docs/format.md)
ID_OFFSET = PREFIX.size + struct.calcsize("<QQQ16sII")  # byte offset of the payload id field
MAX_NDIM = 16

#: Default global cap on a payload's decompressed body (receivers may lower it).
DEFAULT_MAX_BODY = 1 << 30
#: Default cap on items per payload.
DEFAULT_MAX_ITEMS = 1 << 20
#: Largest BLAKE2b key (the payload secret).
MAX_KEY_SIZE = 64


def loc_bound(count: int) -> int:
    """Most bytes a location section of `count` entries may take (format v1 and v2): the ranges
    head plus two 8-byte words per entry. Every encoding DCR writes fits (gaps 9 + 8(count-1),
    split gaps 10 + 9(count-1), sparse gaps at most gaps + 1, plain gaps 4 count, ranges 10 +
    16 runs, bitmap only when smaller than gaps)."""
    return 18 + 16 * count


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadMeta:
    """Transition metadata every payload of an attempt carries (format v1/v2 header fields).

    `version` is the policy version the delta produces (v+1); `base_version` the committed
    version it applies to (v); `baseline_id` identifies the committed baseline / commit record;
    `attempt` the attempt of the transition; `owner` the emitting owner; `sequence` the payload's
    number within (attempt, owner).
    """

    version: int
    base_version: int
    attempt: int
    owner: int
    sequence: int
    baseline_id: bytes = b"\x00" * BASELINE_ID_SIZE

    def __post_init__(self) -> None:
        if len(self.baseline_id) != BASELINE_ID_SIZE:
            raise ValueError(f"baseline_id must be {BASELINE_ID_SIZE} bytes")
        for name in ("version", "base_version", "attempt"):
            if not 0 <= getattr(self, name) < 1 << 64:
                raise ValueError(f"{name} must fit in u64")
        for name in ("owner", "sequence"):
            if not 0 <= getattr(self, name) < 1 << 32:
                raise ValueError(f"{name} must fit in u32")


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemEntry:
    """One row of the item table: everything about an item except its section bytes."""

    name: str
    dtype: str
    kind: Kind
    shape: tuple[int, ...]
    count: int
    loc_encoding: int
    loc_len: int
    val_encoding: int
    val_len: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadHeader:
    """A decoded header (no body): what `peek_header` returns and receivers validate first."""

    format_version: int
    flags: int
    meta: PayloadMeta
    payload_id: bytes
    body_raw_len: int
    body_stored_len: int
    items: tuple[ItemEntry, ...]
    total_len: int

    @property
    def payload_id_hex(self) -> str:
        return self.payload_id.hex()


@dataclass(frozen=True, slots=True, kw_only=True)
class Payload:
    """A decoded payload: header plus items (arrays are this object's own)."""

    header: PayloadHeader
    items: list[DeltaItem] = field(default_factory=list)

    @property
    def meta(self) -> PayloadMeta:
        return self.header.meta

    @property
    def payload_id(self) -> bytes:
        return self.header.payload_id


def _digest(data: memoryview | bytes | bytearray, key: bytes | None) -> bytes:
    if key:
        if len(key) > 64:
            raise ValueError("payload key must be at most 64 bytes (BLAKE2b key limit)")
        return hashlib.blake2b(data, digest_size=DIGEST_SIZE, key=key).digest()
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def encode_sections(item: DeltaItem, *, paper: bool = False) -> tuple[int, bytes, int, bytes]:
    """(loc code, loc bytes, value code, value bytes) of one item."""
    loc_code, loc, val_code, val = encode_section_parts(item, paper=paper)
    return loc_code, b"".join(loc), val_code, b"".join(val)


def encode_section_parts(
    item: DeltaItem, *, paper: bool = False
) -> tuple[int, list[bytes], int, list[bytes]]:
    """`encode_sections` with each section as its parts (heads and byte planes)."""
    loc_code, loc = locations.encode_location_parts(item.indices, paper=paper)
    val_code, val = values.encode_value_parts(item.values, item.dtype_info.itemsize, paper=paper)
    return loc_code, loc, val_code, val


def encode_payload(
    items: Sequence[DeltaItem],
    meta: PayloadMeta,
    *,
    key: bytes | None = None,
    paper: bool = False,
    compress: bool = True,
) -> bytes:
    """Encode `items` into one payload of format `VERSION`. Items are validated first
    (ValueError)."""
    table = bytearray()
    parts: list[bytes] = []
    for item in items:
        item.validate(order=False)  # the location coder checks the order on its differences
        if item.owner != meta.owner:
            raise ValueError(f"item {item.name}: owner {item.owner} != payload owner {meta.owner}")
        d = item.dtype_info
        name = item.name.encode()
        try:
            loc_code, loc, val_code, val = encode_section_parts(item, paper=paper)
        except ValueError as e:
            raise ValueError(f"item {item.name}: {e}") from None
        loc_len, val_len = sum(len(p) for p in loc), sum(len(p) for p in val)
        table += struct.pack("<H", len(name)) + name
        table += struct.pack("<BBB", d.code, int(item.kind), len(item.shape))
        table += struct.pack(f"<{len(item.shape)}Q", *item.shape)
        table += struct.pack("<QBQBQ", item.count, loc_code, loc_len, val_code, val_len)
        parts += loc
        parts += val
    raw_len = sum(len(p) for p in parts)
    if not compress:
        body = b"".join(parts)
    elif paper:  # the paper's streams, compressed as the paper does: one plain frame
        body = compression.compress(b"".join(parts))
    else:  # each byte plane its own zstd block (compression.compress_parts)
        body = compression.compress_parts(parts)
    flags = (FLAG_KEYED if key else 0) | (FLAG_ZSTD if compress else 0)
    head = HEAD.pack(
        meta.version,
        meta.base_version,
        meta.attempt,
        meta.baseline_id,
        meta.owner,
        meta.sequence,
        b"\x00" * ID_SIZE,
        raw_len,
        len(body),
        len(items),
    )
    header = head + bytes(table)
    out = bytearray(PREFIX.pack(MAGIC, VERSION, flags, len(header)) + header + body)
    pid = hashlib.blake2b(out, digest_size=ID_SIZE).digest()
    out[ID_OFFSET : ID_OFFSET + ID_SIZE] = pid
    out += _digest(out, key)
    return bytes(out)


class _Reader:
    def __init__(self, buf: memoryview, label: str) -> None:
        self.buf, self.pos, self.label = buf, 0, label

    def take(self, fmt: str, field: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise PayloadError(f"payload {self.label}: field {field}: header truncated")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def raw(self, n: int, field: str) -> memoryview:
        if self.pos + n > len(self.buf):
            raise PayloadError(f"payload {self.label}: field {field}: header truncated")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out


def bytes_view(data: object) -> memoryview:
    """`data` as a flat byte view; PayloadError for anything that is not bytes-like."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PayloadError(f"payload <{type(data).__name__}>: field data: not bytes")
    buf = memoryview(data)
    if buf.ndim != 1 or buf.itemsize != 1:
        try:
            buf = buf.cast("B")
        except (TypeError, ValueError) as e:
            raise PayloadError(
                f"payload <view>: field data: not a flat byte buffer ({e})"
            ) from None
    return buf


def _check_key(key: object) -> bytes | None:
    """The payload secret as bytes (None or b"" for none); PayloadError for a wrong type/length."""
    if key is None:
        return None
    if not isinstance(key, bytes | bytearray | memoryview):
        raise PayloadError(f"payload <key>: field key: must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if len(key) > MAX_KEY_SIZE:
        raise PayloadError(
            f"payload <key>: field key: {len(key)} bytes, at most {MAX_KEY_SIZE} (BLAKE2b)"
        )
    return key or None


def peek_header(
    data: bytes | memoryview,
    *,
    key: bytes | None = None,
    verify: bool = True,
    max_items: int = DEFAULT_MAX_ITEMS,
) -> PayloadHeader:
    """Parse and validate the header (and, with `verify`, the digest and payload id).

    A keyed payload needs the key; an unkeyed payload is rejected when a key is configured (a
    receiver with a secret accepts only authenticated payloads).
    """
    buf = bytes_view(data)
    key = _check_key(key)
    label = f"<{len(buf)} bytes>"
    if len(buf) < PREFIX.size + HEAD.size + DIGEST_SIZE:
        raise PayloadError(f"payload {label}: field length: {len(buf)} bytes is too short")
    magic, version, flags, header_len = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise PayloadError(f"payload {label}: field magic: {bytes(magic)!r} is not {MAGIC!r}")
    if version not in CODES:
        raise PayloadError(f"payload {label}: field format_version: unsupported version {version}")
    if flags & ~KNOWN_FLAGS:
        raise PayloadError(f"payload {label}: field flags: unknown bits {flags & ~KNOWN_FLAGS:#x}")
    pid = bytes(buf[ID_OFFSET : ID_OFFSET + ID_SIZE])
    label = pid.hex()
    if header_len < HEAD.size or PREFIX.size + header_len + DIGEST_SIZE > len(buf):
        raise PayloadError(f"payload {label}: field header_len: {header_len} out of bounds")
    if verify:
        body_end = len(buf) - DIGEST_SIZE
        keyed = bool(flags & FLAG_KEYED)
        if keyed and not key:
            raise PayloadError(
                f"payload {label}: field digest: keyed payload but no key configured"
            )
        if key and not keyed:
            raise PayloadError(f"payload {label}: field digest: unauthenticated payload rejected")
        want = _digest(buf[:body_end], key if keyed else None)
        if not hmac.compare_digest(want, bytes(buf[body_end:])):
            what = "wrong key or corrupted" if keyed else "corrupted or truncated"
            raise PayloadError(f"payload {label}: field digest: mismatch ({what})")
        h = hashlib.blake2b(buf[:ID_OFFSET], digest_size=ID_SIZE)  # the id field reads as zero
        h.update(b"\x00" * ID_SIZE)
        h.update(buf[ID_OFFSET + ID_SIZE : body_end])
        if h.digest() != pid:
            raise PayloadError(f"payload {label}: field payload_id: not the content hash")
    r = _Reader(buf[PREFIX.size : PREFIX.size + header_len], label)
    (ver, base, attempt, baseline, owner, seq, _pid, raw_len, stored_len, n_items) = r.take(
        "<QQQ16sII16sQQI", "head"
    )
    if n_items > max_items:
        raise PayloadError(f"payload {label}: field n_items: {n_items} exceeds cap {max_items}")
    total = PREFIX.size + header_len + stored_len + DIGEST_SIZE
    if total != len(buf):
        raise PayloadError(
            f"payload {label}: field body_stored_len: {stored_len} implies {total} bytes, "
            f"payload has {len(buf)}"
        )
    if not flags & FLAG_ZSTD and stored_len != raw_len:
        raise PayloadError(f"payload {label}: field body_raw_len: uncompressed body size mismatch")
    entries = []
    section_total = 0
    for i in range(n_items):
        f = f"items[{i}]"
        (name_len,) = r.take("<H", f + ".name_len")
        try:
            name = bytes(r.raw(name_len, f + ".name")).decode()
        except UnicodeDecodeError:
            raise PayloadError(f"payload {label}: field {f}.name: not UTF-8") from None
        if not name:
            raise PayloadError(f"payload {label}: field {f}.name: empty")
        dcode, kind, ndim = r.take("<BBB", f + ".dtype")
        if dcode not in BY_CODE:
            raise PayloadError(f"payload {label}: field {f}.dtype: unknown code {dcode}")
        if kind not in (Kind.XOR, Kind.OVERWRITE):
            raise PayloadError(f"payload {label}: field {f}.kind: unknown kind {kind}")
        if ndim > MAX_NDIM:
            raise PayloadError(f"payload {label}: field {f}.ndim: {ndim} > {MAX_NDIM}")
        shape = r.take(f"<{ndim}Q", f + ".shape")
        numel = 1
        for s in shape:
            numel *= s
        if numel >= 1 << 62:
            raise PayloadError(f"payload {label}: field {f}.shape: {shape} too large")
        count, loc_code, loc_len, val_code, val_len = r.take("<QBQBQ", f + ".sections")
        d = BY_CODE[dcode]
        if count > numel:
            raise PayloadError(f"payload {label}: field {f}.count: {count} > numel {numel}")
        # sparse planes are never longer than dense ones (the encoder falls back to those)
        if val_len > count * d.itemsize or (
            val_code != values.SPARSE_PLANES and val_len != count * d.itemsize
        ):
            raise PayloadError(f"payload {label}: field {f}.val_len: {val_len} for {count} entries")
        if loc_len > loc_bound(count):
            raise PayloadError(
                f"payload {label}: field {f}.loc_len: {loc_len} bytes for {count} entries "
                f"(at most {loc_bound(count)})"
            )
        if loc_code not in CODES[version][0] or val_code not in CODES[version][1]:
            raise PayloadError(
                f"payload {label}: field {f}.encoding: unknown code (location {loc_code}, "
                f"value {val_code}) for format version {version}"
            )
        section_total += loc_len + val_len
        if section_total > raw_len:
            raise PayloadError(f"payload {label}: field {f}.sections: exceed body_raw_len")
        entries.append(
            ItemEntry(
                name=name,
                dtype=d.name,
                kind=Kind(kind),
                shape=tuple(shape),
                count=count,
                loc_encoding=loc_code,
                loc_len=loc_len,
                val_encoding=val_code,
                val_len=val_len,
            )
        )
    if r.pos != len(r.buf):
        raise PayloadError(f"payload {label}: field header_len: {len(r.buf) - r.pos} stray bytes")
    if section_total != raw_len:
        raise PayloadError(
            f"payload {label}: field body_raw_len: {raw_len}, sections sum to {section_total}"
        )
    try:
        meta = PayloadMeta(
            version=ver,
            base_version=base,
            attempt=attempt,
            owner=owner,
            sequence=seq,
            baseline_id=bytes(baseline),
        )
    except ValueError as e:
        raise PayloadError(f"payload {label}: field meta: {e}") from None
    return PayloadHeader(
        format_version=version,
        flags=flags,
        meta=meta,
        payload_id=pid,
        body_raw_len=raw_len,
        body_stored_len=stored_len,
        items=tuple(entries),
        total_len=len(buf),
    )
