"""Relay tree into a real vLLM engine: this process runs the engine and a relay root whose
deliver callback stages payloads on the engine's workers; it then sends a v0 -> v1 delta through
the relay as an owner would, applies it once the tree reports completion, and compares the digest
with a dense load of v1. Writes a JSON report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--v0", required=True)
    ap.add_argument("--v1", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint
    from shared_codec.format import PayloadMeta, peek_header
    from shared_codec.records import Kind, diff_tensors
    from shared_codec.transport.relay import RelayNode, RelaySender
    from tests.integration.vllm._engine import start_llm
    from vllm_dcr_plugin.client import DCRClient
    from vllm_dcr_plugin.relay_stage import stage_deliver

    llm = start_llm(args.v0)
    client = DCRClient(llm)
    v0, v1 = load_checkpoint(args.v0), load_checkpoint(args.v1)
    table = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in v0.items()]
    client.prewarm(table, 0)
    node = RelayNode("root", args.bind, deliver=stage_deliver(client))
    thread = threading.Thread(target=node.serve, daemon=True)
    thread.start()
    node.ready.wait(10)
    items = [diff_tensors(n, v0[n], v1[n], owner=0, kind=Kind.XOR) for n in sorted(v0)]
    payloads = encode_items(
        [i for i in items if i.count],
        PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0),
        BucketConfig(bucket_bytes=8 << 10, threads=0),
    )
    sender = RelaySender(args.bind, window=4)
    for p in payloads:
        sender.send(p)
    sender.send(payloads[0])  # a duplicate on the wire: suppressed by the relay
    ack = sender.complete(
        1, 0, [peek_header(p, verify=False).payload_id_hex for p in payloads], timeout_s=60
    )
    status = client.call("dcr_status")
    acks = client.apply(0, verify=True)
    digest_delta = client.digests()
    client.commit(1)
    client.dense_load(args.v1, 1)
    digest_dense = client.digests()
    node.stop()
    Path(args.out).write_text(
        json.dumps(
            {
                "n_payloads": len(payloads),
                "tree_ack": dataclasses.asdict(ack),
                "staged_before_apply": status,
                "acks": acks,
                "relay_duplicates": node.duplicates,
                "digest_delta": digest_delta,
                "digest_dense": digest_dense,
            },
            default=str,
        )
    )
    os._exit(0)


if __name__ == "__main__":
    main()
