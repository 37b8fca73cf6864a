"""`dcr bench named`'s table (no ranks, no timing): a SYNTHETIC result dict (labelled as such)
renders one row per change rate with both paths' seconds, ratio, per-GB figures, payloads and
exactness, and the memory line."""

from __future__ import annotations

from dcr_tools.bench.named import render


def _row(rate: str, hook: float, named: float) -> dict:
    out = {"rate": rate, "hook_payload_bytes": 3_890_000, "named_payload_bytes": 3_460_000}
    for k, v in (("hook", hook), ("named", named), ("export", 1.3)):
        out.update({f"{k}_seconds": v, f"{k}_min_s": v * 0.9, f"{k}_max_s": v * 1.1})
        out[f"{k}_seconds_per_gb"] = v / 0.63
    out.update(named_vs_hook=named / hook, named_vs_hook_min=5.0, named_vs_hook_max=7.0)
    out["bit_exact"] = True
    return out


def test_render_lists_both_paths_per_rate() -> None:
    res = {
        "size": "medium",
        "checkpoint_bytes": 630_000_000,
        "ranks": 2,
        "repeats": 5,
        "rows": [_row("1%", 0.32, 2.02), _row("3%", 0.53, 2.65)],
        "hook_baseline_bytes": 634e6,
        "named_baseline_bytes": 634e6,
        "hook_baseline_bytes_per_gb": 1.006e9,
        "named_baseline_bytes_per_gb": 1.006e9,
        "peak_rss_bytes": [5.9e9, 5.0e9],
    }
    text = render(res)
    assert "medium model, 0.63 GB BF16 checkpoint, 2 ranks" in text
    assert "| 1% | 0.32 [0.29-0.35] | 2.02 [1.82-2.22] | 1.30 | 6.31x [5.00-7.00]" in text
    assert "| 3.89 / 3.46 | True |" in text
    assert "hook 634 MB (1.01 GB per GB), named 634 MB (1.01 GB per GB)" in text
    assert "5.90 GB, 5.00 GB" in text
