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
``dcr_fetch``, ``dcr_apply``, ``dcr_commit``, ``dcr_abort``, ``dcr_digest``, ``dcr_dense_load``,
``dcr_verify_plan``, ``dcr_set_placement``, ``dcr_metrics``, ``dcr_status``, and for LoRA
adapters (adapters.py) ``dcr_adapter_load``, ``dcr_adapter_fetch``, ``dcr_adapter_commit``,
``dcr_adapter_abort``, ``dcr_adapter_status``.

Limitations:
1. An engine with a speculative draft model (MTP, EAGLE, a draft model) is refused at
   ``dcr_prewarm`` and ``dcr_dense_load``: these RPCs refit the base model only; the native
   backend ``dcr`` refits the draft in the same transition (transfer/worker_engine.py).
2. The request gate checks that the worker holds no request state; the orchestrator closes the
   gate (sync RL: between generations; async RL: ``pause_generation``). The prefix cache is
   salted by weight version in the engine core (prefix_salt.py; every reply's ``weights``
   feeds the version, versions.py), so no reset is needed; with ``DCR_PREFIX_SALT=0`` the
   orchestrator resets it after apply (``llm.reset_prefix_cache()``), see docs/protocol.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from shared_codec.errors import DCRError, ProtocolError
from vllm_dcr_plugin import adapters, cpu_compat, device, patches
from vllm_dcr_plugin import worker as dcr_worker
from vllm_dcr_plugin.arguments import apply_opts as _apply_opts
from vllm_dcr_plugin.arguments import arguments as _arguments
from vllm_dcr_plugin.arguments import boolean as _bool
from vllm_dcr_plugin.arguments import checkpoint as _checkpoint
from vllm_dcr_plugin.arguments import directory as _directory
from vllm_dcr_plugin.arguments import integer as _int
from vllm_dcr_plugin.arguments import json_object as _json
from vllm_dcr_plugin.arguments import name as _name
from vllm_dcr_plugin.arguments import payloads as _payloads
from vllm_dcr_plugin.arguments import seconds as _seconds
from vllm_dcr_plugin.arguments import transport_spec as _transport_spec
from vllm_dcr_plugin.placement import MODES
from vllm_dcr_plugin.plugin import PLUGIN_VERSION, registration_count
from vllm_dcr_plugin.staging import SealedSet, tensor_specs
from vllm_dcr_plugin.versions import weights_state

log = logging.getLogger("dcr.extension")

if TYPE_CHECKING:
    from vllm_dcr_plugin.receiver import Receiver

# Resolving this class is how vLLM tells a worker process that it serves DCR: enable the CPU
# loader condition before the worker loads its model.
cpu_compat.mark_dcr_enabled()


F = TypeVar("F", bound=Callable[..., dict[str, Any]])


def _rpc(fn: F) -> F:
    """Return DCR errors as ``{"ok": False, "error": ...}`` instead of raising.

    An exception raised on some ranks of a multi-rank ``collective_rpc`` leaves the other ranks'
    replies queued in vLLM's executor, so the next call would read stale replies. Every dcr_ RPC
    therefore answers on every rank; successful answers carry ``"ok": True``. Every answer
    names its RPC (``"rpc"``): a call that timed out inside vLLM's executor still answers later,
    and the next call reads that late answer (vLLM 0.32's replies are not tagged), so a handle
    can tell a stale reply from its own (`shared_codec.coordination.engines`). Arguments that do
    not bind to the method's signature (a wrong count, an unknown keyword) are a
    `ProtocolError` reply too; each method validates its arguments' values in `_arguments`.
    Any other exception (a defect, an OS error) is an ``ok: False`` reply as well, with
    ``"internal": True`` and its traceback logged on that rank, for the same reason: it must
    not leave the other ranks' replies behind. (The methods mark the receiver dirty themselves
    when weights may have moved.)
    """
    signature = inspect.signature(fn)
    accepted = ", ".join(p for p in signature.parameters if p != "self")

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            with _arguments(fn.__name__):
                try:
                    signature.bind(self, *args, **kwargs)
                except TypeError as e:  # names the argument, or says what the RPC takes
                    raise TypeError(f"{e}; {fn.__name__} takes ({accepted})") from None
            out = fn(self, *args, **kwargs)
        except DCRError as e:
            return _error_reply(self, fn.__name__, e, internal=False)
        except Exception as e:
            log.exception("dcr: %s failed on rank %s", fn.__name__, getattr(self, "rank", 0))
            return _error_reply(self, fn.__name__, e, internal=True)
        out.setdefault("ok", True)
        out["rpc"] = fn.__name__
        return _with_weights(self, out)

    return wrapper  # type: ignore[return-value]


def _error_reply(worker: Any, rpc: str, e: Exception, *, internal: bool) -> dict[str, Any]:
    """The ``ok: False`` reply of `rpc` on this rank (`_rpc`); ``internal`` marks a defect."""
    reply: dict[str, Any] = {
        "ok": False,
        "rank": int(getattr(worker, "rank", 0)),
        "error": f"{type(e).__name__}: {e}",
        "rpc": rpc,
    }
    if internal:
        reply["internal"] = True
    return _with_weights(worker, reply)


