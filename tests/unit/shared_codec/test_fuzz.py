"""Fuzz targets (hypothesis) for `decode_payload` and the relay message parser (issue 19 item 4).

`decode_payload`: structural mutations of valid payloads. Bytes of the container prefix, the
header (item table included) or the *raw* body are flipped, inserted, deleted or overwritten with
extreme integers; a mutated body is recompressed, the lengths are (usually) fixed up, and the
result is always re-sealed with a valid payload id and digest, so the parser's structural checks,
not just the digest, are what reject it. Property: `PayloadError`, or items whose indices are
strictly increasing and in range with one value per index; never another exception, under 2 s
per example (hypothesis deadline), with decode memory (tracemalloc peak) within a fixed multiple
of the bytes involved.

Relay parser: random bytes, mutated valid frames, JSON objects of a known kind with arbitrary
JSON field values (huge integers, NaN / infinities, deep nesting, odd strings) and non-bytes
frames. Property: `RelayMessageError`, or a message that round-trips with its bounds held.

Default lane: a few hundred examples per target (a few seconds). Slow lane (``-m slow``):
10,000 examples per target.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import struct
import tracemalloc

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from shared_codec import compression
from shared_codec import format as fmt
from shared_codec.decode import decode_payload
from shared_codec.dtypes import dtype_of
from shared_codec.errors import PayloadError, RelayMessageError
from shared_codec.format import PayloadMeta, encode_payload
from shared_codec.records import Kind, make_item
from shared_codec.transport.relay import messages as m

MAX_BODY = 1 << 22
KEY = b"fuzz-key"
FAST = settings(
    max_examples=300,
    deadline=2000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _items(owner: int) -> list:
    rng = np.random.default_rng(owner)
    sparse = np.sort(rng.choice(50_000, 200, replace=False)).astype(np.int64)
    medium = np.sort(rng.choice(2_000, 200, replace=False)).astype(np.int64)
    three_pct = np.flatnonzero(rng.random(120_000) < 0.024).astype(np.int64)
    xor = rng.integers(0, 256, three_pct.size).astype(np.uint16)
    xor[rng.random(three_pct.size) < 0.01] |= 0x0300
    return [
        # sparse gaps (location code 6) and sparse planes (value code 2): a 2.4% change
        make_item("sparse_planes", "bfloat16", (120, 1000), owner, Kind.XOR, three_pct, xor),
        # split gaps (sparse: mean gap 250), gaps (mean gap 10), ranges (one run), bitmap
        # (dense, every other index), empty (ranges)
        make_item(
            "gaps_medium",
            "float16",
            (2_000,),
            owner,
            Kind.XOR,
            medium,
            rng.integers(0, 1 << 16, 200).astype(np.uint16),
        ),
        make_item(
            "gaps",
            "bfloat16",
            (100, 500),
            owner,
            Kind.XOR,
            sparse,
            rng.integers(0, 1 << 16, 200).astype(np.uint16),
        ),
        make_item(
            "ranges",
            "float32",
            (1000,),
            owner,
            Kind.OVERWRITE,
            np.arange(100, 400),
            rng.integers(0, 1 << 32, 300, dtype=np.uint64).astype(np.uint32),
        ),
        make_item(
            "bitmap",
            "int8",
            (3, 700),
            owner,
            Kind.OVERWRITE,
            np.arange(0, 2000, 2),
            rng.integers(0, 256, 1000).astype(np.uint8),
        ),
        make_item(
            "empty", "float64", (4, 4), owner, Kind.XOR, np.arange(0), np.zeros(0, np.uint64)
        ),
        make_item(
            "scalar", "bool", (), owner, Kind.OVERWRITE, np.array([0]), np.array([1], np.uint8)
        ),
    ]


def _base(
    owner: int, *, compress: bool, paper: bool, key: bytes | None
) -> tuple[bytes, bytes | None]:
    meta = PayloadMeta(version=3, base_version=2, attempt=1, owner=owner, sequence=owner)
    return encode_payload(_items(owner), meta, compress=compress, paper=paper, key=key), key


BASES = [
    _base(0, compress=True, paper=False, key=None),
    _base(1, compress=False, paper=True, key=None),  # plain gaps and plain values
    _base(2, compress=True, paper=True, key=KEY),
    _base(3, compress=False, paper=False, key=KEY),
]


def _split(data: bytes) -> tuple[bytearray, bytearray, bytearray]:
    """(prefix, header, raw body) of a valid payload."""
    _, _, flags, header_len = fmt.PREFIX.unpack_from(data, 0)
    end = fmt.PREFIX.size + header_len
    stored = data[end : len(data) - fmt.DIGEST_SIZE]
    raw_len = fmt.peek_header(data, verify=False).body_raw_len
    raw = compression.decompress_exact(stored, raw_len, 1 << 30) if flags & 2 else stored
    return (
        bytearray(data[: fmt.PREFIX.size]),
        bytearray(data[fmt.PREFIX.size : end]),
        bytearray(raw),
    )


def _reseal(buf: bytearray, key: bytes | None) -> bytes:
    """A valid payload id and digest over whatever `buf` (without digest) now holds."""
    if len(buf) >= fmt.ID_OFFSET + fmt.ID_SIZE:
        buf[fmt.ID_OFFSET : fmt.ID_OFFSET + fmt.ID_SIZE] = bytes(fmt.ID_SIZE)
        pid = hashlib.blake2b(bytes(buf), digest_size=fmt.ID_SIZE).digest()
        buf[fmt.ID_OFFSET : fmt.ID_OFFSET + fmt.ID_SIZE] = pid
    return bytes(buf) + fmt._digest(bytes(buf), key)


EXTREMES = [
    0,
    1,
    2,
    7,
    8,
    255,
    256,
    2**16 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**62,
    2**63 - 1,
    2**64 - 1,
]
# weights: the 12-byte prefix is mostly magic, so it gets fewer mutations than the item table and
# the body; length-keeping flips and integer overwrites reach the section decoders most often
REGIONS = ("prefix", "header", "header", "header", "body", "body", "body", "body")
OPS = ("flip", "flip", "flip", "int", "int", "int", "insert", "delete")

mutation = st.tuples(
    st.sampled_from(REGIONS),
    st.sampled_from(OPS),
    st.integers(0, 1 << 20),  # position (modulo the region's length)
    st.integers(1, 255),  # xor mask / inserted byte / deleted length
    st.sampled_from(EXTREMES),
    st.sampled_from((1, 2, 4, 8)),  # integer width
)


def _mutate(region: bytearray, op: str, pos: int, b: int, value: int, width: int) -> None:
    if not region and op != "insert":
        return
    pos %= len(region) + (1 if op == "insert" else 0)
    if op == "flip":
        region[pos] ^= b
    elif op == "insert":
        region[pos:pos] = bytes([b]) * (1 + b % 4)
    elif op == "delete":
        del region[pos : pos + 1 + b % 16]
    else:
        region[pos : pos + width] = (value % (1 << (8 * width))).to_bytes(width, "little")


def build(base: int, muts: list, fix_lengths: bool, recompress: bool) -> tuple[bytes, int]:
    """A mutated, re-sealed payload and the raw body size it was built from."""
    good, key = BASES[base]
    prefix, header, raw = _split(good)
    flags = struct.unpack_from("<H", good, 6)[0]
    original = good[fmt.PREFIX.size + len(header) : len(good) - fmt.DIGEST_SIZE]
    for region, *args in muts:
        _mutate({"prefix": prefix, "header": header, "body": raw}[region], *args)
    if flags & fmt.FLAG_ZSTD and recompress:
        stored = compression.compress(bytes(raw))
    elif flags & fmt.FLAG_ZSTD:
        stored = original  # the body mutations are then checked against the old frame
    else:
        stored = bytes(raw)
    if fix_lengths and len(header) >= fmt.HEAD.size and len(prefix) == fmt.PREFIX.size:
        struct.pack_into("<I", prefix, 8, len(header))
        struct.pack_into("<QQ", header, 64, len(raw), len(stored))
    return _reseal(prefix + header + stored, key), len(raw)


def _note(what: str) -> None:
    """A hypothesis event (outcome statistics, ``--hypothesis-show-statistics``)."""
    with contextlib.suppress(InvalidArgument):  # outside a hypothesis test
        event(what)


def check_decode(data: bytes, key: bytes | None, raw_len: int) -> str:
    """The property: PayloadError, or well-formed items; decode memory is bounded."""
    snapshot = bytes(data)
    tracemalloc.start()
    try:
        try:
            payload = decode_payload(data, key=key, max_body=MAX_BODY)
        except PayloadError as e:
            assert str(e).startswith("payload ") and "field " in str(e), e
            _note("rejected: " + str(e).split("field ", 1)[1].split(":")[0].split(".")[0][:40])
            return "rejected"
        finally:
            peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data == snapshot
    # what the decode yields: the values' bytes (held to the cap like the raw body: sparse
    # planes, format v2, store fewer bytes than they decode to)
    values = sum(e.count * dtype_of(e.dtype).itemsize for e in payload.header.items)
    bound = 64 * (max(raw_len, values) + len(data)) + (1 << 20)
    assert peak <= bound, (peak, raw_len, values, len(data))
    for it, entry in zip(payload.items, payload.header.items, strict=True):
        numel = math.prod(entry.shape)
        idx = it.indices
        assert idx.dtype == np.int64 and idx.shape == (entry.count,)
        assert it.values.shape == (entry.count,)
        assert it.values.dtype == dtype_of(entry.dtype).bits_np
        if entry.count:
            assert int(idx[0]) >= 0 and int(idx[-1]) < numel
            assert bool(np.all(np.diff(idx) > 0))
        it.validate()
    _note("decoded")
    return "decoded"


def test_bases_decode() -> None:
    for data, key in BASES:
        assert len(decode_payload(data, key=key).items) == 7
        rebuilt, raw_len = build(BASES.index((data, key)), [], True, True)
        assert check_decode(rebuilt, key, raw_len) == "decoded"


payload_case = st.tuples(
    st.integers(0, len(BASES) - 1),
    st.lists(mutation, min_size=1, max_size=4),
    st.sampled_from((True, True, True, False)),  # mostly fix the lengths up
    st.sampled_from((True, True, True, False)),  # mostly recompress a mutated body
)


def _run_payload_case(case: tuple) -> None:
    base, muts, fix_lengths, recompress = case
    data, raw_len = build(base, muts, fix_lengths, recompress)
    check_decode(data, BASES[base][1], raw_len)


@FAST
@given(payload_case)
def test_fuzz_decode_payload(case: tuple) -> None:
    _run_payload_case(case)


# --- relay message parser ------------------------------------------------------------------

GOOD_MESSAGES = [
    m.encode(x)
    for x in (
        m.Payload(version=3, attempt=1, payload_id="ab" * 16),
        m.PayloadAck(payload_id="cd" * 16, ok=False, node="n0", error="bad"),
        m.Manifest(version=3, attempt=1, payload_ids=("ab" * 16, "ef" * 16), timeout_s=5.0),
        m.ManifestAck(version=3, attempt=1, complete=False, failed=("n2",), node="n0"),
        m.Abandon(version=3, attempt=1, reason="owners failed"),
        m.AbandonAck(version=3, attempt=1),
        m.Forget(before_version=2),
        m.ForgetAck(before_version=2, node="n0", removed=5, keys=1),
        m.Refused(node="n0", error="why"),
    )
]
FIELDS = sorted({f for c in m._CLASSES.values() for f in c.__dataclass_fields__} | {"type"})

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([2**64 - 1, 2**64, -1, 0])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(["ab" * 16, "AB" * 16, "ab" * 15, "../x", ""])
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def relay_frame(draw) -> object:
    choice = draw(st.integers(0, 5))
    if choice == 0:
        return draw(st.binary(max_size=300))
    if choice == 1:  # a valid frame, mutated
        buf = bytearray(draw(st.sampled_from(GOOD_MESSAGES)))
        for op, pos, b in draw(
            st.lists(
                st.tuples(
                    st.sampled_from(("flip", "insert", "delete")),
                    st.integers(0, 1000),
                    st.integers(1, 255),
                ),
                min_size=1,
                max_size=4,
            )
        ):
            _mutate(buf, op, pos, b, 0, 1)
        return bytes(buf)
    if choice == 2:  # a known kind with arbitrary values for known (and unknown) fields
        body = {"type": draw(st.sampled_from([k.value for k in m.Kind]))}
        body.update(draw(st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=7)))
        return json.dumps(body).encode()
    if choice == 3:  # a valid frame with one field replaced
        body = json.loads(draw(st.sampled_from(GOOD_MESSAGES)))
        body[draw(st.sampled_from(sorted(body)))] = draw(json_value)
        return json.dumps(body).encode()
    if choice == 4:  # deep nesting and huge integer literals
        depth = draw(st.integers(1, 5000))
        digits = draw(st.integers(1, 6000))
        return draw(
            st.sampled_from(
                [
                    b"[" * depth + b"]" * depth,
                    b'{"type": "abandon_ack", "version": ' + b"9" * digits + b', "attempt": 0}',
                    b'{"a":' * depth + b"1" + b"}" * depth,
                ]
            )
        )
    return draw(
        st.sampled_from(
            ["{}", 5, None, 1.5, ["x"], {"type": "refused"}, bytearray(b"{}"), memoryview(b"[]")]
        )
    )


def check_relay(frame: object) -> str:
    try:
        msg = m.decode(frame)  # type: ignore[arg-type]
    except RelayMessageError as e:
        _note("rejected: " + str(e).split(":")[0][:40])
        return "rejected"
    assert type(msg) in m._CLASSES.values()
    assert m.decode(m.encode(msg)) == msg
    for name in msg.__dataclass_fields__:
        v = getattr(msg, name)
        if isinstance(v, int) and not isinstance(v, bool):
            assert 0 <= v < 1 << 64
        if name == "timeout_s":
            assert math.isfinite(v) and 0 < v <= m.MAX_TIMEOUT_S
        if name in ("payload_id", "payload_ids"):
            ids = [v] if isinstance(v, str) else list(v)
            assert all(len(i) == 32 and set(i) <= set("0123456789abcdef") for i in ids)
    _note(f"decoded {type(msg).__name__}")
    return "decoded"


def test_relay_good_messages_decode() -> None:
    assert all(check_relay(f) == "decoded" for f in GOOD_MESSAGES)


@FAST
@given(relay_frame())
def test_fuzz_relay_parser(frame: object) -> None:
    check_relay(frame)
