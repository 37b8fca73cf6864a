"""DCR's glue inside a vLLM worker process: which worker this process runs, whether its engine's
generation is paused, and the worker's one `Receiver`, shared by both front doors (the
``dcr_*`` RPCs of `DCRWorkerExtension` and the native weight-transfer engine ``dcr``), plus,
when the engine runs speculative decoding with a draft model (MTP layers, EAGLE, a draft
model), the draft's own `Receiver` (`draft_receiver_of`: the native engine's draft sessions).

The general plugin's ``register()`` installs, in every vLLM process, three wrappers of vLLM's
``Worker`` methods (the CPU worker inherits them; the wrappers are here, their installation and
removal is patches.py's table):

- ``load_model`` records the worker instance (the native engine is created inside it and gets
  only the model) and, when the worker's weight-transfer backend is ``"dcr"``, turns on the CPU
  loader condition *before* the model loads (cpu_compat: weights stay resident in loader layout);
- ``synchronize_device``: vLLM's engine core calls it on every worker when a pause completes
  (``EngineCore._finish_pause`` for ``pause_generation`` in every mode), so it marks the engine
  paused;
- ``execute_model`` with scheduled tokens marks it running again (a paused engine schedules
  nothing; after ``resume`` the next step runs).

Request gate (both front doors): an apply or dense load is refused while requests hold state on
this worker *and* the engine is not paused. Sync RL empties the worker (or pauses with
``abort``/``wait``); async RL pauses with ``keep``: the frozen requests keep their state and
continue on the new weights after ``resume``.

Limitations:
1. Pause detection follows vLLM 0.32's pause protocol (the pin of these patches in patches.py);
   ``wake_up`` also synchronizes, so a woken engine counts as paused until its next step.
2. A resume followed by an apply before the next step is not detected; vLLM runs the apply
   between two steps either way, so the running requests continue on the new weights.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shared_codec.errors import ProtocolError
from vllm_dcr_plugin import cpu_compat

if TYPE_CHECKING:
    from vllm_dcr_plugin.receiver import Receiver

logger = logging.getLogger(__name__)

BACKEND = "dcr"

#: what the wrapped Worker methods saw in this process: the worker that loaded its model (a
#: weak reference) and whether the engine completed a pause since its last step
_state: dict[str, Any] = {"worker": None, "paused": False}


def wrap_load_model(load_model: Callable[..., Any]) -> Callable[..., Any]:
    """``Worker.load_model`` recording the worker and, for backend ``dcr``, enabling the CPU
    loader condition before the model loads."""

    @functools.wraps(load_model)
    def dcr_load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state["worker"] = weakref.ref(self)
        transfer = getattr(getattr(self, "vllm_config", None), "weight_transfer_config", None)
        if getattr(transfer, "backend", None) == BACKEND:
            cpu_compat.mark_dcr_enabled()
        return load_model(self, *args, **kwargs)

    return dcr_load_model


def wrap_synchronize_device(synchronize_device: Callable[..., Any]) -> Callable[..., Any]:
    """``Worker.synchronize_device`` marking the engine paused (vLLM calls it when a pause
    completes)."""

    @functools.wraps(synchronize_device)
    def dcr_synchronize_device(self: Any) -> None:
        synchronize_device(self)
        _state["paused"] = True

    return dcr_synchronize_device


def wrap_execute_model(execute_model: Callable[..., Any]) -> Callable[..., Any]:
    """``Worker.execute_model`` marking the engine running again when tokens are scheduled."""

    @functools.wraps(execute_model)
    def dcr_execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(scheduler_output, "total_num_scheduled_tokens", 0) > 0:
            _state["paused"] = False
        return execute_model(self, scheduler_output, *args, **kwargs)

    return dcr_execute_model


def paused() -> bool:
    """Whether this process's engine completed a pause and has not stepped since."""
    return bool(_state["paused"])


def current_worker() -> Any:
    """The vLLM worker of this process (recorded when it loaded its model)."""
    ref = _state["worker"]
    worker = ref() if ref is not None else None
    if worker is None:
        raise ProtocolError("no vLLM worker has loaded a model in this process")
    return worker


def _model(worker: Any) -> torch.nn.Module:
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    if model is None:
        raise ProtocolError("the worker has no loaded model (call after engine start)")
    return model


