"""``dcr bench named``: the named-tensor owner against the owner-local Megatron hook, on the same
model, the same change and the same ranks (issue 33 item 1).

Runs as a 2-rank gloo job (torchrun, TP=2) on construct's randomly initialised Qwen3-shaped
GPTModel (``--size``: medium ~316M parameters by default). For each injected change rate (1%,
3%: a uniform share of every parameter's elements updated by relative amplitude 1e-2,
identically on replicas), one warm-up then `REPEATS` timed rounds of each path:

- **hook**: ``DCRHook.build`` (mode X), the payloads handed to a counting sink: detection and
  projection on each rank's own shards. Seconds: the slowest rank.
- **named**: what a framework integration runs. Every rank exports the whole model through the
  bridge (``iter_hf_export``: TP all-gathers, every canonical tensor on every rank, what verl's
  and SkyRL's Megatron sources do), the `NamedTensorOwner` diffs its name-hash share of the stream
  (``take_weights``), and rank 0 builds the attempt onto a ``dir`` transport (``build``).
  Seconds: take (slowest rank) + build. The export alone (``export_seconds``: the stream
  drained, nothing diffed) is timed in the same round, the part the framework pays anyway.

Memory: each path's host baseline (hook: the trackers of the owned shards and the residual
baseline; named: the owned share of the canonical checkpoint), summed over the ranks, and per
GB of the BF16 checkpoint; and each rank's peak RSS after the run (``ru_maxrss``; it includes
the model and everything else, for scale).

Exactness: for each rate, rank 0 applies the hook's payloads and the named owner's payloads
(the reference applier) to copies of the canonical checkpoint before the change and compares
them with the export after it, bit for bit (``bit_exact``).

Rank 0 prints the table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dcr_tools.bench.construct import SIZES, inject, start_job
from dcr_tools.bench.stats import summarize

REPEATS = 5
RATES = (0.01, 0.03)


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="medium", choices=sorted(SIZES))
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    cfg, model = start_job(args.size)
    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.conversion import export_hf_weights, iter_hf_export
    from megatron_dcr_hooks.hook import DCRConfig, DCRHook
    from shared_codec.checkpoint import bits_equal
    from shared_codec.decode import decode_payload
    from shared_codec.named import NamedOwnerConfig, NamedTensorOwner
    from shared_codec.records import apply_items
    from shared_codec.transport.spec import TransportSpec

    rank = dist.get_rank()
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    v0 = export_hf_weights(model, cfg)  # the committed canonical checkpoint (every rank)
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in v0.values())
    gb = checkpoint_bytes / 1e9
    hook = DCRHook([model], DCRConfig(mode="X", architecture=architecture_of(cfg), wrap_step=False))
    root = Path(tempfile.mkdtemp(prefix="dcr-bench-named-")) if rank == 0 else None
    box = [str(root)]
    dist.broadcast_object_list(box, src=0)
    spec = {"kind": "dir", "root": box[0]}
    owner = NamedTensorOwner(
        spec, v0, config=NamedOwnerConfig(encode_threads=0), group=dist.group.WORLD
    )
    if rank != 0:
        v0 = {}  # only rank 0 keeps the checkpoint (the exactness check)
    rows: list[dict[str, Any]] = []
    version = 0
    for rate in RATES:
        inject(model, rate, seed=int(rate * 100))
        runs: dict[str, list[float]] = {k: [] for k in ("hook", "export", "take", "build", "named")}
        hook_payloads: list[bytes] = []
        named_bytes = hook_bytes = 0
        for rep in range(REPEATS + 1):  # the first round is the warm-up
            version += 1
            sink: list[bytes] = []
            dist.barrier()
            r = hook.build(1, rep, sink=sink.append)
            hook_s = _max(r.seconds)
            hook_bytes = int(_sum(r.payload_bytes))
            hook.abort()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in iter_hf_export(model, cfg):
                pass
            export_s = _max(time.perf_counter() - t0)
            dist.barrier()
            take = owner.take_weights(iter_hf_export(model, cfg))
            take_s = _max(take.seconds)
            build_s = 0.0
            if rank == 0:
                reply = owner.build(owner.committed_version + 1, version, False)
                build_s, named_bytes = reply.build_s, reply.payload_bytes
                owner.abort(owner.committed_version + 1, version)
            build_s = _max(build_s)
            if rep:
                for k, v in (
                    ("hook", hook_s), ("export", export_s), ("take", take_s),
                    ("build", build_s), ("named", take_s + build_s),
                ):  # fmt: skip
                    runs[k].append(v)
            # every rank's hook payloads on rank 0 (the exactness check, last round)
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, sink)
            hook_payloads = [p for ps in every for p in ps]
        exact = None
        state = export_hf_weights(model, cfg)  # the canonical checkpoint after the change
        if rank == 0:
            source = TransportSpec.parse(spec).open_source()
            named_items = [
                i
                for p in source.fetch(owner.committed_version + 1, version)
                for i in decode_payload(p).items
            ]
            hook_items = [i for p in hook_payloads for i in decode_payload(p).items]
            exact = True
            for items in (hook_items, named_items):
                held = {n: t.clone() for n, t in v0.items()}
                apply_items(held, items)
                exact = exact and all(bits_equal(held[n], state[n]) for n in state)
        del state
        s = {k: summarize(v) for k, v in runs.items()}
        row: dict[str, Any] = {
            "rate": f"{round(rate * 100)}%",
            "element_change_rate": take.element_change_rate,
            "repeats": REPEATS,
            "hook_payload_bytes": hook_bytes,
            "named_payload_bytes": int(named_bytes),
            "bit_exact": exact,
        }
        for k, stat in s.items():
            row[f"{k}_seconds"], row[f"{k}_min_s"], row[f"{k}_max_s"] = (
                stat["median"],
                stat["min"],
                stat["max"],
            )
            row[f"{k}_seconds_per_gb"] = stat["median"] / gb
        ratio = summarize([n / h for n, h in zip(runs["named"], runs["hook"])])
        row["named_vs_hook"], row["named_vs_hook_min"], row["named_vs_hook_max"] = (
            ratio["median"], ratio["min"], ratio["max"],
        )  # fmt: skip
        rows.append(row)
        if rank == 0:
            print(
                f"[bench named] {row['rate']}: hook {row['hook_seconds']:.2f}s, named "
                f"{row['named_seconds']:.2f}s (export {row['export_seconds']:.2f}s), exact {exact}",
                flush=True,
            )
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
    hook_base = hook.baseline_bytes()
    hook_total = _sum(float(hook_base["baseline_bytes"]))
    named_total = _sum(float(owner.baseline_bytes()))
    peak = [0.0] * dist.get_world_size()
    dist.all_gather_object(peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0)
    if rank == 0:
        res = {
            "benchmark": "named",
            "size": args.size,
            **SIZES[args.size],
            "checkpoint_bytes": checkpoint_bytes,
            "ranks": dist.get_world_size(),
            "repeats": REPEATS,
            "rows": rows,
            "hook_baseline_bytes": hook_total,
            "named_baseline_bytes": named_total,
            "hook_baseline_bytes_per_gb": hook_total / gb,
            "named_baseline_bytes_per_gb": named_total / gb,
            "peak_rss_bytes": peak,
            "hook_baseline_detail_rank0": hook_base,
        }
        print(render(res))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=2))
            print(f"\nwrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()


def render(res: dict) -> str:
    gb = res["checkpoint_bytes"] / 1e9
    lines = [
        f"named-tensor owner vs owner-local hook: {res['size']} model, "
        f"{gb:.2f} GB BF16 checkpoint, {res['ranks']} ranks (TP=2), "
        f"median [min-max] of {res['repeats']} rounds",
        "",
        "| change | hook s | named s (take + build) | of which export s | named / hook | "
        "hook s/GB | named s/GB | payload hook / named MB | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['rate']} | {r['hook_seconds']:.2f} [{r['hook_min_s']:.2f}-{r['hook_max_s']:.2f}] "
            f"| {r['named_seconds']:.2f} [{r['named_min_s']:.2f}-{r['named_max_s']:.2f}] "
            f"| {r['export_seconds']:.2f} | {r['named_vs_hook']:.2f}x "
            f"[{r['named_vs_hook_min']:.2f}-{r['named_vs_hook_max']:.2f}] "
            f"| {r['hook_seconds_per_gb']:.2f} | {r['named_seconds_per_gb']:.2f} "
            f"| {r['hook_payload_bytes'] / 1e6:.2f} / {r['named_payload_bytes'] / 1e6:.2f} "
            f"| {r['bit_exact']} |"
        )
    lines += [
        "",
        f"host baseline (all ranks): hook {res['hook_baseline_bytes'] / 1e6:.0f} MB "
        f"({res['hook_baseline_bytes_per_gb'] / 1e9:.2f} GB per GB), named "
        f"{res['named_baseline_bytes'] / 1e6:.0f} MB ({res['named_baseline_bytes_per_gb'] / 1e9:.2f} "
        f"GB per GB); peak RSS per rank: "
        + ", ".join(f"{p / 1e9:.2f} GB" for p in res["peak_rss_bytes"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
