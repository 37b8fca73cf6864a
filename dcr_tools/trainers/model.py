"""Build a megatron-core GPTModel (local spec) on CPU for a Hugging Face config, from the bridge.

The model's settings come from megatron-bridge itself: `providers.provider_record` runs
the resolved bridge's own ``provider_bridge`` (its CONFIG_MAPPING plus the family's settings:
QK-norm, QKV bias, untied embeddings, MoE options...). This module only adds the CPU choices:
the local (non-Transformer-Engine) layer spec, bf16, fusions off, dropout off, deterministic MoE
routing settings, and the parallel layout. Used by tests, benchmarks and the demo to get real
Megatron trainer ranks on CPU. Production training stacks build their own models (Megatron-LM,
NeMo, Megatron-Bridge providers); DCR only needs the model chunks and the optimizer they have.

Limitations:
1. GPT-style families whose provider is ``GPTModelProvider`` or ``MLAModelProvider`` and whose
   norm is RMSNorm (checked end to end: Llama-3 style, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3
   with multi-latent attention, dense first layers and shared experts, GPT-OSS with YaRN RoPE,
   learnable softmax offsets (attention sinks), alternating sliding-window layers, expert and
   router biases and the clamped GLU, all megatron-core 0.19.2 local features),
   ``Gemma3ModelProvider`` (`dcr_tools.trainers.gemma3`: its own modules plus local stand-ins
   for its Transformer Engine ones; checked end to end) and the hybrid Mamba
   ``HybridModelProvider`` (limitation 7; owner side); other provider classes raise
   ValueError naming the provider. MLA families get megatron's
   ``MLATransformerConfig`` and per-layer local specs (``get_gpt_decoder_block_spec`` without
   Transformer Engine: dense or MoE layers from ``moe_layer_freq``); shared-expert overlap
   (CUDA streams) is off. megatron-core's local MLA spec names the local
   ``DotProductAttention`` as core attention, but ``MLASelfAttention`` builds it with
   ``k_channels`` / ``v_channels``, which that class does not take (``TypeError`` in 0.19.2 and
   0.16.1: megatron/core/transformer/multi_latent_attention.py builds it with them,
   dot_product_attention.py ``__init__`` has no such arguments); `mla_core_attention` is that
   class with the two arguments (its maths already allows a query/key head size other than the
   value head size). megatron-core 0.19.2 also resolves MLA's Q/KV norms itself
   (``mla_qk_norm_config.QKNormConfigResolver``): with ``qk_layernorm`` and no query LoRA it
   demands a fused norm+linear ``linear_q_proj`` (Transformer Engine's; the local backend has
   none), so `mla_self_attention` builds the spec's own unfused local modules, as 0.16.1 does
   (separate ``kv_layernorm``, plain ``linear_q_proj``; the bridge maps these local names).
   megatron-core 0.16.1 without Transformer Engine cannot build ``MLASelfAttention`` at all:
   its ``extensions/transformer_engine.py`` (lines 61-77) replaces the missing ``te`` with a
   ``MagicMock``, so multi_latent_attention.py's ``from ...transformer_engine import TELinear``
   succeeds (``HAVE_TE = True``, lines 54-63) with a mock instead of a class, and
   ``isinstance(self.linear_proj, TELinear)`` (line 185) raises ``TypeError``;
   `mla_self_attention` sets that module's ``HAVE_TE`` to False when its ``TELinear`` is not
   a class (Transformer Engine is absent, so nothing it guards can apply).
2. Pipeline parallelism builds one chunk per virtual stage (`build_gpt_chunks`); MoE with TP>1
   turns on sequence parallelism (megatron requires it; ``sp=True`` turns it on for dense
   models too) and every norm is ``cpu_compat.SPRMSNorm``.
3. Fusions are off (CPU): bias-activation, softmax, RoPE, gradient-accumulation fusion.
4. Context parallelism is in the process groups only, NOT in the attention: megatron-core's
   local ``DotProductAttention`` refuses ``context_parallel_size > 1`` ("Context parallelism is
   only supported by TEDotProductAttention!", megatron/core/transformer/dot_product_attention.py
   lines 57-59 in 0.19.2 and in 0.16.1) and Transformer Engine does not run on CPU. With
   ``cp > 1`` `ParallelLayout.initialize` builds megatron's groups with CP (DP x CP gradient
   reduction in DDP, the distributed optimizer's DP x CP shards, DCR's holder groups all see
   it), while the model is built with ``context_parallel_size=1`` and a CP group of this rank
   alone (`model_process_groups`), so every CP rank runs the whole sequence of its DP rank's
   batch instead of a slice of it. Parameters and gradients stay identical across CP ranks,
   which is all the owner side depends on; the sequence split itself is not exercised.
5. MoE token dispatcher: ``alltoall`` by default. With EP > 1 and ETP > 1 it all-gathers
   uneven per-rank token counts over the expert-TP group (``torch.distributed.all_gather``
   into a list of unequal tensors), which gloo refuses (``ProcessGroupGloo::allgather: invalid
   tensor size``); such layouts pass ``moe_token_dispatcher_type="allgather"`` as an override
   (equal-sized all-gather and reduce-scatter over the TP x EP group). The expert parameter
   layout does not depend on the dispatcher.
6. Expert biases (GPT-OSS) with SequentialMLP at EP=1 under sequence parallelism: megatron-core
   0.19.2 allows biased experts only at ETP=1 (``transformer_config.py`` line 2280, "Bias in
   Moe is only supported when ETP==1"), and then an expert's ``RowParallelLinear`` has no
   explicit expert communication (``tensor_parallel/layers.py`` line 1326: a 1-rank group and
   EP=1), so its forward runs the SP reduce-scatter on a 1-rank group, which returns its input
   as is (``mappings.py`` line 171), and ``MLP.forward`` then adds the expert bias in place
   (``transformer/mlp.py`` line 354, ``output += ...``): autograd refuses with "Output 0 of
   _ReduceScatterToSequenceParallelRegion is a view and is being modified inplace". The local
   spec's expert ``linear_fc2`` is `expert_row_linear`, which clones that output (bit-identical
   values and gradients). Only for MoE families with ``add_bias_linear``.
7. Hybrid Mamba families (Nemotron-H) build megatron-core's hybrid model (`build_hybrid_model`,
   PP=1, dense layers: Mamba-2, attention, MLP by the bridge's layer pattern; MoE layers are not
   wired): ``HybridModel`` for megatron-bridge 0.6.2's ``HybridModelProvider`` (megatron-core
   0.19.2), ``MambaModel`` for megatron-bridge 0.3.1's ``MambaModelProvider`` (megatron-core
   0.16.1). Three CPU adaptations: (a) megatron-core ships only Transformer-Engine hybrid specs
   (0.19.2: megatron/core/models/hybrid/hybrid_layer_specs.py, fused
   ``TELayerNormColumnParallelLinear``), so `hybrid_stack_spec` is a local one with separate
   norms (names the bridge maps: ``norm``, ``input_layernorm``, ``pre_mlp_layernorm``); (b) the
   stack builds its final norm as ``TENorm`` unconditionally (0.19.2:
   megatron/core/models/hybrid/hybrid_block.py line 215; 0.16.1: megatron/core/ssm/
   mamba_block.py line 166): that module's ``TENorm`` name is `SPRMSNorm` while the model is
   constructed; (c) the Mamba mixer needs ``mamba_ssm`` (CUDA/Triton kernels; 0.19.2
   megatron/core/ssm/mamba_mixer.py lines 68-79 and 202-205): without it `mamba_reference` (a
   labelled, test-only plain-PyTorch stand-in for the scan and gated-norm kernels) is served on
   import. The MLP's squared ReLU, ``position_embedding_type="none"`` and the Mamba sizes come
   from the bridge.
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
    vpp: int = 1  # model chunks per pipeline stage (virtual pipeline)
    cp: int = 1  # context parallel: process groups only, not the attention (limitation 4)
    sp: bool = False  # sequence parallelism (forced on for MoE with TP > 1)
    expert_tp: int | None = None  # expert tensor parallel size; default: see `etp`

    @property
    def etp(self) -> int:
        """Expert tensor parallel size: 1 with expert parallelism, else TP (megatron reduces
        expert grads over expert-DP only when EP > 1, so ETP=1 with EP=1 and TP>1 is unsafe),
        unless `expert_tp` sets it."""
        if self.expert_tp is not None:
            return self.expert_tp
        return 1 if self.ep > 1 else self.tp

    def initialize(self) -> None:
        """Initialise megatron's parallel_state on the already-initialised default group."""
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None,
            context_parallel_size=self.cp,
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


