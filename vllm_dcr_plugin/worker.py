"""DCR's glue inside a vLLM worker process: which worker this process runs, whether its engine's
generation is paused, and the worker's one `Receiver`, shared by both front doors (the
``dcr_*`` RPCs of `DCRWorkerExtension` and the native weight-transfer engine ``dcr``).

`install()` runs from the general plugin's ``register()`` in every vLLM process and wraps three
methods of vLLM's ``Worker`` class (the CPU worker inherits them):

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
1. Pause detection follows vLLM 0.32's pause protocol (checked by cpu_compat.check_version's
   pin); ``wake_up`` also synchronizes, so a woken engine counts as paused until its next step.
2. A resume followed by an apply before the next step is not detected; vLLM runs the apply
   between two steps either way, so the running requests continue on the new weights.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch

from shared_codec.errors import ProtocolError
from vllm_dcr_plugin import cpu_compat

if TYPE_CHECKING:
    from vllm_dcr_plugin.receiver import Receiver

logger = logging.getLogger(__name__)

BACKEND = "dcr"

_state: dict[str, Any] = {"installed": False, "worker": None, "paused": False}


def install() -> bool:
    """Wrap vLLM's Worker methods (idempotent). Returns True when installed now."""
    if _state["installed"]:
        return False
    from vllm.v1.worker.gpu_worker import Worker

    load_model = Worker.load_model
    synchronize_device = Worker.synchronize_device
    execute_model = Worker.execute_model

    @functools.wraps(load_model)
    def dcr_load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state["worker"] = weakref.ref(self)
        transfer = getattr(getattr(self, "vllm_config", None), "weight_transfer_config", None)
        if getattr(transfer, "backend", None) == BACKEND:
            cpu_compat.mark_dcr_enabled()
        return load_model(self, *args, **kwargs)

    @functools.wraps(synchronize_device)
    def dcr_synchronize_device(self: Any) -> None:
        synchronize_device(self)
        _state["paused"] = True

    @functools.wraps(execute_model)
    def dcr_execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(scheduler_output, "total_num_scheduled_tokens", 0) > 0:
            _state["paused"] = False
        return execute_model(self, scheduler_output, *args, **kwargs)

    Worker.load_model = dcr_load_model  # type: ignore[method-assign]
    Worker.synchronize_device = dcr_synchronize_device  # type: ignore[method-assign]
    Worker.execute_model = dcr_execute_model  # type: ignore[method-assign]
    _state["installed"] = True
    return True


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
    requests = getattr(getattr(worker, "model_runner", None), "requests", None) or {}
    return {"requests": len(requests), "paused": paused()}


def gate(worker: Any) -> str | None:
    """None when applying is allowed on this worker, else why the request gate is closed."""
    requests = getattr(getattr(worker, "model_runner", None), "requests", None) or {}
    if requests and not paused():
        return (
            f"{len(requests)} request(s) still hold state on this worker and generation is "
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


def receiver_of(worker: Any) -> Receiver:
    """The worker's one Receiver (created on first use); both front doors share it."""
    receiver = getattr(worker, "_dcr_state", None)
    if receiver is None:
        from vllm_dcr_plugin.receiver import Receiver

        receiver = Receiver(
            _model(worker),
            rank=ranks(worker),
            gate=lambda: gate(worker),
            loader_condition=loader_condition,
        )
        worker._dcr_state = receiver
    return receiver
