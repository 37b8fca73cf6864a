"""`dcr_tools.demo_report`: the demo's ``report.html`` rendered by a real headless browser
(Debian's ``chromium``; ``make setup`` installs it when run as root): the verdict line, the
tables and their values as the browser shows them, no external reference, a screenshot. The
report dicts have the shape ``dcr demo`` writes to ``report.json`` (no demo runs here)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from dcr_tools.demo_report import COLUMNS, TABLE_NOTE, table_header, table_row, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium not installed: `make setup` installs it as root with apt-get "
    "(or: apt-get install -y chromium)",
)

VOID = {"meta", "img", "br", "hr", "link", "input", "col", "source", "wbr", "area", "base"}


def _row(step: int, *, exact: bool = True, killed: bool = False, **kw: Any) -> dict[str, Any]:
    """One step's row, with the keys and value types of a real run's report.json."""
    row: dict[str, Any] = {
        "step": step,
        "version": step,
        "reward_mean": 0.51875,
        "rewards": [0.5, 0.625, 0.25, 0.625, 0.5, 0.5, 0.75, 0.4],
        "pg_loss": 0.03422381356358528,
        "generate_s": 0.4969008150000036,
        "train_s": 0.18528043799994975,
        "attempts": 2 if killed else 1,
        "killed": killed,
        "element_change_rate": 0.032443026879626025,
        "payloads": 2,
        "payload_bytes": 11300,
        "construct_s": 0.03477995299999748,
        "publish_s": 0.05109682600004817,
        "transport_apply_s": 0.052849469999955545,
        "fetch_s": 0.01865809999992507,
        "apply_s": 0.11869608700010303,
        "commit_s": 0.03338786100005109,
        "failed_attempts": ["EngineUnreachable: receiver rollout"] if killed else [],
        "payload_pct": 3.4122478560212586,
        "digest": f"{step:064x}",
        "bit_exact": exact,
    }
    row.update(kw)
    return row


def _report(rows: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "demo": "dcr-rl",
        "refit": "dcr",
        "transport": "relay",
        "steps": len(rows),
        "kill_every": 0,
        "checkpoint_bytes": 331160,
        "all_bit_exact": all(r["bit_exact"] for r in rows),
        "final_digest": rows[-1]["digest"] if rows else None,
        "samples_per_prompt": 2,
        "max_tokens": 8,
        "lr": 3e-06,
        "seed": 0,
        "rows": rows,
    }
    report.update(kw)
    return report


class _Page(HTMLParser):
    """The rendered DOM as text: tables (rows of cell texts), the verdict, h2 headings, every
    src/href value and the tags seen."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.h2: list[str] = []
        self.verdict = ""
        self.verdict_class = ""
        self.links: list[str] = []
        self.tags: set[str] = set()
        self._cell: list[str] | None = None
        self._into: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.add(tag)
        self.links += [v or "" for k, v in attrs if k in ("src", "href", "srcset", "action")]
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "h2":
            self._into, self._cell = "h2", []
        elif a.get("id") == "verdict":
            self._into, self._cell = "verdict", []
            self.verdict_class = a.get("class") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "h2" and self._into == "h2":
            self.h2.append("".join(self._cell or []).strip())
            self._into = self._cell = None
        elif tag == "p" and self._into == "verdict":
            self.verdict = "".join(self._cell or []).strip()
            self._into = self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


