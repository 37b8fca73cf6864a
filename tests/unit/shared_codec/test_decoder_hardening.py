"""Decoder hardening: every malformed payload is rejected with PayloadError naming the payload
and the field, never another exception, a crash or a hang; decoding mutates nothing."""

from __future__ import annotations

import hashlib
import struct
import time

import numpy as np
import pytest

from shared_codec import format as fmt
from shared_codec.decode import decode_payload
from shared_codec.errors import PayloadError
from shared_codec.format import PayloadMeta, encode_payload
from shared_codec.records import Kind, make_item

META = PayloadMeta(version=2, base_version=1, attempt=0, owner=1, sequence=0)


def _items():
    rng = np.random.default_rng(3)
    idx = np.sort(rng.choice(5000, 300, replace=False)).astype(np.int64)
    return [
        make_item(
            "a",
            "bfloat16",
            (50, 100),
            1,
            Kind.XOR,
            idx,
            rng.integers(0, 1 << 16, 300).astype(np.uint16),
        ),
        make_item(
            "b", "float32", (7,), 1, Kind.OVERWRITE, np.arange(7), np.arange(7, dtype=np.uint32)
        ),
        make_item(
            "c", "int8", (3, 3), 1, Kind.OVERWRITE, np.array([0, 8]), np.array([1, 2], np.uint8)
        ),
        make_item(
            "d", "bfloat16", (1000,), 1, Kind.XOR, np.arange(100, 900), np.ones(800, np.uint16)
        ),
    ]


def _reseal(buf: bytearray, key: bytes | None = None) -> bytes:
    """Recompute payload id and digest after a mutation, so the structural checks are reached."""
    body_end = len(buf) - fmt.DIGEST_SIZE
    if body_end < fmt.ID_OFFSET + fmt.ID_SIZE:
        return bytes(buf)
    buf[fmt.ID_OFFSET : fmt.ID_OFFSET + fmt.ID_SIZE] = b"\x00" * fmt.ID_SIZE
    pid = hashlib.blake2b(bytes(buf[:body_end]), digest_size=fmt.ID_SIZE).digest()
    buf[fmt.ID_OFFSET : fmt.ID_OFFSET + fmt.ID_SIZE] = pid
    buf[body_end:] = fmt._digest(bytes(buf[:body_end]), key)
    return bytes(buf)


def _decode_or_reject(data: bytes, key: bytes | None = None):
    try:
        return decode_payload(data, key=key, max_body=1 << 22)
    except PayloadError as e:
        assert str(e).startswith("payload "), e
        assert "field " in str(e), e
        return None


@pytest.mark.parametrize("compress", [True, False])
def test_fuzz_mutations_and_truncations(compress: bool) -> None:
    """Thousands of mutated/truncated payloads, half re-sealed so the parser itself is tested."""
    good = encode_payload(_items(), META, compress=compress, paper=not compress)
    reference = decode_payload(good)
    rng = np.random.default_rng(0 if compress else 1)
    deadline = time.monotonic() + 60
    outcomes = {"decoded": 0, "rejected": 0}
    for _case in range(3000):
        assert time.monotonic() < deadline, "fuzz cases must finish in bounded time"
        buf = bytearray(good)
        op = int(rng.integers(0, 4))
        if op == 0:  # flip random bytes, half of the time inside the header
            limit = len(buf) if rng.random() < 0.5 else min(len(buf), 300)
            for pos in rng.integers(0, limit, size=int(rng.integers(1, 4))):
                buf[pos] ^= int(rng.integers(1, 256))
        elif op == 1:  # truncate
            buf = buf[: int(rng.integers(0, len(buf)))]
        elif op == 2:  # overwrite a header integer with an extreme value
            pos = int(rng.integers(0, min(len(buf) - 8, 400)))
            extreme = [0, 1, 2**31, 2**63 - 1, 2**64 - 1][int(rng.integers(0, 5))]
            buf[pos : pos + 8] = struct.pack("<Q", extreme)
        else:  # insert junk
            pos = int(rng.integers(0, len(buf)))
            buf[pos:pos] = bytes(rng.integers(0, 256, size=int(rng.integers(1, 9)), dtype=np.uint8))
        data = _reseal(buf) if rng.random() < 0.7 else bytes(buf)
        snapshot = bytes(data)
        got = _decode_or_reject(data)
        assert data == snapshot  # decoding never mutates its input
        if got is None:
            outcomes["rejected"] += 1
            continue
        outcomes["decoded"] += 1
        # anything accepted is a well-formed payload whose items validate
        for it in got.items:
            it.validate()
        if data == good:
            assert all(a.same_as(b) for a, b in zip(got.items, reference.items, strict=True))
    assert outcomes["rejected"] > 2000


def test_specific_rejections_name_the_field() -> None:
    good = encode_payload(_items(), META)
    cases = {
        "magic": lambda b: b.__setitem__(slice(0, 4), b"XXXX"),
        "format_version": lambda b: b.__setitem__(slice(4, 6), struct.pack("<H", 3)),
        "flags": lambda b: b.__setitem__(slice(6, 8), struct.pack("<H", 0x80)),
    }
    for field, mutate in cases.items():
        buf = bytearray(good)
        mutate(buf)
        with pytest.raises(PayloadError, match=f"field {field}"):
            decode_payload(_reseal(buf))
    with pytest.raises(PayloadError, match="field digest"):
        decode_payload(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(PayloadError, match="too short|field"):
        decode_payload(good[:20])


def test_keys() -> None:
    keyed = encode_payload(_items(), META, key=b"k1")
    assert decode_payload(keyed, key=b"k1").items
    with pytest.raises(PayloadError, match="wrong key"):
        decode_payload(keyed, key=b"k2")
    with pytest.raises(PayloadError, match="no key configured"):
        decode_payload(keyed)
    with pytest.raises(PayloadError, match="unauthenticated payload rejected"):
        decode_payload(encode_payload(_items(), META), key=b"k1")
    # a forger without the key who re-seals with an unkeyed digest is still rejected
    forged = bytearray(keyed)
    forged[-40] ^= 1
    with pytest.raises(PayloadError):
        decode_payload(_reseal(forged, key=b"guess"), key=b"k1")


def test_decompression_bomb_is_bounded() -> None:
    """A payload declaring a huge body is rejected before anything that size is allocated."""
    big = make_item(
        "z", "uint8", (1 << 24,), 1, Kind.OVERWRITE, np.arange(1 << 24), np.zeros(1 << 24, np.uint8)
    )
    data = encode_payload([big], META)
    assert len(data) < 1 << 16  # compresses to almost nothing
    with pytest.raises(PayloadError, match="exceeds the cap"):
        decode_payload(data, max_body=1 << 20)
    assert decode_payload(data, max_body=1 << 26).items[0].count == 1 << 24


def test_too_many_items_is_rejected() -> None:
    its = [
        make_item(f"t{i}", "int8", (2,), 1, Kind.XOR, np.array([0]), np.ones(1, np.uint8))
        for i in range(10)
    ]
    with pytest.raises(PayloadError, match="n_items"):
        decode_payload(encode_payload(its, META), max_items=5)
