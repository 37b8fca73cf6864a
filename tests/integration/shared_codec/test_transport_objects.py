"""Object-storage transport against a real S3 endpoint (moto_server on loopback, started by a
fixture) and the local-directory store: every payload arrives exactly once at every rollout node
with identical bytes, manifests are honoured, missing objects and manifests fail clearly, and
injected S3 errors (a loopback proxy answering 503) are retried.

The cases against a real S3 endpoint (and the same cases on a directory) are here; the local-only ones in tests/unit/shared_codec/test_transport_objects.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from shared_codec.transport import (
    DirectoryStore,
    ObjectFetcher,
    ObjectPublisher,
    S3Store,
    TransportError,
    write_manifest,
)
from shared_codec.transport.objects import cleanup
from tests.unit.shared_codec.test_transport_objects import (
    _FaultProxy,
    _payloads,
)


def _stores(kind: str, tmp_path: Path, endpoint: str | None, bucket: str):
    if kind == "dir":
        return DirectoryStore(tmp_path / "store")
    return S3Store(
        bucket,
        endpoint_url=endpoint,
        prefix="dcr/test",
        create_bucket=True,
        multipart_threshold=5 << 20,
    )


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_every_payload_exactly_once_at_every_node(kind, tmp_path, moto_endpoint) -> None:
    store = _stores(kind, tmp_path, moto_endpoint, f"bucket-{kind}-1")
    sent = {}
    for owner in (0, 1, 2):
        pub = ObjectPublisher(store, version=2, attempt=0, owner=owner)
        for p in _payloads(owner):
            pub.send(p)
            sent[p] = owner
        listing = pub.finish()
        assert len(listing["payloads"]) == len(_payloads(owner)) > 1
    # an object that no owner list mentions is not part of the attempt
    store.put("v000000000002/a000000/o00000/s999999-stray.dcrp", b"junk")
    write_manifest(store, version=2, base_version=1, attempt=0, owners=[0, 1, 2])
    for _node in range(3):
        fetcher = ObjectFetcher(store)
        got = list(fetcher.fetch(2, 0, timeout_s=5))
        assert sorted(got) == sorted(sent)  # identical bytes, each exactly once
        assert fetcher.bytes_fetched == sum(len(p) for p in sent)


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_manifest_rules_and_missing_objects(kind, tmp_path, moto_endpoint) -> None:
    store = _stores(kind, tmp_path, moto_endpoint, f"bucket-{kind}-2")
    pub = ObjectPublisher(store, version=3, attempt=1, owner=0)
    for p in _payloads(0, version=3, attempt=1):
        pub.send(p)
    listing = pub.finish()
    with pytest.raises(TransportError, match="no manifest"):
        list(ObjectFetcher(store).fetch(3, 1, timeout_s=0.3))
    with pytest.raises(TransportError, match="owner 1 has not finished"):
        write_manifest(store, version=3, base_version=2, attempt=1, owners=[0, 1])
    write_manifest(store, version=3, base_version=2, attempt=1, owners=[0])
    write_manifest(store, version=3, base_version=2, attempt=1, owners=[0])  # idempotent
    store.delete(listing["payloads"][1]["key"])
    with pytest.raises(TransportError, match="listed in the manifest is missing"):
        list(ObjectFetcher(store).fetch(3, 1, timeout_s=1))
    with pytest.raises(ValueError, match="publisher is"):
        ObjectPublisher(store, version=4, attempt=0, owner=0).send(_payloads(0)[0])
    assert cleanup(store, committed_version=4) > 0
    assert store.list("v000000000003") == []


@pytest.mark.s3
def test_injected_s3_errors_are_retried(moto_endpoint) -> None:
    proxy = _FaultProxy(moto_endpoint, failures=6)
    t = threading.Thread(target=proxy.serve_forever, daemon=True)
    t.start()
    try:
        endpoint = f"http://127.0.0.1:{proxy.server_address[1]}"
        direct = S3Store("bucket-faults", endpoint_url=moto_endpoint, create_bucket=True)
        store = S3Store("bucket-faults", endpoint_url=endpoint)
        store.put("k/one", b"payload-bytes")
        assert direct.get("k/one") == b"payload-bytes"
        assert store.get("k/one") == b"payload-bytes"
        assert proxy.failed == 6  # every injected failure was absorbed by retries
        never = S3Store("bucket-faults", endpoint_url=endpoint)
        proxy.failures = proxy.failed + 10_000
        never.retry = type(never.retry)(attempts=2, base_s=0.01)
        with pytest.raises(TransportError, match="failed after 2 tries"):
            never.put("k/two", b"x")
    finally:
        proxy.shutdown()


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_stream_yields_payloads_before_the_manifest(kind, tmp_path, moto_endpoint) -> None:
    """`ObjectFetcher.stream`: payloads come out as their objects appear (the owner publishes
    the rest only after the first one was yielded), each exactly once; the manifest is checked
    at the end (an object it does not list fails the attempt); an abandoned attempt stops the
    stream with the coordinator's reason."""
    from shared_codec.transport.objects import abandon_attempt

    store = _stores(kind, tmp_path, moto_endpoint, f"bucket-{kind}-4")
    mine = {o: _payloads(o, version=5, attempt=0) for o in (0, 1)}
    payloads = mine[0] + mine[1]
    pubs = {o: ObjectPublisher(store, version=5, attempt=0, owner=o) for o in (0, 1)}
    pubs[0].send(payloads[0])
    pubs[0]._futures[0].result()
    stream = ObjectFetcher(store).stream(5, 0, timeout_s=10)
    got = [next(stream)]  # before anything else, let alone the manifest, exists
    assert got == [payloads[0]]
    for o in (0, 1):
        for p in mine[o][1 if o == 0 else 0 :]:
            pubs[o].send(p)
    for pub in pubs.values():
        pub.finish()
    write_manifest(store, version=5, base_version=4, attempt=0, owners=[0, 1])
    got.extend(stream)
    assert sorted(got) == sorted(payloads)  # identical bytes, each exactly once

    # a valid payload of the attempt that no owner list mentions fails the stream
    pub = ObjectPublisher(store, version=6, attempt=0, owner=0)
    six = _payloads(0, version=6, attempt=0)
    for p in six[:-1]:
        pub.send(p)
    pub.finish()
    store.put(f"v000000000006/a000000/o00000/s999998-{'e' * 8}.dcrp", six[-1])
    write_manifest(store, version=6, base_version=5, attempt=0, owners=[0])
    with pytest.raises(TransportError, match="not listed by the manifest"):
        list(ObjectFetcher(store).stream(6, 0, timeout_s=10))

    # abandoned: no manifest will come
    abandon_attempt(store, version=7, attempt=0, reason="owners failed: rank 1 died")
    with pytest.raises(TransportError, match="abandoned by the coordinator: owners failed"):
        list(ObjectFetcher(store).stream(7, 0, timeout_s=10))
    with pytest.raises(TransportError, match="abandoned"):
        ObjectFetcher(store).manifest(7, 0, timeout_s=10)


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_sink_and_source_seam(kind, tmp_path, moto_endpoint) -> None:
    """`open_sink` / `open_source` on one spec: owners' sinks carry their payloads, the source
    streams them before the seal and fetches them (in (owner, sequence) order) after it; a
    sink opened without an owner (the coordinator) abandons an attempt, which stops both
    `fetch` and `stream`; a cancelled stream ends quietly."""
    import json

    from shared_codec.transport import Seal, open_sink, open_source

    if kind == "dir":
        spec: dict = {"kind": "dir", "root": str(tmp_path / "seam")}
    else:
        S3Store("bucket-seam", endpoint_url=moto_endpoint, create_bucket=True)
        spec = {"kind": "s3", "bucket": "bucket-seam", "endpoint_url": moto_endpoint, "prefix": "p"}
    mine = {o: _payloads(o, version=8, attempt=0) for o in (0, 1)}
    source = open_source(json.dumps(spec))
    stream = source.stream(8, 0, timeout_s=20)
    sinks = {o: open_sink(spec, version=8, attempt=0, owner=o) for o in (0, 1)}
    sinks[0].send(mine[0][0])
    sinks[0]._pub._futures[0].result()  # type: ignore[attr-defined]
    got = [next(stream)]  # before anything else, let alone the seal, exists
    assert got == mine[0][:1]
    for o in (0, 1):
        for p in mine[o][1 if o == 0 else 0 :]:
            sinks[o].send(p)
    reports = {o: sinks[o].finish() for o in (0, 1)}
    for o in (0, 1):
        assert len(reports[o].payload_ids) == len(mine[o])
        assert reports[o].bytes == sum(len(p) for p in mine[o])
    with pytest.raises(TransportError, match="no manifest"):
        list(source.fetch(8, 0, timeout_s=0.3))
    ids = tuple(i for o in (0, 1) for i in reports[o].payload_ids)
    sinks[0].seal(Seal(base_version=7, owners=(0, 1), payload_ids=ids))
    got.extend(stream)
    assert sorted(got) == sorted(mine[0] + mine[1])  # each exactly once
    assert list(source.fetch(8, 0, timeout_s=5)) == mine[0] + mine[1]
    # what the seal names, for receivers that apply exactly that set
    sealed = source.sealed(8, 0, timeout_s=5)
    assert (sealed.version, sealed.attempt, sealed.base_version) == (8, 0, 7)
    assert sealed.payload_ids == ids
    for s in sinks.values():
        s.close()

    with open_sink(spec, version=9, attempt=0) as coordinator:
        with pytest.raises(ValueError, match="without an owner"):
            coordinator.send(mine[0][0])
        coordinator.abandon("owners failed: rank 1 died")
    for it in (source.fetch(9, 0, timeout_s=10), source.stream(9, 0, timeout_s=10)):
        with pytest.raises(TransportError, match="abandoned by the coordinator: owners failed"):
            list(it)
    with pytest.raises(TransportError, match="abandoned by the coordinator"):
        source.sealed(9, 0, timeout_s=10)
    assert list(source.stream(10, 0, timeout_s=10, cancelled=lambda: True)) == []
