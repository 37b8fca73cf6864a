"""``dcr bench construct``: delta construction time and payload bytes, modes X, P, F.

Runs as a 2-rank gloo job (torchrun, TP=2) on a randomly initialised Qwen3-shaped GPTModel of a
few hundred million parameters (default ~316M: hidden 1024, 16 layers, FFN 4096, vocab 32000;
`--size large`: ~1.34B, `sizes.LARGE`, the scale run).
For each injected change rate (3%, 5%: a uniform share of every parameter's elements updated by
relative amplitude 1e-2, identically on replicas), each mode's hook builds one delta (all
payloads handed to a counting sink) and the weights are restored. Reported per rate and mode:
construction seconds (slowest rank), payload bytes (sum over ranks), and for X/P the detection
time; every build is repeated: one warm-up, then `REPEATS` timed builds, median and min-max.
Scan efficiency = reference seconds / detection seconds on rank 0, the reference being a
same-thread read of the same two streams (`ReadTwo`: every tracked parameter's stored bits and
its baseline, as 64-bit words XORed and ORed into one accumulator, compiled; the least a scan of
both streams must do). Three reference passes run right before each build (the warm-up's
too), on every rank at once as the ranks detect at once; the fastest of the three is that
build's reference. Scan efficiency = the run's read floor (its fastest reference, every X/P row
reading the same number of bytes) / rank 0's median detection (min-max from its slowest and
fastest build); the per-build paired ratio is reported too (``scan_efficiency_paired``). The
floor, because on this VM the reads are bimodal (0.023-0.024 s or 0.031-0.036 s for 634 MB,
for whole stretches of a run, as the host's memory bandwidth comes and goes) while the
detection, compute-bound, stays within +-5%: the paired ratio swings with the read. memcpy (``dst.copy_(src)`` into a preallocated buffer, read +
written bytes per second) is still reported for comparison. Rank 0 prints the table and writes
the JSON. Construction seconds per GB of the BF16 checkpoint (`seconds_per_gb`) compare sizes.
`--modes` picks a subset of X, P, F (the P-vs-F and X-vs-P ratios need the modes they name).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dcr_tools.bench.sizes import LARGE
from dcr_tools.bench.stats import summarize

REPEATS = 5  # timed runs after one warm-up, for builds and the read reference

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
    "large": LARGE,
}


def memcpy_bandwidth(nbytes: int = 256 << 20) -> list[float]:
    """``dst.copy_(src)`` into a preallocated buffer, read + written bytes per second: one
    warm-up, then REPEATS timed copies (one figure per copy)."""
    src = torch.ones(nbytes // 2, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    out = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        dst.copy_(src)
        out.append(2 * src.numel() * 2 / (time.perf_counter() - t0))
    return out


def _read_kernel() -> Any:
    import numba

    @numba.njit(nogil=True, cache=False)
    def read_two(a, b):  # pragma: no cover - compiled
        acc = np.uint64(0)
        for i in range(a.shape[0]):
            acc |= a[i] ^ b[i]
        return acc

    return read_two


class ReadTwo:
    """The scan-efficiency reference for `hook` on this rank: a same-thread read of what its
    change detection reads (every tracked parameter's stored bits and its baseline tracker),
    compiled. `once()` times one pass; `nbytes` is what a pass reads."""

    def __init__(self, hook: Any) -> None:
        from shared_codec.dtypes import tensor_bits

        self.kernel = _read_kernel()
        self.pairs = []
        for t in hook.tracked:
            cur = tensor_bits(t.param.detach().to("cpu")).view(np.uint8)
            base = tensor_bits(hook.trackers[t.index]).view(np.uint8)
            n = cur.size // 8 * 8
            self.pairs.append((cur[:n].view(np.uint64), base[:n].view(np.uint64)))
        self.nbytes = sum(2 * a.nbytes for a, _ in self.pairs)
        self.once()  # compile

    def once(self) -> float:
        t0 = time.perf_counter()
        for a, b in self.pairs:
            self.kernel(a, b)
        return time.perf_counter() - t0


def inject(model: torch.nn.Module, rate: float, seed: int) -> None:
    from shared_codec.scan import stable_hash

    with torch.no_grad():
        for name, p in model.named_parameters():
            # replicas (TP-replicated norms) must receive identical changes: seed by name
            g = torch.Generator().manual_seed(seed * 1_000_003 + stable_hash(name) % 1_000_000)
            flat = p.data.view(-1)
            k = max(1, int(rate * flat.numel()))
            pick = torch.randperm(flat.numel(), generator=g)[:k]
            flat[pick] = (flat[pick].float() * (1 + 1e-2 * torch.randn(k, generator=g))).to(p.dtype)


def start_job(size: str) -> tuple[dict[str, Any], Any]:
    """This rank of the benchmark job (every rank; torchrun's environment): the CPU layer, the
    gloo group, TP=2, and the randomly initialised Qwen3-shaped GPTModel of `size` (SIZES).
    Returns (HF config, this rank's model)."""
    from megatron_dcr_hooks import cpu_compat

    cpu_compat.enable()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dcr_tools.fixtures import hf_config, spec_for
    from dcr_tools.trainers.model import ParallelLayout, build_gpt_model

    layout = ParallelLayout(tp=2)
    layout.initialize()
    model_parallel_cuda_manual_seed(1234)
    cfg = hf_config(spec_for("qwen3", **SIZES[size]))
    return cfg, build_gpt_model(cfg, layout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="medium", choices=sorted(SIZES))
    ap.add_argument("--json", default="")
    ap.add_argument("--modes", default="X,P,F", help="comma-separated subset of X,P,F")
    args = ap.parse_args()
    modes = [m for m in ("X", "P", "F") if m in args.modes.split(",")]
    if not modes or set(args.modes.split(",")) - {"X", "P", "F"}:
        ap.error(f"--modes must name some of X,P,F, got {args.modes!r}")

    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.hook import DCRConfig, DCRHook

    t0 = time.perf_counter()
    cfg, model = start_job(args.size)
    rank = dist.get_rank()
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
        for m in modes
    }
    first = next(iter(hooks.values())).report()
    n_canonical = int(first["canonical_bytes"] // 2)
    bws = memcpy_bandwidth()
    bw = float(np.median(bws))
    rows: list[dict[str, Any]] = []
    for rate in (0.03, 0.05):
        inject(model, rate, seed=int(rate * 100))
        for mode, hook in hooks.items():
            read = ReadTwo(hook) if mode != "F" else None
            builds: list[torch.Tensor] = []
            for rep_i in range(REPEATS + 1):  # the first build is the warm-up
                sizes: list[int] = []

                def count(payload: bytes, sizes: list[int] = sizes) -> None:
                    sizes.append(len(payload))

                # the reference pass right before each build, every rank at once (as they
                # detect at once: the same share of memory bandwidth)
                dist.barrier()
                read_s = min(read.once() for _ in range(3)) if read is not None else 0.0
                dist.barrier()
                rep = hook.build(1, rep_i, sink=count)
                stats = torch.tensor(
                    [
                        rep.seconds,
                        rep.detect_seconds,
                        float(sum(sizes)),
                        rep.owned_elements * 2.0,
                        read_s,
                    ],
                    dtype=torch.float64,
                )
                mx, sm = stats.clone(), stats.clone()
                dist.all_reduce(mx, op=dist.ReduceOp.MAX)
                dist.all_reduce(sm)
                hook.abort()
                if rep_i:
                    builds.append(torch.stack([mx[0], mx[1], sm[2], stats[1], stats[3], stats[4]]))
            b = torch.stack(builds)
            seconds = summarize(b[:, 0].tolist())
            row: dict[str, Any] = {
                "rate": f"{round(rate * 100)}%",
                "mode": mode,
                "repeats": REPEATS,
                "seconds": seconds["median"],
                "seconds_min": seconds["min"],
                "seconds_max": seconds["max"],
                "seconds_runs": seconds["runs"],
                "seconds_per_gb": seconds["median"] / (n_canonical * 2 / 1e9),
                "payload_bytes": int(b[0, 2]),
                "element_change_rate": rep.element_change_rate,
            }
            if read is not None and float(b[:, 1].max()) > 0:
                detect = summarize(b[:, 1].tolist())  # slowest rank
                own = summarize(b[:, 3].tolist())  # this rank (rank 0 reports)
                ref = summarize(b[:, 5].tolist())
                eff = summarize((b[:, 5] / b[:, 3]).tolist())  # per build: its own reference
                scan = float(b[0, 4]) * 2 / own["median"]  # candidate + baseline bytes
                row.update(
                    {
                        "detect_seconds": detect["median"],
                        "detect_min_s": detect["min"],
                        "detect_max_s": detect["max"],
                        "scan_bytes_per_s": scan,
                        "read_bytes_per_s": read.nbytes / ref["median"],
                        "read_seconds": ref["median"],
                        "read_min_s": ref["min"],
                        "read_max_s": ref["max"],
                        "detect_rank0_seconds": own["median"],
                        "detect_rank0_min_s": own["min"],
                        "detect_rank0_max_s": own["max"],
                        "scan_efficiency_paired": eff["median"],
                        "scan_efficiency_paired_min": eff["min"],
                        "scan_efficiency_paired_max": eff["max"],
                        "scan_efficiency_paired_runs": eff["runs"],
                        "scan_vs_memcpy": scan / bw,
                    }
                )
            rows.append(row)
            if rank == 0:
                print(
                    f"[bench construct] {row['rate']} {mode}: {row['seconds']:.2f}s "
                    f"[{row['seconds_min']:.2f}-{row['seconds_max']:.2f}] "
                    f"{row['payload_bytes'] / 1e6:.1f} MB",
                    flush=True,
                )
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
    # the read floor of the run: its fastest reference pass (every X/P row reads the same
    # bytes: the parameters and a tracker of the same size); scan efficiency = floor / rank 0's
    # detection (median, and from its slowest / fastest build)
    floor = min((r["read_min_s"] for r in rows if "read_min_s" in r), default=0.0)
    for r in rows:
        if "read_min_s" in r:
            r["read_floor_s"] = floor
            r["scan_efficiency"] = floor / r["detect_rank0_seconds"]
            r["scan_efficiency_min"] = floor / r["detect_rank0_max_s"]
            r["scan_efficiency_max"] = floor / r["detect_rank0_min_s"]
    if rank == 0:
        res = {
            "benchmark": "construct",
            "size": args.size,
            **SIZES[args.size],
            "parameters": n_canonical,
            "checkpoint_bytes": n_canonical * 2,
            "modes": modes,
            # F classifies nothing as affine: report the share an X or P hook uses
            "affine_share": (hooks.get("X") or hooks.get("P") or hooks["F"]).report()[
                "affine_share"
            ],
            "memcpy_bytes_per_s": bw,
            "memcpy_min_bytes_per_s": min(bws),
            "memcpy_max_bytes_per_s": max(bws),
            "repeats": REPEATS,
            "rows": rows,
            "baseline_bytes_rank0": {m: h.baseline_bytes() for m, h in hooks.items()},
        }
        by = {(r["rate"], r["mode"]): r for r in rows}
        for pct in ("3%", "5%"):
            if "F" in modes and "P" in modes:
                res[f"p_vs_f_speedup_{pct}"] = by[(pct, "F")]["seconds"] / by[(pct, "P")]["seconds"]
            if "X" in modes and "P" in modes:
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
        f"Delta construction ({res['parameters'] / 1e6:.0f}M parameters, "
        f"{res['checkpoint_bytes'] / 1e9:.2f} GB BF16, 2 ranks TP=2, "
        f"affine share {100 * res['affine_share']:.1f}%; memcpy "
        f"{res['memcpy_bytes_per_s'] / 1e9:.1f} GB/s r+w)"
    ]
    out.append(
        f"(median [min-max] of {res['repeats']} builds after a warm-up; scan efficiency = "
        "the run's fastest same-thread read of the same two streams / detection, rank 0; "
        "in parentheses: paired with the read right before each build)"
    )
    out.append(
        f"{'rate':>4} {'mode':>4} | {'seconds':>17} | {'s/GB':>6} | {'payload MB':>10} | "
        f"{'detect s':>20} | {'read s':>6} | {'scan eff. (paired)':>23} | {'vs memcpy':>9}"
    )
    for r in res["rows"]:
        det = eff = mem = rd = "-"
        if "detect_seconds" in r:
            det = f"{r['detect_seconds']:.3f} [{r['detect_min_s']:.3f}-{r['detect_max_s']:.3f}]"
            eff = (
                f"{r['scan_efficiency']:.2f} [{r['scan_efficiency_min']:.2f}-"
                f"{r['scan_efficiency_max']:.2f}]"
            )
            eff += f" ({r['scan_efficiency_paired']:.2f})"
            mem, rd = f"{r['scan_vs_memcpy']:.2f}", f"{r['read_seconds']:.3f}"
        secs = f"{r['seconds']:.2f} [{r['seconds_min']:.2f}-{r['seconds_max']:.2f}]"
        out.append(
            f"{r['rate']:>4} {r['mode']:>4} | {secs:>17} | {r['seconds_per_gb']:6.3f} | "
            f"{r['payload_bytes'] / 1e6:10.2f} | "
            f"{det:>20} | {rd:>6} | {eff:>23} | {mem:>9}"
        )
    for rate in ("3%", "5%"):
        if f"p_vs_f_speedup_{rate}" in res:
            out.append(f"{rate}: P is {res[f'p_vs_f_speedup_{rate}']:.2f}x faster than F")
        if f"x_bytes_saving_vs_p_{rate}" in res:
            out.append(
                f"{rate}: X has {100 * res[f'x_bytes_saving_vs_p_{rate}']:.0f}% fewer bytes than P"
            )
    return "\n".join(out)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
