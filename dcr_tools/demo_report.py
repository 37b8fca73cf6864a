"""What a user of ``dcr demo`` sees: the live per-step table and ``OUT/report.{json,png,html}``.

The demo (`dcr_tools.demo`) builds a report dict, prints `table_header` and one `table_row` per
step while it runs, and hands the finished dict to `write_report`. Everything here is pure
(no processes, no network), so the rendering is testable on a hand-built dict
(``tests/unit/test_demo_report.py`` checks the page in a headless browser).

The report dict: ``refit``, ``transport``, ``steps``, ``kill_every``, ``checkpoint_bytes``,
``all_bit_exact``, ``final_digest``, ``rows`` (one dict per step: ``step``, ``reward_mean``,
``payload_pct``, ``attempts``, ``bit_exact``, ``digest`` and, for DCR refits,
``element_change_rate``, ``payload_bytes``, ``construct_s``, ``publish_s``, ``fetch_s``,
``apply_s``, ``commit_s``; ``dense_s`` for dense refits) and optionally the run settings
``samples_per_prompt``, ``max_tokens``, ``lr``, ``seed``.

Limitations:
1. ``report.html`` is one static page: inline ``<style>``, the plots as a base64 ``data:`` URI,
   no script and no external reference; it embeds the PNG, so it is ~60 kB.
2. The printed table and the HTML table have the same columns (`COLUMNS`); a dense run shows
   zero DCR stage times and its dense-load seconds only in the summary and the plot.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE_NOTE = (
    "(seconds per stage: construction on the trainer, transport = upload/tree tail + "
    "fetch/stage on the engine)"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Column:
    """One column of the per-step table: `label` (printed and HTML header), printed `width`
    (right-aligned), `cell` (the value as text, from one row dict) and `doc` (HTML tooltip)."""

    label: str
    width: int
    cell: Callable[[dict[str, Any]], str]
    doc: str


def _s(row: dict[str, Any], key: str) -> float:
    return float(row.get(key, 0.0))


COLUMNS: tuple[Column, ...] = (
    Column(label="step", width=4, cell=lambda r: str(r["step"]), doc="RL step (= version)"),
    Column(
        label="reward",
        width=7,
        cell=lambda r: f"{r['reward_mean']:.3f}",
        doc="mean reward of the step's completions",
    ),
    Column(
        label="changed",
        width=8,
        cell=lambda r: f"{100 * _s(r, 'element_change_rate'):.2f}%",
        doc="share of weight elements whose bits changed",
    ),
    Column(
        label="payload",
        width=8,
        cell=lambda r: str(int(r.get("payload_bytes", 0))),
        doc="payload bytes sent to the engine",
    ),
    Column(
        label="% ckpt",
        width=7,
        cell=lambda r: f"{r['payload_pct']:.2f}%",
        doc="payload bytes as % of the checkpoint",
    ),
    Column(
        label="construct",
        width=9,
        cell=lambda r: f"{_s(r, 'construct_s'):.2f}",
        doc="seconds: payload construction on the trainer",
    ),
    Column(
        label="transport",
        width=9,
        cell=lambda r: f"{_s(r, 'publish_s') + _s(r, 'fetch_s'):.2f}",
        doc="seconds: upload/tree tail + fetch/stage on the engine",
    ),
    Column(
        label="apply",
        width=6,
        cell=lambda r: f"{_s(r, 'apply_s'):.2f}",
        doc="seconds: apply on the engine",
    ),
    Column(
        label="commit",
        width=6,
        cell=lambda r: f"{_s(r, 'commit_s'):.2f}",
        doc="seconds: commit record",
    ),
    Column(
        label="tries",
        width=5,
        cell=lambda r: str(r["attempts"]),
        doc="refit attempts (2 after a kill)",
    ),
    Column(
        label="exact",
        width=5,
        cell=lambda r: "yes" if r["bit_exact"] else "NO",
        doc="engine digest equals the dense-loaded reference",
    ),
)


def table_header() -> str:
    """The printed table's header line."""
    return " ".join(f"{c.label:>{c.width}}" for c in COLUMNS)


