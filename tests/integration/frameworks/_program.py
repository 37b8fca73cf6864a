"""What the two framework trainer programs share: their arguments, vLLM's checksums, and the
wait for the test to restart a dead server (_harness.py)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import requests


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fault-plan", required=True)
    ap.add_argument("--chaos", action="store_true", help="also kill the server mid-apply")
    return ap.parse_args()


def checksums(url: str) -> dict[str, str]:
    """vLLM's own ``/weight_checker`` checksums of every weight of the server."""
    r = requests.post(url + "/weight_checker", json={"action": "checksum"}, timeout=600)
    r.raise_for_status()
    return r.json()["checksums"]


def await_restart(out: Path, timeout_s: float = 600.0) -> None:
    """Ask the test to restart the server (as the framework restarts a dead one); wait."""
    (out / "restart").write_text("restart the server")
    deadline = time.monotonic() + timeout_s
    while not (out / "restarted").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test did not restart the server")
        time.sleep(0.5)
