"""Retention: after a commit, what older versions left behind is removed, on a background
thread so that deleting objects is never part of a refit's latency.

After the commit of version c, with `keep` versions kept: payloads of versions <= c - keep on
the transport (every attempt: object-store objects, or relay spools and delivered sets through
the tree's ``Forget``, `TransportSpec.forget`), attempt records and engine reports of those
versions in the control store. Commit records stay (the history).

Who calls what: the coordinator `start`s a pass right after each commit's notifications and
`wait`s for the last one before its next refit, resume or initialize (and on demand); `run` is
one pass on the caller's thread.

Limitations:
1. A pass never fails the transition: an error is logged and the next commit's pass removes
   what this one left.
2. Relay retention counts the root's files; nodes are told best effort and catch up with the
   next pass.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from shared_codec.transport.base import ObjectStore
from shared_codec.transport.spec import TransportSpec

ATTEMPTS = "attempts/"
REPORTS = "reports/"

# the version segment of a payload, attempt record or report key ("v<12 digits>/")
_VERSION_IN_KEY = re.compile(r"(?:^|/)v(\d{12})/")


class Retention:
    """Retention of one control store and transport (module docstring). `keep`: versions kept
    after each commit (0 keeps everything); `log`: where errors are reported."""

    def __init__(
        self,
        control: ObjectStore,
        transport: TransportSpec | None,
        keep: int,
        log: Callable[[str], None],
    ) -> None:
        self.control, self.transport, self.keep, self.log = control, transport, keep, log
        self._thread: threading.Thread | None = None
        #: the last pass: committed version, seconds, what it removed
        self.last: dict[str, Any] = {}

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the pass `start` began; True once none is running."""
        t = self._thread
        if t is not None:
            t.join(timeout_s)
            if t.is_alive():
                return False
            self._thread = None
        return True

    def start(self, committed: int) -> None:
        """Run a pass for the commit of `committed` on a background thread (after the last)."""

        def run() -> None:
            t0 = time.perf_counter()
            removed = self.run(committed)  # never raises: errors are logged
            self.last = {
                "committed": committed,
                "seconds": time.perf_counter() - t0,
                "removed": removed,
            }

        self.wait()
        self._thread = threading.Thread(target=run, name="dcr-retention", daemon=True)
        self._thread.start()

    def run(self, committed: int) -> dict[str, int]:
        """One pass after the commit of `committed`: the counts removed (relay payloads: the
        root's files)."""
        removed = {"payloads": 0, "attempts": 0, "reports": 0}
        if self.keep <= 0:
            return removed
        last = committed - self.keep  # versions <= last go
        for what, prefix in (("attempts", ATTEMPTS), ("reports", REPORTS)):
            try:
                for key in self.control.list(prefix):
                    m = _VERSION_IN_KEY.search(key)
                    if m is not None and int(m.group(1)) <= last:
                        self.control.delete(key)
                        removed[what] += 1
            except Exception as e:
                self.log(f"retention of {what} after version {committed} failed: {e}")
        if self.transport is not None and last >= 0:
            try:
                removed["payloads"] = self.transport.forget(last + 1, timeout_s=5.0)
            except Exception as e:
                self.log(f"retention of payloads after version {committed} failed: {e}")
        return removed