class _Balance(HTMLParser):
    """Checks the page as written: every non-void element closed, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def _chromium(*args: str, profile: Path) -> str:
    assert CHROMIUM is not None
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--no-first-run",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _render(report: dict[str, Any], tmp: Path) -> tuple[str, _Page]:
    page = write_report(report, tmp / "out")
    raw = page.read_text(encoding="utf-8")
    dom = _chromium("--dump-dom", page.as_uri(), profile=tmp / "profile")
    parsed = _Page()
    parsed.feed(dom)
    return raw, parsed


def test_report_html_in_a_headless_browser(tmp_path: Path) -> None:
    rows = [
        _row(1),
        _row(2, killed=True, reward_mean=0.515625, payload_bytes=12894, apply_s=0.02440646700006),
        _row(3, reward_mean=0.53125, element_change_rate=0.0285, payload_pct=3.04),
    ]
    report = _report(rows, kill_every=2)
    raw, page = _render(report, tmp_path)

    # standalone, valid: doctype, charset, title, inline style, balanced elements, nothing fetched
    assert raw.startswith("<!doctype html>") and "<meta charset='utf-8'>" in raw
    balance = _Balance()
    balance.feed(raw)
    assert not balance.errors and not balance.stack, (balance.errors, balance.stack)
    assert "<style>" in raw and not {"link", "script", "iframe"} & page.tags
    assert not re.search(r"https?://|url\(", raw), "the page references something external"
    assert page.links and all(v.startswith("data:image/png;base64,") for v in page.links)

    # the verdict at the top, as rendered
    assert page.verdict == (
        "All 3 steps bit-exact: refit by dcr over relay, engine killed mid-apply every 2 steps."
    )
    assert page.verdict_class == "verdict ok"
    assert page.h2 == ["Run settings", "Refit per step", "Summary", "Plots"]
    settings, steps, summary = page.tables
    assert ["transport", "relay"] in settings and ["engine killed every", "2 steps"] in settings
    assert ["checkpoint bytes", "331,160"] in settings and ["samples per prompt", "2"] in settings

    # the per-step table: the printed table's columns and values
    assert steps[0] == [c.label for c in COLUMNS]
    assert steps[0] == ["step", "reward", "changed", "payload", "% ckpt", "construct"] + [
        "transport",
        "apply",
        "commit",
        "tries",
        "exact",
    ]
    assert steps[1:] == [
        ["1", "0.519", "3.24%", "11300", "3.41%", "0.03", "0.07", "0.12", "0.03", "1", "yes"],
        ["2", "0.516", "3.24%", "12894", "3.41%", "0.03", "0.07", "0.02", "0.03", "2", "yes"],
        ["3", "0.531", "2.85%", "11300", "3.04%", "0.03", "0.07", "0.12", "0.03", "1", "yes"],
    ]
    assert [table_row(r).split() for r in rows] == steps[1:]
    assert (
        table_header().split()
        == ["step", "reward", "changed", "payload", "%", "ckpt"] + (steps[0][5:])
    )
    assert TABLE_NOTE in raw

    # totals and ratios
    assert ["payload bytes, all steps", "35,494"] in summary
    assert ["dense refits would move", "993,480"] in summary
    assert ["payload / dense bytes", "3.57%"] in summary
    assert ["steps with a killed engine", "1"] in summary
    assert ["refit attempts, all steps", "4"] in summary
    assert ["final digest", f"{3:064x}"] in summary

    # one screenshot: the page renders (the plot is decoded from its data URI)
    shot = tmp_path / "report.png"
    _chromium("--window-size=1200,1600", f"--screenshot={shot}", Path(tmp_path / "out" /
              "report.html").as_uri(), profile=tmp_path / "profile")  # fmt: skip
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_report_html_says_not_bit_exact_at_the_top(tmp_path: Path) -> None:
    rows = [_row(1), _row(2, exact=False), _row(3, exact=False)]
    _, page = _render(_report(rows, transport="s3"), tmp_path)
    assert page.verdict == (
        "NOT bit-exact: 2 of 3 steps differ from the reference (steps 2, 3; refit by dcr over s3)."
    )
    assert page.verdict_class == "verdict bad"
    assert [r[-1] for r in page.tables[1][1:]] == ["yes", "NO", "NO"]
    assert ["bit-exact steps", "1"] in page.tables[2]


def test_report_html_for_dense_refits(tmp_path: Path) -> None:
    rows = [
        {**_row(s), "attempts": 0, "killed": False, "dense_s": 0.5, "payload_pct": 0.0}
        for s in (1, 2)
    ]
    for r in rows:
        for k in ("element_change_rate", "payload_bytes", "construct_s", "publish_s"):
            del r[k]
        for k in ("fetch_s", "apply_s", "commit_s", "payloads", "transport_apply_s"):
            del r[k]
    _, page = _render(_report(rows, refit="dense", transport="dir"), tmp_path)
    assert page.verdict == ("All 2 steps bit-exact: refit by dense loads of the trainer's export.")
    assert page.tables[1][1] == ["1", "0.519", "0.00%", "0", "0.00%"] + ["0.00"] * 4 + ["0", "yes"]
    assert ["dense refit seconds per step (mean)", "0.50"] in page.tables[2]
