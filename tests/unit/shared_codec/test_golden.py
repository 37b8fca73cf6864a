"""Golden bytes: stored payloads of every format version decode to known records, and encoding
those records reproduces the stored bytes of the current version (2) exactly. Version-1 files
(written before version 2) are frozen: they must keep decoding. Regenerate the current
version's files (only for a deliberate format change, with a new format version) with:
python -m tests.unit.shared_codec.test_golden regen
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from shared_codec.decode import decode_payload
from shared_codec.format import ID_OFFSET, VERSION, PayloadMeta, encode_payload, peek_header
from shared_codec.records import Kind, make_item

GOLDEN = Path(__file__).with_name("golden")
META = PayloadMeta(
    version=7, base_version=6, attempt=1, owner=2, sequence=9, baseline_id=bytes(range(16))
)
KEY = b"golden-key"


def golden_items():
    return [
        # bf16 XOR masks, sparse -> gap coding
        make_item(
            "model.layers.0.mlp.up_proj.weight",
            "bfloat16",
            (4, 8),
            2,
            Kind.XOR,
            np.array([1, 2, 9, 31]),
            np.array([0x0001, 0x0003, 0x0100, 0x8000], np.uint16),
        ),
        # fp32 overwrites of a run -> range coding
        make_item(
            "model.norm.weight",
            "float32",
            (64,),
            2,
            Kind.OVERWRITE,
            np.arange(8, 48),
            np.array([0x3F800000, 0x7FC00001, 0x80000000, 0x00000001] * 10, np.uint32),
        ),
        # fp8 dense but irregular -> bitmap coding
        make_item(
            "experts.w",
            "float8_e4m3fn",
            (8, 25),
            2,
            Kind.OVERWRITE,
            np.array([i for i in range(200) if i % 3 != 1]),
            (np.arange(133) % 251).astype(np.uint8),
        ),
        # empty item
        make_item(
            "empty", "int64", (3,), 2, Kind.XOR, np.array([], np.int64), np.array([], np.uint64)
        ),
    ]


VARIANTS = {
    "plain": {"compress": False},
    "zstd": {"compress": True},
    "zstd_keyed": {"compress": True, "key": KEY},
    "paper": {"compress": True, "paper": True},
}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_golden_decodes_and_reencodes(name: str, version: int) -> None:
    stored = (GOLDEN / f"v{version}_{name}.bin").read_bytes()
    opts = VARIANTS[name]
    p = decode_payload(stored, key=opts.get("key"))
    assert p.meta == META and p.header.format_version == version
    want = golden_items()
    assert len(p.items) == len(want)
    for got, exp in zip(p.items, want, strict=True):
        assert got.same_as(exp)
    if version == VERSION:
        assert encode_payload(want, META, **opts) == stored
    else:  # re-encoded in the current version, only the version, id and digest differ
        again = encode_payload(want, META, **opts)
        assert again[4:6] == struct.pack("<H", VERSION)
        assert again[6:ID_OFFSET] == stored[6:ID_OFFSET]
        assert again[ID_OFFSET + 16 : -32] == stored[ID_OFFSET + 16 : -32]
    h = peek_header(stored, key=opts.get("key"))
    assert [e.loc_encoding for e in h.items] == (
        [4, 4, 4, 2] if opts.get("paper") else [1, 2, 3, 2]
    )


def split_items():
    """Items of `v1_split_blocks.bin` (added 2026-12-04) and the first two of
    `v2_sparse_blocks.bin`: a sparse BF16 XOR item (1% of 200,000 elements: split-gaps
    locations, code 5) whose byte planes exceed 1 KiB, so the zstd body ends a block per plane
    (compression.compress_parts), and a denser one (plain gaps). Their high value planes are
    zero: sparse planes (value code 2) in version 2."""
    rng = np.random.default_rng(18)
    out = []
    for name, rate in (("model.layers.1.mlp.down_proj.weight", 0.01), ("lm_head.weight", 0.05)):
        idx = np.flatnonzero(rng.random(200_000) < rate)
        vals = rng.integers(0, 1 << 16, idx.size).astype(np.uint16) & 0x00FF
        out.append(make_item(name, "bfloat16", (200, 1000), 2, Kind.XOR, idx, vals))
    return out


def sparse_items():
    """Items of `v2_sparse_blocks.bin` (added 2026-12-04): `split_items`, then a 2.4% BF16
    XOR item whose gaps' high plane is almost all zero (sparse gaps, location code 6) and whose
    high value plane has a few exponent carries (sparse planes, value code 2)."""
    rng = np.random.default_rng(19)
    idx = np.flatnonzero(rng.random(400_000) < 0.024)
    vals = rng.integers(0, 256, idx.size).astype(np.uint16)
    vals[rng.random(idx.size) < 0.007] |= 0x0100
    return [
        *split_items(),
        make_item(
            "model.layers.2.mlp.gate_proj.weight", "bfloat16", (400, 1000), 2, Kind.XOR, idx, vals
        ),
    ]


def test_golden_split_blocks_decodes() -> None:
    stored = (GOLDEN / "v1_split_blocks.bin").read_bytes()
    p = decode_payload(stored)
    assert p.meta == META and p.header.format_version == 1
    want = split_items()
    for got, exp in zip(p.items, want, strict=True):
        assert got.same_as(exp)
    assert [(e.loc_encoding, e.val_encoding) for e in p.header.items] == [(5, 1), (1, 1)]


def test_golden_sparse_blocks_decodes_and_reencodes() -> None:
    stored = (GOLDEN / "v2_sparse_blocks.bin").read_bytes()
    p = decode_payload(stored)
    assert p.meta == META and p.header.format_version == 2
    want = sparse_items()
    for got, exp in zip(p.items, want, strict=True):
        assert got.same_as(exp)
    assert [(e.loc_encoding, e.val_encoding) for e in p.header.items] == [(5, 2), (1, 2), (6, 2)]
    assert encode_payload(want, META) == stored


def test_plain_layout_matches_docs() -> None:
    """The first bytes of the uncompressed golden payload, as spelled out in docs/format.md."""
    b = (GOLDEN / "v2_plain.bin").read_bytes()
    assert b[:4] == b"DCRP" and b[4:6] == b"\x02\x00" and b[6:8] == b"\x00\x00"
    assert int.from_bytes(b[12:20], "little") == 7  # version
    assert int.from_bytes(b[20:28], "little") == 6  # base_version
    assert int.from_bytes(b[28:36], "little") == 1  # attempt
    assert b[36:52] == bytes(range(16))  # baseline_id
    assert int.from_bytes(b[52:56], "little") == 2  # owner
    assert int.from_bytes(b[56:60], "little") == 9  # sequence


def regen() -> None:
    """Write the current version's files (version-1 files are frozen)."""
    GOLDEN.mkdir(exist_ok=True)
    for name, opts in VARIANTS.items():
        path = GOLDEN / f"v{VERSION}_{name}.bin"
        path.write_bytes(encode_payload(golden_items(), META, **opts))
        print("wrote", path)
    path = GOLDEN / f"v{VERSION}_sparse_blocks.bin"
    path.write_bytes(encode_payload(sparse_items(), META))
    print("wrote", path)


if __name__ == "__main__" and sys.argv[1:] == ["regen"]:
    regen()
