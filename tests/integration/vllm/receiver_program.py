"""Receiver scenario against one real vLLM engine (run as a program; writes a JSON report).

The engine starts on checkpoint v0. Reference digests and greedy tokens of v1..v3 come from
dense loads (``dcr_dense_load``) on the same engine; then the engine goes back to v0 and is moved
v0 -> v1 (mixed XOR/overwrite delta, staged twice), v1 -> v2 (a partial XOR apply, then an
overwrite-only retry of the complete changed set), v2 -> v3 (overwrite-only), with rejection cases
(wrong base version, corrupted, unknown tensor, wrong shape), exactly-once cases (a re-sequenced
duplicate, an extra and a missing payload against the sealed set) and apply-before-prewarm
checked against digests, and each rank's storage addresses (``dcr_info``'s ``storage``) before
the dense loads and the first apply, and at the end. `--placement` chooses how applies place direct-path items (the
replayed placement plan or the native loader; ``dcr_set_placement``); after the dense
references the plan is re-verified against a fresh trace (``dcr_verify_plan``). The test file
asserts on the report.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

PROMPTS = ["hello world the policy", "a refit sends only the bits"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", required=True, help="JSON list of checkpoint dirs v0..v3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bucket-bytes", type=int, default=8 << 10)
    ap.add_argument("--extra", default="{}", help="JSON dict of extra LLM(...) arguments")
    ap.add_argument("--placement", default="plan", help="plan (replayed placement) or loader")
    args = ap.parse_args()
    versions = json.loads(args.versions)

    from vllm import SamplingParams

    from dcr_tools import faults
    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint
    from shared_codec.format import PayloadMeta
    from shared_codec.records import Kind, diff_checkpoints
    from tests.integration.vllm._engine import start_llm

    # the workers inherit the fault plan's path; the partial apply below arms it
    plan = Path(args.out).with_name("fault-plan.json")
    os.environ.update(faults.environment(plan))
    llm = start_llm(versions[0], args.tp, **json.loads(args.extra))
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    report: dict = {"tp": args.tp, "spans": []}

    def tokens() -> list:
        llm.reset_prefix_cache()
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        report["spans"].append(spans(outs))
        return [list(o.outputs[0].token_ids) for o in outs]

    def spans(outs: list) -> list:
        """vLLM's own weight_versions of each output (versions.py stamps them)."""
        return [[[s.version, s.start, s.end] for s in o.outputs[0].weight_versions] for o in outs]

    def digests() -> list[str]:
        return [d["digest"] for d in llm.collective_rpc("dcr_digest")]

    def storage(infos: list[dict]) -> list[dict[str, int]]:
        """Each rank's parameter / buffer name -> data_ptr (dcr_info's ``storage``)."""
        return [i["storage"] for i in sorted(infos, key=lambda i: i["rank"])]

    def rpc_error(method: str, *a) -> str | None:
        errors = [r.get("error") for r in llm.collective_rpc(method, args=a) if not r["ok"]]
        return "; ".join(errors) if errors else None

    ckpts = [load_checkpoint(v) for v in versions]
    table = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in ckpts[0].items()]

    report["d0"] = digests()
    report["tokens0"] = tokens()
    report["apply_before_prewarm"] = rpc_error("dcr_apply", 0)
    report["set_placement"] = llm.collective_rpc("dcr_set_placement", args=(args.placement,))
    report["prewarm"] = llm.collective_rpc("dcr_prewarm", args=(table, 0))
    report["d0_after_prewarm"] = digests()

    # the RPC error contract on every rank: one bad call per RPC (test_receiver.BAD_CALLS),
    # then the weights are unchanged and the next calls get their own replies
    from safetensors.torch import save_file

    from tests.integration.vllm.test_receiver import BAD_CALLS

    name0, t0 = next(iter(ckpts[0].items()))
    other = Path(args.out).with_name("other-model")
    other.mkdir(exist_ok=True)
    save_file({name0: t0.reshape(-1)[:-1].clone()}, str(other / "model.safetensors"))
    paths = {"<other-model>": str(other), "<not-a-checkpoint>": str(Path(args.out).parent)}
    report["bad_args"] = {}
    for label, (method, a, kw, _) in BAD_CALLS.items():
        a = tuple(paths.get(x, x) if isinstance(x, str) else x for x in a)
        report["bad_args"][label] = llm.collective_rpc(method, args=a, kwargs=kw)
    report["d0_after_bad_args"] = digests()
    report["status_after_bad_args"] = llm.collective_rpc("dcr_status")
    infos = llm.collective_rpc("dcr_info")
    report["info_after_bad_args"] = [{k: i[k] for k in ("ok", "rank", "tp_rank")} for i in infos]
    # storage addresses before the dense loads and the first apply, from this call: on the MLA
    # model at TP=2 (mla-tp2) an extra RPC between the first generation and the references was
    # seen to flip later greedy tokens while every digest (weights, buffers, derived views)
    # stayed equal, so the engine's output there depends on more than its weights
    report["storage"] = {"before_apply": storage(infos)}

    # references: dense loads of v1..v3 on this engine, then back to v0
    report["ref"] = []
    for v in range(1, len(versions)):
        llm.collective_rpc("dcr_dense_load", args=(versions[v], v))
        report["ref"].append({"digest": digests(), "tokens": tokens()})
    llm.collective_rpc("dcr_dense_load", args=(versions[0], 0))
    report["d0_after_dense_reload"] = digests()
    # dense loads keep parameter storage: the plan is still the loader's placement
    report["verify_plan"] = llm.collective_rpc("dcr_verify_plan")
    report["d0_after_verify_plan"] = digests()

    no_xor = set()
    for r in report["prewarm"]:
        no_xor |= set(r["overwrite_only"])

    def payloads(
        a: int, b: int, attempt: int, mode: str, base: int | None = None, sequence: int = 0
    ) -> list:
        kind = Kind.OVERWRITE if mode == "overwrite" else Kind.XOR
        items = diff_checkpoints(ckpts[a], ckpts[b], kind=kind, overwrite=no_xor)
        meta = PayloadMeta(
            version=b,
            base_version=a if base is None else base,
            attempt=attempt,
            owner=0,
            sequence=sequence,
        )
        return encode_items(items, meta, BucketConfig(bucket_bytes=args.bucket_bytes, threads=0))

    # rejections before any write
    good = payloads(0, 1, 0, "mixed")
    corrupt = bytearray(good[0])
    corrupt[len(corrupt) // 2] ^= 0xFF
    import numpy as np

    from shared_codec.format import encode_payload
    from shared_codec.records import make_item

    unknown = encode_payload(
        [
            make_item(
                "model.nonexistent.weight",
                "bfloat16",
                (4,),
                0,
                Kind.XOR,
                np.array([1]),
                np.array([1], np.uint16),
            )
        ],
        PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=90),
    )
    name0, t0 = next(iter(ckpts[0].items()))
    wrong_shape = encode_payload(
        [
            make_item(
                name0,
                "bfloat16",
                (t0.numel() + 1,),
                0,
                Kind.XOR,
                np.array([1]),
                np.array([1], np.uint16),
            )
        ],
        PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=91),
    )
    rej = {
        "wrong_base": llm.collective_rpc("dcr_stage", args=(payloads(0, 1, 0, "mixed", base=5),)),
        "corrupt": llm.collective_rpc("dcr_stage", args=([bytes(corrupt)],)),
        "unknown": llm.collective_rpc("dcr_stage", args=([unknown],)),
        "wrong_shape": llm.collective_rpc("dcr_stage", args=([wrong_shape],)),
    }
    report["rejections"] = rej
    report["d0_after_rejections"] = digests()
    report["empty_apply"] = llm.collective_rpc("dcr_apply", args=(0,))
    report["d0_after_empty_apply"] = digests()

    # exactly once (attempts 7-9, each fenced afterwards): the same changes re-encoded under
    # other sequence numbers, an extra payload and a missing one each fail with a clear error
    # and leave the weights unchanged
    from shared_codec.format import peek_header

    def ids(ps: list) -> list[str]:
        return [peek_header(p, verify=False).payload_id_hex for p in ps]

    def expect(ps: list) -> dict:
        return {"version": 1, "base_version": 0, "payload_ids": ids(ps)}

    eo: dict = {}
    first, again = payloads(0, 1, 7, "mixed"), payloads(0, 1, 7, "mixed", sequence=100)
    eo["first"], eo["again"] = ids(first), ids(again)
    eo["resequenced_stage"] = llm.collective_rpc("dcr_stage", args=(first + again,))
    eo["resequenced_apply"] = llm.collective_rpc(
        "dcr_apply", args=(7, False, expect(first + again))
    )
    llm.collective_rpc("dcr_abort", args=(7,))
    full = payloads(0, 1, 8, "mixed")
    extra = payloads(0, 1, 8, "overwrite", sequence=100)[:1]
    eo["extra"] = ids(extra)
    eo["extra_stage"] = llm.collective_rpc("dcr_stage", args=(full + extra,))
    eo["extra_apply"] = llm.collective_rpc("dcr_apply", args=(8, False, expect(full)))
    llm.collective_rpc("dcr_abort", args=(8,))
    full = payloads(0, 1, 9, "mixed")
    eo["missing"] = ids(full[-1:])
    eo["missing_stage"] = llm.collective_rpc("dcr_stage", args=(full[:-1],))
    eo["missing_apply"] = llm.collective_rpc("dcr_apply", args=(9, False, expect(full)))
    llm.collective_rpc("dcr_abort", args=(9,))
    eo["status"] = llm.collective_rpc("dcr_status")
    report["exactly_once"] = eo
    report["d0_after_exactly_once"] = digests()

    # v0 -> v1: mixed mode, delivered in reverse order, staged twice, applied once
    report["n_payloads_v1"] = len(good)
    report["stage1"] = llm.collective_rpc("dcr_stage", args=(good[::-1],))
    report["stage1_again"] = llm.collective_rpc("dcr_stage", args=(good,))
    report["ack1"] = llm.collective_rpc("dcr_apply", args=(0, True))
    report["d1"] = digests()
    report["tokens1"] = tokens()
    report["commit1"] = llm.collective_rpc("dcr_commit", args=(1,))
    report["late_duplicate_after_commit"] = llm.collective_rpc("dcr_stage", args=(good[:1],))

    # v1 -> v2: partial XOR apply, then an overwrite retry of the complete changed set
    report["stage2"] = llm.collective_rpc("dcr_stage", args=(payloads(1, 2, 1, "mixed"),))
    faults.arm(plan, fail_after_items=5)  # every rank fails after 5 items
    report["ack2_partial"] = llm.collective_rpc("dcr_apply", args=(1, False))
    report["d2_partial"] = digests()
    report["status_after_partial"] = llm.collective_rpc("dcr_status")
    report["abort1"] = llm.collective_rpc("dcr_abort", args=(1,))
    report["stage2_xor_retry"] = llm.collective_rpc("dcr_stage", args=(payloads(1, 2, 2, "mixed"),))
    report["apply2_xor_retry_error"] = rpc_error("dcr_apply", 2)
    llm.collective_rpc("dcr_abort", args=(2,))
    report["stage2_retry"] = llm.collective_rpc("dcr_stage", args=(payloads(1, 2, 3, "overwrite"),))
    report["ack2_retry"] = llm.collective_rpc("dcr_apply", args=(3, True))
    report["d2"] = digests()
    report["tokens2"] = tokens()
    llm.collective_rpc("dcr_commit", args=(2,))

    # v2 -> v3: overwrite-only from a clean receiver, through the orchestrator helper (which
    # checks every rank and resets the prefix cache after apply)
    from vllm_dcr_plugin.client import DCRClient

    client = DCRClient(llm)
    report["stage3"] = client.stage(payloads(2, 3, 0, "overwrite"))
    report["ack3"] = client.apply(0, verify=True)
    report["d3"] = client.digests()
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    report["tokens3"] = [list(o.outputs[0].token_ids) for o in outs]
    report["spans"].append(spans(outs))
    report["commit3"] = client.commit(3)
    report["metrics"] = [m["text"] for m in llm.collective_rpc("dcr_metrics")]
    report["storage"]["end"] = storage(llm.collective_rpc("dcr_info"))  # after all generation
    report["spans_after_commit3"] = spans(llm.generate(PROMPTS, sp, use_tqdm=False))
    Path(args.out).write_text(json.dumps(report, default=str))
    os._exit(0)


if __name__ == "__main__":
    main()
