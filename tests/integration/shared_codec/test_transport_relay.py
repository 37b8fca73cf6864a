"""ZeroMQ relay tree with real sockets on loopback: 1 root + 3 nodes as separate processes in a
balanced binary tree. Every payload arrives exactly once at every node with identical bytes;
the manifest's completion acknowledgement covers the whole tree; a node killed mid-transfer
fails the attempt naming it; with CURVE on, an unauthenticated peer is refused.

The cases over real ZeroMQ relay trees are here; the message checks in tests/unit/shared_codec/test_transport_relay.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from dcr_tools.procs import RelayTree, free_port
from shared_codec.buckets import BucketConfig, encode_items
from shared_codec.format import PayloadMeta, peek_header
from shared_codec.records import Kind, make_item
from shared_codec.transport.relay import (
    CurveKeys,
    RelaySender,
    read_spool,
    stream_spool,
)
from shared_codec.transport.spec import forget
from shared_codec.transport.store import TransportError


def _payloads(owner: int, n_items: int = 6, version: int = 1) -> list[bytes]:
    rng = np.random.default_rng(owner)
    items = []
    for t in range(n_items):
        idx = np.sort(rng.choice(100_000, 10_000, replace=False)).astype(np.int64)
        items.append(
            make_item(
                f"o{owner}.t{t}",
                "bfloat16",
                (100_000,),
                owner,
                Kind.XOR,
                idx,
                rng.integers(0, 1 << 16, idx.size).astype(np.uint16),
            )
        )
    meta = PayloadMeta(
        version=version, base_version=version - 1, attempt=0, owner=owner, sequence=0
    )
    return encode_items(items, meta, BucketConfig(bucket_bytes=60_000, threads=0))


@pytest.mark.zmq
def test_every_payload_exactly_once_at_every_node(tmp_path: Path) -> None:
    tree = RelayTree(tmp_path)
    try:
        owners = {o: _payloads(o) for o in (0, 1)}
        senders = [RelaySender(tree.addrs[0], window=4) for _ in owners]
        ids = []
        for sender, payloads in zip(senders, owners.values(), strict=True):
            for p in payloads:
                sender.send(p)
                ids.append(peek_header(p, verify=False).payload_id_hex)
        senders[0].send(owners[0][0])  # a duplicate: suppressed, still acknowledged
        for s in senders:
            s.flush()
        ack = senders[0].complete(1, 0, ids, timeout_s=20)
        assert ack.complete and ack.failed == ()
        everything = {
            peek_header(p, verify=False).payload_id_hex: p for ps in owners.values() for p in ps
        }
        for i in range(4):
            got = tree.delivered(i)
            assert sorted(got) == sorted(ids)  # exactly once each
            for pid in got:
                f = tree.dirs[i] / f"v{1:012d}-a{0:06d}-{pid}.bin"
                assert f.read_bytes() == everything[pid]
        # a node's spool, read the way engines read it (dcr_fetch with a spool spec): every
        # payload of (version 1, attempt 0) in (owner, sequence) order, nothing of other attempts
        in_order = [p for o in sorted(owners) for p in owners[o]]
        assert read_spool(str(tree.dirs[3]), 1, 0) == in_order
        assert (
            read_spool(str(tree.dirs[3]), 1, 1) == [] and read_spool(str(tree.dirs[3]), 2, 0) == []
        )
        # V_cross: the payload bytes that crossed into the rollout cluster (sent to the root)
        assert sum(s.bytes_sent for s in senders) == sum(len(p) for p in everything.values()) + len(
            owners[0][0]
        )
        for s in senders:
            s.close()
    finally:
        tree.stop()


@pytest.mark.zmq
def test_stream_spool_yields_payloads_as_they_arrive_and_stops_on_abandon(tmp_path: Path) -> None:
    """Pipelined engines read a leaf's spool while the owner is still sending: the first
    payload comes out before the rest is sent; the stream ends at the node's manifest notice
    with every payload exactly once; an attempt the coordinator abandons (sent to the root,
    forwarded down the tree) stops the stream at the leaf with the reason."""
    tree = RelayTree(tmp_path)
    try:
        payloads = _payloads(0)
        ids = [peek_header(p, verify=False).payload_id_hex for p in payloads]
        sender = RelaySender(tree.addrs[0], window=4)
        sender.send(payloads[0])
        sender.flush()
        stream = stream_spool(str(tree.dirs[3]), 1, 0, timeout_s=20)
        got = [next(stream)]  # arrives at the leaf before anything else was sent
        assert got == payloads[:1]
        for p in payloads[1:]:
            sender.send(p)
        ack = sender.complete(1, 0, ids, timeout_s=20)
        assert ack.complete
        got.extend(stream)
        assert sorted(got) == sorted(payloads) and len(got) == len(payloads)
        sender.abandon(2, 0, "owners failed: rank 1 died")
        with pytest.raises(TransportError, match="abandoned by the coordinator: owners failed"):
            list(stream_spool(str(tree.dirs[3]), 2, 0, timeout_s=20))
        sender.close()
    finally:
        tree.stop()


@pytest.mark.zmq
def test_forget_empties_every_spool_of_old_versions_and_refuses_their_stragglers(
    tmp_path: Path,
) -> None:
    """Retention through the tree (`seam.forget` on the relay spec, as the coordinator sends it
    after a commit): every node's spool keeps only versions >= before_version; a late payload
    or manifest of a forgotten version is refused (never spooled again); the kept version
    still reads whole; forgetting again is harmless."""
    tree = RelayTree(tmp_path)
    try:
        spec = {"kind": "relay", "root": tree.addrs[0], "timeout_s": 20}
        sender = RelaySender(tree.addrs[0], window=4)
        sent: dict[int, list[bytes]] = {}
        for v in (1, 2, 3):
            sent[v] = _payloads(0, n_items=3, version=v)
            for p in sent[v]:
                sender.send(p)
            ids = [peek_header(p, verify=False).payload_id_hex for p in sent[v]]
            assert sender.complete(v, 0, ids, timeout_s=20).complete
        assert all(tree.spooled_versions(i) == {1, 2, 3} for i in range(4))
        # the payload files, the delivery log and the manifest notice of versions 1 and 2
        assert forget(spec, 3) == sum(len(sent[v]) + 2 for v in (1, 2))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            tree.spooled_versions(i) != {3} for i in range(4)
        ):
            time.sleep(0.05)  # children forget when the forwarded message arrives
        assert [tree.spooled_versions(i) for i in range(4)] == [{3}] * 4
        assert read_spool(str(tree.dirs[3]), 3, 0) == sent[3]
        assert read_spool(str(tree.dirs[3]), 1, 0) == []
        with pytest.raises(TransportError, match="version 1 was forgotten"):
            sender.send(sent[1][0])
            sender.flush()
        late = RelaySender(tree.addrs[0])
        with pytest.raises(TransportError, match="version 2 was forgotten"):
            late.complete(2, 0, [peek_header(sent[2][0], verify=False).payload_id_hex], 5)
        late.close()
        assert forget(spec, 2) == 0  # cumulative: nothing older is left
        assert [tree.spooled_versions(i) for i in range(4)] == [{3}] * 4
        sender.close()
    finally:
        tree.stop()


@pytest.mark.zmq
def test_killed_node_fails_the_attempt_naming_it(tmp_path: Path) -> None:
    tree = RelayTree(tmp_path)
    try:
        payloads = _payloads(0, n_items=10)
        ids = [peek_header(p, verify=False).payload_id_hex for p in payloads]
        sender = RelaySender(tree.addrs[0], window=4)
        for p in payloads[:3]:
            sender.send(p)
        sender.flush()
        os.killpg(tree.procs[3].pid, signal.SIGKILL)  # node3: a leaf under node1
        for p in payloads[3:]:
            sender.send(p)
        with pytest.raises(TransportError, match="node3"):
            sender.complete(1, 0, ids, timeout_s=8)
        sender.close()
    finally:
        tree.stop()


@pytest.mark.zmq
def test_curve_refuses_unauthenticated_peers(tmp_path: Path) -> None:
    owner = CurveKeys.generate()
    tree = RelayTree(tmp_path, curve=True, allowed_clients=(owner.public,))
    try:
        payloads = _payloads(0, n_items=2)
        ids = [peek_header(p, verify=False).payload_id_hex for p in payloads]
        stranger = CurveKeys.generate()
        bad = RelaySender(
            tree.addrs[0], keys=stranger, root_public=tree.keys[0].public, ack_timeout_s=2
        )
        with pytest.raises(TransportError, match="did not acknowledge"):
            bad.send(payloads[0])
            bad.flush()
        bad.close()
        assert tree.delivered(0) == []
        good = RelaySender(tree.addrs[0], keys=owner, root_public=tree.keys[0].public)
        for p in payloads:
            good.send(p)
        assert good.complete(1, 0, ids, timeout_s=15).complete
        assert all(sorted(tree.delivered(i)) == sorted(ids) for i in range(4))
        good.close()
    finally:
        tree.stop()


@pytest.mark.zmq
def test_node_refuses_malformed_messages_and_keeps_serving() -> None:
    """A malformed header gets a `Refused` answer naming the reason (the node keeps serving);
    a payload frame whose header disagrees with the message is refused, never delivered."""
    import threading

    import zmq

    from shared_codec.transport.relay import RelayNode
    from shared_codec.transport.relay import messages as m

    got: list[bytes] = []
    addr = f"tcp://127.0.0.1:{free_port()}"
    node = RelayNode("n0", addr, deliver=got.append)
    threading.Thread(target=node.serve, daemon=True).start()
    assert node.ready.wait(10)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    try:
        s.send_multipart([b'{"type": "manifest", "attempt": 0}'])
        assert s.poll(5000)
        reply = m.decode(s.recv())
        assert isinstance(reply, m.Refused) and "lacks" in reply.error
        payload = _payloads(0, n_items=1)[0]
        pid = peek_header(payload, verify=False).payload_id_hex
        wrong = m.Payload(version=2, attempt=0, payload_id=pid)  # the payload is version 1
        s.send_multipart([m.encode(wrong), payload])
        assert s.poll(5000)
        ack = m.decode(s.recv())
        assert isinstance(ack, m.PayloadAck) and not ack.ok and got == []
        sender = RelaySender(addr)
        sender.send(payload)
        sender.flush()
        assert got == [payload]
        sender.close()
    finally:
        s.close(0)
        ctx.term()
        node.stop()


@pytest.mark.zmq
def test_relay_sink_and_spool_source_seam(tmp_path: Path) -> None:
    """The seam on a relay tree: owners' sinks (spec kind ``relay``) send to the root; a leaf's
    spool source (kind ``spool``) streams payloads before the seal; the seal returns once the
    whole tree holds them, after which `fetch` on every node yields them in (owner, sequence)
    order; the coordinator's sink (no owner) abandons an attempt, stopping `fetch` and
    `stream` at the leaves."""
    from shared_codec.transport import Seal, open_sink, open_source

    tree = RelayTree(tmp_path)
    try:
        spec = {"kind": "relay", "root": tree.addrs[0], "timeout_s": 20}
        mine = {o: _payloads(o) for o in (0, 1)}
        leaf = open_source({"kind": "spool", "root": str(tree.dirs[3])})
        stream = leaf.stream(1, 0, timeout_s=20)
        sinks = {o: open_sink(spec, version=1, attempt=0, owner=o) for o in (0, 1)}
        sinks[0].send(mine[0][0])
        sinks[0].finish()
        got = [next(stream)]
        assert got == mine[0][:1]
        for o in (0, 1):
            for p in mine[o][1 if o == 0 else 0 :]:
                sinks[o].send(p)
        reports = {o: sinks[o].finish() for o in (0, 1)}
        assert [len(reports[o].payload_ids) for o in (0, 1)] == [len(mine[0]), len(mine[1])]
        with pytest.raises(TransportError, match="no manifest notice"):
            list(leaf.fetch(1, 0, timeout_s=0.3))
        ids = tuple(i for o in (0, 1) for i in reports[o].payload_ids)
        sinks[0].seal(Seal(base_version=0, owners=(0, 1), payload_ids=ids))
        got.extend(stream)
        assert sorted(got) == sorted(mine[0] + mine[1])
        for d in tree.dirs:
            assert list(open_source({"kind": "spool", "root": str(d)}).fetch(1, 0)) == (
                mine[0] + mine[1]
            )
        for d in tree.dirs:  # every node's notice names the seal's base version and ids
            sealed = open_source({"kind": "spool", "root": str(d)}).sealed(1, 0, timeout_s=5)
            assert (sealed.version, sealed.attempt, sealed.base_version) == (1, 0, 0)
            assert sealed.payload_ids == ids
        for s in sinks.values():
            s.close()
        with open_sink(spec, version=2, attempt=0) as coordinator:
            coordinator.abandon("owners failed: rank 1 died")
        for it in (leaf.fetch(2, 0, timeout_s=10), leaf.stream(2, 0, timeout_s=10)):
            with pytest.raises(TransportError, match="abandoned by the coordinator: owners"):
                list(it)
    finally:
        tree.stop()
