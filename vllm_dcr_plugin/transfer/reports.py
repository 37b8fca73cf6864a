"""Reports of the native engine ``dcr``: how a worker tells the trainer what an RPC did.

vLLM's weight-transfer RPCs return nothing to the trainer, and a worker that raises inside a
multi-rank ``collective_rpc`` leaves the other ranks' replies queued in vLLM's executor (the next
call would read them) and, in ``finish_weight_update``, leaves the worker's session flag set. So
the worker engine never raises: every rank writes one JSON report per call into the *control
store* (the object store that also holds DCR's commit records), and the trainer engine reads
them. A report is written once per (engine, step, rank); the trainer treats a missing report as
a failed call.

Keys (``<engine>`` is the name the trainer gave the engine at init)::

    reports/<engine>/init/s<session>/rank<r>.json             prewarm / dense load at init
    reports/<engine>/v<version>/a<attempt>/update/rank<r>.json  one attempt fetched and applied
    reports/<engine>/v<version>/a<attempt>/update/draft/rank<r>.json  ... into the draft model
    reports/<engine>/v<version>/a<attempt>/finish/rank<r>.json  committed or fenced
    reports/<engine>/v<version>/restore/s<session>/rank<r>.json dense load of a committed version

Every report has ``ok`` (bool), ``error`` (str or None), ``rank``, ``world_size`` and the
receiver's ``state`` and ``committed_version`` after the call, plus step-specific fields.
"""

from __future__ import annotations

import json
import time
from typing import Any

from shared_codec.errors import DCRError
from shared_codec.transport.base import ObjectStore

PREFIX = "reports/"


def key(engine: str, step: str, rank: int) -> str:
    return f"{PREFIX}{engine}/{step}/rank{int(rank)}.json"


def init_step(session: str) -> str:
    return f"init/s{session}"


def update_step(version: int, attempt: int) -> str:
    return f"v{int(version):012d}/a{int(attempt):06d}/update"


def draft_update_step(version: int, attempt: int) -> str:
    """The report of an attempt's draft part (a speculative draft's weight-update session)."""
    return update_step(version, attempt) + "/draft"


def finish_step(version: int, attempt: int) -> str:
    return f"v{int(version):012d}/a{int(attempt):06d}/finish"


def restore_step(version: int, session: str) -> str:
    return f"v{int(version):012d}/restore/s{session}"


def write(store: ObjectStore, engine: str, step: str, rank: int, report: dict[str, Any]) -> None:
    """Write one rank's report (a `RankReport` on the wire, protocol version 1)."""
    store.put(key(engine, step, rank), json.dumps(report, sort_keys=True).encode())


def collect(
    store: ObjectStore, engine: str, step: str, *, world_size: int, wait_s: float = 10.0
) -> list[dict[str, Any]]:
    """The reports of every rank ``0..world_size-1`` for `step`, in rank order. Waits up to
    `wait_s` for late ones (a slow store); raises `DCRError` naming the ranks that wrote
    none (the call did not reach them, or they died)."""
    deadline = time.monotonic() + wait_s
    while True:
        got: dict[int, dict[str, Any]] = {}
        for r in range(world_size):
            try:
                got[r] = json.loads(store.get(key(engine, step, r)))
            except (KeyError, FileNotFoundError):
                continue
        missing = [r for r in range(world_size) if r not in got]
        if not missing:
            return [got[r] for r in range(world_size)]
        if time.monotonic() >= deadline:
            raise DCRError(
                f"engine {engine}: no {step} report from rank(s) {missing} "
                f"(the call did not reach them or they died)"
            )
        time.sleep(0.1)
