"""Derived-tensor scenario against one real vLLM engine on a tiny DeepSeek-V3 style (MLA) model
(run as a program; writes a JSON report; tests/integration/vllm/test_derived.py asserts on it).

vLLM's MLA derives absorbed projections (``W_UK_T``, ``W_UV``) from ``kv_b_proj`` after loading;
no later ``load_weights`` call writes them. ``--mode refit``: start on v0, prewarm (the report
names the derived tensors), apply the v0 -> v1 delta through ``dcr_stage`` / ``dcr_apply``,
commit, then dense-load v0 and v1 through ``dcr_dense_load``; digests and greedy tokens after
each. ``--mode fresh``: a new engine started on v1 (the post-load step ran on v1's weights):
the oracle.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", required=True, help="JSON list [v0, v1] of checkpoint dirs")
    ap.add_argument("--mode", choices=("refit", "fresh"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="", help="attention backend (default: start_llm's)")
    args = ap.parse_args()
    v0, v1 = json.loads(args.versions)

    from vllm import SamplingParams

    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint, tensor_table
    from shared_codec.format import PayloadMeta
    from shared_codec.records import diff_checkpoints
    from tests.integration.vllm._engine import start_llm

    sp = SamplingParams(max_tokens=12, temperature=0.0)
    extra = {"attention_backend": args.backend} if args.backend else {}
    llm = start_llm(v1 if args.mode == "fresh" else v0, **extra)
    report: dict = {}

    def snapshot() -> dict:
        llm.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], sp, use_tqdm=False)
        (d,) = llm.collective_rpc("dcr_digest")
        return {
            "digest": d["digest"],
            "tensors": d["tensors"],
            "tokens": outs[0].outputs[0].token_ids,
        }

    if args.mode == "fresh":
        report["fresh"] = snapshot()
        Path(args.out).write_text(json.dumps(report))
        return
    (report["prewarm"],) = llm.collective_rpc("dcr_prewarm", args=(tensor_table(v0), 0))
    report["v0"] = snapshot()
    a, b = load_checkpoint(v0), load_checkpoint(v1)
    no_xor = set(report["prewarm"].get("overwrite_only", {}))
    items = diff_checkpoints(a, b, overwrite=no_xor)
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    payloads = encode_items(items, meta, BucketConfig(bucket_bytes=64 << 10, threads=0))
    (report["stage"],) = llm.collective_rpc("dcr_stage", args=(payloads,))
    (report["apply"],) = llm.collective_rpc("dcr_apply", args=(0,))
    report["applied"] = snapshot()
    (report["commit"],) = llm.collective_rpc("dcr_commit", args=(1,))
    (report["dense_v0"],) = llm.collective_rpc("dcr_dense_load", args=(v0, 0))
    report["dense0"] = snapshot()
    (report["dense_v1"],) = llm.collective_rpc("dcr_dense_load", args=(v1, 1))
    report["dense1"] = snapshot()
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
