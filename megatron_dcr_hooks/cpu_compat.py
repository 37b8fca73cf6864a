"""CPU layer for megatron-core trainer processes (megatron-core 0.16.1 and 0.19.2, torch 2.13 CPU).

megatron-core assumes CUDA in ~200 call sites. This layer lets unmodified megatron-core code
(parallel_state over gloo, GPTModel with the local spec, Megatron DDP, the Megatron optimizers,
MoE dispatchers) run on CPU, so the owner side is tested against real Megatron, not a fake:

1. ``torch.cuda.current_device`` -> ``"cpu"``; ``synchronize``/``empty_cache``/nvtx -> no-ops;
   CUDA streams and events -> inert objects (MoE dispatchers create them).
2. The tensor-parallel RNG tracker runs on the CPU generator (``torch.cuda.*rng*`` and
   megatron's ``_get/_set_cuda_rng_state`` map onto ``torch.get/set_rng_state``).
3. A process-wide ``TorchFunctionMode`` turns ``device="cuda"`` / ``.cuda()`` into CPU and makes
   ``Tensor.type()`` report ``torch.cuda.*Tensor`` for CPU float tensors (the Megatron optimizers
   check parameter types by that string).
4. MoE: ``moe_utils.te_general_gemm = None`` (NameError when Transformer Engine is absent),
   all-to-all split sizes (numpy arrays on CPU) converted to int lists for gloo, and
   ``torch.cuda.FloatTensor``-style constructors produce CPU tensors.
5. ``SPRMSNorm``: the local spec's norm (``torch.nn.RMSNorm`` via WrappedTorchNorm) refuses
   sequence parallelism, which MoE with TP > 1 requires; this subclass accepts it and marks its
   weight ``sequence_parallel`` so ``finalize_model_grads`` all-reduces its gradient over TP.

Limitations:
1. Apply only in trainer processes, never in a vLLM process (it rewrites ``torch.cuda``);
   ``enable()`` refuses when vllm has been imported.
2. Checked on megatron-core 0.16.1 (Python 3.11) and 0.19.2 (Python 3.12) only; other versions
   raise CompatibilityError. 0.19.2 needed nothing beyond what 0.16.1 needed (docs/cpu-compat.md).
3. No Transformer Engine, no FP8, no CUDA graphs, no fused kernels: configs must turn fusions
   off (``bias_activation_fusion``, ``masked_softmax_fusion``, ``apply_rope_fusion``, ...).
4. Always call ``finalize_model_grads`` before ``optimizer.step()`` (otherwise replicated
   q/k layernorm weights drift apart across TP ranks).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from shared_codec.errors import CompatibilityError

#: megatron-core versions this layer was checked on (the owner suite passes on each)
CHECKED_MEGATRON_CORE: tuple[str, ...] = ("0.16.1", "0.19.2")

_state: dict[str, Any] = {"enabled": False, "mode": None}


class _InertStream:
    """Stands in for torch.cuda.Stream / ExternalStream on CPU: all work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _InertEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _InertStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _InertEvent:
    """Stands in for torch.cuda.Event on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU and reports CPU tensors' type() as CUDA types."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = args[0]
            if t.device.type == "cpu" and t.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[t.dtype]
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _int_splits(fn: Any) -> Any:
    """Wrap all_to_all_single: MoE dispatch keeps split sizes as numpy arrays on CPU, and gloo's
    binding accepts only int sequences (also reached from autograd backward, outside any mode)."""

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):  # noqa: A002,ANN001
        if output_split_sizes is not None:
            output_split_sizes = [int(x) for x in output_split_sizes]
        if input_split_sizes is not None:
            input_split_sizes = [int(x) for x in input_split_sizes]
        return fn(output, input, output_split_sizes, input_split_sizes, *a, **k)

    all_to_all_single.__wrapped__ = fn  # type: ignore[attr-defined]
    return all_to_all_single


def _cpu_tensor_ctor(dtype: torch.dtype):
    def ctor(*args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) == 1 and isinstance(args[0], list | tuple):
            return torch.tensor(args[0], dtype=dtype)
        return torch.empty(*args, dtype=dtype)

    return ctor


def check_version() -> str:
    """Return the megatron-core version or raise CompatibilityError if it was not checked."""
    import importlib.metadata

    # the distribution's version: megatron-core >= 0.17's ``package_info.__version__`` appends
    # the git hash of whatever repository contains site-packages (a venv inside a checkout)
    version = importlib.metadata.version("megatron-core")
    if version not in CHECKED_MEGATRON_CORE:
        raise CompatibilityError(
            f"megatron_dcr_hooks.cpu_compat was checked on megatron-core "
            f"{' and '.join(CHECKED_MEGATRON_CORE)}, found {version}; re-check "
            "docs/cpu-compat.md before enabling it"
        )
    return version


def enable() -> None:
    """Apply the CPU layer to this (trainer) process. Idempotent.

    Call before building models or optimizers. Raises CompatibilityError inside a vLLM process
    and on an unchecked megatron-core version.
    """
    if _state["enabled"]:
        return
    if "vllm" in sys.modules:
        raise CompatibilityError(
            "megatron_dcr_hooks.cpu_compat must not be enabled in a process that imported vllm"
        )
    if torch.cuda.is_available():
        return  # real CUDA: nothing to emulate
    check_version()
    cuda: Any = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 0
    cuda.Stream = _InertStream
    cuda.ExternalStream = _InertStream
    cuda.Event = _InertEvent
    cuda.current_stream = lambda *a, **k: _InertStream()
    cuda.default_stream = lambda *a, **k: _InertStream()
    cuda.stream = lambda *a, **k: nullcontext()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.FloatTensor = _cpu_tensor_ctor(torch.float32)
    cuda.HalfTensor = _cpu_tensor_ctor(torch.float16)
    cuda.BFloat16Tensor = _cpu_tensor_ctor(torch.bfloat16)
    cuda.LongTensor = _cpu_tensor_ctor(torch.int64)
    cuda.IntTensor = _cpu_tensor_ctor(torch.int32)
    nvtx: Any = cuda.nvtx
    nvtx.range_push = lambda *a, **k: None
    nvtx.range_pop = lambda *a, **k: None
    nvtx.range = lambda *a, **k: nullcontext()

    torch.distributed.all_to_all_single = _int_splits(torch.distributed.all_to_all_single)

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    try:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    except ImportError:  # pragma: no cover - MoE optional
        pass

    mode = CudaToCpuMode()
    mode.__enter__()
    _state["mode"] = mode
    _state["enabled"] = True


def is_enabled() -> bool:
    """Whether `enable()` has run in this process."""
    return bool(_state["enabled"])


class SPRMSNorm(torch.nn.RMSNorm):
    """RMSNorm that accepts sequence parallelism (weight replicated, grads all-reduced over TP).

    Constructed like megatron's ``WrappedTorchNorm``: ``(config, hidden_size, eps)``.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))  # noqa: B010
