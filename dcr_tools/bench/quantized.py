"""``dcr bench quantized``: quantized deltas against BF16 deltas and a quantized dense load, in
one run (issue 32 item 6).

A Qwen3 model (`apply.SIZES`: medium ~165M parameters by default) is written in BF16. Versions
with a uniform 1%, 3% and 5% of elements changed in every tensor are derived from it (low
mantissa bits, `perturb_checkpoint`). Both are quantized in `--format` by the library
(`write_quantized_model`). Then, side by side:

- Construction, in this process on canonical checkpoints, one warm-up and `repeats` timed
  runs each:
  - ``bf16``: the BF16 delta (`diff_checkpoints`) encoded into payloads;
  - ``quantized``: the same changed elements find their quantization groups, only those are
    requantized against the committed quantized baseline (`quantized_delta`; other tensors
    diffed as usual), and the result is encoded.
  Payload bytes are compared with the BF16 delta's payloads and with the full quantized
  checkpoint (its safetensors bytes). Also reported: the touched groups (of all groups), and
  the share of the changed BF16 elements of quantized weights whose quantized byte did not
  change (``silent``).
- Apply, on one real vLLM engine (TP=1, the DCR worker extension) started on quantized v0:
  - ``dense``: ``dcr_dense_load`` of the quantized checkpoint (worker-side seconds);
  - ``apply``: ``dcr_stage`` + ``dcr_apply`` of the quantized payloads, worker-side seconds
    from the ACK. It includes re-deriving the touched layers through vLLM's post-load step.
    The warm-up is checked bit for bit against a dense load of the quantized v_rate. The
    engine is dense-loaded back to v0 after each run (untimed).

The construction figures are canonical (one process, whole checkpoints). A Megatron owner adds
the projection and the all-gather to the group owners (megatron_dcr_hooks/quantized.py).
JSON keys are documented in docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from dcr_tools.bench.apply import SIZES, start_engine
from dcr_tools.bench.stats import machine, summarize


def build_delta(
    old: dict[str, Any],
    new: dict[str, Any],
    committed: dict[str, Any] | None,
    fmt: Any,
    overwrite: set[str],
    counts: dict[str, int] | None = None,
) -> list[Any]:
    """The items of one refit: BF16 (`committed` None) or quantized against the `committed`
    quantized checkpoint. `counts` (untimed runs only): adds the changed BF16 elements of
    quantized weights, the silent ones among them, and the touched and all groups."""
    import numpy as np

    from shared_codec.dtypes import tensor_bits
    from shared_codec.quantized import groups_of, quantized_delta, quantizes, scale_name
    from shared_codec.records import Kind, diff_tensors

    items: list[Any] = []
    for name in sorted(old):
        if committed is None or not quantizes(name):
            kind = Kind.OVERWRITE if name in overwrite else Kind.XOR
            item = diff_tensors(name, old[name], new[name], kind=kind)
            items += [item] if item.count else []
            continue
        changed = np.flatnonzero(tensor_bits(old[name]) != tensor_bits(new[name]))
        s = scale_name(name)
        kind = Kind.OVERWRITE if s in overwrite else Kind.XOR
        q, sc = committed[name], committed[s]
        nq, _, its = quantized_delta(name, new[name], changed, q, sc, fmt, scale_kind=kind)
        items += its
        if counts is not None:
            shape = (int(q.shape[0]), int(q.shape[1]))
            counts["bf16_changed"] += int(changed.size)
            same = tensor_bits(nq)[changed] == tensor_bits(q)[changed]
            counts["silent"] += int(same.sum())
            counts["groups"] += int(groups_of(changed, shape, fmt).size)
            every = np.arange(q.numel(), dtype=np.int64)
            counts["groups_total"] += int(groups_of(every, shape, fmt).size)
    return items


def _timed(fn: Any, repeats: int) -> tuple[Any, list[float]]:
    out, runs = fn(), []  # the first call is the warm-up
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return out, runs


def run(
    size: str = "medium",
    fmt_name: str = "int8-channel",
    rates: tuple[float, ...] = (0.01, 0.03, 0.05),
    repeats: int = 5,
) -> dict[str, Any]:
    from dcr_tools.fixtures import perturb_checkpoint, write_quantized_model, write_tiny_model
    from shared_codec.buckets import BucketConfig, encode_items
    from shared_codec.checkpoint import load_checkpoint, tensor_table
    from shared_codec.format import PayloadMeta
    from shared_codec.quantized import format_of

    fmt = format_of(fmt_name)
    host = machine()
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-quantized-"))
    dims = SIZES[size]
    print(f"[bench quantized] writing the {size} model, {fmt_name}, to {work}", flush=True)
    v0 = write_tiny_model("qwen3", work / "v0", seed=0, **dims)
    q0 = write_quantized_model(v0, work / "q0", fmt_name)
    old, committed = load_checkpoint(v0), load_checkpoint(q0)
    quant_bytes = sum(f.stat().st_size for f in q0.glob("*.safetensors"))
    n_params = sum(t.numel() for t in old.values())
    print(f"[bench quantized] {n_params / 1e6:.1f}M parameters; starting vLLM", flush=True)
    llm, rpc = start_engine(q0)

    prewarm = rpc("dcr_prewarm", tensor_table(q0), 0)
    overwrite = set(prewarm["overwrite_only"])
    rpc("dcr_dense_load", str(q0), 0)  # warm-up
    dense = summarize([rpc("dcr_dense_load", str(q0), 0)["seconds"] for _ in range(repeats)])
    print(f"[bench quantized] quantized dense load: {dense['median']:.3f} s", flush=True)
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    buckets = BucketConfig()
    rows = []
    for i, rate in enumerate(rates):
        path = work / f"v_{round(rate * 100)}pct"
        perturb_checkpoint(v0, path, seed=100 + i, rate=(rate, rate))
        qpath = write_quantized_model(path, work / f"q_{round(rate * 100)}pct", fmt_name)
        new = load_checkpoint(path)

        def bf16(new: dict[str, Any] = new) -> list[bytes]:
            return encode_items(build_delta(old, new, None, fmt, overwrite), meta, buckets)

        def quantized(new: dict[str, Any] = new) -> list[bytes]:
            return encode_items(build_delta(old, new, committed, fmt, overwrite), meta, buckets)

        bf16_payloads, bf16_runs = _timed(bf16, repeats)
        q_payloads, q_runs = _timed(quantized, repeats)
        counts = {"bf16_changed": 0, "silent": 0, "groups": 0, "groups_total": 0}
        build_delta(old, new, committed, fmt, overwrite, counts)  # untimed: the counts
        bf16_s, q_s = summarize(bf16_runs), summarize(q_runs)
        rpc("dcr_dense_load", str(qpath), 1)
        want = rpc("dcr_digest")["digest"]
        rpc("dcr_dense_load", str(q0), 0)
        applies: list[float] = []
        for rep in range(repeats + 1):  # the first is a warm-up, checked bit for bit
            staged = rpc("dcr_stage", q_payloads)
            ack = rpc("dcr_apply", 0)
            if not ack["ok"] or len(staged["staged"]) != len(q_payloads):
                raise RuntimeError(f"apply failed: {ack.get('error')}")
            if rep == 0:
                if rpc("dcr_digest")["digest"] != want:
                    raise RuntimeError(f"the quantized apply at {rate:.0%} is not bit-exact")
            else:
                applies.append(ack["timings"]["total_s"])
            rpc("dcr_commit", 1)
            rpc("dcr_dense_load", str(q0), 0)
        apply_s = summarize(applies)
        q_bytes, b_bytes = sum(len(p) for p in q_payloads), sum(len(p) for p in bf16_payloads)
        row: dict[str, Any] = {
            "rate": f"{round(rate * 100)}%",
            **counts,
            "silent_share": counts["silent"] / max(counts["bf16_changed"], 1),
            "groups_share": counts["groups"] / max(counts["groups_total"], 1),
            "bf16_payload_bytes": b_bytes,
            "quantized_payload_bytes": q_bytes,
            "bf16_construct_s": bf16_s,
            "quantized_construct_s": q_s,
            "apply_s": apply_s,
            "bit_exact": True,
        }
        row["payload_vs_bf16"] = q_bytes / b_bytes
        row["payload_vs_quantized_checkpoint"] = q_bytes / quant_bytes
        row["construct_vs_bf16"] = q_s["median"] / bf16_s["median"]
        row["apply_vs_dense"] = apply_s["median"] / dense["median"]
        rows.append(row)
        print(
            f"[bench quantized] {row['rate']}: payload {row['payload_vs_bf16']:.2f}x BF16, "
            f"construct {row['construct_vs_bf16']:.2f}x BF16, apply "
            f"{100 * row['apply_vs_dense']:.1f}% of the quantized dense load",
            flush=True,
        )
    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    shutil.rmtree(work, ignore_errors=True)
    return {
        "benchmark": "quantized",
        "machine": host,
        "format": fmt_name,
        "model": {"size": size, **dims, "parameters": n_params},
        "quantized_checkpoint_bytes": quant_bytes,
        "quantized": prewarm["quantized"],
        "repeats": repeats,
        "dense_load_s": dense,
        "rows": rows,
    }


def render(res: dict[str, Any]) -> str:
    m = res["model"]

    def s(x: dict[str, Any]) -> str:
        return f"{x['median']:.3f} [{x['min']:.3f}-{x['max']:.3f}]"

    out = [
        f"Quantized refit, {res['format']} ({m['parameters'] / 1e6:.1f}M params, quantized "
        f"checkpoint {res['quantized_checkpoint_bytes'] / 1e6:.0f} MB, vLLM CPU TP=1; median "
        f"[min-max] of {res['repeats']} after a warm-up)",
        f"quantized dense load: {s(res['dense_load_s'])} s",
        f"{'rate':>4} | {'silent':>6} | {'groups':>14} | {'payload MB q / bf16':>19} | "
        f"{'q/bf16':>6} | {'q/ckpt':>6} | {'construct s q':>21} | {'construct s bf16':>21} | "
        f"{'q/bf16':>6} | {'apply s':>21} | {'/dense':>6} | exact",
    ]
    for r in res["rows"]:
        out.append(
            f"{r['rate']:>4} | {100 * r['silent_share']:5.1f}% | "
            f"{r['groups']:6d} ({100 * r['groups_share']:4.1f}%) | "
            f"{r['quantized_payload_bytes'] / 1e6:8.2f} / {r['bf16_payload_bytes'] / 1e6:8.2f} | "
            f"{r['payload_vs_bf16']:6.2f} | {r['payload_vs_quantized_checkpoint']:6.3f} | "
            f"{s(r['quantized_construct_s']):>21} | {s(r['bf16_construct_s']):>21} | "
            f"{r['construct_vs_bf16']:6.2f} | {s(r['apply_s']):>21} | "
            f"{100 * r['apply_vs_dense']:5.1f}% | {'yes' if r['bit_exact'] else 'NO'}"
        )
    return "\n".join(out)


def main(json_path: str | None, size: str, fmt: str, repeats: int = 5) -> int:
    res = run(size, fmt, repeats=repeats)
    print(render(res))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=2))
        print(f"\nwrote {json_path}")
    return 0
