"""Build a megatron-core GPTModel (local spec) for a Hugging Face Qwen3 / Qwen3-MoE config.

Used by tests, benchmarks and the demo to get real Megatron trainer ranks on CPU. Production
training stacks build their own models (Megatron-LM, NeMo, Megatron-Bridge providers); DCR only
needs the model chunks and the optimizer they already have.

Limitations:
1. Qwen3 and Qwen3-MoE configs only (RMSNorm, SwiGLU, QK-norm, RoPE, no biases).
2. Pipeline parallelism is not wired here (PP=1); MoE with TP>1 turns on sequence parallelism
   (megatron requires it) and uses ``cpu_compat.SPRMSNorm`` for every norm.
3. Fusions are off (CPU): bias-activation, softmax, RoPE, gradient-accumulation fusion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Megatron parallel sizes of one trainer job (DP is what is left of the world size)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def etp(self) -> int:
        """Expert tensor parallel size: 1 with expert parallelism, else TP (megatron reduces
        expert grads over expert-DP only when EP > 1, so ETP=1 with EP=1 and TP>1 is unsafe)."""
        return 1 if self.ep > 1 else self.tp

    def initialize(self) -> None:
        """Initialise megatron's parallel_state on the already-initialised default group."""
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
        )


def rope_theta_of(hf_config: dict[str, Any]) -> float:
    """RoPE base from an HF config (transformers 5 moves it into ``rope_parameters``)."""
    params = hf_config.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    if "rope_theta" in hf_config:
        return float(hf_config["rope_theta"])
    raise ValueError("HF config has no rope_theta (neither top-level nor in rope_parameters)")


def transformer_config_from_hf(
    hf_config: dict[str, Any], layout: ParallelLayout, **overrides: Any
) -> Any:
    """A megatron ``TransformerConfig`` equivalent to a Qwen3 / Qwen3-MoE HF config dict."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = int(hf_config.get("num_experts", 0) or 0) > 0
    kwargs: dict[str, Any] = {
        "num_layers": hf_config["num_hidden_layers"],
        "hidden_size": hf_config["hidden_size"],
        "num_attention_heads": hf_config["num_attention_heads"],
        "num_query_groups": hf_config["num_key_value_heads"],
        "kv_channels": hf_config.get("head_dim")
        or hf_config["hidden_size"] // hf_config["num_attention_heads"],
        "ffn_hidden_size": hf_config["intermediate_size"],
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config["rms_norm_eps"],
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bf16": True,
        "params_dtype": torch.bfloat16,
        "pipeline_dtype": torch.bfloat16,
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "expert_model_parallel_size": layout.ep,
        "sequence_parallel": moe and layout.tp > 1,
        "use_cpu_initialization": True,
        "perform_initialization": True,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "attention_softmax_in_fp32": True,
    }
    if moe:
        kwargs.update(
            {
                "num_moe_experts": hf_config["num_experts"],
                "moe_router_topk": hf_config["num_experts_per_tok"],
                "moe_ffn_hidden_size": hf_config["moe_intermediate_size"],
                "moe_router_load_balancing_type": "none",
                "moe_aux_loss_coeff": 0.0,
                "moe_token_dispatcher_type": "alltoall",
                "moe_grouped_gemm": False,
                "moe_router_pre_softmax": not hf_config.get("norm_topk_prob", True),
                "moe_router_dtype": "fp32",
                "expert_tensor_parallel_size": layout.etp,
                "moe_permute_fusion": False,
            }
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(config: Any) -> Any:
    """The local (non-Transformer-Engine) GPT layer spec with SP-aware RMSNorm everywhere."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dcr_hooks.cpu_compat import SPRMSNorm

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    sub = spec.submodules
    sub.input_layernorm = SPRMSNorm
    sub.pre_mlp_layernorm = SPRMSNorm
    attn = sub.self_attention.submodules
    attn.q_layernorm = SPRMSNorm
    attn.k_layernorm = SPRMSNorm
    return spec


def build_gpt_model(hf_config: dict[str, Any], layout: ParallelLayout, **overrides: Any) -> Any:
    """A GPTModel for `hf_config` on this rank (parallel_state must be initialised).

    Vocabulary is the HF vocabulary exactly (it must divide by TP); embeddings are tied iff
    ``tie_word_embeddings``.
    """
    from megatron.core.models.gpt import GPTModel

    config = transformer_config_from_hf(hf_config, layout, **overrides)
    vocab = int(hf_config["vocab_size"])
    if vocab % layout.tp:
        raise ValueError(f"vocab_size {vocab} must be divisible by TP={layout.tp}")

    # A block spec (not a layer spec) so the final norm is SPRMSNorm too.
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_dcr_hooks.cpu_compat import SPRMSNorm

    block = TransformerBlockSubmodules(
        layer_specs=[layer_spec(config)] * config.num_layers, layer_norm=SPRMSNorm
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab,
        max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(rope_theta_of(hf_config)),
    )
    return model
