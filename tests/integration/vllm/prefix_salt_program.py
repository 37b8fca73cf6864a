"""The version-salted prefix cache on one real vLLM engine (run as a program; writes a JSON
report for tests/integration/vllm/test_prefix_salt.py).

The engine (TP=1, 32-token blocks) serves v0; one long prompt is generated twice per state,
each time with vLLM's own ``num_cached_tokens`` (prompt tokens served from the prefix cache)
and ``weight_versions``. DCR moves it v0 -> v1 through the ``dcr_*`` RPCs with no prefix-cache
reset anywhere: a partial apply (a fault plan fails every rank after 5 items), the abort, an
overwrite retry, the commit. The oracle of the tokens after the commit is a dense load of v1
with a reset prefix cache.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", required=True, help="JSON list of checkpoint dirs v0, v1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    versions = json.loads(args.versions)

    from vllm import SamplingParams

    from dcr_tools import faults
    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint
    from shared_codec.format import PayloadMeta
    from shared_codec.records import Kind, diff_checkpoints
    from tests.integration.vllm._engine import start_llm

    plan = Path(args.out).with_name("fault-plan.json")
    os.environ.update(faults.environment(plan))
    llm = start_llm(versions[0], 1, block_size=32)
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = {"prompt_token_ids": [(7 * i + 3) % 500 + 10 for i in range(150)]}
    report: dict = {}

    def gen() -> dict:
        (o,) = llm.generate([prompt], sp, use_tqdm=False)
        return {
            "tokens": list(o.outputs[0].token_ids),
            "cached": o.num_cached_tokens,
            "versions": [s.version for s in o.outputs[0].weight_versions],
        }

    def twice(label: str) -> None:
        report[label] = [gen(), gen()]

    def ok(method: str, *a) -> list:
        replies = llm.collective_rpc(method, args=a)
        assert all(r["ok"] for r in replies), replies
        return replies

    ckpts = [load_checkpoint(v) for v in versions]
    table = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in ckpts[0].items()]
    pre = ok("dcr_prewarm", table, 0)
    no_xor = set(pre[0]["overwrite_only"])

    def payloads(attempt: int, kind: Kind) -> list:
        items = diff_checkpoints(ckpts[0], ckpts[1], kind=kind, overwrite=no_xor)
        meta = PayloadMeta(version=1, base_version=0, attempt=attempt, owner=0, sequence=0)
        return encode_items(items, meta, BucketConfig(bucket_bytes=8 << 10, threads=0))

    twice("v0")
    ok("dcr_stage", payloads(0, Kind.XOR))
    faults.arm(plan, fail_after_items=5)
    report["partial_ack"] = llm.collective_rpc("dcr_apply", args=(0,))
    twice("partial")  # weights part v0, part v1: no committed version
    ok("dcr_abort", 0)
    ok("dcr_stage", payloads(1, Kind.OVERWRITE))
    ok("dcr_apply", 1)
    twice("retried")  # the complete v1 candidate, not committed yet
    ok("dcr_commit", 1)
    twice("v1")
    ok("dcr_dense_load", versions[1], 1)
    llm.reset_prefix_cache()
    report["dense_v1"] = gen()
    Path(args.out).write_text(json.dumps(report))
    os._exit(0)


if __name__ == "__main__":
    main()