def _with_weights(worker: Any, reply: dict[str, Any]) -> dict[str, Any]:
    """Every reply carries its rank's weights state (``"weights"``), from which the engine core
    stamps vLLM's ``weight_version`` (versions.py); none before the receiver exists."""
    receiver = dcr_worker.existing_receiver(worker)
    if receiver is not None:
        reply["weights"] = weights_state(receiver)
    return reply


_EXPECT_KEYS = {"version", "base_version", "payload_ids"}


def _expect(v: Any, attempt: int) -> SealedSet | None:
    """The sealed set `dcr_apply` is held to: ``{"version": int, "base_version": int or None,
    "payload_ids": [hex, ...]}`` (the attempt's manifest), or None. Ids that are not 32 hex
    digits or are listed twice are a `ProtocolError` (staging.SealedSet.of)."""
    if v is None:
        return None
    v = _json(v, "expect")
    if not isinstance(v, dict):
        raise TypeError(f"expect must be a dict or None, got {type(v).__name__}")
    if set(v) != _EXPECT_KEYS:
        raise ValueError(f"expect takes exactly {sorted(_EXPECT_KEYS)}, got {sorted(map(str, v))}")
    ids = v["payload_ids"]
    if not isinstance(ids, list | tuple) or not all(isinstance(i, str) for i in ids):
        raise TypeError("expect.payload_ids must be a list of hex strings")
    base = v["base_version"]
    version = _int(v["version"], "expect.version")
    base_version = None if base is None else _int(base, "expect.base_version")
    try:
        return SealedSet.of(
            version=version, attempt=attempt, base_version=base_version, payload_ids=ids
        )
    except ProtocolError as e:
        raise ProtocolError(f"expect.payload_ids: {e}") from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DCRWorkerExtension:
    """Mixed into vLLM's worker; see the module docstring for the calling convention."""

    def _dcr_model(self) -> torch.nn.Module:
        return dcr_worker.receiver_of(self).model

    def _dcr_receiver(self) -> Receiver:
        return dcr_worker.receiver_of(self)

    def _dcr_base_only(self, rpc: str) -> None:
        """`ProtocolError` on an engine that runs a speculative draft: these RPCs refit the
        base model only, which would leave the draft stale."""
        if dcr_worker.draft_model(self) is not None:
            raise ProtocolError(
                f"{rpc}: this engine runs a speculative draft model, and the dcr_* RPCs refit "
                "only the base model (the draft would go stale); refit it through vLLM's "
                "weight-transfer API with backend 'dcr' (--weight-transfer-config "
                '\'{"backend": "dcr"}\'), which refits both in one transition'
            )

    @_rpc
    def dcr_prewarm(self, tensors: list, committed_version: int = 0) -> dict[str, Any]:
        """Register canonical tensors ``[[name, dtype, shape], ...]``, reserve scratch for the
        largest, and trace the native loader once per tensor with all writes into model storage
        suppressed. Returns the capability report (skipped, overwrite_only, unsupported)."""
        with _arguments("dcr_prewarm"):
            tensor_specs(tensors)
            version = _int(committed_version, "committed_version")
        self._dcr_base_only("dcr_prewarm")
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
        fetches for itself; a `version` not after the committed one is refused at once. With
        `apply` (``{"verify": bool}``) the fetch is pipelined: payloads
        are fetched as they appear and each is applied once staged; the attempt's ACK is
        returned under ``"ack"``."""
        with _arguments("dcr_fetch"):
            spec = _transport_spec(store, "store")
            args = (_int(version, "version"), _int(attempt, "attempt"))
            timeout = _seconds(timeout_s, "timeout_s")
            opts = _apply_opts(apply)
            self._dcr_receiver().check_version(args[0], "version")
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
        receiver is then clean at `version`. `path` may be a replica's checkpoint URL
        (shared_codec/replica/client.py): it is downloaded first, then loaded and removed."""
        from shared_codec.replica.client import local_checkpoint

        with _arguments("dcr_dense_load"):
            version = _int(version, "version")  # before any download
        self._dcr_base_only("dcr_dense_load")
        with local_checkpoint(path) as local:
            with _arguments("dcr_dense_load"):
                checked = _checkpoint(local, "path")
                self._dcr_receiver().check_checkpoint(checked, "path")
            return self._dcr_receiver().dense_load(checked, version)

    @_rpc
    def dcr_verify_plan(self) -> dict[str, Any]:
        """Re-trace the native loader and compare the placement plan with the fresh trace
        (vllm_dcr_plugin/placement.py); the fresh plan is kept. Returns ``matches``,
        ``differences`` ({tensor: why}), ``stale_before`` and the plan counts."""
        return self._dcr_receiver().verify_plan()

    @_rpc
    def dcr_set_placement(self, mode: str) -> dict[str, Any]:
        """``"plan"`` (default: replay the recorded placement) or ``"loader"`` (every item
        through ``load_weights``, counted as fall backs); returns ``previous`` and
        ``placement``. The start-up default comes from ``DCR_PLACEMENT`` (config.py)."""
        with _arguments("dcr_set_placement"):
            if not isinstance(mode, str):
                raise TypeError(f"mode must be a string, got {type(mode).__name__}")
            if mode not in MODES:
                raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        return self._dcr_receiver().set_placement(mode)

    @_rpc
    def dcr_memory(self, reset_peak: bool = False) -> dict[str, Any]:
        """RSS and peak RSS of this worker process (peak reset first with `reset_peak`)."""
        with _arguments("dcr_memory"):
            reset = _bool(reset_peak, "reset_peak")
        return self._dcr_receiver().memory(reset)

    @_rpc
    def dcr_metrics(self) -> dict[str, Any]:
        """This rank's Prometheus metrics: ``{"text": exposition, "port": port or None}``
        (vllm_dcr_plugin/metrics.py; ``DCR_METRICS_PORT``, config.py, also serves them over
        HTTP)."""
        m = self._dcr_receiver().metrics
        return {"rank": int(getattr(self, "rank", 0)), "text": m.text(), "port": m.server_port}

    # -- LoRA adapters (adapters.py) -----------------------------------------------------------
    @_rpc
    def dcr_adapter_load(self, alias: str, path: str, version: int = 0) -> dict[str, Any]:
        """Dense-load the PEFT adapter directory `path` as committed `version` of `alias` and
        activate it (the engine core resolves requests naming `alias` to it once every rank
        answered). Needs an engine started with LoRA enabled."""
        with _arguments("dcr_adapter_load"):
            name = _name(alias, "alias")
            checked = _directory(path, "path")
            v = _int(version, "version")
        return adapters.receiver_of(self).load(name, checked, v)

    @_rpc
    def dcr_adapter_fetch(
        self, alias: str, store: str, version: int, attempt: int, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        """Fetch an attempt of `alias`'s next version from `store` (a JSON store or spool spec),
        apply it to a copy of the committed adapter and add it to vLLM's LoRA manager as the
        candidate; requests keep using the committed version until ``dcr_adapter_commit``."""
        with _arguments("dcr_adapter_fetch"):
            name = _name(alias, "alias")
            spec = _transport_spec(store, "store")
            v, a = _int(version, "version"), _int(attempt, "attempt")
            timeout = _seconds(timeout_s, "timeout_s")
        return adapters.receiver_of(self).fetch(name, spec, v, a, timeout)

    @_rpc
    def dcr_adapter_commit(self, alias: str, version: int) -> dict[str, Any]:
        """The candidate of `version` becomes `alias`'s committed, active version; versions
        beyond ``DCR_ADAPTER_LIVE_VERSIONS`` (default 2) leave vLLM's LoRA manager."""
        with _arguments("dcr_adapter_commit"):
            name, v = _name(alias, "alias"), _int(version, "version")
        return adapters.receiver_of(self).commit(name, v)

    @_rpc
    def dcr_adapter_abort(self, alias: str, attempt: int) -> dict[str, Any]:
        """Fence `attempt` of `alias`; its candidate leaves vLLM's LoRA manager and the
        committed version stays active."""
        with _arguments("dcr_adapter_abort"):
            name, a = _name(alias, "alias"), _int(attempt, "attempt")
        return adapters.receiver_of(self).abort(name, a)

    @_rpc
    def dcr_adapter_status(self) -> dict[str, Any]:
        """Every adapter alias on this rank (committed version, live versions, candidate) and
        the digest of every adapter vLLM's LoRA manager holds (``loaded``, by lora id)."""
        return {"rank": int(getattr(self, "rank", 0)), **adapters.receiver_of(self).status()}

    @_rpc
    def dcr_status(self) -> dict[str, Any]:
        """Receiver state: clean/applied/dirty, versions, staged payloads and bytes."""
        return self._dcr_receiver().status()

    @_rpc
    def dcr_info(self) -> dict[str, Any]:
        """Versions, ranks and the rank-local parameters/buffers (name -> shape, dtype).

        Returns a plain dict: ``plugin_version``, ``format_version``, ``vllm_version``, the rank
        fields, ``cpu_compat`` (loader-condition state), ``patches`` (every patch of vLLM
        internals: name, target, pinned version, active; vllm_dcr_plugin/patches.py),
        ``plugin_registrations`` (how often vLLM called the general plugin's ``register()`` in
        this worker process), ``parameters`` and ``buffers`` (lists of ``[name, shape,
        dtype]``), ``storage`` (parameter name, ``buffer:<name>`` for a buffer -> ``data_ptr()``;
        applies keep every address, which CUDA graphs captured: vllm_dcr_plugin/device.py).
        Callable on every rank; no side effects.
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
            **dcr_worker.ranks(self),
            "cpu_compat": {
                "installed": all(patches.active(p.name) for p in patches.PATCHES if p.cpu_only),
                **cpu_compat.status(),
            },
            "patches": patches.status(),
            "plugin_registrations": registration_count(),
            "parameters": params,
            "buffers": buffers,
            "storage": device.storage_pointers(model),
        }