#: CPU choices applied on top of the bridge's provider settings (module docstring).
_CPU_SETTINGS: dict[str, Any] = {
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "bf16": True,
    "fp16": False,
    "params_dtype": torch.bfloat16,
    "pipeline_dtype": torch.bfloat16,
    "use_cpu_initialization": True,
    "perform_initialization": True,
    "bias_activation_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "cross_entropy_loss_fusion": False,  # DeepSeek's provider asks for TE's fused loss
    "attention_softmax_in_fp32": True,
}

#: MoE choices for deterministic CPU tests (SequentialMLP experts, no load-balancing loss).
_CPU_MOE_SETTINGS: dict[str, Any] = {
    "moe_router_load_balancing_type": "none",
    "moe_aux_loss_coeff": 0.0,
    "moe_token_dispatcher_type": "alltoall",  # "allgather" for EP x ETP (limitation 5)
    "moe_grouped_gemm": False,
    "moe_router_dtype": "fp32",
    "moe_permute_fusion": False,
}

#: MLA choices: shared-expert overlap runs the shared expert on a side CUDA stream.
_CPU_MLA_SETTINGS: dict[str, Any] = {"moe_shared_expert_overlap": False}

#: Provider classes the CPU builder covers (Gemma-3: `dcr_tools.trainers.gemma3`; hybrid Mamba:
#: `build_hybrid_model`).
_PROVIDERS = (
    None, "GPTModelProvider", "MLAModelProvider", "Gemma3ModelProvider", "HybridModelProvider",
    "MambaModelProvider",
)  # fmt: skip