def table_row(row: dict[str, Any]) -> str:
    """One printed table line for a step's row dict."""
    return " ".join(f"{c.cell(row):>{c.width}}" for c in COLUMNS)


def verdict(report: dict[str, Any]) -> tuple[bool, str]:
    """(every step bit-exact, one line saying so with the step count and transport)."""
    rows = report["rows"]
    how = (
        "refit by dense loads of the trainer's export"  # no transport carries a dense refit
        if report["refit"] == "dense"
        else f"refit by {report['refit']} over {report['transport']}"
    )
    if report.get("kill_every"):
        how += f", engine killed mid-apply every {report['kill_every']} steps"
    if not rows:
        return False, f"No steps ran ({how})."
    bad = [str(r["step"]) for r in rows if not r["bit_exact"]]
    n = f"{len(rows)} step{'s' if len(rows) != 1 else ''}"
    if not bad:
        return True, f"All {n} bit-exact: {how}."
    which = f"step{'s' if len(bad) != 1 else ''} {', '.join(bad)}"
    return False, f"NOT bit-exact: {len(bad)} of {n} differ from the reference ({which}; {how})."


def settings(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The run settings as (label, value) pairs (optional keys only when present)."""
    out = [
        ("refit", str(report["refit"])),
        ("transport", str(report["transport"])),
        ("steps", str(report["steps"])),
        ("engine killed every", f"{report['kill_every']} steps" if report["kill_every"] else "-"),
        ("checkpoint bytes", f"{report['checkpoint_bytes']:,}"),
    ]
    for key, label in (
        ("samples_per_prompt", "samples per prompt"),
        ("max_tokens", "max tokens per completion"),
        ("lr", "learning rate (Adam)"),
        ("seed", "fixture seed"),
    ):
        if key in report:
            out.append((label, str(report[key])))
    return out


def summary(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Totals and ratios over all steps as (label, value) pairs."""
    rows = report["rows"]
    if not rows:
        return [("steps run", "0")]
    n = len(rows)
    moved = sum(int(r.get("payload_bytes", 0)) for r in rows)
    dense = n * int(report["checkpoint_bytes"])
    out = [("steps run", str(n)), ("bit-exact steps", f"{sum(r['bit_exact'] for r in rows)}")]
    if report["refit"] == "dense":
        out.append(("dense refit seconds per step (mean)", f"{_mean(rows, 'dense_s'):.2f}"))
    else:
        stage = sum(_s(r, k) for r in rows for k in _STAGES) / n
        out += [
            ("payload bytes, all steps", f"{moved:,}"),
            ("dense refits would move", f"{dense:,}"),
            ("payload / dense bytes", f"{100 * moved / dense:.2f}%" if dense else "-"),
            ("fewer bytes than dense", f"{dense / moved:.1f}x" if moved else "-"),
            (
                "changed elements per step (mean)",
                f"{100 * _mean(rows, 'element_change_rate'):.2f}%",
            ),
            ("refit seconds per step (mean)", f"{stage:.2f}"),
        ]
    switches = " -> ".join("/".join(r.get("rollout_versions") or ["?"]) for r in rows)
    out += [
        ("rollout weight versions, step by step (switch at each commit)", switches),
        ("refit attempts, all steps", str(sum(int(r["attempts"]) for r in rows))),
        ("steps with a killed engine", str(sum(bool(r.get("killed")) for r in rows))),
        (
            "reward, first -> last step",
            f"{rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f}",
        ),
        ("final digest", str(report.get("final_digest"))),
    ]
    return out


_STAGES = ("construct_s", "publish_s", "fetch_s", "apply_s", "commit_s")


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(_s(r, key) for r in rows) / len(rows)


def render_png(report: dict[str, Any]) -> bytes:
    """The plots: refit timeline per stage, payload bytes per step (PNG bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = report["rows"]
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0.0] * len(rows)
    for key, label in (
        ("construct_s", "construction"),
        ("publish_s", "upload + manifest"),
        ("fetch_s", "fetch + stage"),
        ("apply_s", "apply"),
        ("commit_s", "commit"),
        ("dense_s", "dense refit"),
    ):
        vals = [max(0.0, _s(r, key)) for r in rows]
        if any(vals):
            ax1.bar(steps, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_xlabel("step")
    ax1.set_ylabel("seconds")
    ax1.set_title("refit timeline per stage")
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend(fontsize=8)
    kb = [r.get("payload_bytes", 0) / 1e3 for r in rows]
    ax2.bar(steps, kb, color="tab:green", label="payload")
    ax2.axhline(report["checkpoint_bytes"] / 1e3, color="grey", ls="--", label="checkpoint")
    ax2.set_yscale("log")
    if any(v > 0 for v in kb):
        # a log axis starting just under the smallest bar, so the bars are visible
        ax2.set_ylim(bottom=min(v for v in kb if v > 0) / 4)
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_xlabel("step")
    ax2.set_ylabel("kB")
    ax2.set_title("payload bytes per step")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


_STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: #1b1f24; margin: 2rem auto; max-width: 72rem; padding: 0 1rem; }
h1 { font-size: 1.5rem; margin: 0 0 .75rem; }
h2 { font-size: 1.15rem; margin: 1.75rem 0 .5rem; }
.verdict { font-size: 1.2rem; font-weight: 600; padding: .75rem 1rem; border-radius: 6px; }
.verdict.ok { background: #e6f4ea; color: #0d5222; border: 1px solid #9bd3ae; }
.verdict.bad { background: #fdecea; color: #8a1c13; border: 1px solid #f1a9a0; }
table { border-collapse: collapse; margin: .25rem 0; }
caption { caption-side: top; text-align: left; color: #57606a; font-size: .85rem;
          padding-bottom: .35rem; }
th, td { border: 1px solid #d0d7de; padding: .3rem .65rem; }
th { background: #f6f8fa; text-align: left; font-weight: 600; }
table.steps td { text-align: right; font-variant-numeric: tabular-nums; }
table.steps th { text-align: right; }
table.kv th { width: 18rem; }
td.no { color: #8a1c13; font-weight: 700; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: .85rem; }
img { max-width: 100%; height: auto; border: 1px solid #d0d7de; }
"""


_NO_CELL = "<td class='no'>"


def _kv_table(pairs: list[tuple[str, str]]) -> str:
    body = "".join(
        f"<tr><th scope='row'>{html.escape(k)}</th><td>{_value(k, v)}</td></tr>" for k, v in pairs
    )
    return f"<table class='kv'><tbody>{body}</tbody></table>"


def _value(label: str, value: str) -> str:
    return f"<code>{html.escape(value)}</code>" if "digest" in label else html.escape(value)


def render_html(report: dict[str, Any], png: bytes | None) -> str:
    """The standalone page: verdict, run settings, per-step table, summary, plots."""
    ok, line = verdict(report)
    head = "".join(
        f"<th scope='col' title='{html.escape(c.doc, quote=True)}'>{html.escape(c.label)}</th>"
        for c in COLUMNS
    )
    body = "".join(
        "<tr>"
        + "".join(
            (_NO_CELL if c.label == "exact" and not r["bit_exact"] else "<td>")
            + f"{html.escape(c.cell(r))}</td>"
            for c in COLUMNS
        )
        + "</tr>"
        for r in report["rows"]
    )
    steps = (
        f"<table class='steps'><caption>{html.escape(TABLE_NOTE)}</caption>"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )
    plots = (
        "<h2>Plots</h2><img alt='refit timeline per stage and payload bytes per step' "
        f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        if png
        else ""
    )
    title = f"DCR demo: {len(report['rows'])} RL steps, refit by {report['refit']}"
    return (
        "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f"<p class='verdict {'ok' if ok else 'bad'}' id='verdict'>{html.escape(line)}</p>"
        f"<h2>Run settings</h2>{_kv_table(settings(report))}"
        f"<h2>Refit per step</h2>{steps}"
        f"<h2>Summary</h2>{_kv_table(summary(report))}"
        f"{plots}</body></html>\n"
    )


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """Write ``report.json``, ``report.png`` and the standalone ``report.html`` (which embeds
    the PNG) into `out_dir` (created if missing); returns the HTML's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    png = render_png(report)
    (out / "report.png").write_bytes(png)
    page = out / "report.html"
    page.write_text(render_html(report, png), encoding="utf-8")
    return page
