"""GPU lane timing (not a test): change detection against the device's memory bandwidth, and
the direct scatter, on a CUDA tensor.

What it times, on one BF16 tensor of `n` elements resident on the device, with a share `rate`
of its elements changed against a host baseline (docs/benchmarks.md, "GPU lane"):

- the device's bandwidths, as references: ``d2d_copy`` (a device-to-device copy of the tensor;
  its "moved" rate counts bytes read and written), ``h2d_pinned`` (host -> device from pinned
  memory), ``host_stage`` (the baseline copied from pageable into pinned host memory, the host
  side of streaming it) and ``d2h`` (device -> host into pageable memory);
- ``device_scan_<chunk>``: detection on the device as the owner hook runs it for a GPU parameter
  (megatron_dcr_hooks/detection.py `DeviceScan`): the host baseline streamed in chunks of that
  size through two pinned buffers and compared on the device; the changed indices and bits
  come back;
- ``detect``: the host path (the hook's path for host parameters, and what it did for GPU ones
  before `DeviceScan`): ``d2h``, then the compiled scan `changed_indices` against the baseline;
- ``scatter_xor`` / ``scatter_overwrite``: `scatter_direct` (vllm_dcr_plugin/scatter.py) of one
  item with those entries into the device tensor (its torch index path).

Each is run `warmup` times, then `repeats` (at least 5) times; the device is synchronized
around every run; each row is the median and min-max (`dcr_tools.bench.stats.summarize`). Both
detections are checked once against the injected change (``checks``; exit 1 when one fails).
It prints a table and writes JSON. ``--device cpu`` runs the same harness on host tensors (a
small `n` proves the code path on a machine without a GPU; ``h2d_pinned`` is not timed there,
``host_stage`` is a plain copy); with ``--device cuda`` and no CUDA it says so and writes
nothing.

Limitations:
1. One tensor size and one change rate per run; no end-to-end refit and no vLLM engine.
2. The host side runs on one thread (the compiled scan and the staging copy), as in the hook.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dcr_tools.bench.stats import summarize

#: streamed-scan chunk sizes timed by default (DeviceScan's default is 64 MiB)
SCAN_CHUNKS = (16 << 20, 64 << 20, 256 << 20)


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


def _mib(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


#: copies of the tensor's bytes the run holds at once, on the device and on the host (`auto`)
_DEVICE_COPIES, _HOST_COPIES = 6, 8


def auto_elements(device: str, largest: int = 1 << 30, smallest: int = 1 << 24) -> int:
    """The largest power of two of BF16 elements up to `largest` whose run fits in half the
    free device memory and half the available host memory (`_DEVICE_COPIES` / `_HOST_COPIES`
    copies of the tensor's bytes); `smallest` when nothing larger does."""
    free_dev = torch.cuda.mem_get_info()[0] if device == "cuda" else 1 << 62
    host = 1 << 62
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) << 10
    except OSError:
        pass
    n = largest
    while n > smallest and (
        2 * n * _DEVICE_COPIES > free_dev // 2 or 2 * n * _HOST_COPIES > host // 2
    ):
        n //= 2
    return n


