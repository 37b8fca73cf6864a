"""Start a real vLLM engine with the DCR worker extension, generate greedily, call dcr_info.

Run as a program (vLLM spawns processes, so it needs a __main__ guard); writes a JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompts", required=True, help="JSON list of prompts")
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra", default="{}", help="JSON dict of extra LLM(...) arguments")
    args = ap.parse_args()

    from vllm import SamplingParams

    from tests.integration.vllm._engine import start_llm

    t0 = time.monotonic()
    llm = start_llm(args.model, args.tp, **json.loads(args.extra))
    started = time.monotonic() - t0
    outs = llm.generate(
        json.loads(args.prompts),
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=5),
    )
    infos = llm.collective_rpc("dcr_info")
    digests = [d["digest"] for d in llm.collective_rpc("dcr_digest")]
    Path(args.out).write_text(
        json.dumps(
            {
                "start_s": started,
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                # per position: top-5 {token id: logprob} (near-ties explain TP differences)
                "logprobs": [
                    [
                        {str(t): float(lp.logprob) for t, lp in pos.items()}
                        for pos in o.outputs[0].logprobs
                    ]
                    for o in outs
                ],
                "texts": [o.outputs[0].text for o in outs],
                "infos": infos,
                "digests": digests,
            }
        )
    )
    os._exit(0)  # skip vLLM's slow teardown; the test kills the process group anyway


if __name__ == "__main__":
    main()
