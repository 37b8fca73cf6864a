"""Orchestrator-side helper around the DCR RPCs of one vLLM engine.

`DCRClient(engine)` wraps anything with ``collective_rpc`` and ``reset_prefix_cache`` (``LLM``,
``LLMEngine``; for ``AsyncLLM`` await the engine's own methods with the same RPC names). It
checks every rank's ``ok``, raises `DCRError` with the ranks' errors, and resets the prefix
cache after every apply or dense load, because KV and prefix caches hold activations computed
with the old weights (docs/protocol.md, "Request gate and caches").
"""

from __future__ import annotations

from typing import Any

from shared_codec.errors import DCRError


class DCRClient:
    """Calls dcr_ RPCs on every rank of one engine and checks the replies."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """Run `method` on every rank; raise DCRError naming the failing ranks."""
        replies = self.engine.collective_rpc(method, args=args, kwargs=kwargs or None)
        failed = [r for r in replies if not r.get("ok", False)]
        if failed:
            detail = "; ".join(f"rank {r.get('rank')}: {r.get('error')}" for r in failed)
            raise DCRError(f"{method} failed on {len(failed)}/{len(replies)} ranks: {detail}")
        return replies

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
        self, attempt: int, verify: bool = False, expect: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """Apply the attempt on every rank, then invalidate the prefix cache (always, since a
        failed apply leaves partially written weights too). Raises if any ACK is not ok.
        `expect`: the attempt's sealed set (``dcr_apply``'s, docs/protocol.md)."""
        kwargs: dict[str, Any] = {"verify": verify}
        if expect is not None:
            kwargs["expect"] = expect
        try:
            acks = self.engine.collective_rpc("dcr_apply", args=(attempt,), kwargs=kwargs)
        finally:
            self.engine.reset_prefix_cache()
        bad = [a for a in acks if not a.get("ok")]
        if bad:
            raise DCRError(
                f"dcr_apply attempt {attempt} failed: "
                + "; ".join(f"rank {a.get('rank')}: {a.get('error')}" for a in bad)
            )
        return acks

    def commit(self, version: int) -> list[dict[str, Any]]:
        return self.call("dcr_commit", version)

    def abort(self, attempt: int) -> list[dict[str, Any]]:
        return self.call("dcr_abort", attempt)

    def dense_load(self, path: str, version: int) -> list[dict[str, Any]]:
        try:
            return self.call("dcr_dense_load", path, version)
        finally:
            self.engine.reset_prefix_cache()

    def digests(self) -> list[str]:
        return [r["digest"] for r in self.call("dcr_digest")]