def run(
    n: int,
    rate: float,
    repeats: int,
    warmup: int,
    *,
    device: str = "cuda",
    seed: int = 0,
    scan_chunks: tuple[int, ...] = SCAN_CHUNKS,
) -> dict[str, Any]:
    """Time the operations with the tensor on `device` (module docstring)."""
    from shared_codec.dtypes import tensor_bits
    from shared_codec.kernels import changed_indices, warm_up
    from shared_codec.records import Kind, make_item
    from shared_codec.scan import DeviceScan
    from vllm_dcr_plugin.intercept import ViewGeom, flat_storage_bits
    from vllm_dcr_plugin.scatter import scatter_direct

    warm_up()
    cuda = device == "cuda"
    rng = np.random.default_rng(seed)
    base = torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, n, dtype=np.int16))
    idx = np.unique(rng.integers(0, n, int(n * rate), dtype=np.int64))
    vals = rng.integers(1, 1 << 15, idx.size, dtype=np.int16)
    cur = base.clone()
    cur[torch.from_numpy(idx)] ^= torch.from_numpy(vals)
    dev = cur.view(torch.bfloat16).to(device, copy=True)
    tracker_t = base.view(torch.bfloat16)  # the host baseline (pageable), as the hook keeps it
    tracker = tensor_bits(tracker_t)
    want_bits = tensor_bits(cur.view(torch.bfloat16))[idx]
    del cur
    nbytes = 2 * n

    checks: dict[str, bool] = {}
    found = changed_indices(tensor_bits(dev.to("cpu")), tracker)
    checks["detect_finds_the_change"] = bool(np.array_equal(found, idx))
    del found
    scans = {_mib(c): DeviceScan(c) for c in scan_chunks}
    for name, scan in scans.items():
        local, new, _ = scan(dev, tracker_t)
        checks[f"device_scan_{name}_finds_the_change"] = bool(
            np.array_equal(local, idx) and np.array_equal(new, want_bits)
        )
        del local, new

    geom = ViewGeom.of(dev)
    flat = flat_storage_bits(dev)
    items = {
        k: make_item("w", "bfloat16", (n,), 0, k, idx, vals) for k in (Kind.XOR, Kind.OVERWRITE)
    }
    d2d_dst = torch.empty_like(dev)
    stage_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    tracker_bytes = tracker_t.view(torch.uint8)
    ops: dict[str, tuple[Callable[[], Any], int]] = {  # name -> (run, bytes moved per run)
        "d2d_copy": (lambda: d2d_dst.copy_(dev), 2 * nbytes),  # read + write
        "host_stage": (lambda: stage_dst.copy_(tracker_bytes), nbytes),
        "d2h": (lambda: dev.to("cpu"), nbytes),
    }
    if cuda:
        h2d_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ops["h2d_pinned"] = (lambda: h2d_dst.copy_(stage_dst, non_blocking=True), nbytes)
    for name, scan in scans.items():
        ops[f"device_scan_{name}"] = (functools.partial(scan, dev, tracker_t), nbytes)
    ops["detect"] = (lambda: changed_indices(tensor_bits(dev.to("cpu")), tracker), nbytes)
    ops["scatter_xor"] = (
        lambda: scatter_direct(items[Kind.XOR], geom, flat, geom, [], False),
        nbytes,
    )
    ops["scatter_overwrite"] = (
        lambda: scatter_direct(items[Kind.OVERWRITE], geom, flat, geom, [], False),
        nbytes,
    )
    rows: dict[str, dict[str, Any]] = {}
    for name, (fn, moved) in ops.items():
        rows[name] = {**summarize(_timed(fn, repeats, warmup, device)), "bytes_moved": moved}
    return {
        "device": torch.cuda.get_device_name(0) if cuda else device,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "elements": n,
        "bytes": nbytes,
        "rate": rate,
        "entries": int(idx.size),
        "repeats": repeats,
        "warmup": warmup,
        "scan_chunks": list(scan_chunks),
        "seconds": rows,
        "checks": checks,
        "ok": all(checks.values()),
    }


def render(res: dict[str, Any]) -> str:
    lines = [
        f"GPU lane on {res['device']} (torch {res['torch']}): bf16 tensor of {res['elements']} "
        f"elements ({res['bytes'] / 2**30:.2f} GiB), {res['entries']} changed "
        f"({res['rate']:.2%}); median (min-max) of {res['repeats']} runs after "
        f"{res['warmup']} warm-up",
        f"{'operation':<22} {'median ms':>10} {'min-max ms':>22} {'GB/s tensor':>12} "
        f"{'GB/s moved':>11}",
    ]
    for name, s in res["seconds"].items():
        span = f"{s['min'] * 1e3:.3f}-{s['max'] * 1e3:.3f}"
        lines.append(
            f"{name:<22} {s['median'] * 1e3:>10.3f} {span:>22} "
            f"{res['bytes'] / s['median'] / 1e9:>12.2f} {s['bytes_moved'] / s['median'] / 1e9:>11.2f}"
        )
    lines.append("(GB/s = 1e9 bytes/s; 'moved' counts d2d_copy's bytes read and written)")
    for name, ok in res["checks"].items():
        lines.append(f"[{'ok' if ok else 'FAIL'}] {name}")
    return "\n".join(lines)


def _chunks(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--elements",
        default=str(1 << 26),
        help="BF16 elements of the tensor, or 'auto' (up to 2^30 as memory allows)",
    )
    ap.add_argument("--rate", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--scan-chunks",
        type=_chunks,
        default=SCAN_CHUNKS,
        help="DeviceScan chunk sizes in bytes, comma-separated",
    )
    ap.add_argument("--json", default="out/bench/gpu_lane.json")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[gpu-lane] no CUDA device (torch.cuda.is_available() is False): nothing timed")
        return 0
    if args.repeats < 5:
        raise SystemExit("--repeats must be at least 5")
    n = auto_elements(args.device) if args.elements == "auto" else int(args.elements)
    res = run(
        n,
        args.rate,
        args.repeats,
        args.warmup,
        device=args.device,
        scan_chunks=args.scan_chunks,
    )
    print(render(res))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"[gpu-lane] wrote {out}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
