"""``dcr bench prefix``: the prefix cache across DCR refits in an async RL loop, version-salted
(issue 34 item 2) against the global reset DCR used before.

One engine per mode (vLLM's ``AsyncLLM`` in a child process, the tiny Qwen3 fixture, TP=1,
32-token blocks), each running the same loop. Every step:
1. an in-flight request (a long generation) runs; the step pauses generation in ``keep`` mode
   (vLLM's async-RL pause: the request is frozen with its KV);
2. DCR refits v -> v+1 through the ``dcr_*`` RPCs (stage, apply, commit);
3. the mode's cache handling:
   - ``salted``: nothing (the engine salts by weight version, prefix_salt.py);
   - ``reset``: ``reset_prefix_cache()``, what DCR's clients call after every apply. vLLM refuses
     it while blocks are in use, i.e. while the keep-mode request is frozen: it returns False and
     the old version's cache survives (``DCR_PREFIX_SALT=0`` in this engine);
   - ``reset-running``: ``reset_prefix_cache(reset_running_requests=True)``, the reset that
     succeeds: vLLM preempts the frozen request, which recomputes its KV on resume
     (``DCR_PREFIX_SALT=0``);
4. resume; then the rollout of v+1: ``PROMPTS`` prompts sharing a 96-token system prefix,
   ``GROUP`` samples each (the first request alone, then the rest at once). The in-flight
   request's prompt shares nothing with them.

Per mode and repeat (one warm-up then `repeats` timed repeats of `STEPS` steps): the prefix-hit
rate of the rollout's prompt tokens (vLLM's ``num_cached_tokens``), the stale tokens (cached
tokens of the first request after each refit: before it no request of the new version computed
any block it could hit, so every hit there is KV of the old weights), the rollout's median time to first token, the frozen
request's time from resume to its next token, and the resets vLLM refused. Printed as a table;
``--json`` writes everything.

Limitations:
1. CPU and a tiny model: the times show the mechanism, not a GPU's magnitudes.
2. The refit itself is the same in every mode and not part of any figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from dcr_tools.bench.stats import aggregate

MODES = ("salted", "reset", "reset-running")
STEPS = 3
PROMPTS = 4
GROUP = 4
SYSTEM = [(11 * i + 5) % 400 + 20 for i in range(96)]  # the shared system prefix
FIGURES = ("hit_rate", "stale_tokens", "ttft_ms", "inflight_resume_ms", "resets_refused")


def prompt(p: int) -> Any:
    """Prompt `p` (a vLLM ``TokensPrompt``): the system prefix, then 64 tokens of its own; the
    in-flight request's (``p == PROMPTS``) shares nothing with them (288 tokens of its own), so
    that the first request after a refit can only hit blocks of the rollout before it."""
    if p == PROMPTS:
        return {"prompt_token_ids": [(17 * i + 3) % 60 + 440 for i in range(288)]}
    return {"prompt_token_ids": SYSTEM + [(13 * i + 7 * p) % 300 + 30 for i in range(64)]}


async def run_mode(mode: str, versions: list[str], repeats: int) -> list[dict[str, Any]]:
    """The loop of the module docstring on one engine; one dict of figures per timed repeat."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint
    from shared_codec.format import PayloadMeta
    from shared_codec.records import Kind, diff_checkpoints

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=versions[0],
            dtype="bfloat16",
            enforce_eager=True,
            worker_extension_cls="vllm_dcr_plugin.DCRWorkerExtension",
            max_model_len=512,
            max_num_seqs=8,
            block_size=32,
            seed=0,
        )
    )
    ckpts = [load_checkpoint(v) for v in versions]
    n = 0  # request ids

    async def rpc(method: str, *args: Any) -> list[dict[str, Any]]:
        replies = await engine.collective_rpc(method, args=args)
        bad = [r for r in replies if not r.get("ok")]
        if bad:
            raise RuntimeError(f"{method}: {bad}")
        return replies

    async def one(p: int, tokens: int, seen: list[float] | None = None) -> dict[str, Any]:
        nonlocal n
        n += 1
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
        t0, first, cached = time.perf_counter(), None, 0
        async for out in engine.generate(prompt(p), sp, request_id=f"r{n}"):
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids:
                first = now if first is None else first
                if seen is not None:
                    seen.append(now)
            if out.num_cached_tokens is not None:
                cached = out.num_cached_tokens
        assert first is not None
        return {"ttft": first - t0, "cached": cached, "prompt": len(prompt(p)["prompt_token_ids"])}

    pre = await rpc(
        "dcr_prewarm", [[k, str(t.dtype)[6:], list(t.shape)] for k, t in ckpts[0].items()], 0
    )
    no_xor = set(pre[0]["overwrite_only"])
    version, attempt, results = 0, 0, []
    for rep in range(repeats + 1):  # the first repeat is the warm-up
        rows, stale, refused, resume = [], 0, 0, []
        for _ in range(STEPS):
            src, dst = version % len(ckpts), (version + 1) % len(ckpts)
            stamps: list[float] = []
            inflight = asyncio.create_task(one(PROMPTS, 200, stamps))
            while len(stamps) < 4:  # it runs: it holds KV blocks
                if inflight.done():
                    inflight.result()  # its error
                    raise RuntimeError("the in-flight request ended before the pause")
                await asyncio.sleep(0.005)
            await engine.pause_generation(mode="keep", clear_cache=False)
            items = diff_checkpoints(ckpts[src], ckpts[dst], kind=Kind.XOR, overwrite=no_xor)
            meta = PayloadMeta(
                version=version + 1, base_version=version, attempt=attempt, owner=0, sequence=0
            )
            await rpc("dcr_stage", encode_items(items, meta, BucketConfig(threads=0)))
            await rpc("dcr_apply", attempt)
            await rpc("dcr_commit", version + 1)
            version, attempt = version + 1, attempt + 1
            if mode == "reset":
                refused += not await engine.reset_prefix_cache()
            elif mode == "reset-running":
                refused += not await engine.reset_prefix_cache(reset_running_requests=True)
            before = len(stamps)
            t_resume = time.perf_counter()
            await engine.resume_generation()
            probe = await one(0, 4)  # the first request of the new version
            stale += probe["cached"]
            rows.append(probe)
            for p in range(PROMPTS):
                group = [] if p == 0 else [one(p, 4)]
                group += [one(p, 4) for _ in range(GROUP - 1)]
                rows += await asyncio.gather(*group)
            await inflight
            if len(stamps) > before:
                resume.append(stamps[before] - t_resume)
        if rep == 0:
            continue
        results.append(
            {
                "hit_rate": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
                "stale_tokens": stale,
                "ttft_ms": 1e3 * sorted(r["ttft"] for r in rows)[len(rows) // 2],
                "inflight_resume_ms": 1e3 * sorted(resume)[len(resume) // 2],
                "resets_refused": refused,
                "requests": len(rows),
            }
        )
    engine.shutdown()
    return results


def child(mode: str, versions: list[str], repeats: int, out: str) -> None:
    results = asyncio.run(run_mode(mode, versions, repeats))
    Path(out).write_text(json.dumps(results))
    os._exit(0)  # vLLM's engine core process and threads: no lingering shutdown


def table(res: dict[str, Any]) -> str:
    lines = [
        "| mode | prefix-hit rate | stale tokens per repeat | TTFT ms | frozen request resume ms "
        "| resets refused |",
        "|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        r = res["modes"][mode]
        cells = [
            f"{100 * r['hit_rate']:.1f}% ({100 * r['hit_rate_min']:.1f}-{100 * r['hit_rate_max']:.1f})",
            f"{r['stale_tokens']:.0f} ({r['stale_tokens_min']:.0f}-{r['stale_tokens_max']:.0f})",
            f"{r['ttft_ms']:.1f} ({r['ttft_ms_min']:.1f}-{r['ttft_ms_max']:.1f})",
            f"{r['inflight_resume_ms']:.1f} ({r['inflight_resume_ms_min']:.1f}-"
            f"{r['inflight_resume_ms_max']:.1f})",
            f"{r['resets_refused']:.0f} of {STEPS}",
        ]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(json_path: str | None, repeats: int) -> int:
    from dcr_tools.fixtures import perturb_checkpoint, write_tiny_model
    from dcr_tools.procs import base_env

    with tempfile.TemporaryDirectory(prefix="dcr-bench-prefix-") as tmp:
        root = Path(tmp)
        versions = [str(write_tiny_model("qwen3", root / "v0", seed=0))]
        perturb_checkpoint(versions[0], root / "v1", seed=1)
        versions.append(str(root / "v1"))
        res: dict[str, Any] = {
            "bench": "prefix",
            "steps": STEPS,
            "prompts": PROMPTS,
            "group": GROUP,
            "repeats": repeats,
            "modes": {},
        }
        for mode in MODES:
            out = root / f"{mode}.json"
            env = base_env(DCR_PREFIX_SALT="1" if mode == "salted" else "0")
            cmd = [sys.executable, "-m", "dcr_tools.bench.prefix", "--child", mode,
                   "--versions", json.dumps(versions), "--repeats", str(repeats), "--out", str(out)]  # fmt: skip
            with open(root / f"{mode}.log", "wb") as log:
                rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            if rc != 0 or not out.exists():
                print((root / f"{mode}.log").read_text()[-4000:], file=sys.stderr)
                return rc or 1
            runs = json.loads(out.read_text())
            res["modes"][mode] = {**aggregate(runs, FIGURES), "runs": runs}
    print(table(res))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=MODES)
    ap.add_argument("--versions")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.child:
        child(a.child, json.loads(a.versions), a.repeats, a.out)
    else:
        raise SystemExit(main(a.json, a.repeats))
