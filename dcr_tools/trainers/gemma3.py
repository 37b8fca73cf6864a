"""CPU build of megatron-bridge's Gemma-3 model (``Gemma3ModelProvider``) on megatron-core's
local (non-Transformer-Engine) modules.

What the provider builds (megatron-bridge 0.6.2, ``models/gemma/gemma3_provider.py``), and what
this module uses for it:

- Settings: the provider class's own dataclass defaults (zero-centred RMSNorm gamma, QK-norm,
  ``interleaved_attn_pattern=(5, 1)``, GELU-tanh gated MLP, tied embeddings, ...) under the
  bridge's ``provider_bridge`` record (sliding window, the ``(local, global)`` RoPE bases,
  ``softmax_scale = query_pre_attn_scalar ** -0.5``, the RoPE scaling factor): `provider_defaults`.
- Its own pure-megatron modules, taken from the provider's module as they are:
  ``Gemma3SelfAttention`` (local or global RoPE per layer), ``Gemma3LanguageModelEmbedding``
  (embeddings times sqrt(hidden)), ``Gemma3RotaryEmbedding`` (both RoPE tables) and the
  ``provide()`` step that swaps the last two into the GPTModel (`finish_model`).
- CPU stand-ins for its Transformer Engine modules, with the parameter names the bridge maps:
  ``TELayerNormColumnParallelLinear`` (pre-attention / pre-MLP norm fused into ``linear_qkv`` /
  ``linear_fc1``: ``layer_norm_weight``) -> `LocalLayerNormColumnParallelLinear`;
  megatron-bridge's ``TERowParallelLinearLayerNorm`` (post-attention / post-MLP norm inside
  ``linear_proj`` / ``linear_fc2``: ``post_layernorm.weight``) -> `LocalRowParallelLinearLayerNorm`;
  ``TENorm`` with ``layernorm_zero_centered_gamma`` -> `ZeroCenteredRMSNorm` (``x / rms * (1 + w)``
  in fp32, as transformers' ``Gemma3RMSNorm``); ``Gemma3TEDotProductAttention`` (window
  ``(w - 1, 0)`` on local layers, none on global ones) -> `gemma3_core_attention`, the local
  ``DotProductAttention``, whose softmax builds the sliding-window causal mask itself
  (``FusedScaleMaskSoftmax(window_size=...)``).

Limitations:
1. Text-only ``Gemma3ForCausalLM`` (``is_vision_language`` False); soft-capping is refused (the
   provider has none; Gemma-3 configs carry ``null``), as are HF ``layer_types`` that do not
   follow the provider's hard-coded ``interleaved_attn_pattern`` (the bridge does not read
   ``layer_types``; Megatron would train another model than the checkpoint's).
2. ``LocalRowParallelLinearLayerNorm`` is registered with the bridge's ``AutoMapping`` as a
   row-parallel module, as the bridge registers its TE class (``gemma3_bridge.py``); without it
   AutoMapping's name fallback would call it a norm ("Norm" in the name) and replicate it.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

import torch

PROVIDER = "Gemma3ModelProvider"

#: provider fields that are not ``TransformerConfig`` fields but that the provider's own
#: modules read from the config (``Gemma3SelfAttention``, the core attention)
CONFIG_EXTRAS = ("interleaved_attn_pattern", "is_vision_language", "rope_scaling_factor")

#: provider fields left out: a TE layer spec (replaced by `layer_spec`) and the flash backend
#: (Transformer Engine's; the local core attention is used)
_SKIPPED = ("transformer_layer_spec", "attention_backend")


def provider_class() -> Any:
    """The installed megatron-bridge's ``Gemma3ModelProvider`` (resolved through the registry)."""
    from megatron_dcr_hooks.bridge_registry import resolve

    return resolve("Gemma3ForCausalLM").bridge_class.PROVIDER_CLASS


def provider_module() -> Any:
    """The module defining ``Gemma3ModelProvider`` (``gemma3_provider``), already imported by
    the bridge registry."""
    return sys.modules[provider_class().__module__]


def provider_defaults() -> dict[str, Any]:
    """The fields ``Gemma3ModelProvider`` declares itself, with their defaults (the family's
    settings; the bridge's ``provider_bridge`` record goes on top)."""
    cls = provider_class()
    own = cls.__dict__.get("__annotations__", {})
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in own or f.name in _SKIPPED:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def check_hf_config(hf_config: dict[str, Any], settings: dict[str, Any]) -> None:
    """ValueError when the checkpoint is not the model the provider builds (limitation 1)."""
    arch = settings.get("architecture", "Gemma3ForCausalLM")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf_config.get(key) is not None:
            raise ValueError(f"{arch}: {key}={hf_config[key]}; Gemma3ModelProvider has none")
    if settings.get("is_vision_language"):
        raise ValueError(f"{arch}: the CPU builder covers text-only Gemma-3")
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        local, full = settings["interleaved_attn_pattern"]
        want = [
            "full_attention" if (i + 1) % (local + full) == 0 else "sliding_attention"
            for i in range(len(layer_types))
        ]
        if list(layer_types) != want:
            raise ValueError(
                f"{arch}: layer_types {layer_types} differ from the provider's "
                f"interleaved_attn_pattern {settings['interleaved_attn_pattern']}"
            )


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred gamma: ``x / rms(x) * (1 + w)`` computed in fp32 and cast
    back (``TENorm`` with ``layernorm_zero_centered_gamma``; transformers' ``Gemma3RMSNorm``).
    Constructed like megatron's norms, ``(config, hidden_size, eps)``; the weight is replicated
    over TP (``sequence_parallel`` marks it for the TP gradient all-reduce under SP)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **kwargs: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))  # noqa: B010

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rms_norm(x, self.weight, self.eps)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * (1 + weight)`` over the last dimension, in fp32, cast to ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


