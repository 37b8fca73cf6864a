"""Object-storage transport against a real S3 endpoint (moto_server on loopback, started by a
fixture) and the local-directory store: every payload arrives exactly once at every rollout node
with identical bytes, manifests are honoured, missing objects and manifests fail clearly, and
injected S3 errors (a loopback proxy answering 503) are retried."""

from __future__ import annotations

import http.client
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest

from shared_codec.buckets import BucketConfig, encode_items
from shared_codec.format import PayloadMeta
from shared_codec.records import Kind, make_item
from shared_codec.transport import (
    DirectoryStore,
    ObjectFetcher,
    ObjectPublisher,
    TransportError,
    write_manifest,
)


class _FaultProxy(http.server.ThreadingHTTPServer):
    """Loopback HTTP proxy that answers 503 SlowDown to the first `failures` requests."""

    def __init__(self, upstream: str, failures: int) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.failures = failures
        self.lock = threading.Lock()
        self.failed = 0
        super().__init__(("127.0.0.1", 0), _ProxyHandler)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _relay(self) -> None:
        srv: _FaultProxy = self.server  # type: ignore[assignment]
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        with srv.lock:
            fail = srv.failed < srv.failures
            if fail:
                srv.failed += 1
        if fail:
            msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        host, port = srv.upstream.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
        conn.request(self.command, self.path, body=body or None, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay


def _payloads(owner: int, version: int = 2, attempt: int = 0) -> list[bytes]:
    rng = np.random.default_rng(owner)
    items = []
    for t in range(4):
        idx = np.sort(rng.choice(200_000, 20_000, replace=False)).astype(np.int64)
        items.append(
            make_item(
                f"o{owner}.t{t}",
                "bfloat16",
                (200_000,),
                owner,
                Kind.XOR,
                idx,
                rng.integers(0, 1 << 16, idx.size).astype(np.uint16),
            )
        )
    meta = PayloadMeta(
        version=version, base_version=version - 1, attempt=attempt, owner=owner, sequence=0
    )
    return encode_items(items, meta, BucketConfig(bucket_bytes=100_000, threads=0))


def test_directory_listing_walks_only_the_prefix_and_hides_partial_writes(tmp_path: Path) -> None:
    from shared_codec.transport.store import (
        DEFAULT_POLL_S,
        DirectoryStore,
        ThrottledStore,
        poll_interval,
    )

    store = DirectoryStore(tmp_path / "s")
    keys = ["v1/a0/o0.dcrp", "v1/a0/o1.dcrp", "v1/a0/owners/r0.json", "v1/a1/o0.dcrp", "v10/x", "w"]
    for k in keys:
        store.put(k, k.encode())
    (tmp_path / "s" / "v1" / "a0" / ".tmp-half").write_bytes(b"partial")  # a write in flight
    assert store.list("") == sorted(keys)
    assert store.list("v1") == sorted(keys[:5])  # "v10/x" starts with "v1" too
    assert store.list("v1/") == keys[:4]
    assert store.list("v1/a0/o") == keys[:3]
    assert store.list("v1/a0/o1") == ["v1/a0/o1.dcrp"]
    assert store.list("v1/a0/owners/") == ["v1/a0/owners/r0.json"]
    assert store.list("v2/") == [] and store.list("w/") == [] and store.list("w") == ["w"]
    # watchers poll a local directory fast, through a throttled link too; other stores default
    assert poll_interval(store) == poll_interval(ThrottledStore(store, 1e6)) == (0.002, 0.005)
    assert poll_interval(object()) == DEFAULT_POLL_S


def test_open_store_specs_and_throttle(tmp_path: Path) -> None:
    import json
    import time

    from shared_codec.transport.spec import open_store
    from shared_codec.transport.store import DirectoryStore, ThrottledStore

    plain = open_store(json.dumps({"kind": "dir", "root": str(tmp_path / "s")}))
    assert isinstance(plain, DirectoryStore)
    slow = open_store({"kind": "dir", "root": str(tmp_path / "s"), "bandwidth_bytes_per_s": 4e6})
    assert isinstance(slow, ThrottledStore)
    data = bytes(range(256)) * 4096  # 1 MiB
    t0 = time.monotonic()
    slow.put("a/x", data)
    assert slow.get("a/x") == data and plain.get("a/x") == data
    # two transfers of 1 MiB over a 4 MB/s link cannot finish in less than ~0.5 s
    assert time.monotonic() - t0 >= 2 * len(data) / 4e6 * 0.99
    assert slow.bytes == 2 * len(data) and slow.list("a/") == ["a/x"]
    for bad in ({"kind": "ftp"}, "not json", [1]):
        with pytest.raises(ValueError, match="store spec"):
            open_store(bad)  # type: ignore[arg-type]


def test_transport_specs_are_validated(tmp_path: Path) -> None:
    """A sink spec names where payloads go (dir, s3, relay), a source spec where a rollout node
    reads them (dir, s3, spool); anything else is a ValueError before any I/O."""
    from shared_codec.transport import open_sink, open_source

    for bad, why in (
        ({"kind": "spool", "root": str(tmp_path)}, "kind must be one of"),
        ({"kind": "dir"}, "needs 'root'"),
        ("{", "not JSON"),
        ("[1]", "JSON object"),
    ):
        with pytest.raises(ValueError, match=why):
            open_sink(bad, version=1, attempt=0, owner=0)
    with pytest.raises(ValueError, match="kind must be one of"):
        open_source({"kind": "relay", "root": "tcp://127.0.0.1:1"})


def test_malformed_manifests_and_listings_are_transport_errors(tmp_path: Path) -> None:
    """A manifest or owner list with a wrong type, a missing field or a malformed payload id
    fails the fetch with TransportError (never a KeyError / TypeError / ValueError)."""
    import json

    store = DirectoryStore(tmp_path / "store")
    pub = ObjectPublisher(store, version=2, attempt=0, owner=0)
    for p in _payloads(0)[:2]:
        pub.send(p)
    pub.finish()
    write_manifest(store, version=2, base_version=1, attempt=0, owners=[0])
    assert len(list(ObjectFetcher(store).fetch(2, 0, timeout_s=5))) == 2
    prefix = "v000000000002/a000000/"
    manifest = json.loads(store.get(f"{prefix}manifest.json"))
    listing = json.loads(store.get(f"{prefix}owners/o00000.json"))
    entry = listing["payloads"][0]
    bad_manifests = [b"{not json", b"[1, 2]", json.dumps({**manifest, "owners": ["x"]}).encode()]
    bad_entries = [
        {**entry, "payload_id": "ab"},
        {**entry, "payload_id": 7},
        {**entry, "size": "12"},
        {k: v for k, v in entry.items() if k != "key"},
    ]
    good_manifest = store.get(f"{prefix}manifest.json")
    for bad in bad_manifests:
        store.put(f"{prefix}manifest.json", bad)
        with pytest.raises(TransportError, match="manifest"):
            list(ObjectFetcher(store).fetch(2, 0, timeout_s=5))
    store.put(f"{prefix}manifest.json", good_manifest)
    for bad in bad_entries:
        body = {**listing, "payloads": [bad, *listing["payloads"][1:]]}
        store.put(f"{prefix}owners/o00000.json", json.dumps(body).encode())
        with pytest.raises(TransportError, match="malformed manifest or owner list"):
            list(ObjectFetcher(store).fetch(2, 0, timeout_s=5))
