"""Drive DCR on vLLM engines through their worker extension: coordinator handles for a
``vllm serve`` engine (`HttpEngine`, over HTTP) and for an engine running as a Ray actor
(`RayEngine`, through the actor's ``collective_rpc``).

`HttpEngine` is the `shared_codec.coordination.coordinator.Receiver` of one ``vllm serve`` engine (all its
ranks). It uses only vLLM's own HTTP API: ``POST /collective_rpc`` (the dev endpoints, enabled
with ``VLLM_SERVER_DEV_MODE=1``) to call the ``dcr_`` RPCs, ``POST /reset_prefix_cache`` after
every apply or dense load, and ``GET /health``. Payloads never pass through HTTP: ``dcr_fetch``
makes every worker fetch the attempt from the object store named by the store spec.

A launcher (``dcr_tools.procs.ServeProcess`` for local engines) restarts a dead engine on
`HttpEngine.restore`.

Replies out of step: a ``collective_rpc`` that times out inside vLLM's executor (vLLM 0.32,
multiprocess executor) still answers later, and the next call reads that late answer instead of
its own (vLLM's replies are not tagged). Every dcr_ RPC names itself in its reply (``"rpc"``);
a handle that sees a timed-out call or a reply naming another RPC marks the engine out of step:
every later call raises `EngineUnreachable` at once (so the coordinator fences and restores
it), and `restore` restarts it (its launcher) before the dense load - a restart is the only
way to bring the replies back in step.

Limitations:
1. The dev endpoints must not be exposed beyond the trusted control network (vLLM warns at
   start); put an authenticating proxy in front of them in production.
2. `restore` restarts a dead or out-of-step engine only when a launcher was given; otherwise
   it raises.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from shared_codec.errors import DCRError, EngineUnreachable


class HttpEngine:
    """Coordinator handle for one ``vllm serve`` engine (see the module docstring).

    `store`: store spec the workers fetch from; `checkpoint_for(version)`: a canonical
    checkpoint directory of a committed version (dense loads on restore); `tensors`: the
    canonical tensor table for ``dcr_prewarm`` (``[[name, dtype, shape], ...]``); `launcher`:
    starts a replacement engine and returns its base URL. `pipelined` (default): `apply` is one
    pipelined ``dcr_fetch`` (each payload applied as it arrives; the coordinator starts it while
    the owners build); ``False``: fetch everything, then ``dcr_apply`` with the attempt's
    sealed set as ``expect`` when this process can read the seal (object stores; a relay
    spool is on the rollout node, whose fetch records the seal itself). Recovery tests arm
    faults in the engine's environment instead (``DCR_FAULT_PLAN``, vllm_dcr_plugin.faults).
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        store: dict[str, Any],
        checkpoint_for: Callable[[int], str],
        tensors: list,
        launcher: Callable[[], str] | None = None,
        verify: bool = False,
        pipelined: bool = True,
    ) -> None:
        self.name = name
        self.pipelined = pipelined
        self.base_url = base_url.rstrip("/")
        self.store = json.dumps(store, sort_keys=True)
        self.checkpoint_for = checkpoint_for
        self.tensors = tensors
        self.launcher = launcher
        self.verify = verify
        self.last: dict[str, Any] = {}
        self.out_of_step = ""  # why this engine's replies cannot be trusted (module docstring)

    # -- HTTP ----------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise EngineUnreachable(
                f"receiver {self.name}: POST {path} -> HTTP {e.code}: {e.read()[:300]!r}"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            raise EngineUnreachable(
                f"receiver {self.name} unreachable at {self.base_url}: {e}"
            ) from None
        return json.loads(raw) if raw else None

    def _call(self, method: str, args: list[Any], timeout: float) -> list[dict[str, Any]]:
        """vLLM's ``collective_rpc`` of `method` on every rank: the per-rank replies."""
        self._in_step(method)
        try:
            out = self._post(
                "/collective_rpc",
                {"method": method, "args": args, "timeout": timeout},
                timeout + 30,
            )
        except EngineUnreachable as e:
            if "timed out" in str(e):  # inside vLLM's executor: its late reply is queued
                self.out_of_step = f"{method} timed out inside vLLM ({e})"
            raise
        replies = (out or {}).get("results")
        if not isinstance(replies, list) or not all(isinstance(r, dict) for r in replies):
            raise DCRError(f"receiver {self.name}: {method} returned {out!r}")
        return self._own(method, replies)

    def _in_step(self, method: str) -> None:
        if self.out_of_step:
            raise EngineUnreachable(
                f"receiver {self.name}: not calling {method}: its replies are out of step "
                f"({self.out_of_step}); restore (restart) the engine"
            )

    def _own(self, method: str, replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`replies` if they answer `method` (replies without ``"rpc"``: an older plugin);
        else the engine is out of step (module docstring) and this raises."""
        stale = sorted({str(r["rpc"]) for r in replies if r.get("rpc") not in (None, method)})
        if stale:
            self.out_of_step = f"{method} read the late reply of an earlier {', '.join(stale)}"
            raise EngineUnreachable(
                f"receiver {self.name}: {self.out_of_step} (vLLM's collective_rpc replies are "
                "out of step after a call timed out); restore (restart) the engine"
            )
        return replies

    def rpc(self, method: str, *args: Any, timeout: float = 600.0) -> list[dict[str, Any]]:
        """Call a dcr_ RPC on every rank; raise DCRError naming the receiver and failing ranks."""
        replies = self._call(method, list(args), timeout)
        bad = [r for r in replies if not r.get("ok")]
        if bad:
            raise DCRError(
                f"receiver {self.name}: {method} failed on "
                + "; ".join(f"rank {r.get('rank')}: {r.get('error')}" for r in bad)
            )
        return replies

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache", None, 60)

    # -- coordinator Engine protocol -----------------------------------------------------------
    def prewarm(self, version: int) -> list[dict[str, Any]]:
        return self.rpc("dcr_prewarm", self.tensors, version)

    def apply(self, version: int, attempt: int, timeout_s: float) -> dict[str, Any]:
        """Fetch + stage on every rank, then apply; the merged ACK of all ranks. Pipelined (the
        default): one ``dcr_fetch`` call that applies payloads as they arrive (those already
        waiting together), so it can be
        started while the owners still build. A fetch the engine answered with an error (a
        missing or rejected payload) is a failed ACK; an engine that does not answer raises
        `EngineUnreachable`."""
        t0 = time.perf_counter()
        opts = {"verify": self.verify} if self.pipelined else None
        answered = False  # the engine answered the apply: no health probe before the reset
        try:
            try:
                fetched = self.rpc(
                    "dcr_fetch",
                    self.store,
                    version,
                    attempt,
                    timeout_s,
                    opts,
                    timeout=timeout_s,
                )
            except EngineUnreachable:
                raise
            except DCRError as e:
                self.last = {"ok": False, "error": f"fetch failed: {e}", "ranks": []}
                return self.last
            t1 = time.perf_counter()
            if opts is not None:
                acks = [f["ack"] for f in fetched]
                t1 = t0 + max(float(f.get("fetch_seconds", 0.0)) for f in fetched)
            else:
                try:
                    expect = self._sealed(version, attempt, timeout_s)
                except DCRError as e:  # the manifest the engines fetched is unreadable here
                    self.last = {"ok": False, "error": f"seal unreadable: {e}", "ranks": []}
                    return self.last
                acks = self._call("dcr_apply", [attempt, self.verify, expect], timeout_s)
            answered = True
        finally:
            if answered or self.healthy():
                self.reset_prefix_cache()  # also after a failed apply: weights may be partial
        errors = [f"rank {a.get('rank')}: {a.get('error')}" for a in acks if not a.get("ok")]
        merged: dict[str, Any] = {
            "ok": not errors,
            "error": "; ".join(errors) or None,
            "ranks": acks,
            "pipelined": opts is not None,
            "fetch_s": t1 - t0,  # pipelined: until the last payload arrived (applies overlap)
            "apply_s": time.perf_counter() - t1,  # pipelined: the tail after the last payload
            "fetched_bytes": sum(int(f.get("bytes", 0)) for f in fetched),
            "payloads": max((int(f.get("payloads", 0)) for f in fetched), default=0),
            "elements_written": sum(int(a.get("elements_written", 0)) for a in acks),
        }
        self.last = merged
        return merged

    def _sealed(self, version: int, attempt: int, timeout_s: float) -> dict[str, Any] | None:
        """``dcr_apply``'s `expect`: the set the attempt's manifest names (docs/protocol.md,
        "Exactly once"), read from an object store; None for a relay spool (not readable here:
        the engines' fetch recorded the node's manifest notice)."""
        spec = json.loads(self.store)
        if spec.get("kind") not in ("dir", "s3"):
            return None
        from shared_codec.transport.seam import open_source

        sealed = open_source(spec).sealed(version, attempt, timeout_s)
        return {
            "version": sealed.version,
            "base_version": sealed.base_version,
            "payload_ids": list(sealed.payload_ids),
        }

    def commit(self, version: int) -> None:
        self.rpc("dcr_commit", version)

    def abort(self, attempt: int) -> None:
        self.rpc("dcr_abort", attempt)

    def digest(self) -> str:
        """One digest of the engine: SHA-256 over the ranks' combined digests in rank order."""
        replies = sorted(self.rpc("dcr_digest"), key=lambda r: int(r.get("rank", 0)))
        h = hashlib.sha256()
        for r in replies:
            h.update(str(r["digest"]).encode())
        return h.hexdigest()

    def restore(self, version: int) -> None:
        """Restart the engine if it died (needs a launcher), dense-load committed `version`,
        prewarm; the receiver is then clean at `version`."""
        relaunched = False
        if self.out_of_step or not self.healthy():
            why = f"out of step ({self.out_of_step})" if self.out_of_step else "down"
            if self.launcher is None:
                raise DCRError(f"receiver {self.name} is {why} and has no launcher to restart it")
            self._relaunch()
            self.out_of_step, relaunched = "", True
        try:
            self.rpc("dcr_dense_load", self.checkpoint_for(version), version)
        except EngineUnreachable:
            # a worker that died can leave the API server answering /health for a moment while
            # its executor is already shut down (vLLM: "collective_rpc should not be called on
            # follower node"): restart it once, then load
            if relaunched or self.launcher is None:
                raise
            self._relaunch()
            self.out_of_step = ""
            self.rpc("dcr_dense_load", self.checkpoint_for(version), version)
        self.reset_prefix_cache()
        self.prewarm(version)

    def _relaunch(self) -> None:
        assert self.launcher is not None
        self.base_url = self.launcher().rstrip("/")


class RayEngine(HttpEngine):
    """Coordinator handle for one vLLM engine that runs as a Ray actor (``ray.remote(LLM)`` or an
    ``AsyncLLM`` actor) with the DCR worker extension: the ``dcr_`` RPCs go through the actor's
    own ``collective_rpc`` (vLLM's executor fans them out to the workers) and the prefix cache
    is reset through its ``reset_prefix_cache``; everything else is `HttpEngine`'s.

    `launcher` returns a new actor handle (`restore` of a dead actor). An actor that died or
    does not answer within the call's deadline raises `EngineUnreachable`.

    Limitations:
    1. Needs ``ray`` in the coordinator's process (imported on first call).
    """

    def __init__(
        self,
        name: str,
        actor: Any,
        *,
        store: dict[str, Any],
        checkpoint_for: Callable[[int], str],
        tensors: list,
        launcher: Callable[[], Any] | None = None,
        verify: bool = False,
        pipelined: bool = True,
    ) -> None:
        super().__init__(
            name,
            f"ray-actor://{name}",
            store=store,
            checkpoint_for=checkpoint_for,
            tensors=tensors,
            verify=verify,
            pipelined=pipelined,
        )
        self.actor = actor
        self.launcher = launcher

    def _get(self, ref: Any, timeout: float) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise EngineUnreachable(f"receiver {self.name} (Ray actor): {e}") from None

    def _call(self, method: str, args: list[Any], timeout: float) -> list[dict[str, Any]]:
        self._in_step(method)
        ref = self.actor.collective_rpc.remote(method, timeout=timeout, args=tuple(args))
        replies = self._get(ref, timeout + 30)
        if not isinstance(replies, list) or not all(isinstance(r, dict) for r in replies):
            raise DCRError(f"receiver {self.name}: {method} returned {replies!r}")
        return self._own(method, replies)

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            self._get(self.actor.get_weight_version.remote(), timeout)
            return True
        except EngineUnreachable:
            return False

    def reset_prefix_cache(self) -> None:
        self._get(self.actor.reset_prefix_cache.remote(), 60)

    def _relaunch(self) -> None:
        assert self.launcher is not None
        self.actor = self.launcher()