_CLASSES: dict[str, Any] = {}


def _local_classes() -> dict[str, Any]:
    """The CPU stand-ins (module docstring), built once (megatron imports are lazy here)."""
    if _CLASSES:
        return _CLASSES
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dcr_hooks import bridge_loader

    is_local = provider_module()._is_local_attn_layer

    class LocalLayerNormColumnParallelLinear(ColumnParallelLinear):
        """Column-parallel linear with its input norm fused in (``layer_norm_weight``), as
        ``TELayerNormColumnParallelLinear``: the norm runs before the linear's own input
        all-gather / copy, so its gradient is complete on every TP rank."""

        def __init__(self, input_size: int, output_size: int, *, config: Any, **kw: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kw)
            self.layer_norm_weight = torch.nn.Parameter(
                torch.zeros(input_size, dtype=config.params_dtype)
            )
            setattr(self.layer_norm_weight, "sequence_parallel", bool(config.sequence_parallel))  # noqa: B010
            self.norm_eps = float(config.layernorm_epsilon)

        def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            normed = zero_centered_rms_norm(input_, self.layer_norm_weight, self.norm_eps)
            return super().forward(normed, *args, **kwargs)

    class LocalRowParallelLinearLayerNorm(RowParallelLinear):
        """Row-parallel linear followed by a norm of its output (``post_layernorm``), as
        megatron-bridge's ``TERowParallelLinearLayerNorm`` (no bias: the provider has none)."""

        def __init__(self, input_size: int, output_size: int, *, config: Any, **kw: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kw)
            self.post_layernorm = ZeroCenteredRMSNorm(
                config, output_size, eps=config.layernorm_epsilon
            )

        def forward(self, x: torch.Tensor) -> Any:
            output, bias = super().forward(x)
            if bias is not None:
                raise ValueError("a post-norm before a deferred bias add is not Gemma-3's")
            return self.post_layernorm(output), bias

    class Gemma3DotProductAttention(DotProductAttention):
        """The local core attention with ``Gemma3TEDotProductAttention``'s per-layer window:
        ``(window - 1, 0)`` on local layers, none on global ones."""

        def __init__(self, config: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
            config = copy.copy(config)
            if is_local(layer_number, config.interleaved_attn_pattern):
                config.window_size = (int(config.window_size) - 1, 0)
            else:
                config.window_size = None
            config.window_attn_skip_freq = None
            super().__init__(config, layer_number, *args, **kwargs)

    # the bridge registers its TE class this way (module docstring, limitation 2)
    automapping = bridge_loader.load_conversion().param_mapping.AutoMapping
    automapping.register_module_type(LocalRowParallelLinearLayerNorm.__name__, "row")
    _CLASSES.update(
        column=LocalLayerNormColumnParallelLinear,
        row=LocalRowParallelLinearLayerNorm,
        core_attention=Gemma3DotProductAttention,
    )
    return _CLASSES


def layer_spec(config: Any) -> Any:
    """``gemma3_layer_spec`` with the local stand-ins (module docstring)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    local = _local_classes()
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=provider_module().Gemma3SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=local["column"],
                    core_attention=local["core_attention"],
                    q_layernorm=ZeroCenteredRMSNorm if config.qk_layernorm else None,
                    k_layernorm=ZeroCenteredRMSNorm if config.qk_layernorm else None,
                    linear_proj=local["row"],
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=local["column"], linear_fc2=local["row"]),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def finish_model(model: Any, config: Any, settings: dict[str, Any]) -> Any:
    """``Gemma3ModelProvider.provide``'s last step on a built GPTModel: its embedding (scaled by
    sqrt(hidden)) and its two-table RoPE replace megatron's, then embeddings and output layer
    are set up again (tied weights)."""
    mod = provider_module()
    local_base, global_base = settings["rotary_base"]
    if hasattr(model, "embedding"):
        model.embedding = mod.Gemma3LanguageModelEmbedding(
            config=config,
            vocab_size=model.vocab_size,
            max_sequence_length=int(settings.get("seq_length", 4096)),
            position_embedding_type=settings.get("position_embedding_type", "rope"),
            scatter_to_sequence_parallel=bool(
                settings.get("scatter_embedding_sequence_parallel", True)
            ),
        )
    model.rotary_pos_emb = mod.Gemma3RotaryEmbedding(
        kv_channels=config.kv_channels,
        rotary_percent=1.0,
        rotary_interleaved=config.rotary_interleaved,
        seq_len_interpolation_factor=settings.get("seq_len_interpolation_factor"),
        rotary_base=global_base,
        rope_scaling=False,
        rope_scaling_factor=float(settings.get("rope_scaling_factor", 1.0)),
        use_cpu_initialization=config.use_cpu_initialization,
        rotary_base_local=local_base,
    )
    if hasattr(model, "embedding") or hasattr(model, "output_layer"):
        model.setup_embeddings_and_output_layer()
    return model