#: Provider-class defaults the bridge's ``provider_bridge`` leaves to the class (DCR's provider
#: record holds what the bridge sets, not the class defaults). HybridModelProvider:
#: megatron/bridge/models/hybrid/hybrid_provider.py (megatron-bridge 0.6.2) lines 138-139;
#: MambaModelProvider: megatron/bridge/models/mamba/mamba_provider.py (0.3.1) lines 102-109.
_PROVIDER_DEFAULTS: dict[str, dict[str, Any]] = {
    "HybridModelProvider": {"gated_linear_unit": False, "normalization": "RMSNorm"},
    "MambaModelProvider": {
        "gated_linear_unit": False, "normalization": "RMSNorm", "position_embedding_type": "none"
    },
}  # fmt: skip

#: Hybrid (Mamba) CPU choices: the memory-efficient training path (megatron's default) runs the
#: split-conv1d scan; MoE / MTP settings of the family are for MoE layers this builder has not.
_CPU_HYBRID_SETTINGS: dict[str, Any] = {"use_mamba_mem_eff_path": True}

#: Provider fields that are GPTModel arguments, not TransformerConfig fields.
_MODEL_ARGS = (
    "vocab_size",
    "seq_length",
    "share_embeddings_and_output_weights",
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "rope_scaling",
    "rope_scaling_factor",
)


