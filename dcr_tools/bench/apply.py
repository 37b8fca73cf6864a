"""``dcr bench apply``: in-place apply vs a dense load, on one real vLLM engine, in one run.

A medium Qwen3 model (default ~165M parameters, BF16) is written locally; versions with a
uniform 1%, 3% and 5% of elements changed in every tensor are derived from it. One vLLM engine
(TP=1, the DCR worker extension) starts on v0 and is prewarmed. Then, side by side:

- dense: ``dcr_dense_load(v0)`` (reads the safetensors file and runs ``load_weights``), median of
  3, worker-side seconds;
- apply at each rate: the canonical diff v0 -> v_rate is encoded (mixed XOR/overwrite), staged
  and applied (``dcr_apply``), worker-side seconds from the ACK (decode + loader application);
  the engine is dense-loaded back to v0 between rates (untimed). The peak-RSS delta of the worker
  over stage + apply (Linux VmHWM reset) is the receiver memory beyond resident weights.

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


def run(size: str = "medium", rates: tuple[float, ...] = (0.01, 0.03, 0.05)) -> dict[str, Any]:
    from vllm import LLM

    from dcr_tools.fixtures import perturb_checkpoint, write_tiny_model
    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint
    from shared_codec.format import PayloadMeta
    from shared_codec.records import Kind, diff_tensors

    work = Path(tempfile.mkdtemp(prefix="dcr-bench-apply-"))
    dims = MEDIUM if size == "medium" else SMALL
    print(f"[bench apply] writing the {size} model and {len(rates)} versions to {work}", flush=True)
    v0 = write_tiny_model("qwen3", work / "v0", seed=0, **dims)
    ckpt0 = load_checkpoint(v0)
    versions = {}
    for i, rate in enumerate(rates):
        path = work / f"v_{round(rate * 100)}pct"
        perturb_checkpoint(v0, path, seed=100 + i, rate=(rate, rate))
        versions[rate] = path
    n_params = sum(t.numel() for t in ckpt0.values())
    ckpt_bytes = sum(t.numel() * t.element_size() for t in ckpt0.values())
    largest = max(t.numel() * t.element_size() for t in ckpt0.values())
    print(f"[bench apply] {n_params / 1e6:.1f}M parameters; starting vLLM", flush=True)
    llm = LLM(
        model=str(v0),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=2,
        gpu_memory_utilization=0.1,
        seed=0,
        worker_extension_cls="vllm_dcr_plugin.DCRWorkerExtension",
    )

    def rpc(method: str, *args: Any) -> dict[str, Any]:
        out = llm.collective_rpc(method, args=args)[0]
        if not out.get("ok", True):
            raise RuntimeError(f"{method}: {out['error']}")
        return out

    table = [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in ckpt0.items()]
    report = rpc("dcr_prewarm", table, 0)
    no_xor = set(report["overwrite_only"])
    dense = []
    for _ in range(3):
        dense.append(rpc("dcr_dense_load", str(v0), 0)["seconds"])
    dense_s = statistics.median(dense)
    print(f"[bench apply] dense load: {dense_s:.3f} s (median of 3)", flush=True)
    rows = []
    for rate, path in versions.items():
        new = load_checkpoint(path)
        items = []
        for name in sorted(ckpt0):
            kind = Kind.OVERWRITE if name in no_xor else Kind.XOR
            item = diff_tensors(name, ckpt0[name], new[name], owner=0, kind=kind)
            if item.count:
                items.append(item)
        meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
        payloads = encode_items(items, meta, BucketConfig())
        mem0 = rpc("dcr_memory", True)
        t0 = time.perf_counter()
        staged = rpc("dcr_stage", payloads)
        stage_s = time.perf_counter() - t0
        ack = rpc("dcr_apply", 0)
        mem1 = rpc("dcr_memory")
        if not ack["ok"] or len(staged["staged"]) != len(payloads):
            raise RuntimeError(f"apply failed: {ack.get('error')} / {staged['rejected'][:1]}")
        apply_s = ack["timings"]["total_s"]
        rows.append(
            {
                "rate": f"{round(rate * 100)}%",
                "changed_elements": sum(i.count for i in items),
                "payload_bytes": sum(len(p) for p in payloads),
                "payloads": len(payloads),
                "stage_s": stage_s,
                "apply_s": apply_s,
                "apply_decode_s": ack["timings"]["decode_s"],
                "dense_load_s": dense_s,
                "apply_vs_dense": apply_s / dense_s,
                "peak_rss_delta_bytes": (mem1["peak_rss_bytes"] or 0) - (mem0["rss_bytes"] or 0),
                "staged_bytes_before_apply": sum(len(p) for p in payloads),
            }
        )
        print(
            f"[bench apply] {rows[-1]['rate']}: apply {apply_s:.3f} s "
            f"({100 * apply_s / dense_s:.1f}% of dense)",
            flush=True,
        )
        rpc("dcr_commit", 1)
        rpc("dcr_dense_load", str(v0), 0)
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
        "dense_load_s": dense_s,
        "dense_load_runs_s": dense,
        "rows": rows,
    }


def render(res: dict[str, Any]) -> str:
    m = res["model"]
    out = [
        f"Apply vs dense load ({m['parameters'] / 1e6:.1f}M params, "
        f"{m['checkpoint_bytes'] / 1e6:.0f} MB BF16, vLLM CPU TP=1)"
    ]
    out.append(
        f"{'rate':>5} | {'changed':>10} | {'payload MB':>10} | {'apply s':>8} | "
        f"{'dense s':>8} | {'apply/dense':>11} | {'peak RSS +MB':>12}"
    )
    for r in res["rows"]:
        out.append(
            f"{r['rate']:>5} | {r['changed_elements']:10d} | {r['payload_bytes'] / 1e6:10.2f} | "
            f"{r['apply_s']:8.3f} | {r['dense_load_s']:8.3f} | {100 * r['apply_vs_dense']:10.1f}% | "
            f"{r['peak_rss_delta_bytes'] / 1e6:12.1f}"
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
