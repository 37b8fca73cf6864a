"""`RpcChannel`: the receiver contract over DCR's ``dcr_*`` RPCs and vLLM's ``collective_rpc``,
the base of the HTTP, Ray and in-process channels (engines.py).

A subclass supplies the transport: `_collective` (one ``collective_rpc`` call: the raw per-rank
replies), `healthy`, `reset_prefix_cache` and, optionally, a launcher. This base turns the
contract into RPCs:

- `load`: ``dcr_dense_load`` (then the prefix cache is reset) and ``dcr_prewarm``;
- `deliver`: pipelined, one ``dcr_fetch`` that applies payloads as they arrive; otherwise
  ``dcr_fetch`` (stage everything), then ``dcr_apply`` held to the attempt's sealed set when
  this process can read the seal (object stores; a relay spool is on the rollout node, whose
  fetch records the seal itself). The prefix cache is reset after every apply (also a failed
  one: weights may be partial), since KV and prefix caches hold activations of the old
  weights;
- `send_commit`, `send_abort`: ``dcr_commit``, ``dcr_abort``; `read_digest`: ``dcr_digest`` of every rank,
  combined by `protocol.engine_digest`.

Replies out of step: a ``collective_rpc`` that times out inside vLLM's executor (vLLM 0.32,
multiprocess executor) still answers later, and the next call reads that late answer instead of
its own (vLLM's replies are not tagged). Every ``dcr_*`` RPC names itself in its reply
(`RankReply.rpc`); a channel that sees a timed-out call or a reply naming another RPC marks the
engine out of step (`out_of_step`): every later call raises `EngineUnreachable` at once (so the
coordinator fences and restores it), and `down` says so, so that the handle's restore restarts
it (its launcher) before the dense load - a restart is the only way to bring the replies back
in step.

Limitations:
1. `store` is the source spec every rank fetches from; ranks of one engine share it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shared_codec.coordination.protocol import (
    DigestReply,
    EngineAck,
    FetchReply,
    RankAck,
    RankReply,
    engine_digest,
)
from shared_codec.errors import DCRError, EngineUnreachable, ProtocolError
from shared_codec.transport.spec import Role, TransportSpec


class RpcChannel:
    """The ``dcr_*`` RPC channel base (module docstring). `store`: the source spec the ranks
    fetch attempts from; `launcher`: restarts the engine (see the subclass for what it
    returns)."""

    name: str = "engine"

    def __init__(self, *, store: Any, launcher: Callable[[], Any] | None = None) -> None:
        spec = TransportSpec.parse(store, role=Role.SOURCE, what="store") if store else None
        self.source = spec
        self.store = spec.to_json() if spec is not None else ""
        self.launcher = launcher
        self.out_of_step = ""  # why this engine's replies cannot be trusted (module docstring)

    # -- the transport (subclasses) ------------------------------------------------------------
    def _collective(
        self, method: str, args: list[Any], kwargs: Mapping[str, Any] | None, timeout: float
    ) -> Any:
        """One ``collective_rpc`` of `method`: the raw replies (a list of dicts)."""
        raise NotImplementedError

    def healthy(self, timeout: float = 5.0) -> bool:
        raise NotImplementedError

    def reset_prefix_cache(self) -> None:
        raise NotImplementedError

    def _launch(self) -> None:
        """Start a replacement engine through `launcher` and point this channel at it."""
        raise NotImplementedError

    def refusal(self, method: str) -> str:
        """Why `method` is not sent to an engine out of step."""
        return (
            f"receiver {self.name}: not calling {method}: its replies are out of step "
            f"({self.out_of_step}); restore (restart) the engine"
        )

    # -- calls ---------------------------------------------------------------------------------
    def call(
        self,
        method: str,
        args: Sequence[Any],
        timeout: float,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[RankReply]:
        """`method` on every rank: each rank's reply, checked (`RankReply`) and its own."""
        if self.out_of_step:
            raise EngineUnreachable(self.refusal(method))
        out = self._collective(method, list(args), kwargs, timeout)
        if not isinstance(out, list) or not all(isinstance(r, dict) for r in out):
            raise DCRError(f"receiver {self.name}: {method} returned {out!r:.300}")
        replies = [RankReply.parse(r, what=f"{method} reply") for r in out]
        stale = sorted({r.rpc for r in replies if r.rpc != method})
        if stale:
            self.out_of_step = f"{method} read the late reply of an earlier {', '.join(stale)}"
            raise EngineUnreachable(
                f"receiver {self.name}: {self.out_of_step} (vLLM's collective_rpc replies are "
                "out of step after a call timed out); restore (restart) the engine"
            )
        return replies

    def call_ok(
        self,
        method: str,
        args: Sequence[Any],
        timeout: float,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[RankReply]:
        """`call`, raising `DCRError` naming every rank that failed."""
        replies = self.call(method, args, timeout, kwargs)
        failed = [r for r in replies if not r.ok]
        if failed:
            raise DCRError(
                f"{method} failed on {len(failed)}/{len(replies)} ranks: "
                + "; ".join(f"rank {r.rank}: {r.error}" for r in failed)
            )
        return replies

    # -- the receiver contract (handle.Channel) ------------------------------------------------
    def load(self, version: int, path: str | None, tensors: list) -> list[Any]:
        if path is not None:
            self.call_ok("dcr_dense_load", [path, version], 600.0)
            self.reset_prefix_cache()
        return self.call_ok("dcr_prewarm", [tensors, version], 600.0)

    def deliver(
        self, version: int, attempt: int, timeout_s: float, *, pipelined: bool, verify: bool
    ) -> EngineAck:
        t0 = time.perf_counter()
        opts = {"verify": verify} if pipelined else None
        answered = False  # the engine answered the apply: no health probe before the reset
        try:
            try:
                replies = self.call_ok(
                    "dcr_fetch", [self.store, version, attempt, timeout_s, opts], timeout_s
                )
            except EngineUnreachable:
                raise
            except DCRError as e:
                return EngineAck.failed(f"fetch failed: receiver {self.name}: {e}")
            fetched = [FetchReply.parse(r.fields(), what="dcr_fetch reply") for r in replies]
            t1 = time.perf_counter()
            if pipelined:
                acks = [_fetched_ack(f, attempt) for f in fetched]
                t1 = t0 + max(f.fetch_seconds for f in fetched)
            else:
                try:
                    expect = self._sealed(version, attempt, timeout_s)
                except DCRError as e:  # the manifest the engines fetched is unreadable here
                    return EngineAck.failed(f"seal unreadable: {e}")
                applied = self.call("dcr_apply", [attempt, verify, expect], timeout_s)
                acks = [_rank_ack(r, attempt) for r in applied]
            answered = True
        finally:
            if answered or self.healthy():
                self.reset_prefix_cache()
        return EngineAck.merge(
            acks,
            pipelined=pipelined,
            fetch_s=t1 - t0,
            apply_s=time.perf_counter() - t1,
            fetched_bytes=sum(f.bytes for f in fetched),
            payloads=max((f.payloads for f in fetched), default=0),
        )

    def _sealed(self, version: int, attempt: int, timeout_s: float) -> dict[str, Any] | None:
        """``dcr_apply``'s `expect`: the set the attempt's manifest names (docs/protocol.md,
        "Exactly once"), read from an object store; None for a relay spool (not readable here:
        the engines' fetch recorded the node's manifest notice)."""
        if self.source is None or self.source.kind not in ("dir", "s3"):
            return None
        sealed = self.source.open_source().sealed(version, attempt, timeout_s)
        return {
            "version": sealed.version,
            "base_version": sealed.base_version,
            "payload_ids": list(sealed.payload_ids),
        }

    def send_commit(self, version: int) -> None:
        self.call_ok("dcr_commit", [version], 600.0)

    def send_abort(self, attempt: int) -> None:
        self.call_ok("dcr_abort", [attempt], 600.0)

    def digests(self) -> list[DigestReply]:
        """Every rank's digest reply."""
        replies = self.call_ok("dcr_digest", [], 600.0)
        return [DigestReply.parse(r.fields(), what="dcr_digest reply") for r in replies]

    def read_digest(self) -> str:
        return engine_digest((d.rank, d.digest) for d in self.digests())

    def down(self) -> str:
        if self.out_of_step:
            return f"out of step ({self.out_of_step})"
        return "" if self.healthy() else "down"

    def can_relaunch(self) -> bool:
        return self.launcher is not None

    def relaunch(self) -> None:
        if self.launcher is None:
            raise ProtocolError(f"receiver {self.name}: no launcher to restart it")
        self._launch()
        self.out_of_step = ""


def _rank_ack(reply: RankReply, attempt: int) -> RankAck:
    """A rank's ``dcr_apply`` answer as its ACK (an RPC that failed before the apply, e.g. a
    bad argument, is a failed ACK naming the error)."""
    if "attempt" in reply.extra:
        return RankAck.parse(reply.fields(), what=f"rank {reply.rank} ACK")
    return RankAck(
        ok=False, attempt=attempt, rank=reply.rank, target_version=None, error=reply.error
    )


def _fetched_ack(fetched: FetchReply, attempt: int) -> RankAck:
    if fetched.ack is None:
        raise ProtocolError(f"rank {fetched.rank}: a pipelined dcr_fetch answered without its ACK")
    return fetched.ack
