"""Test-only fault injection: a fault plan file, switched on by ``DCR_FAULT_PLAN``, fired by a
receiver observer (vllm_dcr_plugin/observer.py).

Recovery tests (and the demo's ``--kill-every``) make a receiver die or fail part-way through an
attempt. The faults are not RPC arguments and not product code: an engine is started with
``DCR_FAULT_PLAN=PATH`` and ``DCR_RECEIVER_OBSERVER=dcr_tools.faults:FaultPlan`` in its
environment (`environment`; ``dcr_tools.procs.base_env`` adds the observer wherever the plan is
named, and the test suite's conftest names the observer for every process it starts), and a
test arms a fault by writing a plan to PATH (`arm`). Inert while nothing is armed: when the
variable is unset, or PATH does not exist, `take` returns `NO_FAULTS` without touching the file
system beyond one ``stat``.

Plan (JSON object): ``id`` (a fresh token per arming, written by `arm`), optionally ``rank`` (the
worker rank it fires on; every rank when absent) and ``role`` (the receiver it fires in:
``base``, or ``draft`` for a speculative draft's; any when absent), and one or more of

- ``kill_after_payloads``: SIGKILL the worker after staging that many payloads of a fetch
  (a receiver dying mid-transfer);
- ``fail_after_items``: fail the attempt (as a loader error would, `InjectedFailure`) after
  that many items were applied, leaving a partial apply behind;
- ``kill_after_items``: SIGKILL the worker at that point (a receiver dying mid-apply).

Contract: the receiver calls the observer's ``begin`` once at the start of each fetch and apply,
which `take`s the plan. A call that can fire one of the plan's keys (a plain ``dcr_fetch``:
``kill_after_payloads``; ``dcr_apply``: the item keys; a pipelined ``dcr_fetch``: all three)
consumes the whole plan for its rank, atomically (it creates ``PATH.<id>.rank<r>``
exclusively), so a plan fires at most once on each rank, also across an engine restart; other
calls leave it armed. Items are counted over the whole call (every part of a pipelined fetch).

Limitations:
1. Test-only: nothing here is part of the protocol (docs/protocol.md does not mention it).
2. A plain fetch consumes a plan that also names item keys without firing those.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shared_codec.errors import ProtocolError
from vllm_dcr_plugin.observer import Call

ENV = "DCR_FAULT_PLAN"
OBSERVER_ENV = "DCR_RECEIVER_OBSERVER"  # vllm_dcr_plugin.config.ENV_OBSERVER
OBSERVER = "dcr_tools.faults:FaultPlan"
ITEM_KEYS = ("fail_after_items", "kill_after_items")
KEYS = ("kill_after_payloads", *ITEM_KEYS)
_FIRES: dict[str, tuple[str, ...]] = {
    Call.FETCH: ("kill_after_payloads",),
    Call.APPLY: ITEM_KEYS,
    Call.PIPELINED: KEYS,
}


class InjectedFailure(RuntimeError):
    """Fault injection (``fail_after_items``): raised before the loader pulls the next item.
    State left behind: the items applied before it (a partial apply; the receiver is dirty)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Faults:
    """The faults armed for one fetch or apply call (all None: none)."""

    kill_after_payloads: int | None = None
    fail_after_items: int | None = None
    kill_after_items: int | None = None

    def remaining(self, items_done: int, *, kill: bool = True) -> Faults:
        """The item faults left after `items_done` items of the call were pulled; without
        `kill` the kill is dropped."""

        def left(n: int | None) -> int | None:
            return None if n is None else max(0, n - items_done)

        return replace(
            self,
            fail_after_items=left(self.fail_after_items),
            kill_after_items=left(self.kill_after_items) if kill else None,
        )


NO_FAULTS = Faults()


def environment(path: str | os.PathLike[str]) -> dict[str, str]:
    """The variables an engine needs for the fault plan at `path` (plan and observer)."""
    return {ENV: str(path), OBSERVER_ENV: OBSERVER}


def take(rank: int, call: str, role: str = "base") -> Faults:
    """The faults the plan named by ``DCR_FAULT_PLAN`` arms for this `call` (``fetch``,
    ``apply`` or ``pipelined``) on `rank` in the receiver of `role`, consumed (see the module
    docstring); `NO_FAULTS` when none."""
    path = os.environ.get(ENV, "").strip()
    if not path or not os.path.exists(path):
        return NO_FAULTS
    try:
        plan = json.loads(Path(path).read_text())
    except FileNotFoundError:  # removed between the check and the read
        return NO_FAULTS
    except (OSError, ValueError) as e:
        raise ProtocolError(f"{ENV}={path}: unreadable fault plan: {e}") from None
    if not isinstance(plan, dict):
        raise ProtocolError(f"{ENV}={path}: a fault plan is a JSON object")
    if plan.get("rank") is not None and int(plan["rank"]) != int(rank):
        return NO_FAULTS
    if plan.get("role") is not None and plan["role"] != role:
        return NO_FAULTS
    fire = {k: int(plan[k]) for k in _FIRES[call] if plan.get(k) is not None}
    if not fire:
        return NO_FAULTS
    claim = f"{path}.{plan.get('id', 'plan')}.rank{int(rank)}"
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:  # this rank consumed the plan already
        return NO_FAULTS
    return Faults(**fire)


def arm(
    path: str | os.PathLike[str], *, rank: int | None = None, role: str | None = None, **fault: int
) -> None:
    """Write a fault plan to `path` (atomically; a fresh id re-arms a consumed plan). `fault`:
    one or more of ``kill_after_payloads``, ``fail_after_items``, ``kill_after_items``;
    `role`: fire only in that receiver (``base`` or ``draft``)."""
    unknown = set(fault) - set(KEYS)
    if unknown or not fault:
        raise ValueError(f"a fault plan names one or more of {KEYS}, got {sorted(fault)}")
    plan: dict[str, Any] = {"id": uuid.uuid4().hex, **{k: int(v) for k, v in fault.items()}}
    if rank is not None:
        plan["rank"] = int(rank)
    if role is not None:
        plan["role"] = str(role)
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(plan))
    os.replace(tmp, path)


class FaultPlan:
    """The receiver observer (vllm_dcr_plugin.observer.ReceiverObserver) that fires the plan."""

    def begin(self, rank: int, call: Call, role: str = "base") -> ArmedCall | None:
        faults = take(rank, call, role)
        return None if faults == NO_FAULTS else ArmedCall(faults)


class ArmedCall:
    """The faults of one call (a `CallObserver`): payloads staged and items pulled so far."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.pulled = 0

    def before_payload(self, index: int, data: bytes) -> None:
        kill = self.faults.kill_after_payloads
        if kill is not None and index >= kill:
            kill_self()

    def before_item(self, item: object) -> None:
        f = self.faults
        if f.kill_after_items is not None and self.pulled >= f.kill_after_items:
            kill_self()
        if f.fail_after_items is not None and self.pulled >= f.fail_after_items:
            raise InjectedFailure(
                f"injected failure after {f.fail_after_items} items (fault injection)"
            )
        self.pulled += 1


def kill_self() -> None:
    """SIGKILL this worker process (no cleanup: a receiver dying)."""
    os.kill(os.getpid(), signal.SIGKILL)