def provider_settings(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The bridge's provider settings for `hf_config` (``providers.provider_record``).

    ValueError when the family needs a builder this module does not have (its provider class
    or norm is named)."""
    from dcr_tools.trainers import mamba_reference
    from dcr_tools.trainers.providers import provider_record
    from megatron_dcr_hooks.bridge_registry import resolve

    # before any bridge module imports megatron-core's Mamba mixer (limitation 7); inert for
    # families without Mamba layers and when mamba_ssm is installed
    mamba_reference.install()

    reg = resolve(hf_config)
    if reg.provider not in _PROVIDERS:
        raise ValueError(
            f"{reg.architecture}: the bridge builds it with {reg.provider}; the CPU builder "
            f"covers {', '.join(str(p) for p in _PROVIDERS if p)} families only"
        )
    record = dict(_PROVIDER_DEFAULTS.get(str(reg.provider), {}))
    record.update(vars(provider_record(hf_config)))
    provider = record.pop("provider_class", None)
    if provider == "Gemma3ModelProvider":
        from dcr_tools.trainers import gemma3

        # the provider class's own defaults carry the family's settings; the record goes on top
        record = {**gemma3.provider_defaults(), **record}
        gemma3.check_hf_config(hf_config, record)
    arch = record.pop("architecture")
    hybrid = reg.provider in ("HybridModelProvider", "MambaModelProvider")
    if hybrid and record.get("position_embedding_type") == "none":
        pass  # Nemotron-H: attention layers without position embedding
    elif record.get("position_embedding_type", "rope") not in ("rope", "yarn"):
        raise ValueError(
            f"{arch}: position embedding {record['position_embedding_type']!r}; the CPU builder "
            "covers RoPE and YaRN RoPE only"
        )
    if record.get("normalization", "LayerNorm") != "RMSNorm":
        raise ValueError(
            f"{arch}: normalization {record.get('normalization', 'LayerNorm')!r}; the CPU "
            "builder's SP-aware norm is RMSNorm only"
        )
    return record


def transformer_config_from_hf(
    hf_config: dict[str, Any], layout: ParallelLayout, **overrides: Any
) -> Any:
    """A megatron ``TransformerConfig`` for `hf_config`: the bridge's provider settings, the
    CPU settings above, the parallel layout, then `overrides`."""
    import dataclasses

    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    settings = provider_settings(hf_config)
    if "activation_func" in settings:
        settings["activation_func"] = _uncompiled(settings["activation_func"])
    mla = bool(settings.get("multi_latent_attention"))
    config_class = MLATransformerConfig if mla else TransformerConfig
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs = {k: v for k, v in settings.items() if k in fields}
    moe = int(kwargs.get("num_moe_experts") or 0) > 0
    kwargs.update(_CPU_SETTINGS)
    kwargs.update(
        {
            "tensor_model_parallel_size": layout.tp,
            "pipeline_model_parallel_size": layout.pp,
            "virtual_pipeline_model_parallel_size": layout.vpp if layout.vpp > 1 else None,
            # CP is in the process groups only: the local attention refuses CP (limitation 4)
            "context_parallel_size": 1,
            "expert_model_parallel_size": layout.ep,
            "sequence_parallel": layout.tp > 1 and (moe or layout.sp),
        }
    )
    if moe:
        kwargs.update(_CPU_MOE_SETTINGS)
        kwargs["expert_tensor_parallel_size"] = layout.etp
    else:
        kwargs["num_moe_experts"] = None
    if mla:
        kwargs.update(_CPU_MLA_SETTINGS)
    if settings.get("is_hybrid_model"):
        kwargs.update({k: v for k, v in _CPU_HYBRID_SETTINGS.items() if k in fields})
        if not moe:  # the family's MoE router options would be validated against no experts
            kwargs = {k: v for k, v in kwargs.items() if not k.startswith("moe_")}
    kwargs.update(overrides)
    config = config_class(**kwargs)
    # YaRN's parameters are GPTModelProvider fields, not TransformerConfig ones; GPTModel reads
    # them from its config (``getattr(self.config, "yarn_...")``), as it does on the provider
    for name, value in settings.items():
        if name.startswith("yarn_") and name not in fields:
            setattr(config, name, value)
    if "interleaved_attn_pattern" in settings:  # Gemma-3: read by the provider's own modules
        from dcr_tools.trainers import gemma3

        for name in gemma3.CONFIG_EXTRAS:
            setattr(config, name, settings[name])
    return config


def _uncompiled(fn: Any) -> Any:
    """`fn` without megatron's ``jit_fuser`` (``torch.compile`` on torch >= 2.2, e.g. GELU-tanh's
    ``fast_gelu``): fusions are off on CPU (limitation 3)."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def layer_spec(config: Any) -> Any:
    """The local (non-Transformer-Engine) GPT layer spec with SP-aware RMSNorm everywhere."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_dcr_hooks.cpu_compat import SPRMSNorm

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization="RMSNorm",
    )
    sub = spec.submodules
    sub.input_layernorm = SPRMSNorm
    sub.pre_mlp_layernorm = SPRMSNorm
    if config.num_moe_experts and config.add_bias_linear:
        _use_expert_row_linear(sub.mlp)
    if config.qk_layernorm:
        attn = sub.self_attention.submodules
        attn.q_layernorm = SPRMSNorm
        attn.k_layernorm = SPRMSNorm
    return spec


_EXPERT_ROW_LINEAR: list[type] = []


def expert_row_linear() -> type:
    """megatron-core's ``RowParallelLinear`` whose output is a fresh tensor when its (expert)
    tensor-parallel group has one rank and no explicit expert communication (module docstring,
    limitation 6). Same values, same gradients: the clone is the fix autograd's error names."""
    if _EXPERT_ROW_LINEAR:
        return _EXPERT_ROW_LINEAR[0]
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class ExpertRowParallelLinear(RowParallelLinear):
        def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, Any]:
            output, bias = super().forward(input_)
            if not self.explicit_expert_comm and self.input_size_per_partition == self.input_size:
                output = output.clone()  # the 1-rank reduction returned its input as is
            return output, bias

    # megatron-bridge's AutoMapping tells parallelism by module class name; its own API for a
    # custom module class
    from megatron_dcr_hooks.bridge_loader import load_conversion

    auto = load_conversion().param_mapping.AutoMapping
    auto.register_module_type(ExpertRowParallelLinear.__name__, "row")
    _EXPERT_ROW_LINEAR.append(ExpertRowParallelLinear)
    return ExpertRowParallelLinear


