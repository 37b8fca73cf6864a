"""DCRWorkerExtension: the RPC surface DCR adds to every vLLM worker.

vLLM mixes this class into its worker class (``--worker-extension-cls
vllm_dcr_plugin.DCRWorkerExtension``); an orchestrator calls the methods with
``llm.collective_rpc("dcr_info")`` / ``engine.collective_rpc(...)``. Every method is prefixed
``dcr_`` so it cannot collide with worker attributes, takes and returns plain values only
(str, int, float, bytes, lists and dicts of those), and runs on every worker rank.

Errors: a DCR error (bad arguments, wrong order, loader condition) is returned as
``{"ok": False, "error": "..."}`` on every rank rather than raised (see `_rpc`). Arguments are
validated and normalised here, at the RPC boundary: a bad argument (wrong type or count, an
unknown store kind, a dtype the codec does not carry, a negative version) is a
``ProtocolError`` reply and changes nothing.

RPCs (the protocol is docs/protocol.md): ``dcr_info``, ``dcr_prewarm``, ``dcr_stage``,
``dcr_fetch``, ``dcr_apply``, ``dcr_commit``, ``dcr_abort``, ``dcr_digest``, ``dcr_dense_load``, ``dcr_metrics``, ``dcr_status``.

Limitations:
1. The request gate checks that the worker holds no request state; the orchestrator closes the
   gate (sync RL: between generations; async RL: ``pause_generation``) and resets the prefix
   cache after apply (``llm.reset_prefix_cache()``), see docs/protocol.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from shared_codec.errors import DCRError, ProtocolError
from vllm_dcr_plugin import PLUGIN_VERSION, cpu_compat, registration_count
from vllm_dcr_plugin.receiver import Receiver
from vllm_dcr_plugin.staging import SealedSet, tensor_specs

# Resolving this class is how vLLM tells a worker process that it serves DCR: enable the CPU
# loader condition before the worker loads its model.
cpu_compat.mark_dcr_enabled()


F = TypeVar("F", bound=Callable[..., dict[str, Any]])

_ARG_ERRORS = (ValueError, TypeError, KeyError)


def _rpc(fn: F) -> F:
    """Return DCR errors as ``{"ok": False, "error": ...}`` instead of raising.

    An exception raised on some ranks of a multi-rank ``collective_rpc`` leaves the other ranks'
    replies queued in vLLM's executor, so the next call would read stale replies. Every dcr_ RPC
    therefore answers on every rank; successful answers carry ``"ok": True``. Arguments that do
    not bind to the method's signature (a wrong count, an unknown keyword) are a
    `ProtocolError` reply too; each method validates its arguments' values in `_arguments`.
    """
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            with _arguments(fn.__name__):
                signature.bind(self, *args, **kwargs)
            out = fn(self, *args, **kwargs)
        except DCRError as e:
            rank = getattr(self, "rank", 0)
            return {"ok": False, "rank": int(rank), "error": f"{type(e).__name__}: {e}"}
        out.setdefault("ok", True)
        return out

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def _arguments(method: str) -> Iterator[None]:
    """Argument parsing of one RPC: a bad-argument error (ValueError, TypeError, KeyError)
    becomes `ProtocolError` (the call changed nothing). Only argument parsing runs inside."""
    try:
        yield
    except _ARG_ERRORS as e:
        raise ProtocolError(f"{method}: bad arguments: {type(e).__name__}: {e}") from None


def _int(v: Any, what: str) -> int:
    """A non-negative integer: ints, or decimal strings (vLLM's HTTP ``/collective_rpc``)."""
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise TypeError(f"{what} must be an integer, got {type(v).__name__}")
    n = int(v)
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    return n


def _bool(v: Any, what: str) -> bool:
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "0", "false", "no", ""):
        return v.strip().lower() in ("1", "true", "yes")
    if isinstance(v, bool | int) and int(v) in (0, 1):
        return bool(v)
    raise ValueError(f"{what} must be a boolean, got {v!r:.40}")


