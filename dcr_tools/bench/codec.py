"""``dcr bench codec``: value-coding sizes (paper Table 2), full payload sizes, codec throughput.

Three measurements, all in one run (JSON keys in docs/benchmarks.md):

1. ``table2``: the paper's Table 2 as described there: `n` (20 million) standard-normal values
   generated in BF16, independent FP32 Gaussian noise of standard deviation a in {1e-4, 1e-3,
   1e-2} added, rounded to BF16; the changed words only, in input order, zstd level 1:
   overwrite MB, XOR MB and their ratio, next to the paper's figures, and the same two streams
   with this codec's value coding (byte planes).
2. ``payload``: full payload bytes (values + locations + headers, all buckets) as % of the
   checkpoint bytes when a uniform 1%, 3% and 5% of the elements of a BF16 checkpoint are updated
   with relative amplitude 1e-2 (x * (1 + 1e-2 * N(0, 1)), rounded to BF16), for the paper's
   streams (XOR + plain u32 gaps) and this codec (XOR + byte-plane gaps/values), plus the share of
   elements whose stored bits actually changed. Next to them, in the same run, two references:
   the empirical entropy bound (`entropy_bound`: an ideal code for each item's gap distribution
   plus the order-0 entropy of each byte plane of its XOR words) and plain byte-shuffled gap
   coding (`shuffled_reference`: u32 gaps and the XOR words split into byte planes, every plane
   its own zstd-1 frame, no headers).
3. ``throughput``: encode and decode MB/s of raw records (int64 index + stored value per entry)
   on one core (no thread pool, one torch thread), at every rate: one warm-up, then the median
   and min-max of 5 timed runs (the ``throughput`` key keeps the 3% case).

1 MB is 10^6 bytes, as in the paper.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from shared_codec.buckets import BucketConfig, encode_items
from shared_codec.decode import decode_payload
from shared_codec.dtypes import tensor_bits
from shared_codec.format import Payload, PayloadMeta
from shared_codec.locations import to_planes
from shared_codec.records import DeltaItem, Kind, diff_tensors

PAPER_TABLE2 = {  # a -> (overwrite MB, XOR MB, reduction)
    "1e-4": (0.74, 0.33, 2.21),
    "1e-3": (7.02, 3.23, 2.18),
    "1e-2": (25.70, 14.93, 1.72),
}
REPEATS = 5  # throughput: median (and min-max) of this many timed runs, after one warm-up
PAPER_PAYLOAD_PCT = {"3%": 2.4, "5%": 3.8}  # 120B, section 8.5 (values + locations)


def _mb(n: int) -> float:
    return n / 1e6


def table2(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Table 2 rows for a in {1e-4, 1e-3, 1e-2} over `n` BF16 inputs."""
    z = zstandard.ZstdCompressor(level=1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float32).to(torch.bfloat16)
    old = tensor_bits(x)
    rows = []
    for a_str, a in (("1e-4", 1e-4), ("1e-3", 1e-3), ("1e-2", 1e-2)):
        noise = torch.randn(n, generator=g, dtype=torch.float32) * a
        new = tensor_bits((x.float() + noise).to(torch.bfloat16))
        changed = np.flatnonzero(old != new)
        ow, xo = new[changed], old[changed] ^ new[changed]
        ow_plain = len(z.compress(ow.astype("<u2").tobytes()))
        xor_plain = len(z.compress(xo.astype("<u2").tobytes()))
        ow_planes = len(z.compress(to_planes(ow, 2)))
        xor_planes = len(z.compress(to_planes(xo, 2)))
        p_ow, p_xor, p_red = PAPER_TABLE2[a_str]
        rows.append(
            {
                "a": a_str,
                "changed_words": int(changed.size),
                "overwrite_mb": _mb(ow_plain),
                "xor_mb": _mb(xor_plain),
                "reduction": ow_plain / xor_plain,
                "paper_overwrite_mb": p_ow,
                "paper_xor_mb": p_xor,
                "paper_reduction": p_red,
                "overwrite_vs_paper": _mb(ow_plain) / p_ow - 1,
                "xor_vs_paper": _mb(xor_plain) / p_xor - 1,
                "planes_overwrite_mb": _mb(ow_planes),
                "planes_xor_mb": _mb(xor_planes),
                "planes_xor_vs_paper_overwrite": p_ow / _mb(xor_planes),
            }
        )
        del noise, new
    return rows


