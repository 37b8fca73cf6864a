"""TEST PROGRAM: ``dcr replica serve`` with the store's test-only crash hook armed from the
environment, so a chaos test can SIGKILL the replica's service at one crash point
(shared_codec/replica/crash.py) while a coordinator drives it over HTTP.

``DCR_TEST_REPLICA_KILL_AT=<point>[#n]``: SIGKILL this process at the n-th arrival (default 1)
at `point`. Arguments: those of ``dcr replica serve``.
"""

from __future__ import annotations

import os
import signal
import sys

from shared_codec.replica import crash


def _arm(spec: str) -> None:
    point, _, nth = spec.partition("#")
    if point not in crash.CRASH_POINTS:
        raise SystemExit(f"unknown crash point {point!r}")
    left = [int(nth or 1)]

    def hook(at: str) -> None:
        if at == point:
            left[0] -= 1
            if left[0] == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    crash._hook = hook


def main() -> int:
    from dcr_tools.cli import main as dcr_main

    spec = os.environ.get("DCR_TEST_REPLICA_KILL_AT", "")
    if spec:
        _arm(spec)
    return int(dcr_main(["replica", "serve", *sys.argv[1:]]) or 0)


if __name__ == "__main__":
    sys.exit(main())
