"""The ``dcr_*`` RPC channels to vLLM engines (rpc_channel.py), and the engine handles built
on them (handle.py):

- `HttpChannel` / `HttpEngine`: one ``vllm serve`` engine (all its ranks), through vLLM's own
  HTTP API only: ``POST /collective_rpc`` (the dev endpoints, enabled with
  ``VLLM_SERVER_DEV_MODE=1``), ``POST /reset_prefix_cache`` and ``GET /health``. Payloads never
  pass through HTTP: ``dcr_fetch`` makes every worker fetch the attempt from the source spec.
  A launcher (``dcr_tools.procs.ServeProcess`` for local engines) returns the base URL of a
  restarted engine.
- `RayChannel` / `RayEngine`: an engine that runs as a Ray actor (``ray.remote(LLM)`` or an
  ``AsyncLLM`` actor) with the DCR worker extension: the RPCs go through the actor's own
  ``collective_rpc``; the launcher returns a new actor handle.
- `InProcessChannel` / `InProcessEngine`: an ``LLM`` (or ``LLMEngine``) in this process. vLLM's
  synchronous client waits for the engine core without a bound (after a TP worker died
  mid-apply, ``reset_prefix_cache`` was seen waiting forever), so every call runs on a helper
  thread and is waited for at most its deadline; a worker that dies or hangs raises
  `EngineUnreachable` naming the call, and the engine is then dead to the channel (every later
  call is refused at once).

`HttpEngine`, `RayEngine` and `InProcessEngine` are each a handle over itself as its channel.

Limitations:
1. The dev endpoints must not be exposed beyond the trusted control network (vLLM warns at
   start); put an authenticating proxy in front of them in production.
2. A restart needs a launcher; without one `restore` of a dead or out-of-step engine raises.
3. Ray needs ``ray`` in the coordinator's process (imported on first call).
4. An in-process call that missed its deadline keeps its helper thread (a daemon) until vLLM
   returns, if ever; the engine is unusable by then.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from shared_codec.coordination.handle import EngineHandle
from shared_codec.coordination.rpc_channel import RpcChannel
from shared_codec.errors import DCRError, EngineUnreachable

T = TypeVar("T")


class HttpChannel(RpcChannel):
    """``dcr_*`` RPCs over a ``vllm serve``'s HTTP API (module docstring)."""

    def __init__(
        self, base_url: str, *, store: Any, launcher: Callable[[], str] | None = None
    ) -> None:
        super().__init__(store=store, launcher=launcher)
        self.base_url = base_url.rstrip("/")

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

    def _collective(
        self, method: str, args: list[Any], kwargs: Mapping[str, Any] | None, timeout: float
    ) -> Any:
        body: dict[str, Any] = {"method": method, "args": args, "timeout": timeout}
        if kwargs:
            body["kwargs"] = dict(kwargs)
        try:
            out = self._post("/collective_rpc", body, timeout + 30)
        except EngineUnreachable as e:
            if "timed out" in str(e):  # inside vLLM's executor: its late reply is queued
                self.out_of_step = f"{method} timed out inside vLLM ({e})"
            raise
        return out.get("results") if isinstance(out, dict) else out

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout) as resp:
                return resp.status == 200  # type: ignore[no-any-return]
        except (urllib.error.URLError, OSError):
            return False

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache", None, 60)

    def _launch(self) -> None:
        assert self.launcher is not None
        self.base_url = str(self.launcher()).rstrip("/")


class HttpEngine(EngineHandle, HttpChannel):
    """The handle of one ``vllm serve`` engine, over its own `HttpChannel`.

    `store`: the source spec the workers fetch from; `checkpoint_for(version)`: a canonical
    checkpoint directory of a committed version (dense loads on restore); `tensors`: the
    canonical tensor table for ``dcr_prewarm``; `launcher`: starts a replacement engine and
    returns its base URL; `pipelined`, `verify`: `EngineHandle`'s."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        store: Any,
        checkpoint_for: Callable[[int], Any],
        tensors: list,
        launcher: Callable[[], str] | None = None,
        verify: bool = False,
        pipelined: bool = True,
    ) -> None:
        HttpChannel.__init__(self, base_url, store=store, launcher=launcher)
        EngineHandle.__init__(
            self,
            name,
            self,
            tensors=tensors,
            checkpoint_for=checkpoint_for,
            verify=verify,
            pipelined=pipelined,
        )


class RayChannel(RpcChannel):
    """``dcr_*`` RPCs through a vLLM Ray actor's ``collective_rpc`` (module docstring). An
    actor that died or does not answer within the call's deadline raises `EngineUnreachable`."""

    def __init__(
        self, actor: Any, *, store: Any, launcher: Callable[[], Any] | None = None
    ) -> None:
        super().__init__(store=store, launcher=launcher)
        self.actor = actor

    def _get(self, ref: Any, timeout: float) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise EngineUnreachable(f"receiver {self.name} (Ray actor): {e}") from None

    def _collective(
        self, method: str, args: list[Any], kwargs: Mapping[str, Any] | None, timeout: float
    ) -> Any:
        extra = {"kwargs": dict(kwargs)} if kwargs else {}
        ref = self.actor.collective_rpc.remote(method, timeout=timeout, args=tuple(args), **extra)
        return self._get(ref, timeout + 30)

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            self._get(self.actor.get_weight_version.remote(), timeout)
            return True
        except EngineUnreachable:
            return False

    def reset_prefix_cache(self) -> None:
        self._get(self.actor.reset_prefix_cache.remote(), 60)

    def _launch(self) -> None:
        assert self.launcher is not None
        self.actor = self.launcher()