def synthetic_step(
    n: int, rate: float, seed: int, tensors: int = 8
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A BF16 checkpoint of `n` elements in `tensors` tensors, and the same with a uniform
    `rate` of elements updated by relative amplitude 1e-2."""
    g = torch.Generator().manual_seed(seed)
    per = n // tensors
    old, new = {}, {}
    for t in range(tensors):
        w = (0.02 * torch.randn(per, generator=g)).to(torch.bfloat16).reshape(per // 1000, 1000)
        flat = w.reshape(-1).float()
        pick = torch.randperm(per, generator=g)[: int(rate * per)]
        upd = flat.clone()
        upd[pick] = flat[pick] * (1 + 1e-2 * torch.randn(pick.numel(), generator=g))
        old[f"t{t}.weight"] = w
        new[f"t{t}.weight"] = upd.to(torch.bfloat16).reshape(w.shape)
    return old, new


def _entropy_bytes(symbols: np.ndarray) -> float:
    """Empirical order-0 entropy of `symbols`, in bytes: sum of -log2(frequency) / 8."""
    if symbols.size == 0:
        return 0.0
    _, counts = np.unique(symbols, return_counts=True)
    return float(-(counts * np.log2(counts / symbols.size)).sum()) / 8


def entropy_bound(items: list[DeltaItem]) -> float:
    """Bytes an ideal coder needs for `items` under the empirical model: per item, the entropy of
    its gaps' distribution (differences of consecutive indices; the first index is free) plus the
    order-0 entropy of each byte plane of its values. No headers."""
    total = 0.0
    for item in items:
        total += _entropy_bytes(np.diff(item.indices))
        width = item.dtype_info.itemsize
        planes = item.values.view(np.uint8).reshape(-1, width)
        total += sum(_entropy_bytes(planes[:, j]) for j in range(width))
    return total


def shuffled_reference(items: list[DeltaItem]) -> int:
    """Plain byte-shuffled gap coding: per item, u32 gaps (first index, then differences) and
    the value words as byte planes, every plane compressed as its own zstd-1 frame (no headers,
    no item table): the reference this codec's payloads must not exceed."""
    z = zstandard.ZstdCompressor(level=1)
    total = 0
    for item in items:
        gaps = np.diff(item.indices, prepend=0).astype(np.uint32)
        width = item.dtype_info.itemsize
        for words, w in ((gaps, 4), (item.values, width)):
            planes = np.frombuffer(to_planes(words, w), dtype=np.uint8).reshape(w, -1)
            total += sum(len(z.compress(plane.tobytes())) for plane in planes)
    return total


def _timed(fn: Callable[[], Any]) -> tuple[Any, list[float]]:
    """One warm-up call, then REPEATS timed calls; (last result, seconds of each timed call)."""
    out = fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, times


def _rates(raw: int, times: list[float]) -> dict[str, Any]:
    """MB/s of `raw` bytes: median, min and max over `times` (min MB/s from the slowest run)."""
    med = float(np.median(times))
    return {
        "s": med,
        "mb_s": _mb(raw) / med,
        "min_mb_s": _mb(raw) / max(times),
        "max_mb_s": _mb(raw) / min(times),
        "runs_s": times,
    }


def payload_sizes(n: int, rates: tuple[float, ...], seed: int = 1) -> tuple[list[dict], dict]:
    """Full payload size rows (with the entropy bound and the shuffled reference, and the
    encode/decode throughput of this codec), and the throughput row of the 3% case."""
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    rows, throughput = [], {}
    for rate in rates:
        old, new = synthetic_step(n, rate, seed)
        ckpt_bytes = sum(t.numel() * t.element_size() for t in old.values())
        items = [diff_tensors(k, old[k], new[k], owner=0, kind=Kind.XOR) for k in old]
        changed = sum(i.count for i in items)
        bound = entropy_bound(items)
        shuffled = shuffled_reference(items)
        row: dict[str, Any] = {
            "rate": f"{round(rate * 100)}%",
            "elements": sum(t.numel() for t in old.values()),
            "bit_change_rate": changed / sum(t.numel() for t in old.values()),
            "checkpoint_bytes": ckpt_bytes,
            "bound_bytes": bound,
            "bound_pct": 100 * bound / ckpt_bytes,
            "shuffled_bytes": shuffled,
            "shuffled_pct": 100 * shuffled / ckpt_bytes,
        }
        for mode, paper in (("paper", True), ("dcr", False)):
            cfg = BucketConfig(paper=paper, threads=0)

            def encode(c: BucketConfig = cfg, its: list[DeltaItem] = items) -> list[bytes]:
                return encode_items(its, meta, c)

            payloads, enc_times = _timed(encode)
            size = sum(len(p) for p in payloads)
            row[f"{mode}_payload_bytes"] = size
            row[f"{mode}_payload_pct"] = 100 * size / ckpt_bytes
            row[f"{mode}_payloads"] = len(payloads)
            row[f"{mode}_vs_bound"] = size / bound
            row[f"{mode}_vs_shuffled"] = size / shuffled
            if mode == "dcr":
                raw = sum(i.raw_bytes for i in items)

                def decode(ps: list[bytes] = payloads) -> list[Payload]:
                    return [decode_payload(p) for p in ps]

                _, dec_times = _timed(decode)
                enc, dec = _rates(raw, enc_times), _rates(raw, dec_times)
                thr: dict[str, Any] = {"raw_record_bytes": raw, "repeats": REPEATS}
                for what, r in (("encode", enc), ("decode", dec)):
                    thr.update({f"{what}_{k}": v for k, v in r.items()})
                row["throughput"] = thr
                if rate == 0.03:
                    throughput = thr
        if f"{round(rate * 100)}%" in PAPER_PAYLOAD_PCT:
            row["paper_reported_pct"] = PAPER_PAYLOAD_PCT[f"{round(rate * 100)}%"]
        rows.append(row)
    return rows, throughput


def run(table2_n: int = 20_000_000, payload_n: int = 20_000_000) -> dict[str, Any]:
    """Run all three measurements and return the JSON-ready result."""
    torch.set_num_threads(1)
    t2 = table2(table2_n)
    rows, thr = payload_sizes(payload_n, (0.01, 0.03, 0.05))
    return {
        "benchmark": "codec",
        "machine": {
            "python": platform.python_version(),
            "processor": platform.processor(),
            "torch_threads": torch.get_num_threads(),
        },
        "table2_n": table2_n,
        "payload_n": payload_n,
        "table2": t2,
        "payload": rows,
        "throughput": thr,
    }


def render(result: dict[str, Any]) -> str:
    """The printed tables."""
    out = [f"Table 2 ({result['table2_n']:,} BF16 inputs, zstd-1 of changed words, MB = 1e6 B)"]
    out.append(
        f"{'a':>5} | {'overwrite':>9} {'paper':>6} | {'XOR':>6} {'paper':>6} | "
        f"{'reduct.':>7} {'paper':>5} | {'planes OW':>9} {'planes XOR':>10} {'vs paper OW':>11}"
    )
    for r in result["table2"]:
        out.append(
            f"{r['a']:>5} | {r['overwrite_mb']:9.2f} {r['paper_overwrite_mb']:6.2f} | "
            f"{r['xor_mb']:6.2f} {r['paper_xor_mb']:6.2f} | {r['reduction']:6.2f}x "
            f"{r['paper_reduction']:4.2f}x | {r['planes_overwrite_mb']:9.2f} "
            f"{r['planes_xor_mb']:10.2f} {r['planes_xor_vs_paper_overwrite']:10.2f}x"
        )
    out.append("")
    out.append(
        f"Full payload, % of checkpoint bytes ({result['payload_n']:,} BF16 elements, "
        "relative amplitude 1e-2)"
    )
    out.append(
        f"{'rate':>5} | {'bits changed':>12} | {'bound':>6} | {'shuffled':>8} | "
        f"{'paper mode':>10} | {'this codec':>10} | {'/ bound':>7} | {'/ shuffled':>10} | "
        f"{'paper reports':>13}"
    )
    for r in result["payload"]:
        rep = f"{r['paper_reported_pct']:.1f}%" if "paper_reported_pct" in r else "-"
        out.append(
            f"{r['rate']:>5} | {100 * r['bit_change_rate']:11.2f}% | {r['bound_pct']:5.3f}% | "
            f"{r['shuffled_pct']:7.3f}% | {r['paper_payload_pct']:9.3f}% | "
            f"{r['dcr_payload_pct']:9.3f}% | {r['dcr_vs_bound']:6.3f}x | "
            f"{r['dcr_vs_shuffled']:9.3f}x | {rep:>13}"
        )
    out.append("")
    out.append(
        f"Throughput (one core, MB/s of raw records, median [min-max] of "
        f"{REPEATS} runs after a warm-up)"
    )
    for r in result["payload"]:
        t = r["throughput"]
        out.append(
            f"{r['rate']:>5} | {t['raw_record_bytes'] / 1e6:5.1f} MB | encode "
            f"{t['encode_mb_s']:5.0f} [{t['encode_min_mb_s']:.0f}-{t['encode_max_mb_s']:.0f}] | "
            f"decode {t['decode_mb_s']:5.0f} [{t['decode_min_mb_s']:.0f}-{t['decode_max_mb_s']:.0f}]"
        )
    return "\n".join(out)


def main(json_path: str | None, table2_n: int, payload_n: int) -> int:
    result = run(table2_n, payload_n)
    print(render(result))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {json_path}")
    return 0
