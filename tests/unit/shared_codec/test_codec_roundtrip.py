"""Property-based round trips of the codec: records -> payload bytes -> records, all dtypes,
shapes, densities 0-100%, empty items, single elements, the maximum index; plus bucketing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared_codec.buckets import BucketConfig, BucketEncoder, encode_items
from shared_codec.decode import decode_payload
from shared_codec.dtypes import BY_NAME
from shared_codec.format import PayloadMeta, encode_payload, peek_header
from shared_codec.records import (
    DeltaItem,
    Kind,
    apply_items,
    diff_checkpoints,
    diff_tensors,
    make_item,
)

DTYPES = sorted(BY_NAME)


@st.composite
def items(draw, owner: int = 7) -> DeltaItem:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=0, max_size=3)))
    numel = int(np.prod(shape)) if shape else 1
    density = draw(st.sampled_from([0.0, 0.001, 0.05, 0.3, 0.9, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    mask = rng.random(numel) < density
    if draw(st.booleans()):  # runs of consecutive indices
        start = int(rng.integers(0, numel))
        mask[start : start + int(rng.integers(1, 64))] = True
    if draw(st.booleans()):
        mask[numel - 1] = True  # the maximum index
    idx = np.flatnonzero(mask).astype(np.int64)
    d = BY_NAME[dtype]
    vals = rng.integers(
        0, 2 ** (8 * d.itemsize), size=idx.shape[0], dtype=np.uint64, endpoint=False
    )
    kind = draw(st.sampled_from([Kind.XOR, Kind.OVERWRITE]))
    name = draw(st.sampled_from(["w", "model.layers.0.self_attn.q_proj.weight", "ü/ñ.name"]))
    return make_item(name, dtype, shape, owner, kind, idx, vals.astype(d.bits_np))


META = PayloadMeta(version=5, base_version=4, attempt=2, owner=7, sequence=3, baseline_id=b"B" * 16)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(items(), min_size=0, max_size=4), st.booleans(), st.booleans(), st.booleans())
def test_payload_round_trip(its, paper, keyed, compress) -> None:
    key = b"secret" if keyed else None
    data = encode_payload(its, META, key=key, paper=paper, compress=compress)
    p = decode_payload(data, key=key)
    assert p.meta == META
    assert len(p.items) == len(its)
    for got, want in zip(p.items, its, strict=True):
        assert got.same_as(want)
    # payload id is a content hash: identical content, identical id and bytes
    again = encode_payload(its, META, key=key, paper=paper, compress=compress)
    assert again == data and peek_header(again, key=key).payload_id == p.payload_id


@settings(max_examples=40, deadline=None)
@given(st.lists(items(), min_size=1, max_size=5), st.integers(64, 4000))
def test_buckets_split_and_reassemble(its, bucket_bytes) -> None:
    payloads = encode_items(its, META, BucketConfig(bucket_bytes=bucket_bytes, threads=0))
    decoded = [decode_payload(p) for p in payloads]
    assert [d.meta.sequence for d in decoded] == list(range(3, 3 + len(payloads)))
    for d in decoded:
        raw = sum(i.raw_bytes for i in d.items)
        max_entry = max(8 + i.dtype_info.itemsize for i in d.items)
        assert raw <= bucket_bytes + max_entry
    # concatenating the parts of each tensor restores every item, in order
    flat = [i for d in decoded for i in d.items]
    pos = 0
    for want in its:
        parts, n = [], 0
        while n < want.count or (want.count == 0 and not parts):
            part = flat[pos]
            pos += 1
            assert (part.name, part.dtype, part.shape, part.kind) == (
                want.name,
                want.dtype,
                want.shape,
                want.kind,
            )
            parts.append(part)
            n += part.count
        assert np.array_equal(np.concatenate([p.indices for p in parts]), want.indices)
        assert np.array_equal(np.concatenate([p.values for p in parts]), want.values)
    assert pos == len(flat)


def test_threaded_buckets_keep_order() -> None:
    rng = np.random.default_rng(0)
    its = []
    for k in range(12):
        idx = np.sort(rng.choice(1_000_000, size=50_000, replace=False)).astype(np.int64)
        its.append(
            make_item(
                f"t{k}",
                "bfloat16",
                (1000, 1000),
                7,
                Kind.XOR,
                idx,
                rng.integers(0, 65536, size=idx.size).astype(np.uint16),
            )
        )
    cfg = BucketConfig(bucket_bytes=400_000, threads=2, parallel_min_bytes=1)
    enc = BucketEncoder(META, cfg)
    out: list[bytes] = []
    for it in its:
        out += enc.add(it)
    out += enc.finish()
    assert out == encode_items(its, META, BucketConfig(bucket_bytes=400_000, threads=0))
    assert enc.payload_count == len(out) and enc.stored_bytes == sum(map(len, out))


def _bf16_items(n: int, entries: int, seed: int = 0) -> list[DeltaItem]:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        idx = np.sort(rng.choice(1_000_000, size=entries, replace=False)).astype(np.int64)
        vals = rng.integers(0, 65536, size=idx.size).astype(np.uint16)
        out.append(make_item(f"t{k}", "bfloat16", (1000, 1000), 7, Kind.XOR, idx, vals))
    return out


def _raw_sizes(payloads: list[bytes]) -> list[int]:
    return [sum(it.raw_bytes for it in decode_payload(p).items) for p in payloads]


def test_taper_shrinks_the_last_buckets_and_keeps_every_record() -> None:
    its = _bf16_items(8, 40_000)  # 8 x 400,000 raw record bytes
    total = sum(it.raw_bytes for it in its)
    cfg = BucketConfig(bucket_bytes=1_000_000, min_bucket_bytes=50_000, threads=0)
    enc = BucketEncoder(META, cfg)
    out: list[bytes] = []
    for k, it in enumerate(its):
        out += enc.add(it, after=sum(x.raw_bytes for x in its[k + 1 :]))
    out += enc.finish()
    sizes = _raw_sizes(out)
    assert sum(sizes) == total == enc.raw_bytes
    # full buckets while more than two buckets' worth is still to come, then halving to the floor
    assert sizes == [1_000_000, 1_000_000, 600_000, 300_000, 150_000, 75_000, 50_000, 25_000]
    plain = _raw_sizes(encode_items(its, META, BucketConfig(bucket_bytes=1_000_000, threads=0)))
    assert plain == [1_000_000, 1_000_000, 1_000_000, 200_000]
    got = [it for p in out for it in decode_payload(p).items]
    for want in its:
        parts = [g for g in got if g.name == want.name]
        assert np.array_equal(np.concatenate([p.indices for p in parts]), want.indices)
        assert np.array_equal(np.concatenate([p.values for p in parts]), want.values)
    assert [peek_header(p).meta.sequence for p in out] == list(range(3, 3 + len(out)))


def test_taper_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="min_bucket_bytes"):
        BucketConfig(min_bucket_bytes=8)
    enc = BucketEncoder(META, BucketConfig(threads=0))
    with pytest.raises(ValueError, match="after must be >= 0"):
        enc.add(_bf16_items(1, 10)[0], after=-1)
    assert enc.open_bytes == 0 and enc.finish() == []


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int32,
    ],
)
@pytest.mark.parametrize("kind", [Kind.XOR, Kind.OVERWRITE])
def test_diff_apply_is_bit_exact_including_nan_payloads(dtype, kind) -> None:
    g = torch.Generator().manual_seed(1)
    old = torch.randn(64, 33, generator=g)
    new = old.clone()
    new[::3] *= 1.01
    old_t, new_t = old.to(dtype), new.to(dtype)
    if dtype.is_floating_point and dtype.itemsize == 2:
        # NaNs with different payloads and signed zeros must round-trip as bits
        new_t.view(torch.int16)[0, :4] = torch.tensor(
            [0x7FC1, 0x7FC2, -32768, 0], dtype=torch.int16
        )
    item = diff_tensors("w", old_t, new_t, owner=7, kind=kind)
    p = decode_payload(encode_payload([item], META))
    state = {"w": old_t.clone()}
    apply_items(state, p.items)
    assert torch.equal(state["w"].view(torch.uint8), new_t.view(torch.uint8))


def test_make_item_rejects_inconsistent_records() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        make_item("w", "bfloat16", (10,), 0, Kind.XOR, np.array([3, 3]), np.zeros(2, np.uint16))
    with pytest.raises(ValueError, match="out of range"):
        make_item("w", "bfloat16", (10,), 0, Kind.XOR, np.array([10]), np.zeros(1, np.uint16))
    with pytest.raises(ValueError, match="need 2 bytes"):
        make_item("w", "bfloat16", (10,), 0, Kind.XOR, np.array([1]), np.zeros(1, np.uint32))
    with pytest.raises(ValueError, match="not carried"):
        make_item("w", "complex64", (10,), 0, Kind.XOR, np.array([1]), np.zeros(1, np.uint64))
    with pytest.raises(ValueError, match="owner"):
        encode_payload(
            [make_item("w", "int8", (4,), 1, Kind.XOR, np.array([1]), np.zeros(1, np.uint8))], META
        )


def test_diff_checkpoints_sorted_nonempty_with_overwrite_names() -> None:
    g = torch.Generator().manual_seed(3)
    old = {n: torch.randn(16, generator=g).to(torch.bfloat16) for n in ("b", "a", "same", "c")}
    new = {n: t.clone() for n, t in old.items()}
    for n in ("a", "b", "c"):
        new[n][::3] += 1
    items = diff_checkpoints(old, new, overwrite={"c"}, owner=2)
    assert [(i.name, i.kind, i.owner) for i in items] == [
        ("a", Kind.XOR, 2),
        ("b", Kind.XOR, 2),
        ("c", Kind.OVERWRITE, 2),
    ]  # "same" has no changed bits: no item
    tensors = {n: t.clone() for n, t in old.items()}
    apply_items(tensors, items)
    for n in old:
        assert torch.equal(tensors[n].view(torch.int16), new[n].view(torch.int16))
    assert all(i.kind == Kind.OVERWRITE for i in diff_checkpoints(old, new, kind=Kind.OVERWRITE))
