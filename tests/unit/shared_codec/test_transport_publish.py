"""`publish_attempt` (shared_codec/transport/publish.py) on a real directory store: every owner's
payloads go through its own sink, the seal names every owner and payload id, and a rollout
node's source reads back exactly those bytes; a payload of another attempt is refused by the
sink before anything is sealed."""

from __future__ import annotations

import numpy as np
import pytest

from shared_codec.buckets import BucketConfig, encode_items
from shared_codec.format import PayloadMeta, peek_header
from shared_codec.records import Kind, make_item
from shared_codec.transport import open_source, publish_attempt


def _payloads(owner: int, version: int, attempt: int) -> list[bytes]:
    rng = np.random.default_rng(owner)
    idx = np.sort(rng.choice(50_000, 2_000, replace=False)).astype(np.int64)
    item = make_item(f"t{owner}", "bfloat16", (50_000,), owner, Kind.XOR, idx,
                     rng.integers(1, 1 << 16, idx.size).astype(np.uint16))  # fmt: skip
    meta = PayloadMeta(version=version, base_version=version - 1, attempt=attempt, owner=owner,
                       sequence=0)  # fmt: skip
    return encode_items([item], meta, BucketConfig(bucket_bytes=1500, threads=0))


def test_every_owner_sent_then_sealed(tmp_path) -> None:
    spec = {"kind": "dir", "root": str(tmp_path)}
    sent = {o: _payloads(o, 3, 1) for o in (1, 0)}
    assert all(len(p) > 1 for p in sent.values())
    ids = publish_attempt(spec, version=3, attempt=1, base_version=2, payloads=sent)
    want = [peek_header(p, verify=False).payload_id_hex for o in (0, 1) for p in sent[o]]
    assert list(ids) == want
    source = open_source(spec)
    sealed = source.sealed(3, 1, 5.0)
    assert sealed.base_version == 2 and list(sealed.payload_ids) == want
    assert sorted(source.fetch(3, 1, 5.0)) == sorted(p for ps in sent.values() for p in ps)


def test_a_payload_of_another_attempt_is_refused_before_the_seal(tmp_path) -> None:
    spec = {"kind": "dir", "root": str(tmp_path)}
    with pytest.raises(ValueError, match="attempt"):
        publish_attempt(
            spec, version=3, attempt=2, base_version=2, payloads={0: _payloads(0, 3, 1)}
        )
    with pytest.raises(Exception, match="manifest"):
        open_source(spec).sealed(3, 2, 0.2)