def _use_expert_row_linear(mlp: Any) -> None:
    """Route SequentialMLP experts' ``linear_fc2`` through `expert_row_linear` in a local MoE
    spec (megatron-core 0.19.2: ``partial(MoELayer, submodules=MoESubmodules(experts=
    partial(SequentialMLP, submodules=MLPSubmodules(...))))``); other spec shapes unchanged."""
    moe_sub = getattr(mlp, "keywords", {}).get("submodules")
    experts = getattr(moe_sub, "experts", None)
    exp_sub = getattr(experts, "keywords", {}).get("submodules")
    if exp_sub is not None and hasattr(exp_sub, "linear_fc2"):
        exp_sub.linear_fc2 = expert_row_linear()


_MLA_CORE_ATTENTION: list[type] = []


def mla_core_attention() -> type:
    """megatron-core's local ``DotProductAttention`` taking MLA's ``k_channels`` (query/key head
    size, used by the caller's explicit ``softmax_scale``) and ``v_channels`` (value head size:
    the output is ``heads per partition x v_channels`` wide instead of ``kv_channels x heads``).
    Module docstring, limitation 1."""
    if _MLA_CORE_ATTENTION:
        return _MLA_CORE_ATTENTION[0]
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(
            self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
            **kwargs: Any,
        ) -> None:  # fmt: skip
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
            if k_channels is not None:
                self.hidden_size_per_attention_head = k_channels

    _MLA_CORE_ATTENTION.append(MLADotProductAttention)
    return MLADotProductAttention


