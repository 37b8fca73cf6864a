"""Orchestrator-side helper around the DCR RPCs of one vLLM engine.

`DCRClient(engine, timeout_s=600)` wraps anything with ``collective_rpc`` and
``reset_prefix_cache`` (``LLM``, ``LLMEngine``; for ``AsyncLLM`` await the engine's own methods
with the same RPC names). It checks every rank's ``ok``, raises `DCRError` with the ranks'
errors, and resets the prefix cache after every apply or dense load, because KV and prefix
caches hold activations computed with the old weights (docs/protocol.md, "Request gate and
caches").

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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from shared_codec.errors import DCRError, EngineUnreachable

T = TypeVar("T")


class DCRClient:
    """Calls dcr_ RPCs on every rank of one engine and checks the replies."""

    def __init__(self, engine: Any, *, timeout_s: float = 600.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.engine = engine
        self.timeout_s = float(timeout_s)
        self.dead: str | None = None  # why the engine is dead to this client

    def _bounded(self, what: str, fn: Callable[[], T], timeout_s: float) -> T:
        """`fn()` on a helper thread, waited for at most `timeout_s`: its result, or its error
        as raised; `EngineUnreachable` when it did not return in time or the engine failed."""
        if self.dead is not None:
            raise EngineUnreachable(f"{what}: the engine is dead to this client ({self.dead})")
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller below
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name=f"dcr-client-{what}", daemon=True).start()
        if not done.wait(timeout_s):
            self.dead = f"{what} did not return within {timeout_s:.0f}s"
            raise EngineUnreachable(
                f"{what}: no answer within {timeout_s:.0f}s (a worker or the engine core is "
                "dead or hung); restart the engine and retry with overwrites"
            )
        err = box.get("error")
        if err is None:
            return box["value"]  # type: ignore[no-any-return]
        if isinstance(err, DCRError | ValueError | TypeError):
            raise err  # an answer: the engine is alive
        # vLLM's failures of a dead worker or engine core: EngineDeadError, "Executor
        # failed", "Call to collective_rpc method failed: cancelled", TimeoutError
        self.dead = f"{what} failed: {type(err).__name__}: {err}"
        raise EngineUnreachable(
            f"{what}: the engine failed ({type(err).__name__}: {err}); restart the engine "
            "and retry with overwrites"
        ) from err

    def _rpc(self, method: str, args: tuple, kwargs: dict | None, deadline_s: float | None) -> Any:
        timeout = self.timeout_s if deadline_s is None else float(deadline_s)
        return self._bounded(
            method,
            lambda: self.engine.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs),
            timeout + 5.0,  # vLLM's own timeout first, when it works
        )

    def _reset_prefix_cache(self) -> None:
        self._bounded("reset_prefix_cache", self.engine.reset_prefix_cache, self.timeout_s)

    def call(
        self, method: str, *args: Any, deadline_s: float | None = None, **kwargs: Any
    ) -> list[dict[str, Any]]:
        """Run `method` on every rank (`args`, `kwargs`: the RPC's) within `deadline_s` (the
        client's `timeout_s` by default); raise DCRError naming the failing ranks."""
        replies = self._rpc(method, args, kwargs or None, deadline_s)
        failed = [r for r in replies if not r.get("ok", False)]
        if failed:
            detail = "; ".join(f"rank {r.get('rank')}: {r.get('error')}" for r in failed)
            raise DCRError(f"{method} failed on {len(failed)}/{len(replies)} ranks: {detail}")
        return replies  # type: ignore[no-any-return]

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
        try:
            acks = self._rpc("dcr_apply", (attempt,), kwargs, deadline_s)
        finally:
            if self.dead is None:
                self._reset_prefix_cache()
        bad = [a for a in acks if not a.get("ok")]
        if bad:
            raise DCRError(
                f"dcr_apply attempt {attempt} failed: "
                + "; ".join(f"rank {a.get('rank')}: {a.get('error')}" for a in bad)
            )
        return acks  # type: ignore[no-any-return]

    def commit(self, version: int) -> list[dict[str, Any]]:
        return self.call("dcr_commit", version)

    def abort(self, attempt: int) -> list[dict[str, Any]]:
        return self.call("dcr_abort", attempt)

    def dense_load(self, path: str, version: int) -> list[dict[str, Any]]:
        try:
            return self.call("dcr_dense_load", path, version)
        finally:
            if self.dead is None:
                self._reset_prefix_cache()

    def digests(self) -> list[str]:
        return [r["digest"] for r in self.call("dcr_digest")]
