"""The replica's HTTP service and its clients (shared_codec/replica/service.py, client.py) on real
loopback sockets: a real `Coordinator` drives `HttpReplica` through transitions; checkpoints
come down with range reads under a lease, bit-exact; the service refuses bad ranges, unknown or
expired leases, paths outside the lease and bad arguments, changing nothing; a lease holds its
slot against a stage; ``dcr replica serve`` runs as its own process.

TEST DOUBLE (labelled): `LineageOwners` (replica_cases.py) stands in for the owner service."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from shared_codec.checkpoint import combined_digest, load_checkpoint, state_digests
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.errors import ArgumentError, EngineUnreachable, ReplicaError
from shared_codec.replica import ReplicaStore
from shared_codec.replica.client import HttpReplica, download, local_checkpoint
from shared_codec.replica.receiver import ReplicaReceiver
from shared_codec.replica.service import ReplicaService
from shared_codec.transport.store import DirectoryStore
from tests.unit.shared_codec.replica_cases import (
    LineageOwners,
    caught_up,
    lineage_of,
    other_files,
    same_bits,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def initial(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("replica-http") / "initial")


@pytest.fixture(scope="module")
def lineage(initial) -> list[dict[str, torch.Tensor]]:
    return lineage_of(initial, 3, seed=10)


def bootstrapped(tmp: Path, initial: Path) -> Path:
    with ReplicaStore(tmp / "replica") as s:
        s.bootstrap(initial)
    return tmp / "replica"


@pytest.fixture
def served(tmp_path, initial, lineage):
    """A replica behind a running service, a coordinator with its `HttpReplica` as the only
    receiver, initialized at version 0."""
    spec = {"kind": "dir", "root": str(tmp_path / "payloads")}
    rx = ReplicaReceiver(bootstrapped(tmp_path, initial), spec, lease_timeout_s=0.3)
    service = ReplicaService(rx).start()
    handle = HttpReplica(service.url)
    owners = LineageOwners(lineage, spec)
    coord = Coordinator(
        DirectoryStore(tmp_path / "control"), owners, [handle],
        CoordinatorConfig(ack_timeout_s=20.0), log=lambda _m: None, transport=spec,
    )  # fmt: skip
    coord.initialize("lineage-v0")
    yield rx, service, handle, coord, owners
    service.stop()
    rx.close()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _lease(base: str, version: int, ttl_s: float = 60.0) -> dict:
    req = urllib.request.Request(
        base + "/replica/leases",
        data=json.dumps({"version": version, "ttl_s": ttl_s}).encode(),
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_coordinator_drives_the_replica_over_http(served, lineage, initial, tmp_path) -> None:
    rx, service, handle, coord, _ = served
    for v in (1, 2):
        res = coord.refit()
        assert res.version == v and res.attempts[0].acks["replica"].ok
        assert res.record.digests == {"replica": combined_digest(state_digests(lineage[v]))}
    assert handle.status()["committed"] == 2
    # range reads of 1000 bytes, 3 at a time, under one lease: bit-exact, other files too
    got = download(handle.checkpoint_for(2), tmp_path / "dl", chunk_bytes=1000, threads=3)
    assert same_bits(load_checkpoint(got), lineage[2]) == []
    assert other_files(got) == other_files(initial)
    size = sum(f.stat().st_size for f in got.rglob("*") if f.is_file())
    assert handle.status()["served"] == {"leases": 1, "bytes": size}
    # a URL dense-load path: downloaded into a temporary directory, removed afterwards
    with local_checkpoint(handle.checkpoint_for(2)) as path:
        assert same_bits(load_checkpoint(path), lineage[2]) == []
    assert not Path(path).exists()
    with local_checkpoint(str(got)) as same:  # a directory is itself
        assert same == str(got)
    # a version the replica no longer holds (v1: its slot caught up to v2 after the commit):
    # refused, nothing left behind
    caught_up(rx.root, 2)
    for v in (0, 1):
        with pytest.raises(ReplicaError, match=f"version {v} is not held"):
            download(handle.checkpoint_for(v), tmp_path / f"dl{v}")
        assert not (tmp_path / f"dl{v}").exists()


def test_ranges_leases_and_refusals(served) -> None:
    rx, service, handle, coord, _ = served
    base = service.url
    lease = _lease(base, 0)
    files = {f["path"]: f["size"] for f in lease["files"]}
    shard = next(p for p in files if p.endswith(".safetensors"))
    url = f"{base}/replica/leases/{lease['lease']}/files/{shard}"
    whole = (rx.root / f"slot{rx.status().committed_slot}" / shard).read_bytes()
    assert _get(url) == (200, whole) and len(whole) == files[shard]
    assert _get(url, {"Range": "bytes=10-19"}) == (206, whole[10:20])
    assert _get(url, {"Range": "bytes=-7"}) == (206, whole[-7:])
    assert _get(url, {"Range": f"bytes={len(whole) - 3}-"}) == (206, whole[-3:])
    for bad in ("bytes=5-2", f"bytes={len(whole)}-", "lines=1-2", "bytes=0-1,4-5"):
        code, body = _get(url, {"Range": bad})
        assert code == 400 and json.loads(body)["error_type"] == "ArgumentError", bad
    # only the lease's files: no other path under the root
    lid = lease["lease"]
    for rel in ("../STATE.json", "..%2FSTATE.json", "nope.safetensors"):
        assert _get(f"{base}/replica/leases/{lid}/files/{rel}")[0] == 404, rel
    assert _get(f"{base}/replica/leases/{'0' * 32}/files/{shard}")[0] == 404
    # an expired lease is gone
    short = _lease(base, 0, ttl_s=0.2)
    time.sleep(0.4)
    assert _get(f"{base}/replica/leases/{short['lease']}/files/{shard}")[0] == 404


def test_a_lease_holds_its_slot_against_a_stage(served, lineage) -> None:
    """Version 0 leased over HTTP, then version 1 committed: the slot holding version 0 cannot
    catch up after the commit (the receiver does not wait) and the next stage, which must write
    it, waits out its lease timeout and fails (nothing changed); released, the retry commits."""
    rx, service, handle, coord, owners = served
    lease = _lease(service.url, 0)
    coord.refit()
    owners.build(2, 0, False)
    ack = handle.apply(2, 0, 10.0)
    assert not ack.ok and "LeaseHeld" in (ack.error or "") and "http 127.0.0.1" in ack.error
    assert rx.status().committed == 1 and handle.digest() == combined_digest(
        state_digests(lineage[1])
    )
    req = urllib.request.Request(f"{service.url}/replica/leases/{lease['lease']}", method="DELETE")
    urllib.request.urlopen(req, timeout=30).read()
    res = coord.refit()
    assert res.version == 2 and res.record.digests["replica"] == combined_digest(
        state_digests(lineage[2])
    )


def test_bad_arguments_change_nothing(served, lineage) -> None:
    rx, service, handle, coord, _ = served
    before = handle.digest()
    for body in ({"version": "1", "attempt": 0}, {"version": 1, "attempt": -1},
                 {"version": 1, "attempt": 0, "timeout_s": 0}, {}):  # fmt: skip
        req = urllib.request.Request(
            service.url + "/replica/apply", data=json.dumps(body).encode(), method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400, body
    with pytest.raises(ArgumentError, match="version must be an integer"):
        handle.commit(-1)  # type: ignore[arg-type]
    with pytest.raises(ReplicaError):
        handle.restore(5)
    assert handle.digest() == before and rx.status().committed == 0
    code, body = _get(service.url + "/replica/nope")
    assert code == 404 and "no such endpoint" in json.loads(body)["error"]


def test_dcr_replica_serve_process(tmp_path, initial, lineage) -> None:
    root = bootstrapped(tmp_path, initial)
    spec = {"kind": "dir", "root": str(tmp_path / "payloads")}
    dcr = str(Path(sys.executable).with_name("dcr"))
    proc = subprocess.Popen(
        [dcr, "replica", "serve", str(root), "--source", json.dumps(spec)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline())
        handle = HttpReplica(line["url"])
        coord = Coordinator(
            DirectoryStore(tmp_path / "control"), LineageOwners(lineage, spec), [handle],
            CoordinatorConfig(ack_timeout_s=20.0), log=lambda _m: None, transport=spec,
        )  # fmt: skip
        coord.initialize()
        assert coord.refit().record.digests["replica"] == combined_digest(state_digests(lineage[1]))
    finally:
        proc.kill()
        proc.wait(30)
    with pytest.raises(EngineUnreachable):
        handle.digest()
    # what it committed is durable: a new receiver on the root holds version 1
    rx = ReplicaReceiver(root, spec)
    try:
        assert rx.committed_version() == 1
    finally:
        rx.close()
    bad = subprocess.run([dcr, "replica", "serve", str(tmp_path / "none"), "--source",
                          json.dumps(spec)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 1 and "not bootstrapped" in bad.stderr