def held_requests(worker: Any) -> int:
    """How many requests hold state on the worker (its model runner's ``requests``)."""
    return len(getattr(getattr(worker, "model_runner", None), "requests", None) or {})


def ranks(worker: Any) -> dict[str, int]:
    """The worker's global rank and its tensor / pipeline parallel coordinates."""
    from vllm.distributed import parallel_state as ps

    return {
        "rank": int(getattr(worker, "rank", 0)),
        "tp_rank": int(ps.get_tensor_model_parallel_rank()),
        "tp_size": int(ps.get_tensor_model_parallel_world_size()),
        "pp_rank": int(ps.get_pp_group().rank_in_group),
        "pp_size": int(ps.get_pp_group().world_size),
    }


def gate_state(worker: Any) -> dict[str, Any]:
    """What the request gate sees: requests holding state on the worker, and the pause flag."""
    return {"requests": held_requests(worker), "paused": paused()}


def gate(worker: Any) -> str | None:
    """None when applying is allowed on this worker, else why the request gate is closed."""
    requests = held_requests(worker)
    if requests and not paused():
        return (
            f"{requests} request(s) still hold state on this worker and generation is "
            "not paused; finish them or pause generation (pause_generation / POST /pause) "
            "before applying"
        )
    return None


def loader_condition() -> str | None:
    """None when the native loader keeps weights resident in loader layout."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not cpu_compat.dcr_enabled():
        return (
            "CPU linear/MoE weights are prepacked (the DCR loader condition is off: "
            f"{cpu_compat.ENV_FLAG}=0, or neither the DCR worker extension nor the 'dcr' "
            "weight-transfer backend was configured when the model loaded)"
        )
    return None


def existing_receiver(worker: Any) -> Receiver | None:
    """The worker's Receiver if one was created (`receiver_of`), else None."""
    return getattr(worker, "_dcr_state", None)


def receiver_of(worker: Any) -> Receiver:
    """The worker's one Receiver (created on first use, configured from this process's
    environment: config.py); both front doors share it."""
    receiver = getattr(worker, "_dcr_state", None)
    if receiver is None:
        from vllm_dcr_plugin.config import ReceiverConfig
        from vllm_dcr_plugin.receiver import Receiver

        receiver = Receiver(
            _model(worker),
            rank=ranks(worker),
            gate=lambda: gate(worker),
            loader_condition=loader_condition,
            config=ReceiverConfig.from_env(),
        )
        worker._dcr_state = receiver
    return receiver


def draft_model(worker: Any) -> torch.nn.Module | None:
    """The worker's speculative draft model (MTP layers, EAGLE, a draft model), None without
    one (vLLM's ``Worker.get_draft_model``)."""
    get = getattr(worker, "get_draft_model", None)
    return get() if callable(get) else None


def existing_draft_receiver(worker: Any) -> Receiver | None:
    """The worker's draft Receiver if one was created (`draft_receiver_of`), else None."""
    return getattr(worker, "_dcr_draft_state", None)


def draft_receiver_of(worker: Any) -> Receiver:
    """The Receiver of the worker's speculative draft model (created on first use, with the
    base receiver's rank, gate and loader condition, and serving no metrics port). Storage vLLM shares between the draft and
    the target model (an MTP or EAGLE draft's embedding or LM head) is the target receiver's:
    the draft's receiver skips tensors that write only there. `ProtocolError` when the engine
    runs no draft model."""
    receiver = getattr(worker, "_dcr_draft_state", None)
    if receiver is None:
        import dataclasses

        from vllm_dcr_plugin.config import ReceiverConfig
        from vllm_dcr_plugin.receiver import Receiver

        model = draft_model(worker)
        if model is None:
            raise ProtocolError(
                "this engine runs no speculative draft model (start vLLM with "
                "--speculative-config naming an MTP, EAGLE or draft-model method)"
            )
        config = dataclasses.replace(ReceiverConfig.from_env(), metrics_port=None)
        base = receiver_of(worker)  # the same worker: its coordinates, gate and condition
        receiver = Receiver(
            model,
            rank=dict(base.rank),
            gate=base.gate,
            loader_condition=base.loader_condition,
            config=config,
            role="draft",
            shared_with=_model(worker),
        )
        worker._dcr_draft_state = receiver
    return receiver
