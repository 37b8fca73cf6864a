"""A coordinator that SIGKILLs itself at one protocol step (run as a program by test_chaos.py).

``python -m tests.integration.chaos_coordinator_program CONFIG_JSON`` builds a `Coordinator` on the chaos
cluster's real participants (the trainer job's owner service, the rollout engine over HTTP,
the control store and the owners' transport), then runs ``resume()`` and ``refit()`` and kills
itself (SIGKILL: no cleanup, no reply read, nothing flushed) at the step CONFIG's ``kill``
names:

- ``after_prepare``: the attempt record is reserved; nobody else was told anything;
- ``during_apply``: the build request was sent and the engine's pipelined fetch + apply started
  (the owners keep building and sealing, the engine keeps applying: nobody waits for them);
- ``after_acks``: every engine ACKed ok; before the candidate guard and the compare-and-set;
- ``after_cas``: the commit record of the new version is written; no participant was told;
- ``during_owner_commit``: the engines were told to commit, the owners' commit request (the
  baseline update) was sent, and the coordinator died before the reply.

The kill points are wrappers in this program (test-only); the product code is unchanged. The
program prints ``CHAOS kill at STEP`` just before the kill, so the test can tell the kill it
asked for from any other death.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from shared_codec.checkpoint import tensor_table
from shared_codec.coordination.commit import CommitLog, CommitRecord
from shared_codec.coordination.coordinator import AttemptResult, Coordinator, CoordinatorConfig
from shared_codec.coordination.engines import HttpEngine
from shared_codec.coordination.owners import RemoteOwners
from shared_codec.replica.client import HttpReplica
from shared_codec.transport.spec import open_store

STEPS = ("after_prepare", "during_apply", "after_acks", "after_cas", "during_owner_commit")


def die(step: str) -> None:
    print(f"CHAOS kill at {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class KillingOwners(RemoteOwners):
    """`RemoteOwners` that dies right after sending a build or commit request."""

    def __init__(self, endpoint: str, kill: str) -> None:
        super().__init__(endpoint, timeout_s=300)
        self.kill = kill
        self.armed_from = 1 << 62  # set after `resume` (whose own commit call must pass)

    def _send_and_die(self, step: str, op: str, **fields: Any) -> None:
        sock = self._socket()
        sock.send(json.dumps({"op": op, **fields}).encode())
        time.sleep(0.3)  # let zmq's I/O thread put the request on the wire
        die(step)

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        if self.kill == "during_apply":
            self._send_and_die(self.kill, "build", version=version, attempt=attempt, retry=retry)
        return super().build(version, attempt, retry)

    def commit(self, version: int) -> None:
        if self.kill == "during_owner_commit" and version >= self.armed_from:
            time.sleep(1.0)  # the engines' commits (started together with this one) land first
            self._send_and_die(self.kill, "commit", version=version)
        super().commit(version)


class KillingLog(CommitLog):
    """`CommitLog` that dies right after the compare-and-set of a new version."""

    def __init__(self, store: Any, kill: str) -> None:
        super().__init__(store)
        self.kill = kill

    def commit(self, expected_version: int | None, record: CommitRecord) -> CommitRecord:
        out = super().commit(expected_version, record)
        if self.kill == "after_cas" and record.version > 0:
            die(self.kill)
        return out


class KillingCoordinator(Coordinator):
    kill = ""

    def prepare(self, version: int) -> tuple[int, bool]:
        out = super().prepare(version)
        if self.kill == "after_prepare":
            die(self.kill)
        return out

    def _collect(self, res: AttemptResult, futures: dict[str, Any], deadline: float) -> None:
        super()._collect(res, futures, deadline)
        if self.kill == "after_acks" and not res.failed:  # every ACK in, guard passed, no CAS
            die(self.kill)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    kill = str(cfg["kill"])
    if kill not in STEPS:
        raise SystemExit(f"unknown kill step {kill!r}; choose from {STEPS}")
    ckpts = str(cfg["ckpts"])

    def checkpoint_for(version: int) -> str:
        return os.path.join(ckpts, f"v{version}")

    engines: list[Any] = [
        HttpEngine(
            e["name"],
            e["url"],
            store=cfg["engine_store"],
            checkpoint_for=checkpoint_for,
            tensors=tensor_table(checkpoint_for(0)),
        )
        for e in cfg["engines"]
    ]
    if cfg.get("replica"):  # the rollout cluster's replica: a required receiver, first
        engines.insert(0, HttpReplica(cfg["replica"]))
    control = open_store(cfg["control"])
    owners = KillingOwners(cfg["owners"], kill)
    coord = KillingCoordinator(
        control,
        owners,
        engines,
        CoordinatorConfig(max_attempts=3, ack_timeout_s=120),
        log=lambda m: print(f"[coordinator] {m}", flush=True),
        transport=cfg["transport"],
    )
    coord.kill = kill
    coord.commits = KillingLog(control, kill)
    committed = coord.resume()
    owners.armed_from = committed + 1
    print(f"[coordinator] resumed at committed version {committed}", flush=True)
    # a watchdog: a kill point that is never reached must not leave a coordinator running
    threading.Timer(float(cfg.get("timeout_s", 240)), lambda: os._exit(3)).start()
    res = coord.refit()
    print(f"[coordinator] NOT KILLED: committed version {res.version}", flush=True)
    os._exit(2)


if __name__ == "__main__":
    main()