class RayEngine(EngineHandle, RayChannel):
    """The handle of one vLLM engine that runs as a Ray actor, over its own `RayChannel`
    (arguments as `HttpEngine`'s; `launcher` returns a new actor handle)."""

    def __init__(
        self,
        name: str,
        actor: Any,
        *,
        store: Any,
        checkpoint_for: Callable[[int], Any],
        tensors: list,
        launcher: Callable[[], Any] | None = None,
        verify: bool = False,
        pipelined: bool = True,
    ) -> None:
        RayChannel.__init__(self, actor, store=store, launcher=launcher)
        EngineHandle.__init__(
            self,
            name,
            self,
            tensors=tensors,
            checkpoint_for=checkpoint_for,
            verify=verify,
            pipelined=pipelined,
        )


class InProcessChannel(RpcChannel):
    """``dcr_*`` RPCs on an ``LLM`` / ``LLMEngine`` in this process, each call bounded by its
    deadline (module docstring). `timeout_s`: the deadline of calls that do not name one."""

    def __init__(
        self,
        engine: Any,
        *,
        timeout_s: float = 600.0,
        store: Any = None,
        launcher: Callable[[], Any] | None = None,
    ) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise ValueError(f"timeout_s must be a number of seconds, got {timeout_s!r:.40}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        super().__init__(store=store, launcher=launcher)
        self.engine = engine
        self.timeout_s = float(timeout_s)

    def refusal(self, method: str) -> str:
        return f"{method}: the engine is dead to this client ({self.out_of_step})"

    def bounded(self, what: str, fn: Callable[[], T], timeout_s: float) -> T:
        """`fn()` on a helper thread, waited for at most `timeout_s`: its result, or its error
        as raised; `EngineUnreachable` when it did not return in time or the engine failed
        (the engine is then dead to this channel)."""
        if self.out_of_step:
            raise EngineUnreachable(self.refusal(what))
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
            self.out_of_step = f"{what} did not return within {timeout_s:.0f}s"
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
        self.out_of_step = f"{what} failed: {type(err).__name__}: {err}"
        raise EngineUnreachable(
            f"{what}: the engine failed ({type(err).__name__}: {err}); restart the engine "
            "and retry with overwrites"
        ) from err

    def _collective(
        self, method: str, args: list[Any], kwargs: Mapping[str, Any] | None, timeout: float
    ) -> Any:
        kw = dict(kwargs) if kwargs else None
        return self.bounded(
            method,
            lambda: self.engine.collective_rpc(
                method, timeout=timeout, args=tuple(args), kwargs=kw
            ),
            timeout + 5.0,  # vLLM's own timeout first, when it works
        )

    def healthy(self, timeout: float = 5.0) -> bool:
        return not self.out_of_step

    def reset_prefix_cache(self) -> None:
        if not self.out_of_step:  # a dead engine's cache is gone with it
            self.bounded("reset_prefix_cache", self.engine.reset_prefix_cache, self.timeout_s)

    def _launch(self) -> None:
        assert self.launcher is not None
        self.engine = self.launcher()


class InProcessEngine(EngineHandle, InProcessChannel):
    """The handle of an ``LLM`` in this process (a coordinator and its engine in one process),
    over its own `InProcessChannel`; `launcher` returns a new ``LLM``."""

    def __init__(
        self,
        name: str,
        engine: Any,
        *,
        store: Any,
        checkpoint_for: Callable[[int], Any] | None,
        tensors: list,
        launcher: Callable[[], Any] | None = None,
        verify: bool = False,
        pipelined: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        InProcessChannel.__init__(self, engine, timeout_s=timeout_s, store=store, launcher=launcher)
        EngineHandle.__init__(
            self,
            name,
            self,
            tensors=tensors,
            checkpoint_for=checkpoint_for,
            verify=verify,
            pipelined=pipelined,
        )


__all__ = [
    "HttpChannel",
    "HttpEngine",
    "InProcessChannel",
    "InProcessEngine",
    "RayChannel",
    "RayEngine",
]
