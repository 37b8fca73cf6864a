"""GPU lane timing (not a test): change detection and the direct scatter on a CUDA tensor.

What it times, on one BF16 tensor of `n` elements resident on the device, with a share `rate`
of its elements changed (docs/benchmarks.md, "GPU lane"):

- ``d2h``: the device -> host copy of the tensor that every build makes per owned shard;
- ``detect``: what the owner hook does per shard (megatron_dcr_hooks/detection.py): that copy,
  then `changed_indices` against the host tracker;
- ``scatter_xor`` / ``scatter_overwrite``: `scatter_direct` (vllm_dcr_plugin/apply.py) of one
  item with those entries into the device tensor (its torch index path).

Each is run once to warm up, then `repeats` times; CUDA is synchronized around every run. It
prints a table and writes JSON. Without CUDA it says so and writes nothing.

Limitations:
1. One tensor size and one change rate per run; no end-to-end refit and no vLLM engine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dcr_tools.bench.stats import summarize


def _timed(fn: Callable[[], Any], repeats: int, warmup: int, device: str) -> list[float]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def run(
    n: int, rate: float, repeats: int, warmup: int, *, device: str = "cuda", seed: int = 0
) -> dict[str, Any]:
    """Time the four operations with the tensor on `device` (module docstring; "cpu" only
    checks the harness: the scatter then takes the compiled CPU path)."""
    from shared_codec.dtypes import tensor_bits
    from shared_codec.kernels import changed_indices, warm_up
    from shared_codec.records import Kind, make_item
    from vllm_dcr_plugin.intercept import ViewGeom, flat_storage_bits
    from vllm_dcr_plugin.scatter import scatter_direct

    warm_up()
    rng = np.random.default_rng(seed)
    base = torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, n, dtype=np.int16))
    idx = np.unique(rng.integers(0, n, int(n * rate), dtype=np.int64))
    vals = rng.integers(1, 1 << 15, idx.size, dtype=np.int16)
    cur = base.clone()
    cur[torch.from_numpy(idx)] ^= torch.from_numpy(vals)
    dev = cur.view(torch.bfloat16).to(device, copy=True)
    tracker = tensor_bits(base.view(torch.bfloat16))
    found = changed_indices(tensor_bits(dev.to("cpu")), tracker)
    assert np.array_equal(found, idx), "detection disagrees with the injected changes"
    geom = ViewGeom.of(dev)
    flat = flat_storage_bits(dev)
    items = {
        k: make_item("w", "bfloat16", (n,), 0, k, idx, vals) for k in (Kind.XOR, Kind.OVERWRITE)
    }
    ops: dict[str, Callable[[], Any]] = {
        "d2h": lambda: dev.to("cpu"),
        "detect": lambda: changed_indices(tensor_bits(dev.to("cpu")), tracker),
        "scatter_xor": lambda: scatter_direct(items[Kind.XOR], geom, flat, geom, [], False),
        "scatter_overwrite": lambda: scatter_direct(
            items[Kind.OVERWRITE], geom, flat, geom, [], False
        ),
    }
    rows = {name: summarize(_timed(fn, repeats, warmup, device)) for name, fn in ops.items()}
    return {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
        "torch": torch.__version__,
        "elements": n,
        "bytes": 2 * n,
        "rate": rate,
        "entries": int(idx.size),
        "repeats": repeats,
        "warmup": warmup,
        "seconds": rows,
    }


def render(res: dict[str, Any]) -> str:
    lines = [
        f"GPU lane on {res['device']} (torch {res['torch']}): bf16 tensor of {res['elements']} "
        f"elements, {res['entries']} changed ({res['rate']:.2%}); median (min-max) of "
        f"{res['repeats']} runs after {res['warmup']} warm-up",
        f"{'operation':<18} {'median ms':>10} {'min-max ms':>20} {'GB/s (tensor)':>14}",
    ]
    for name, s in res["seconds"].items():
        span = f"{s['min'] * 1e3:.3f}-{s['max'] * 1e3:.3f}"
        lines.append(
            f"{name:<18} {s['median'] * 1e3:>10.3f} {span:>20} "
            f"{res['bytes'] / s['median'] / 1e9:>14.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 26)
    ap.add_argument("--rate", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default="out/bench/gpu_lane.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("[gpu-lane] no CUDA device (torch.cuda.is_available() is False): nothing timed")
        return 0
    if args.repeats < 5:
        raise SystemExit("--repeats must be at least 5")
    res = run(args.elements, args.rate, args.repeats, args.warmup)
    print(render(res))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"[gpu-lane] wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
