"""``dcr bench construct``: delta construction time and payload bytes, modes X, P, F.

Runs as a 2-rank gloo job (torchrun, TP=2) on a randomly initialised Qwen3-shaped GPTModel of a
few hundred million parameters (default ~316M: hidden 1024, 16 layers, FFN 4096, vocab 32000).
For each injected change rate (3%, 5%: a uniform share of every parameter's elements updated by
relative amplitude 1e-2, identically on replicas), each mode's hook builds one delta (all
payloads handed to a counting sink) and the weights are restored. Reported per rate and mode:
construction seconds (slowest rank), payload bytes (sum over ranks), and for X/P the detection
time; scan efficiency = ((candidate + baseline bytes read) / detection seconds) / memcpy
bandwidth, memcpy measured in the same run as ``dst.copy_(src)`` into a preallocated buffer
(read + written bytes per second). Rank 0 prints the table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SIZES = {
    "medium": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
    },
    "small": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 4096,
    },
}


def memcpy_bandwidth(nbytes: int = 256 << 20) -> float:
    src = torch.ones(nbytes // 2, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 2 / best


def inject(model: torch.nn.Module, rate: float, seed: int) -> None:
    from megatron_dcr_hooks.tasks import stable_hash

    with torch.no_grad():
        for name, p in model.named_parameters():
            # replicas (TP-replicated norms) must receive identical changes: seed by name
            g = torch.Generator().manual_seed(seed * 1_000_003 + stable_hash(name) % 1_000_000)
            flat = p.data.view(-1)
            k = max(1, int(rate * flat.numel()))
            pick = torch.randperm(flat.numel(), generator=g)[:k]
            flat[pick] = (flat[pick].float() * (1 + 1e-2 * torch.randn(k, generator=g))).to(p.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="medium", choices=sorted(SIZES))
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from megatron_dcr_hooks import cpu_compat

    cpu_compat.enable()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dcr_tools.fixtures import hf_config, spec_for
    from dcr_tools.trainers.model import ParallelLayout, build_gpt_model
    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.hook import DCRConfig, DCRHook

    rank = dist.get_rank()
    layout = ParallelLayout(tp=2)
    layout.initialize()
    model_parallel_cuda_manual_seed(1234)
    cfg = hf_config(spec_for("qwen3", **SIZES[args.size]))
    t0 = time.perf_counter()
    model = build_gpt_model(cfg, layout)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(
            f"[bench construct] model built in {time.perf_counter() - t0:.1f}s; "
            f"{n_params / 1e6:.1f}M parameters per rank (TP=2)",
            flush=True,
        )
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    hooks = {
        m: DCRHook(
            [model],
            DCRConfig(mode=m, architecture=architecture_of(cfg), wrap_step=False, encode_threads=0),
        )
        for m in ("X", "P", "F")
    }
    bw = memcpy_bandwidth()
    rows: list[dict[str, Any]] = []
    for rate in (0.03, 0.05):
        inject(model, rate, seed=int(rate * 100))
        for mode, hook in hooks.items():
            sizes: list[int] = []

            def count(payload: bytes, sizes: list[int] = sizes) -> None:
                sizes.append(len(payload))

            dist.barrier()
            rep = hook.build(1, 0, sink=count)
            stats = torch.tensor(
                [rep.seconds, rep.detect_seconds, float(sum(sizes)), float(rep.owned_elements * 2)],
                dtype=torch.float64,
            )
            mx, sm = stats.clone(), stats.clone()
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            dist.all_reduce(sm)
            hook.abort()
            row: dict[str, Any] = {
                "rate": f"{round(rate * 100)}%",
                "mode": mode,
                "seconds": float(mx[0]),
                "payload_bytes": int(sm[2]),
                "element_change_rate": rep.element_change_rate,
            }
            if mode != "F" and mx[1] > 0:
                scan = 2 * float(stats[3]) / float(stats[1])  # this rank: candidate + baseline
                row.update(
                    {
                        "detect_seconds": float(mx[1]),
                        "scan_bytes_per_s": scan,
                        "scan_efficiency": scan / bw,
                    }
                )
            rows.append(row)
            if rank == 0:
                print(
                    f"[bench construct] {row['rate']} {mode}: {row['seconds']:.2f}s "
                    f"{row['payload_bytes'] / 1e6:.1f} MB",
                    flush=True,
                )
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
    if rank == 0:
        share = hooks["X"].report()
        res = {
            "benchmark": "construct",
            "size": args.size,
            **SIZES[args.size],
            "parameters": int(share["canonical_bytes"] // 2),
            "affine_share": share["affine_share"],
            "memcpy_bytes_per_s": bw,
            "rows": rows,
            "baseline_bytes_rank0": {m: h.baseline_bytes() for m, h in hooks.items()},
        }
        by = {(r["rate"], r["mode"]): r for r in rows}
        for pct in ("3%", "5%"):
            res[f"p_vs_f_speedup_{pct}"] = by[(pct, "F")]["seconds"] / by[(pct, "P")]["seconds"]
            res[f"x_bytes_saving_vs_p_{pct}"] = (
                1 - by[(pct, "X")]["payload_bytes"] / by[(pct, "P")]["payload_bytes"]
            )
        print(render(res))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=2))
            print(f"\nwrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()


def render(res: dict) -> str:
    out = [
        f"Delta construction ({res['parameters'] / 1e6:.0f}M parameters, 2 ranks TP=2, "
        f"affine share {100 * res['affine_share']:.1f}%; memcpy "
        f"{res['memcpy_bytes_per_s'] / 1e9:.1f} GB/s r+w)"
    ]
    out.append(
        f"{'rate':>4} {'mode':>4} | {'seconds':>8} | {'payload MB':>10} | "
        f"{'detect s':>8} | {'scan eff.':>9}"
    )
    for r in res["rows"]:
        det = f"{r['detect_seconds']:8.3f}" if "detect_seconds" in r else f"{'-':>8}"
        eff = f"{r['scan_efficiency']:9.2f}" if "scan_efficiency" in r else f"{'-':>9}"
        out.append(
            f"{r['rate']:>4} {r['mode']:>4} | {r['seconds']:8.2f} | "
            f"{r['payload_bytes'] / 1e6:10.2f} | {det} | {eff}"
        )
    for rate in ("3%", "5%"):
        out.append(
            f"{rate}: P is {res[f'p_vs_f_speedup_{rate}']:.2f}x faster than F; X has "
            f"{100 * res[f'x_bytes_saving_vs_p_{rate}']:.0f}% fewer bytes than P"
        )
    return "\n".join(out)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
