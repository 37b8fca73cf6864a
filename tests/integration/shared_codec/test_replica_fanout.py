"""Read once per cluster (shared_codec/replica/fanout.py) on real components: owners publish to
a real S3 endpoint (moto_server); the rollout cluster's replica is the one reader of the store
and forwards every payload down a real ZeroMQ relay tree (root + 2 nodes, separate processes);
two receivers read only their node's spool; a real `Coordinator` commits with all three.

TEST DOUBLES (labelled): `LineageOwners` (replica_cases.py) stands in for the trainer's owner
service; the two "engines" are `ReplicaReceiver`s on their own roots reading their node's spool
(real receivers of canonical payloads, so their stored bits are compared with the lineage; they
stand in for vLLM engines, which read a spool the same way).

Checked: every version bit-exact on the replica and both spool receivers; every node's spool
holds exactly the sealed set with the bytes in S3; the replica read one payload set from S3 per
attempt whatever the number of receivers; owners failing make the coordinator abandon the
attempt in S3, the replica abandons it down the tree and the spool receivers stop at once;
retention empties the spools of versions no receiver needs."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from dcr_tools.procs import RelayTree
from shared_codec.checkpoint import combined_digest, load_checkpoint, state_digests
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.format import peek_header
from shared_codec.replica import ReplicaStore
from shared_codec.replica.receiver import ReplicaReceiver
from shared_codec.transport.spec import open_source, open_store
from tests.unit.shared_codec.replica_cases import (
    LineageOwners,
    lineage_of,
    write_checkpoint,
)

pytestmark = [pytest.mark.s3, pytest.mark.zmq]


@pytest.fixture(scope="module")
def lineage(tmp_path_factory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    initial = write_checkpoint(tmp_path_factory.mktemp("fanout") / "initial")
    return initial, lineage_of(initial, 4, seed=20)


class FailingOnce(LineageOwners):
    """`LineageOwners` whose build of (`version`, attempt 0) raises after a pause (the trainer
    lost a rank while the receivers already wait)."""

    fail: tuple[int, int] | None = None

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        if (version, attempt) == self.fail:
            time.sleep(1.0)  # the receivers are streaming by now
            raise RuntimeError("owner rank 1 lost")
        return super().build(version, attempt, retry)


def _spool_ids(node_dir: Path, version: int, attempt: int) -> dict[str, bytes]:
    src = open_source({"kind": "spool", "root": str(node_dir)})
    return {peek_header(p, verify=False).payload_id_hex: p for p in src.fetch(version, attempt, 5)}


@pytest.mark.timeout(600)
def test_one_fetcher_per_cluster_fans_out_over_the_relay_tree(
    moto_endpoint, lineage, tmp_path
) -> None:
    import boto3

    initial, versions = lineage
    bucket = f"fanout-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket
    )
    s3 = {"kind": "s3", "bucket": bucket, "endpoint_url": moto_endpoint, "prefix": "run"}
    tree = RelayTree(tmp_path, n=3, k=2)  # node0 (the root) -> node1, node2
    roots = [tmp_path / f"replica{i}" for i in range(3)]
    for r in roots:
        with ReplicaStore(r) as s:
            s.bootstrap(initial)
    replica = ReplicaReceiver(
        roots[0], s3, fanout={"kind": "relay", "root": tree.addrs[0], "timeout_s": 30.0}
    )
    spooled = [
        ReplicaReceiver(roots[i], {"kind": "spool", "root": str(tree.dirs[i])}, name=f"engine{i}")
        for i in (1, 2)
    ]
    owners = FailingOnce(versions, s3)
    coord = Coordinator(
        open_store(s3), owners, [replica, *spooled], CoordinatorConfig(ack_timeout_s=60.0),
        log=lambda m: print(f"[coordinator] {m}", flush=True), transport=s3,
    )  # fmt: skip
    try:
        coord.initialize()
        for v in (1, 2):
            res = coord.refit()
            assert res.retries == 0 and res.record.receivers == ("replica", "engine1", "engine2")
            want = combined_digest(state_digests(versions[v]))
            assert set(res.record.digests.values()) == {want}
            # the replica read the attempt's payload set once from S3; each node spools exactly
            # that set, byte for byte
            objects = _s3_payloads(s3, v)
            acks = res.attempts[0].acks
            assert acks["replica"].fetched_bytes == sum(len(p) for p in objects.values())
            for i in (1, 2):
                assert _spool_ids(tree.dirs[i], v, 0) == objects
                assert acks[f"engine{i}"].fetched_bytes == acks["replica"].fetched_bytes
        assert replica.bytes_in == sum(len(p) for v in (1, 2) for p in _s3_payloads(s3, v).values())

        # owners fail while everyone waits: the coordinator abandons in S3, the replica down
        # the tree, the spool receivers stop at once (long before the 60 s deadline)
        owners.fail = (3, 0)
        t0 = time.monotonic()
        res = coord.refit()
        first = res.attempts[0]
        assert "owner rank 1 lost" in first.failed["owners"]
        assert all("abandon" in first.failed[n] for n in ("replica", "engine1", "engine2")), (
            first.failed
        )
        assert not first.unreachable and time.monotonic() - t0 < 45
        assert res.record.version == 3 and res.record.attempt == 1
        assert set(res.record.digests.values()) == {combined_digest(state_digests(versions[3]))}

        # retention on the tree: after v4 commits, the spools keep v3 and v4 only
        res = coord.refit()
        assert res.record.version == 4
        deadline = time.monotonic() + 20
        while any(tree.spooled_versions(i) - {3, 4} for i in range(3)):
            assert time.monotonic() < deadline, [tree.spooled_versions(i) for i in range(3)]
            time.sleep(0.2)
        for r in (replica, *spooled):
            with r.checkpoint_for(4) as path:
                assert combined_digest(state_digests(load_checkpoint(path))) == combined_digest(
                    state_digests(versions[4])
                )
    finally:
        for r in (replica, *spooled):
            r.close()
        tree.stop()


def _s3_payloads(spec: dict[str, Any], version: int, attempt: int = 0) -> dict[str, bytes]:
    src = open_source(spec)
    return {peek_header(p, verify=False).payload_id_hex: p for p in src.fetch(version, attempt, 5)}
