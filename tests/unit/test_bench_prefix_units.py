"""`dcr bench prefix`'s table (no engine, no timing): a SYNTHETIC result dict (labelled as such)
renders one row per mode with the median and spread of every figure."""

from __future__ import annotations

from dcr_tools.bench.prefix import MODES, STEPS, table
from dcr_tools.bench.stats import aggregate


def test_table_lists_every_mode_with_medians_and_spreads() -> None:
    runs = {
        "salted": [dict(hit_rate=0.70, stale_tokens=0, ttft_ms=30.0, inflight_resume_ms=9.0,
                        resets_refused=0)] * 5,
        "reset": [dict(hit_rate=0.78, stale_tokens=384, ttft_ms=28.0, inflight_resume_ms=9.0,
                       resets_refused=3)] * 5,
        "reset-running": [dict(hit_rate=0.62, stale_tokens=0, ttft_ms=33.0,
                               inflight_resume_ms=80.0, resets_refused=0)] * 5,
    }  # fmt: skip
    keys = ("hit_rate", "stale_tokens", "ttft_ms", "inflight_resume_ms", "resets_refused")
    res = {"modes": {m: aggregate(runs[m], keys) for m in MODES}}
    text = table(res)
    assert "| salted | 70.0% (70.0-70.0) | 0 (0-0) | 30.0 (30.0-30.0) |" in text
    assert (
        f"| reset | 78.0% (78.0-78.0) | 384 (384-384) | 28.0 (28.0-28.0) | 9.0 (9.0-9.0) | 3 of {STEPS} |"
        in text
    )
    assert (
        "| reset-running | 62.0% (62.0-62.0) | 0 (0-0) | 33.0 (33.0-33.0) | 80.0 (80.0-80.0) |"
        in text
    )
