"""Deadline scenario on real vLLM engines (run as a program; writes a JSON report): a TP=2
engine whose rank-1 worker is SIGKILLed mid-apply (the test-only fault plan), driven through
`DCRClient` with a deadline; then a restarted engine (a new TP=2 engine on the committed v0)
is repaired by the overwrite retry. References come from dense loads of v1 on the first engine.
The test file asserts on the report."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

PROMPTS = ["hello world the policy", "a refit sends only the bits"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", required=True, help="JSON list of checkpoint dirs v0, v1")
    ap.add_argument("--deadline", type=float, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    v0, v1 = json.loads(args.versions)

    from vllm import SamplingParams

    from dcr_tools import faults
    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint
    from shared_codec.errors import EngineUnreachable
    from shared_codec.format import PayloadMeta
    from shared_codec.records import Kind, diff_checkpoints
    from tests.integration.vllm._engine import start_llm
    from vllm_dcr_plugin.client import DCRClient

    plan = Path(args.out).with_name("fault-plan.json")
    os.environ.update(faults.environment(plan))  # the workers inherit the plan's path
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    a, b = load_checkpoint(v0), load_checkpoint(v1)
    table = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in a.items()]
    report: dict = {}

    def payloads(attempt: int, kind: Kind, no_xor: set[str]) -> list[bytes]:
        items = diff_checkpoints(a, b, kind=kind, overwrite=no_xor)
        meta = PayloadMeta(version=1, base_version=0, attempt=attempt, owner=0, sequence=0)
        return encode_items(items, meta, BucketConfig(bucket_bytes=8 << 10, threads=0))

    def tokens(llm) -> list:
        llm.reset_prefix_cache()
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]

    # engine 1: references, then an XOR attempt whose rank-1 worker dies mid-apply
    llm = start_llm(v0, 2)
    client = DCRClient(llm, timeout_s=args.deadline)
    reports = client.prewarm(table, 0)
    no_xor = client.overwrite_only(reports)
    client.dense_load(v1, 1)
    report["ref_digests"], report["ref_tokens"] = client.digests(), tokens(llm)
    client.dense_load(v0, 0)
    report["d0"] = client.digests()
    report["staged"] = [len(r["staged"]) for r in client.stage(payloads(0, Kind.XOR, no_xor))]
    faults.arm(plan, kill_after_items=1, rank=1)
    t0 = time.monotonic()
    try:
        client.apply(0, verify=True)
        report["apply_error"] = None
    except EngineUnreachable as e:
        report["apply_error"] = f"{type(e).__name__}: {e}"
    report["apply_seconds"] = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        client.digests()
        report["after_error"] = None
    except EngineUnreachable as e:
        report["after_error"] = f"{type(e).__name__}: {e}"
    report["after_seconds"] = time.monotonic() - t0
    Path(args.out).write_text(json.dumps(report))

    # engine 2 (the restart): a new engine on the committed version, the overwrite retry
    llm2 = start_llm(v0, 2)
    client2 = DCRClient(llm2, timeout_s=args.deadline)
    client2.prewarm(table, 0)
    report["restart_d0"] = client2.digests()
    report["retry_staged"] = [
        len(r["staged"]) for r in client2.stage(payloads(1, Kind.OVERWRITE, no_xor))
    ]
    report["retry_acks"] = client2.apply(1, verify=True)
    report["retry_digests"], report["retry_tokens"] = client2.digests(), tokens(llm2)
    client2.commit(1)
    Path(args.out).write_text(json.dumps(report, default=str))
    os._exit(0)


if __name__ == "__main__":
    main()
