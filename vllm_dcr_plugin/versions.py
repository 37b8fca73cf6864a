"""The version of the weights an engine generates with, as vLLM's own ``weight_version``, on the
``dcr_*`` RPC path (issue 34 item 3: per-span weight versions).

vLLM 0.32 stamps every step's output with its engine core's ``weight_version`` and gives each
finished request its spans (``CompletionOutput.weight_versions``: ``WeightVersionSpan(version,
start, end)`` over output-token indexes; ``/inference/v1/generate`` returns them). On the native
path (backend ``dcr``) vLLM sets the version itself at ``finish_weight_update(weight_version)``,
which DCR calls with the committed version. The ``dcr_*`` RPCs run through
``collective_rpc`` instead, which leaves the version alone: a client stamping afterwards would
race the engine's next step. So the engine core stamps it in the same utility call
(`stamping_collective_rpc`, installed by patches.py): every ``dcr_*`` reply carries its rank's
`weights_state` (extension.py), and after a ``dcr_*`` call the label is:

- ``"<v>"`` when every rank is clean at committed version ``v`` (a commit, a dense load, a
  prewarm, or an attempt fenced before any write): the same string the native path uses;
- ``"<t>-uncommitted.<n>"`` when any rank holds applied, applying or dirty weights for target
  version ``t`` (between an apply and its commit, or after a failure part-way, until an
  overwrite retry commits): tokens generated there came from no committed version, and say so.
  ``n`` counts the applies the ranks have run (the most of any rank), so that each write of
  uncommitted weights has its own label: a failed part-way apply and the overwrite retry that
  repairs it are different weights, and the prefix cache salted by the label (prefix_salt.py)
  must not share blocks between them;
- unchanged when a reply carries no state (a rank without a receiver yet, an RPC that failed
  before reaching one): nothing DCR did moved weights.

Requests generated across a change (a keep-mode pause, or an engine left running) get one span
per label. DCR's coordinator applies under a pause or with no request holding state (the
request gate, worker.py), so in its flows a span boundary is a commit.

Limitations:
1. The engine core reads the replies of its own ``collective_rpc``; with data parallelism every
   DP engine core stamps its own ranks.
2. Weights moved outside DCR (vLLM's own ``update_weights`` without ``finish_weight_update``'s
   version, a ``load_weights`` through another RPC) are not seen here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

UNCOMMITTED = "-uncommitted"


def weights_state(receiver: Any) -> dict[str, Any]:
    """One rank's share of the label: its receiver's state and versions."""
    return {
        "state": receiver.state.value,
        "committed_version": int(receiver.committed_version),
        "target_version": None if receiver.target_version is None else int(receiver.target_version),
        "apply_calls": int(receiver.apply_calls),
    }


def label_of(replies: Sequence[Any]) -> str | None:
    """The weight-version label of the ranks' replies (module docstring); None: leave it."""
    states: list[dict[str, Any]] = [
        r["weights"] for r in replies if isinstance(r, dict) and isinstance(r.get("weights"), dict)
    ]
    if not replies or len(states) != len(replies):
        return None
    if all(s["state"] == "clean" for s in states):
        committed = {s["committed_version"] for s in states}
        return str(committed.pop()) if len(committed) == 1 else None
    targets = [s["target_version"] for s in states if s["target_version"] is not None]
    target = max(targets) if targets else max(s["committed_version"] for s in states) + 1
    applies = max(int(s.get("apply_calls", 0)) for s in states)
    return f"{target}{UNCOMMITTED}.{applies}"


def stamping_collective_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EngineCore.collective_rpc`` that, after a ``dcr_*`` method, sets the engine core's
    ``weight_version`` from the replies (`label_of`), before the engine can step again."""

    @functools.wraps(original)
    def collective_rpc(
        self: Any,
        method: Any,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = original(self, method, timeout, args, kwargs)
        if isinstance(method, str) and method.startswith("dcr_adapter_") and isinstance(out, list):
            from vllm_dcr_plugin import adapters

            adapters.activate_from(method, out)  # the adapter an alias resolves to
        if isinstance(method, str) and method.startswith("dcr_") and isinstance(out, list):
            label = label_of(out)
            if label is not None and label != self.get_weight_version():
                log.info("dcr: weight_version %s after %s", label, method)
                self.set_weight_version(label)
        return out

    return collective_rpc
