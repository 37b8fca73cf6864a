"""Stage and apply payload files on a real vLLM engine, then compare with a dense load.

Used by the end-to-end test: payloads come from real Megatron training steps (the owner hook),
the engine starts on the v0 export; the digest after applying must equal the digest after a
dense load of the v1 export, and greedy tokens must match. Writes a JSON report.
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
    args = ap.parse_args()

    from vllm import SamplingParams

    from shared_codec.checkpoint import load_checkpoint
    from tests.vllm._engine import start_llm

    llm = start_llm(args.v0)
    sp = SamplingParams(max_tokens=8, temperature=0.0)

    def tokens() -> list:
        llm.reset_prefix_cache()
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]

    table = [
        [n, str(t.dtype).removeprefix("torch."), list(t.shape)]
        for n, t in load_checkpoint(args.v0).items()
    ]
    payloads = [f.read_bytes() for f in sorted(Path(args.payloads).glob("*.bin"))]
    r: dict = {"n_payloads": len(payloads)}
    r["prewarm"] = llm.collective_rpc("dcr_prewarm", args=(table, 0))
    r["stage"] = llm.collective_rpc("dcr_stage", args=(payloads,))
    r["ack"] = llm.collective_rpc("dcr_apply", args=(0, True))
    r["digest_delta"] = [d["digest"] for d in llm.collective_rpc("dcr_digest")]
    r["tokens_delta"] = tokens()
    llm.collective_rpc("dcr_commit", args=(1,))
    llm.collective_rpc("dcr_dense_load", args=(args.v1, 1))
    r["digest_dense"] = [d["digest"] for d in llm.collective_rpc("dcr_digest")]
    r["tokens_dense"] = tokens()
    llm.collective_rpc("dcr_dense_load", args=(args.v0, 0))
    r["digest_v0"] = [d["digest"] for d in llm.collective_rpc("dcr_digest")]
    Path(args.out).write_text(json.dumps(r, default=str))
    os._exit(0)


if __name__ == "__main__":
    main()