_MLA_SELF_ATTENTION: list[type] = []


def mla_self_attention() -> type:
    """megatron-core's ``MLASelfAttention`` building the layer spec's own unfused local modules
    (``linear_q_proj``, ``linear_q_up_proj``, ``linear_kv_up_proj``, ``q_layernorm``,
    ``kv_layernorm``) instead of 0.19.2's resolution into fused norm+linear projections, which
    the local backend does not have (module docstring, limitation 1). On megatron-core
    versions without that resolution (0.16.1) it is ``MLASelfAttention`` unchanged."""
    if _MLA_SELF_ATTENTION:
        return _MLA_SELF_ATTENTION[0]
    from megatron.core.transformer import multi_latent_attention as mla_module
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if getattr(mla_module, "HAVE_TE", False) and not isinstance(
        getattr(mla_module, "TELinear", None), type
    ):
        mla_module.HAVE_TE = False  # a MagicMock stand-in, not Transformer Engine (0.16.1)

    class LocalMLASelfAttention(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
            return {
                name: getattr(submodules, name)
                for name in (
                    "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "q_layernorm",
                    "kv_layernorm",
                )
            }  # fmt: skip

    _MLA_SELF_ATTENTION.append(LocalMLASelfAttention)
    return LocalMLASelfAttention


def block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """The block spec of this rank's layers (pipeline stage `vp_stage`): the local layer spec
    with SP-aware RMSNorm everywhere, the final norm included. MLA families take megatron's own
    per-layer local specs (dense or MoE per ``moe_layer_freq``: ``get_gpt_decoder_block_spec``
    without Transformer Engine), the others one `layer_spec` for every layer."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from megatron_dcr_hooks.cpu_compat import SPRMSNorm

    if getattr(config, "interleaved_attn_pattern", None) is not None:
        from dcr_tools.trainers import gemma3

        n = get_num_layers_to_build(config, vp_stage=vp_stage)
        return TransformerBlockSubmodules(
            layer_specs=[gemma3.layer_spec(config)] * n, layer_norm=gemma3.ZeroCenteredRMSNorm
        )
    if not getattr(config, "multi_latent_attention", False):
        n = get_num_layers_to_build(config, vp_stage=vp_stage)
        return TransformerBlockSubmodules(
            layer_specs=[layer_spec(config)] * n, layer_norm=SPRMSNorm
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
    )
    for spec in block.layer_specs:
        sub = spec.submodules
        sub.input_layernorm = SPRMSNorm
        sub.pre_mlp_layernorm = SPRMSNorm
        sub.self_attention.module = mla_self_attention()
        attn = sub.self_attention.submodules
        attn.core_attention = mla_core_attention()
        if attn.kv_layernorm is not IdentityOp:
            attn.kv_layernorm = SPRMSNorm
        # the query norm exists with a query LoRA only (megatron refuses an unused one)
        attn.q_layernorm = SPRMSNorm if config.q_lora_rank is not None else IdentityOp
    block.layer_norm = SPRMSNorm
    return block


def model_process_groups(layout: ParallelLayout) -> Any:
    """The process groups the model itself gets: ``None`` (megatron's ``parallel_state``
    groups) without context parallelism; with ``layout.cp > 1`` those groups with the context
    parallel group (and TP x CP) replaced by this rank alone (TP), so the model never splits
    the sequence (module docstring, limitation 4). Collective: every rank of the job calls it
    once, at the same point (it creates one single-rank group per rank)."""
    if layout.cp == 1:
        return None
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    solo, _ = dist.new_subgroups(group_size=1)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    # init=False fields: dataclasses.replace refuses them, so set them on the fresh collection
    groups.cp = solo
    groups.tp_cp = ps.get_tensor_model_parallel_group()
    return groups


def build_gpt_chunks(hf_config: dict[str, Any], layout: ParallelLayout, **overrides: Any) -> list:
    """This rank's model chunks (one per virtual pipeline stage, ``layout.vpp``), each a GPTModel
    holding the layers megatron assigns to (pipeline rank, virtual stage); embedding on the
    first stage's first chunk, final norm and output layer on the last stage's last chunk.
    parallel_state must be initialised with the same layout."""
    from megatron.core import parallel_state as ps

    config = transformer_config_from_hf(hf_config, layout, **overrides)
    groups = model_process_groups(layout)
    if provider_settings(hf_config).get("is_hybrid_model"):
        if layout.pp > 1 or layout.vpp > 1:
            raise ValueError("the CPU hybrid (Mamba) builder covers PP=1 only")
        return [build_hybrid_model(hf_config, layout, config=config, pg_collection=groups)]
    chunks = []
    for vp in range(layout.vpp):
        stage = vp if layout.vpp > 1 else None
        chunks.append(
            build_gpt_model(
                hf_config,
                layout,
                config=config,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
                pg_collection=groups,
            )
        )
    return chunks


def build_gpt_model(
    hf_config: dict[str, Any],
    layout: ParallelLayout,
    *,
    config: Any = None,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    pg_collection: Any = None,
    **overrides: Any,
) -> Any:
    """A GPTModel for `hf_config` on this rank (parallel_state must be initialised): the whole
    model with PP=1, one pipeline chunk otherwise (`build_gpt_chunks`).

    Vocabulary is the HF vocabulary exactly (it must divide by TP); embeddings are tied iff the
    bridge's provider says so (``tie_word_embeddings``). `pg_collection`: the model's process
    groups; default `model_process_groups(layout)` (a collective call with ``cp > 1``).
    """
    from megatron.core.models.gpt import GPTModel

    settings = provider_settings(hf_config)
    if config is None:
        config = transformer_config_from_hf(hf_config, layout, **overrides)
    vocab = int(settings["vocab_size"])
    if vocab % layout.tp:
        raise ValueError(f"vocab_size {vocab} must be divisible by TP={layout.tp}")
    if pg_collection is None:
        pg_collection = model_process_groups(layout)
    rope: dict[str, Any] = {}
    if settings.get("rope_scaling"):
        rope = {"rope_scaling": True, "rope_scaling_factor": settings["rope_scaling_factor"]}
    gemma3 = "interleaved_attn_pattern" in settings
    if gemma3:
        # (local, global) bases: megatron's RotaryEmbedding gets the local one, then
        # `gemma3.finish_model` swaps in the provider's two-table RoPE (as ``provide`` does)
        rotary_base = int(settings["rotary_base"][0])
    else:
        # read explicitly: a config without it would get the bridge's silent default base
        rotary_base = int(rope_theta_of(hf_config))
    model = GPTModel(
        config=config,
        # a block spec (not a layer spec) so the final norm is SPRMSNorm too
        transformer_layer_spec=block_spec(config, vp_stage),
        vocab_size=vocab,
        max_sequence_length=int(settings.get("seq_length", 4096)),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(
            settings.get("share_embeddings_and_output_weights", False)
        ),
        position_embedding_type=settings.get("position_embedding_type", "rope"),
        rotary_percent=float(settings.get("rotary_percent", 1.0)),
        rotary_base=rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
        **rope,
    )
    if gemma3:
        from dcr_tools.trainers import gemma3 as family

        family.finish_model(model, config, settings)
    return model


def _hybrid_classes() -> tuple[Any, Any, Any]:
    """(stack, stack submodules, block module) of the installed megatron-core: 0.19's
    ``models/hybrid/hybrid_block.HybridStack`` or 0.16's ``ssm/mamba_block.MambaStack``."""
    try:
        from megatron.core.models.hybrid import hybrid_block as block
    except ImportError:  # megatron-core 0.16
        from megatron.core.ssm import mamba_block as block

        return block.MambaStack, block.MambaStackSubmodules, block
    return block.HybridStack, block.HybridStackSubmodules, block


def hybrid_stack_spec() -> Any:
    """A local (non-Transformer-Engine) ``HybridStack`` spec: megatron-core ships only
    Transformer-Engine hybrid specs (megatron/core/models/hybrid/hybrid_layer_specs.py: the
    Mamba ``in_proj`` and the attention / MLP first linears are ``TELayerNormColumnParallelLinear``).
    Here every norm is a separate `SPRMSNorm` (``norm``, ``input_layernorm``,
    ``pre_mlp_layernorm``: names the Nemotron-H bridge maps), the Mamba projections are local
    column / row parallel linears, attention and MLP are the local GPT spec's modules."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from megatron_dcr_hooks.cpu_compat import SPRMSNorm

    stack, stack_submodules, _ = _hybrid_classes()
    gpt = get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm").submodules
    mixer = ModuleSpec(
        module=MambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )
    return ModuleSpec(
        module=stack,
        submodules=stack_submodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=SPRMSNorm, mixer=mixer, mamba_bda=get_bias_dropout_add
                ),
            ),
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=SPRMSNorm,
                    self_attention=gpt.self_attention,
                    self_attn_bda=get_bias_dropout_add,
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=SPRMSNorm, mlp=gpt.mlp, mlp_bda=get_bias_dropout_add
                ),
            ),
        ),
    )


def build_hybrid_model(
    hf_config: dict[str, Any],
    layout: ParallelLayout,
    *,
    config: Any = None,
    pg_collection: Any = None,
    **overrides: Any,
) -> Any:
    """megatron-core's hybrid model (Mamba-2 / attention / MLP layers by the family's layer
    pattern) for a Nemotron-H style family, PP=1: ``HybridModel`` (``HybridModelProvider``,
    megatron-core 0.19) or ``MambaModel`` (``MambaModelProvider``, megatron-core 0.16).

    CPU adaptations (limitation 7): the Mamba kernels are `mamba_reference`'s labelled
    plain-PyTorch stand-in when ``mamba_ssm`` is not installed; the local `hybrid_stack_spec`;
    the stack's final norm, which megatron-core hard-codes as ``TENorm``, is built as
    `SPRMSNorm` (the stack module's ``TENorm`` name is rebound while the model is
    constructed)."""
    from dcr_tools.trainers import mamba_reference

    mamba_reference.install()
    mamba_reference.check_mixer()
    from megatron_dcr_hooks.cpu_compat import SPRMSNorm

    _, _, block = _hybrid_classes()

    settings = provider_settings(hf_config)
    if config is None:
        config = transformer_config_from_hf(hf_config, layout, **overrides)
    vocab = int(settings["vocab_size"])
    if vocab % layout.tp:
        raise ValueError(f"vocab_size {vocab} must be divisible by TP={layout.tp}")
    if pg_collection is None:
        pg_collection = model_process_groups(layout)
    if "hybrid_layer_pattern" in settings:  # megatron-bridge 0.6: HybridModel
        from megatron.core.models.hybrid.hybrid_model import HybridModel as model_class

        model_args = {
            "hybrid_stack_spec": hybrid_stack_spec(),
            "hybrid_layer_pattern": settings["hybrid_layer_pattern"],
        }
    else:  # megatron-bridge 0.3: MambaModel (megatron-core 0.16)
        from megatron.core.models.mamba.mamba_model import MambaModel as model_class

        model_args = {
            "mamba_stack_spec": hybrid_stack_spec(),
            "hybrid_override_pattern": settings["hybrid_override_pattern"],
        }
    te_norm = block.TENorm
    block.TENorm = SPRMSNorm
    try:
        return model_class(
            config=config,
            vocab_size=vocab,
            max_sequence_length=int(settings.get("seq_length", 4096)),
            **model_args,
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=bool(
                settings.get("share_embeddings_and_output_weights", False)
            ),
            position_embedding_type=settings.get("position_embedding_type", "none"),
            pg_collection=pg_collection,
        )
    finally:
        block.TENorm = te_norm
