"""The GPU lane's closing summary (scripts/gpu_lane.sh): one table of the steps, the owner
checks, the test counts and the detection figures; writes ``summary.json`` and exits 1 when a
step failed, timed out or was cut by the budget, or a program's own checks failed.

Standard library only: it runs whatever the steps before it could or could not install.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

#: step statuses that fail the lane
BAD = ("failed", "timeout", "no-time")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _junit(path: Path) -> dict[str, int] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in out:
            out[k] += int(s.get(k, 0))
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


def _rate(res: dict[str, Any], op: str) -> str:
    s = res.get("seconds", {}).get(op)
    if not s:
        return "-"
    return f"{s['bytes_moved'] / s['median'] / 1e9:.1f} GB/s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=Path, required=True)
    ap.add_argument("--env", type=Path, required=True)
    ap.add_argument("--junit", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cuda", type=int, required=True)
    ap.add_argument("--seconds", type=int, required=True)
    args = ap.parse_args(argv)

    steps = []
    if args.steps.is_file():
        for line in args.steps.read_text().splitlines():
            name, status, rc, secs = line.split()
            steps.append({"step": name, "status": status, "exit": int(rc), "seconds": float(secs)})
    owner = _json(args.out / "owner.json")
    device = _json(args.out / "device.json")
    codec = _json(args.out / "codec.json")
    tests = _junit(args.junit)
    failed = [s["step"] for s in steps if s["status"] in BAD]
    if owner is not None and not owner.get("ok"):
        failed.append("owner checks")
    if device is not None and not device.get("ok"):
        failed.append("detection checks")
    summary: dict[str, Any] = {
        "mode": "cuda" if args.cuda else "cpu (no CUDA device: no GPU figure)",
        "env": _json(args.env) or {},
        "seconds": args.seconds,
        "steps": steps,
        "owner_checks": owner.get("checks") if owner else None,
        "tests": tests,
        "detect": {op: device["seconds"][op]["median"] for op in device.get("seconds", {})}
        if device
        else None,
        "detect_elements": device.get("elements") if device else None,
        "codec_throughput": codec.get("throughput") if codec else None,
        "failed": failed,
        "ok": not failed,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    env = summary["env"]
    print(
        f"[gpu-lane] ===== summary: {summary['mode']}; python {env.get('python', '?')}, torch "
        f"{env.get('torch', '?')}, device {env.get('device', 'none')}; {args.seconds} s ====="
    )
    for s in steps:
        print(
            f"[gpu-lane] {s['step']:<8} {s['status']:<8} exit {s['exit']:>4} {s['seconds']:>7.1f} s"
        )
    if owner:
        bad = [k for k, v in owner["checks"].items() if not v]
        print(
            f"[gpu-lane] owner: {sum(owner['checks'].values())}/{len(owner['checks'])} checks "
            f"passed on {owner['device']}, world {owner['groups']['world_backend']}, DCR host "
            f"group {owner['groups']['host_backend']}"
            + (f"; FAILED: {', '.join(bad)}" if bad else "")
        )
    if tests:
        print(
            f"[gpu-lane] tests: {tests['passed']} passed, {tests['failures'] + tests['errors']} "
            f"failed, {tests['skipped']} skipped"
        )
    if device:
        scans = [op for op in device["seconds"] if op.startswith("device_scan_")]
        best = max(scans, key=lambda op: 1 / device["seconds"][op]["median"]) if scans else None
        print(
            f"[gpu-lane] detect ({device['elements']} bf16 elements, {device['rate']:.0%} changed, "
            f"{device['device']}): d2d copy {_rate(device, 'd2d_copy')} (read+write), h2d pinned "
            f"{_rate(device, 'h2d_pinned')}, host stage {_rate(device, 'host_stage')}; "
            f"{best or 'device scan'} {_rate(device, best) if best else '-'}, host path "
            f"{_rate(device, 'detect')}"
        )
    if codec and codec.get("throughput"):
        t = codec["throughput"]
        print(
            f"[gpu-lane] codec (3%): encode {t.get('encode_mb_s', 0):.0f} MB/s, decode "
            f"{t.get('decode_mb_s', 0):.0f} MB/s"
        )
    print(f"[gpu-lane] {'OK' if not failed else 'FAILED: ' + ', '.join(failed)} ({args.out})")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
