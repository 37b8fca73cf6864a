"""Orchestrator-side helper around the DCR RPCs of one vLLM engine.

`DCRClient(engine, timeout_s=600)` wraps anything with ``collective_rpc`` and
``reset_prefix_cache`` (``LLM``, ``LLMEngine``; for ``AsyncLLM`` await the engine's own methods
with the same RPC names). It checks every rank's ``ok``, raises `DCRError` with the ranks'
errors, and resets the prefix cache after every apply or dense load, because KV and prefix
caches hold activations computed with the old weights. The engine core's version salt makes
this reset redundant (and vLLM refuses it while keep-mode requests hold blocks); it stays for
engines with salting off (docs/protocol.md, "Request gate and caches").

Deadlines: every call (the RPC and the cache reset after it) returns or raises within
`timeout_s` (per call: ``deadline_s=``). vLLM bounds the workers' side of ``collective_rpc`` with
its ``timeout`` argument, but its synchronous engine client waits for the engine core without a
bound (after a TP worker died mid-apply, ``reset_prefix_cache`` was seen waiting forever), so the
client waits for each call on a helper thread. A worker that dies or hangs, or an engine core
that is gone, raises `EngineUnreachable` naming the call, and the client refuses every later
call at once (the engine is dead to it): restart the engine, bring it to the committed version
(a new engine loads it; ``dense_load`` otherwise), prewarm, and retry the attempt with
overwrites (docs/operations.md, failure playbook).

Limitations:
1. A call that missed its deadline keeps its helper thread (a daemon) until vLLM returns, if
   ever; the engine is unusable by then.
2. This is the orchestrator's helper; a coordinator drives an in-process engine through
   `shared_codec.coordination.engines.InProcessEngine` (the same channel).
"""

from __future__ import annotations

from typing import Any

from shared_codec.coordination.engines import InProcessChannel
from shared_codec.errors import DCRError


class DCRClient:
    """Calls dcr_ RPCs on every rank of one engine and checks the replies (module docstring);
    the calls go through an `InProcessChannel`, the coordinator's in-process channel."""

    def __init__(self, engine: Any, *, timeout_s: float = 600.0) -> None:
        self.channel = InProcessChannel(engine, timeout_s=timeout_s)
        self.engine = engine
        self.timeout_s = self.channel.timeout_s

    @property
    def dead(self) -> str | None:
        """Why the engine is dead to this client (None while it is not)."""
        return self.channel.out_of_step or None

    def call(
        self, method: str, *args: Any, deadline_s: float | None = None, **kwargs: Any
    ) -> list[dict[str, Any]]:
        """Run `method` on every rank (`args`, `kwargs`: the RPC's) within `deadline_s` (the
        client's `timeout_s` by default); raise DCRError naming the failing ranks."""
        timeout = self.timeout_s if deadline_s is None else float(deadline_s)
        replies = self.channel.call_ok(method, args, timeout, kwargs or None)
        return [r.to_wire() for r in replies]

    def prewarm(self, tensors: list, committed_version: int = 0) -> list[dict[str, Any]]:
        return self.call("dcr_prewarm", tensors, committed_version)

    def overwrite_only(self, reports: list[dict[str, Any]]) -> set[str]:
        """Tensors any rank needs as OVERWRITE items (the owners' `DCRConfig.overwrite_only`)."""
        out: set[str] = set()
        for r in reports:
            out |= set(r["overwrite_only"])
        return out

    def stage(self, payloads: list[bytes]) -> list[dict[str, Any]]:
        """Stage payloads on every rank; raise if any rank rejected one."""
        replies = self.call("dcr_stage", payloads)
        rejected = [x for r in replies for x in r["rejected"]]
        if rejected:
            raise DCRError(f"{len(rejected)} payload rejection(s): {rejected[0]['reason']}")
        return replies

    def apply(
        self,
        attempt: int,
        verify: bool = False,
        expect: dict[str, Any] | None = None,
        *,
        deadline_s: float | None = None,
    ) -> list[dict[str, Any]]:
        """Apply the attempt on every rank, then invalidate the prefix cache (always, since a
        failed apply leaves partially written weights too; not on a dead engine). Raises if
        any ACK is not ok. `expect`: the attempt's sealed set (``dcr_apply``'s,
        docs/protocol.md)."""
        kwargs: dict[str, Any] = {"verify": verify}
        if expect is not None:
            kwargs["expect"] = expect
        timeout = self.timeout_s if deadline_s is None else float(deadline_s)
        try:
            acks = self.channel.call("dcr_apply", (attempt,), timeout, kwargs)
        finally:
            self.channel.reset_prefix_cache()
        bad = [a for a in acks if not a.ok]
        if bad:
            raise DCRError(
                f"dcr_apply attempt {attempt} failed: "
                + "; ".join(f"rank {a.rank}: {a.error}" for a in bad)
            )
        return [a.to_wire() for a in acks]

    def commit(self, version: int) -> list[dict[str, Any]]:
        return self.call("dcr_commit", version)

    def abort(self, attempt: int) -> list[dict[str, Any]]:
        return self.call("dcr_abort", attempt)

    def dense_load(self, path: str, version: int) -> list[dict[str, Any]]:
        try:
            return self.call("dcr_dense_load", path, version)
        finally:
            self.channel.reset_prefix_cache()

    def digests(self) -> list[str]:
        return [d.digest for d in self.channel.digests()]