def _seconds(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise TypeError(f"{what} must be a number of seconds, got {type(v).__name__}")
    t = float(v)
    if not t > 0:  # also NaN
        raise ValueError(f"{what} must be > 0, got {v!r}")
    return t


_SPEC_KEYS = {"dir": ("root",), "spool": ("root",), "s3": ("bucket",)}


def _store_spec(v: Any) -> dict[str, Any]:
    """A store spec (dict or its JSON text) of a known kind with its required fields."""
    spec = json.loads(v) if isinstance(v, str) else v
    if not isinstance(spec, dict):
        raise TypeError(f"store spec must be a JSON object, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind not in _SPEC_KEYS:
        raise ValueError(f"store spec kind must be one of {sorted(_SPEC_KEYS)}, got {kind!r}")
    for key in _SPEC_KEYS[kind]:
        if not isinstance(spec.get(key), str) or not spec[key]:
            raise KeyError(f"a {kind!r} store spec needs a non-empty string {key!r}")
    return dict(spec)


def _apply_opts(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise TypeError(f"apply must be a dict or None, got {type(v).__name__}")
    unknown = set(v) - {"verify"}
    if unknown:
        raise ValueError(f"apply takes only 'verify', got {sorted(unknown)}")
    return {"verify": _bool(v.get("verify", False), "apply.verify")}


_EXPECT_KEYS = {"version", "base_version", "payload_ids"}


def _expect(v: Any, attempt: int) -> SealedSet | None:
    """The sealed set `dcr_apply` is held to: ``{"version": int, "base_version": int or None,
    "payload_ids": [hex, ...]}`` (the attempt's manifest), or None. Ids that are not 32 hex
    digits or are listed twice are a `ProtocolError` (staging.SealedSet.of)."""
    if v is None:
        return None
    if isinstance(v, str):
        v = json.loads(v)
    if not isinstance(v, dict):
        raise TypeError(f"expect must be a dict or None, got {type(v).__name__}")
    if set(v) != _EXPECT_KEYS:
        raise ValueError(f"expect takes exactly {sorted(_EXPECT_KEYS)}, got {sorted(map(str, v))}")
    ids = v["payload_ids"]
    if not isinstance(ids, list | tuple) or not all(isinstance(i, str) for i in ids):
        raise TypeError("expect.payload_ids must be a list of hex strings")
    base = v["base_version"]
    return SealedSet.of(
        version=_int(v["version"], "expect.version"),
        attempt=attempt,
        base_version=None if base is None else _int(base, "expect.base_version"),
        payload_ids=ids,
    )


def _payloads(v: Any) -> list[bytes]:
    if not isinstance(v, list | tuple) or not all(
        isinstance(p, bytes | bytearray | memoryview) for p in v
    ):
        raise TypeError("payloads must be a list of bytes")
    return list(v)


def _directory(v: Any, what: str) -> str:
    if not isinstance(v, str) or not os.path.isdir(v):
        raise ValueError(f"{what} must name an existing directory, got {v!r:.200}")
    return v


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DCRWorkerExtension:
    """Mixed into vLLM's worker; see the module docstring for the calling convention."""

    def _dcr_model(self) -> torch.nn.Module:
        runner = getattr(self, "model_runner", None)
        model = getattr(runner, "model", None)
        if model is None:
            raise ProtocolError("the worker has no loaded model (call after engine start)")
        return model

    def _dcr_ranks(self) -> dict[str, int]:
        from vllm.distributed import parallel_state as ps

        return {
            "rank": int(getattr(self, "rank", 0)),
            "tp_rank": int(ps.get_tensor_model_parallel_rank()),
            "tp_size": int(ps.get_tensor_model_parallel_world_size()),
            "pp_rank": int(ps.get_pp_group().rank_in_group),
            "pp_size": int(ps.get_pp_group().world_size),
        }

    def _dcr_receiver(self) -> Receiver:
        receiver = getattr(self, "_dcr_state", None)
        if receiver is None:
            receiver = Receiver(
                self._dcr_model(),
                rank=self._dcr_ranks(),
                gate=self._dcr_gate,
                loader_condition=self._dcr_loader_condition,
            )
            self._dcr_state = receiver
        return receiver

    def _dcr_gate(self) -> str | None:
        """None when no request runs on this worker, else why the gate is closed."""
        runner = getattr(self, "model_runner", None)
        requests = getattr(runner, "requests", None) or {}
        if requests:
            return (
                f"{len(requests)} request(s) still hold state on this worker; finish or pause "
                "generation before applying"
            )
        return None

    def _dcr_loader_condition(self) -> str | None:
        """None when the native loader keeps weights resident in loader layout."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and not cpu_compat.dcr_enabled():
            return (
                "CPU linear/MoE weights are prepacked (the DCR loader condition is off: "
                f"{cpu_compat.ENV_FLAG}=0 or the plugin was not loaded before the model)"
            )
        return None

    @_rpc
    def dcr_prewarm(self, tensors: list, committed_version: int = 0) -> dict[str, Any]:
        """Register canonical tensors ``[[name, dtype, shape], ...]``, reserve scratch for the
        largest, and trace the native loader once per tensor with all writes into model storage
        suppressed. Returns the capability report (skipped, overwrite_only, unsupported)."""
        with _arguments("dcr_prewarm"):
            tensor_specs(tensors)
            version = _int(committed_version, "committed_version")
        return self._dcr_receiver().prewarm(tensors, version)

    @_rpc
    def dcr_stage(self, payloads: list) -> dict[str, Any]:
        """Validate, deduplicate and keep payloads (bytes); returns staged/duplicates/rejected."""
        with _arguments("dcr_stage"):
            items = _payloads(payloads)
        return self._dcr_receiver().stage(items)

    @_rpc
    def dcr_fetch(
        self,
        store: str,
        version: int,
        attempt: int,
        timeout_s: float = 60.0,
        apply: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Fetch the attempt's payloads from an object store and stage them. `store` is a JSON
        store spec (``{"kind": "dir", "root": ...}``, ``{"kind": "s3", "bucket": ...,
        "endpoint_url": ...}`` or a relay node's ``{"kind": "spool", "root": ...}``); every rank
        fetches for itself. With `apply` (``{"verify": bool}``) the fetch is pipelined: payloads
        are fetched as they appear and each is applied once staged; the attempt's ACK is
        returned under ``"ack"``."""
        with _arguments("dcr_fetch"):
            spec = _store_spec(store)
            args = (_int(version, "version"), _int(attempt, "attempt"))
            timeout = _seconds(timeout_s, "timeout_s")
            opts = _apply_opts(apply)
        return self._dcr_receiver().fetch(spec, *args, timeout, opts)

    @_rpc
    def dcr_apply(
        self, attempt: int, verify: bool = False, expect: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Apply every staged payload of `attempt` in place through ``load_weights``; the ACK
        reports items, elements, bytes, timings and post-apply mismatches (``verify``). With
        `expect` (the attempt's manifest: ``{"version", "base_version", "payload_ids": [hex,
        ...]}``) the attempt must hold exactly that payload set, or nothing is applied."""
        with _arguments("dcr_apply"):
            a = _int(attempt, "attempt")
            args = (a, _bool(verify, "verify"), _expect(expect, a))
        return self._dcr_receiver().apply(*args)

    @_rpc
    def dcr_commit(self, version: int) -> dict[str, Any]:
        """The coordinator committed `version`: the receiver's committed version advances."""
        with _arguments("dcr_commit"):
            v = _int(version, "version")
        return self._dcr_receiver().commit(v)

    @_rpc
    def dcr_abort(self, attempt: int) -> dict[str, Any]:
        """Fence `attempt`: drop its staged payloads and refuse its late ones."""
        with _arguments("dcr_abort"):
            a = _int(attempt, "attempt")
        return self._dcr_receiver().abort(a)

    @_rpc
    def dcr_digest(self) -> dict[str, Any]:
        """Per-rank digest of every parameter and buffer (by name) plus a combined digest."""
        return self._dcr_receiver().digest()

    @_rpc
    def dcr_dense_load(self, path: str, version: int = 0) -> dict[str, Any]:
        """Dense refit from a canonical checkpoint directory through ``load_weights``; the
        receiver is then clean at `version`."""
        with _arguments("dcr_dense_load"):
            args = (_directory(path, "path"), _int(version, "version"))
        return self._dcr_receiver().dense_load(*args)

    @_rpc
    def dcr_memory(self, reset_peak: bool = False) -> dict[str, Any]:
        """RSS and peak RSS of this worker process (peak reset first with `reset_peak`)."""
        with _arguments("dcr_memory"):
            reset = _bool(reset_peak, "reset_peak")
        return self._dcr_receiver().memory(reset)

    @_rpc
    def dcr_metrics(self) -> dict[str, Any]:
        """This rank's Prometheus metrics: ``{"text": exposition, "port": port or None}``
        (vllm_dcr_plugin/metrics.py; ``DCR_METRICS_PORT`` also serves them over HTTP)."""
        m = self._dcr_receiver().metrics
        return {"rank": int(getattr(self, "rank", 0)), "text": m.text(), "port": m.server_port}

    @_rpc
    def dcr_status(self) -> dict[str, Any]:
        """Receiver state: clean/applied/dirty, versions, staged payloads and bytes."""
        return self._dcr_receiver().status()

    @_rpc
    def dcr_info(self) -> dict[str, Any]:
        """Versions, ranks and the rank-local parameters/buffers (name -> shape, dtype).

        Returns a plain dict: ``plugin_version``, ``format_version``, ``vllm_version``, the rank
        fields, ``cpu_compat`` (loader-condition state), ``plugin_registrations`` (how often vLLM
        called the general plugin's ``register()`` in this worker process), ``parameters`` and ``buffers`` (lists of
        ``[name, shape, dtype]``). Callable on every rank; no side effects.
        """
        import vllm

        from shared_codec import FORMAT_VERSION

        model = self._dcr_model()
        params = [[n, list(p.shape), _dtype_name(p.dtype)] for n, p in model.named_parameters()]
        buffers = [[n, list(b.shape), _dtype_name(b.dtype)] for n, b in model.named_buffers()]
        return {
            "plugin_version": PLUGIN_VERSION,
            "format_version": FORMAT_VERSION,
            "vllm_version": vllm.__version__,
            **self._dcr_ranks(),
            "cpu_compat": cpu_compat.status(),
            "plugin_registrations": registration_count(),
            "parameters": params,
            "buffers": buffers,
        }
