"""Quantized refit scenario against one real vLLM engine serving a quantized checkpoint (run as a
program; writes a JSON report; tests/integration/vllm/test_quantized.py asserts on it).

The trainer's BF16 canonical checkpoints v0 and v1 are given. The engine serves v0 quantized by
the library quantizer (``write_quantized_model``). ``--mode refit``: prewarm (the report names
the engine's format), build the owner's quantized delta (each changed BF16 element marks its
quantization group; only touched groups are requantized against the committed quantized
baseline, `shared_codec.quantized.quantized_delta`), apply it through ``dcr_stage`` /
``dcr_apply``, commit, then dense-load quantized v0 and v1 through ``dcr_dense_load``; digests
and greedy tokens after each. ``--mode fresh``: a new engine started on quantized v1, the
oracle.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16", required=True, help="JSON list [v0, v1] of BF16 checkpoint dirs")
    ap.add_argument("--quantized", required=True, help="JSON list [q0, q1]: written here")
    ap.add_argument("--format", required=True)
    ap.add_argument("--mode", choices=("refit", "fresh"), required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument(
        "--recovery",
        default="",
        help="JSON [bf16 v2, quantized v2]: after v1, a v2 attempt fails part-way "
        "(fault plan) and its overwrite retry repairs the engine",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    (v0, v1), (q0, q1) = json.loads(args.bf16), json.loads(args.quantized)
    import os

    from dcr_tools import faults

    plan = Path(args.out).with_name("fault-plan.json")
    os.environ.update(faults.environment(plan))  # the workers inherit it; armed below

    import numpy as np
    from vllm import SamplingParams

    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint, tensor_table
    from shared_codec.dtypes import tensor_bits
    from shared_codec.format import PayloadMeta
    from shared_codec.quantized import format_of, quantized_delta, quantizes, scale_name
    from shared_codec.records import Kind, diff_tensors
    from tests.integration.vllm._engine import start_llm

    sp = SamplingParams(max_tokens=12, temperature=0.0)
    llm = start_llm(q1 if args.mode == "fresh" else q0, tp=args.tp)
    report: dict = {}

    def snapshot() -> dict:
        llm.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], sp, use_tqdm=False)
        ranks = llm.collective_rpc("dcr_digest")
        return {
            "digests": [d["digest"] for d in ranks],
            "tensors": [d["tensors"] for d in ranks],
            "tokens": outs[0].outputs[0].token_ids,
        }

    if args.mode == "fresh":
        report["fresh"] = snapshot()
        Path(args.out).write_text(json.dumps(report))
        return
    # recipes that are not the engine's format are refused at prewarm, changing nothing
    other = {"int8": "float8_e4m3fn", "float8_e4m3fn": "int8"}
    recipes = {
        "bf16": tensor_table(v0),
        "other-format": [[n, other.get(d, d), s] for n, d, s in tensor_table(q0)],
        "no-scales": [[n, d, s] for n, d, s in tensor_table(q0) if not n.endswith("_scale")],
    }
    report["refused_recipes"] = {
        k: llm.collective_rpc("dcr_prewarm", args=(t, 0)) for k, t in recipes.items()
    }
    report["after_refusals"] = snapshot()
    report["prewarm"] = llm.collective_rpc("dcr_prewarm", args=(tensor_table(q0), 0))
    report["v0"] = snapshot()

    fmt = format_of(args.format)
    no_xor = set().union(*(r.get("overwrite_only", {}) for r in report["prewarm"]))

    def owner_delta(bf16_old: str, bf16_new: str, quantized_old: str, overwrite: bool) -> tuple:
        """The owner: BF16 change -> touched groups -> requantized against the quantized
        baseline (`overwrite`: every record an overwrite, as a retry sends)."""
        old, new, committed = (load_checkpoint(p) for p in (bf16_old, bf16_new, quantized_old))
        items, result, counts = [], dict(committed), {"bf16_changed": 0}
        for name in sorted(old):
            changed = np.flatnonzero(tensor_bits(old[name]) != tensor_bits(new[name]))
            counts["bf16_changed"] += int(changed.size)
            if not quantizes(name):
                kind = Kind.OVERWRITE if overwrite or name in no_xor else Kind.XOR
                item = diff_tensors(name, old[name], new[name], kind=kind)
                items += [item] if item.count else []
                result[name] = new[name]
                continue
            s = scale_name(name)
            wkind = Kind.OVERWRITE if overwrite else Kind.XOR
            skind = Kind.OVERWRITE if overwrite or s in no_xor else Kind.XOR
            nq, ns, its = quantized_delta(
                name, new[name], changed, committed[name], committed[s], fmt, kind=wkind,
                scale_kind=skind,
            )  # fmt: skip
            items += its
            result[name], result[s] = nq, ns
        return items, result, counts

    items, result, owner = owner_delta(v0, v1, q0, overwrite=False)
    library = load_checkpoint(q1)
    owner["equals_library"] = sorted(result) == sorted(library) and all(
        bool(np.array_equal(tensor_bits(result[n]), tensor_bits(library[n]))) for n in library
    )
    owner["items"] = len(items)
    owner["elements"] = sum(int(it.count) for it in items)
    report["owner"] = owner

    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    payloads = encode_items(items, meta, BucketConfig(bucket_bytes=64 << 10, threads=0))
    report["stage"] = llm.collective_rpc("dcr_stage", args=(payloads,))
    report["apply"] = llm.collective_rpc("dcr_apply", args=(0,))
    report["applied"] = snapshot()
    report["commit"] = llm.collective_rpc("dcr_commit", args=(1,))
    if args.recovery:  # v1 -> v2: attempt 0 fails part-way, its overwrite retry repairs
        v2, q2 = json.loads(args.recovery)
        xor, _, _ = owner_delta(v1, v2, q1, overwrite=False)
        retry, _, _ = owner_delta(v1, v2, q1, overwrite=True)
        meta2 = PayloadMeta(version=2, base_version=1, attempt=0, owner=0, sequence=0)
        report["stage_partial"] = llm.collective_rpc(
            "dcr_stage", args=(encode_items(xor, meta2, BucketConfig(bucket_bytes=64 << 10)),)
        )
        faults.arm(plan, fail_after_items=5)  # every rank fails after 5 items
        report["ack_partial"] = llm.collective_rpc("dcr_apply", args=(0,))
        report["partial"] = snapshot()
        report["abort"] = llm.collective_rpc("dcr_abort", args=(0,))
        meta3 = PayloadMeta(version=2, base_version=1, attempt=1, owner=0, sequence=0)
        report["stage_retry"] = llm.collective_rpc(
            "dcr_stage", args=(encode_items(retry, meta3, BucketConfig(bucket_bytes=64 << 10)),)
        )
        report["ack_retry"] = llm.collective_rpc("dcr_apply", args=(1,))
        report["retried"] = snapshot()
        report["commit2"] = llm.collective_rpc("dcr_commit", args=(2,))
        report["dense_v2"] = llm.collective_rpc("dcr_dense_load", args=(q2, 2))
        report["dense2"] = snapshot()
    report["dense_v0"] = llm.collective_rpc("dcr_dense_load", args=(q0, 0))
    report["dense0"] = snapshot()
    report["dense_v1"] = llm.collective_rpc("dcr_dense_load", args=(q1, 1))
    report["dense1"] = snapshot()
    Path(args.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
