"""A replica writer that SIGKILLs itself at a named crash point (the kill tests' child).

``python -m tests.integration.shared_codec.replica_kill_program ROOT CASES`` with
``DCR_REPLICA_KILL_AT=<point>[#<n>]`` in the environment (or `run` after `arm` in a forked
child): opens the store at ROOT, bootstraps it from ``CASES/initial`` and runs `SCRIPT`,
reading each attempt's payloads from ``CASES/v<version>-a<attempt>/``. The hook installed by
`arm` kills the process with SIGKILL the n-th time (default the first) the store reaches the
point (`shared_codec.replica.store.CRASH_POINTS`). Exits 0 when the point was never reached.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from shared_codec.replica import ReplicaStore, crash

ENV = "DCR_REPLICA_KILL_AT"

#: every crash point is reached at least once: stage with and without a lagging shadow, an
#: overwrite retry over a partial attempt, an abort, three commits (one left unsynced, as a
#: receiver's), restarts that redo a staged and a committed attempt from the log
SCRIPT: tuple[tuple[str, int, int], ...] = (
    ("stage", 1, 0),
    ("commit", 1, 0),
    ("stage", 2, 0),  # catches the lagging slot up; a partial attempt (owner 0 only)
    ("stage", 2, 1),  # the overwrite retry: undoes attempt 0 first
    ("commit-unsynced", 2, 1),  # as a receiver commits: synced later
    ("reopen", 2, 1),  # recovery redoes the committed slot (0 undone, 1 written), syncs it
    ("stage", 3, 0),  # a bogus attempt ...
    ("abort", 3, 0),  # ... aborted
    ("stage", 3, 1),
    ("reopen", 3, 1),  # recovery redoes the staged attempt from the log
    ("commit", 3, 1),
)


def attempt_payloads(cases: Path, version: int, attempt: int) -> list[bytes]:
    return [f.read_bytes() for f in sorted((cases / f"v{version}-a{attempt}").iterdir())]


def arm(spec: str) -> None:
    """Install the crash hook: SIGKILL at the n-th arrival at the point `spec` names."""
    point, _, nth = spec.partition("#")
    want = int(nth or 1)
    seen = 0

    def hook(at: str) -> None:
        nonlocal seen
        if at == point:
            seen += 1
            if seen == want:
                os.kill(os.getpid(), signal.SIGKILL)

    crash._hook = hook


def run(root: Path, cases: Path) -> None:
    store = ReplicaStore(root)
    try:
        store.bootstrap(cases / "initial")
        for op, version, attempt in SCRIPT:
            if op == "stage":
                store.stage(version, attempt, attempt_payloads(cases, version, attempt))
            elif op in ("commit", "commit-unsynced"):
                store.commit(version, attempt, sync=op == "commit")
            elif op == "reopen":
                store.close()
                store = ReplicaStore(root)
            else:
                store.abort(version, attempt)
    finally:
        store.close()


def main(argv: list[str]) -> int:
    root, cases = Path(argv[1]), Path(argv[2])
    spec = os.environ.get(ENV, "")
    if spec:
        arm(spec)
    run(root, cases)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
