"""The bridge is resolved from the HF architectures through megatron-bridge's own registrations
(no DCR model table): every architecture the installed bridge registers resolves, the mapping
registry and provider settings are the bridge's own, unknown architectures are clear errors.
In-process (imports the installed megatron-bridge modules); no ranks, no engine."""

from __future__ import annotations

import pytest
import torch

from dcr_tools.trainers.providers import provider_record
from megatron_dcr_hooks import bridge_loader, bridge_registry
from shared_codec.errors import CompatibilityError

#: what each checked megatron-bridge registers (bridge_loader.CHECKED_BRIDGE pins the versions):
#: 0.3.1 in the rollout env (Python 3.11), 0.6.2 in the trainer env (Python 3.12, with einops)
EXPECTED_031 = {
    "DeciLMForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "GemmaForCausalLM",
    "Glm4MoeForCausalLM", "Glm4vMoeForConditionalGeneration", "GptOssForCausalLM",
    "LlamaForCausalLM", "Mistral3ForConditionalGeneration", "MistralForCausalLM",
    "NemotronForCausalLM", "NemotronHForCausalLM", "NemotronH_Nano_VL_V2", "OlmoeForCausalLM",
    "Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
}  # fmt: skip
EXPECTED_062 = {
    "BailingMoeV2ForCausalLM", "DeciLMForCausalLM", "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "Ernie4_5_MoeForCausalLM",
    "Ernie4_5_VLMoeForConditionalGeneration", "Exaone4ForCausalLM",
    "Exaone4_5_ForConditionalGeneration", "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM",
    "FalconH1ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration", "GemmaForCausalLM", "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM", "Glm4vMoeForConditionalGeneration", "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM", "HYV3ForCausalLM", "KimiK25ForConditionalGeneration",
    "KimiK2ForCausalLM", "LlamaForCausalLM", "MiMoForCausalLM", "MiMoV2FlashForCausalLM",
    "MiniMaxM2ForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
    "Mistral3ForConditionalGeneration", "MistralForCausalLM", "NemotronForCausalLM",
    "NemotronHForCausalLM", "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_VL_V2",
    "OlmoeForCausalLM", "Qwen2AudioForConditionalGeneration", "Qwen2ForCausalLM",
    "Qwen2_5OmniForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ASRForConditionalGeneration", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3OmniMoeForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration", "SarvamMLAForCausalLM", "SarvamMoEForCausalLM",
    "Step3p5ForCausalLM", "Step3p7ForConditionalGeneration",
}  # fmt: skip
#: bridge modules that cannot import on CPU, by version (they need Transformer Engine)
UNAVAILABLE = {
    "0.3.1": set(),
    "0.6.2": {
        "megatron.bridge.models.gemma.gemma4_bridge",
        "megatron.bridge.models.gemma_vl.gemma4_vl_bridge",
    },
}
EXPECTED = {"0.3.1": EXPECTED_031, "0.6.2": EXPECTED_062}[bridge_loader.check_version()]
#: bridges that build their mapping registry from the HF config (not resolvable by name alone)
NEEDS_CONFIG = {
    "0.3.1": set(),
    "0.6.2": {
        "BailingMoeV2ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
        "DeepseekV4ForCausalLM", "Glm4MoeForCausalLM", "Glm4vMoeForConditionalGeneration",
        "GlmMoeDsaForCausalLM", "HYV3ForCausalLM", "NemotronHForCausalLM", "Step3p5ForCausalLM",
        "Step3p7ForConditionalGeneration",
    },
}  # fmt: skip


def _cfg(arch: str, **kw: object) -> dict:
    base = {
        "architectures": [arch], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "max_position_embeddings": 512,
    }  # fmt: skip
    base.update(kw)
    return base


def test_every_registered_architecture_resolves() -> None:
    found = bridge_registry.discover()
    print(f"\n{len(found.registrations)} architectures registered by megatron-bridge:")
    for arch, reg in sorted(found.registrations.items()):
        print(f"  {arch:40s} {reg.module} ({reg.bridge_class.__name__})")
    # every bridge module imports on CPU, except those that need Transformer Engine
    assert set(found.unavailable) == UNAVAILABLE[bridge_loader.check_version()], found.unavailable
    assert all("transformer_engine" in e for e in found.unavailable.values())
    assert set(found.registrations) == EXPECTED, set(found.registrations) ^ EXPECTED
    # nothing an importable module's source registers is dropped
    declared = {
        s for m, sources in found.declared.items() if m not in found.unavailable for s in sources
    }
    assert declared <= set(found.registrations) | {"Mistral3ForConditionalGeneration"}
    needs_config = set()
    for arch, reg in found.registrations.items():
        assert bridge_registry.resolve(arch) is reg
        try:
            registry = reg.mapping_registry()
        except CompatibilityError as e:  # built from the HF config (bridge 0.6): named
            assert arch in str(e) and "from the HF config" in str(e)
            needs_config.add(arch)
            continue
        assert len(registry.mappings) > 0, arch
    assert needs_config == NEEDS_CONFIG[bridge_loader.check_version()], needs_config


def test_resolution_follows_autobridge() -> None:
    # AutoBridge takes the first architecture with a supported suffix
    assert "ForCausalLM" in bridge_registry.supported_suffixes()
    cfg = _cfg("LlamaForCausalLM")
    cfg["architectures"] = ["LlamaModel", "LlamaForCausalLM"]
    assert bridge_registry.architecture_of(cfg) == "LlamaForCausalLM"
    assert bridge_registry.resolve(cfg).bridge_class.__name__ == "LlamaBridge"
    # a model_type that one bridge registers (register_bridge(model_type=...)) also resolves
    assert bridge_registry.resolve("qwen3_moe").architecture == "Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match="no 'architectures'"):
        bridge_registry.architecture_of({"model_type": "llama"})
    with pytest.raises(ValueError, match="ends with"):
        bridge_registry.architecture_of({"architectures": ["LlamaModel"]})


def test_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=f"'FrobnicatorForCausalLM'.*registers {len(EXPECTED)}"):
        bridge_registry.resolve("FrobnicatorForCausalLM")
    with pytest.raises(ValueError, match="'FrobnicatorForCausalLM'"):
        bridge_registry.mapping_registry_for(_cfg("FrobnicatorForCausalLM"))


def test_unimportable_bridge_module_is_named_with_its_error(monkeypatch) -> None:
    """Unit (a fake module entry in the discovery state): an architecture whose only bridge
    module failed to import is reported with that module and its import error."""
    st = bridge_registry._state()
    fake = "megatron.bridge.models.fake.fake_bridge"
    monkeypatch.setitem(st.declared, fake, ["FakeForCausalLM"])
    monkeypatch.setitem(st.unavailable, fake, "ImportError: no module named 'fake_kernels'")
    monkeypatch.setattr(st, "imported", st.imported | {fake})
    with pytest.raises(ValueError, match=r"fake_bridge, which cannot be imported.*fake_kernels"):
        bridge_registry.resolve("FakeForCausalLM")


def test_mapping_registries_are_the_bridges_own() -> None:
    pm = bridge_loader.load_conversion().param_mapping
    reg = bridge_registry.mapping_registry_for("Qwen3ForCausalLM")
    qkv = reg.megatron_to_hf_lookup("decoder.layers.3.self_attention.linear_qkv.weight")
    assert isinstance(qkv, pm.QKVMapping)
    assert qkv.hf_param == {
        "q": "model.layers.3.self_attn.q_proj.weight",
        "k": "model.layers.3.self_attn.k_proj.weight",
        "v": "model.layers.3.self_attn.v_proj.weight",
    }
    # the local spec's standalone norm name resolves through the registry's aliases
    norm = reg.megatron_to_hf_lookup("decoder.layers.0.input_layernorm.weight")
    assert norm is not None and norm.hf_param == "model.layers.0.input_layernorm.weight"
    moe = bridge_registry.mapping_registry_for("Qwen3MoeForCausalLM")
    fc1 = moe.megatron_to_hf_lookup(
        "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"
    )
    assert isinstance(fc1, pm.GatedMLPMapping)
    assert fc1.hf_param["gate"] == "model.layers.1.mlp.experts.5.gate_proj.weight"
    qwen2 = bridge_registry.mapping_registry_for("Qwen2ForCausalLM")
    bias = qwen2.megatron_to_hf_lookup("decoder.layers.0.self_attention.linear_qkv.bias")
    assert isinstance(bias, pm.QKVMapping)
    assert bias.hf_param["k"] == "model.layers.0.self_attn.k_proj.bias"
    llama = bridge_registry.mapping_registry_for("LlamaForCausalLM")
    assert llama.megatron_to_hf_lookup("decoder.layers.0.self_attention.q_layernorm.weight") is None
    head = llama.megatron_to_hf_lookup("output_layer.weight")
    assert head is not None and head.hf_param == "lm_head.weight"


def test_provider_settings_come_from_the_bridge() -> None:
    q3 = provider_record(_cfg("Qwen3ForCausalLM"))
    assert q3.qk_layernorm is True and q3.add_qkv_bias is False
    q2 = provider_record(_cfg("Qwen2ForCausalLM", attention_bias=True))
    assert q2.add_qkv_bias is True and not getattr(q2, "qk_layernorm", False)
    llama = provider_record(_cfg("LlamaForCausalLM", attention_bias=False))
    assert not getattr(llama, "qk_layernorm", False) and llama.add_qkv_bias is False
    assert llama.share_embeddings_and_output_weights is False
    assert llama.activation_func is torch.nn.functional.silu
    assert (llama.num_layers, llama.num_query_groups, llama.kv_channels) == (2, 2, 32)
    assert llama.params_dtype is torch.bfloat16
    moe = provider_record(
        _cfg(
            "Qwen3MoeForCausalLM",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,  # bridge 0.6 reads it (every Qwen3-MoE config.json has it)
        )
    )
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (8, 2, 64)
    # transformers 5 keeps rope_theta in rope_parameters: it must not fall back to a default
    t5 = _cfg("LlamaForCausalLM")
    t5["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    del t5["rope_theta"]
    assert provider_record(t5).rotary_base == 500000.0
    # a family the CPU builder does not cover says which provider it needs
    from dcr_tools.trainers.model import provider_settings

    with pytest.raises(ValueError, match="Gemma2ModelProvider"):
        provider_settings(_cfg("Gemma2ForCausalLM"))
    # Gemma-3 is covered on megatron-bridge 0.6.2 (the trainer env, `_TRAINER_PROBE`); 0.3.1's
    # Gemma3 provider_bridge loads the HF config again from a path and reads transformers 4's
    # top-level RoPE fields, so it cannot run on a config dict
    from dcr_tools.fixtures import hf_config, spec_for

    if bridge_loader.check_version() == "0.3.1":
        with pytest.raises(ValueError, match="_model_name_or_path"):
            provider_settings(hf_config(spec_for("gemma3")))
    # an MLA family is covered: no query LoRA stays None (not MLATransformerConfig's 512), and
    # RoPE without YaRN is unscaled, as the real base provider_bridge sets them
    from dcr_tools.fixtures import MLA_CONFIG

    mla = provider_settings(MLA_CONFIG)
    assert mla["multi_latent_attention"] and mla["q_lora_rank"] is None
    assert (mla["kv_lora_rank"], mla["qk_pos_emb_head_dim"], mla["v_head_dim"]) == (512, 64, 512)
    assert (mla["rotary_scaling_factor"], mla["mscale_all_dim"]) == (1.0, 1.0)
    assert mla["position_embedding_type"] == "rope"
    # YaRN on a GPT provider is recorded as the real base provider_bridge maps it, whether the
    # config carries it as rope_scaling or (transformers 5) rope_parameters
    from dcr_tools.fixtures import GPT_OSS_YARN, hf_config, spec_for
    from shared_codec.errors import CompatibilityError

    yarn = {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
        "beta_fast": 16.0, "beta_slow": 2.0, "truncate": True,
    }  # fmt: skip
    # (the family's own provider_bridge has the last word on position_embedding_type:
    # megatron-bridge 0.3.1's Qwen3 bridge sets "rope" after the base, 0.6.2's leaves "yarn")
    want = {
        "yarn_rotary_scaling_factor": 8.0,
        "yarn_original_max_position_embeddings": 1024, "yarn_beta_fast": 16.0,
        "yarn_beta_slow": 2.0, "yarn_correction_range_round_to_int": True,
    }  # fmt: skip
    qwen3 = _cfg("Qwen3ForCausalLM")
    for key in ("rope_scaling", "rope_parameters"):
        got = provider_settings({**qwen3, key: {**yarn, "rope_theta": 500000.0}})
        assert {k: got.get(k) for k in want} == want, key
    # GPT-OSS's own provider_bridge then sets its YaRN values whatever the config says; the
    # fixture's config states the same ones
    oss = provider_settings({**hf_config(spec_for("gpt-oss")), "rope_parameters": yarn})
    assert oss["position_embedding_type"] == "yarn"
    assert (
        oss["yarn_rotary_scaling_factor"], oss["yarn_original_max_position_embeddings"],
        oss["yarn_beta_fast"], oss["yarn_beta_slow"], oss["yarn_correction_range_round_to_int"],
    ) == (
        GPT_OSS_YARN["factor"], GPT_OSS_YARN["original_max_position_embeddings"],
        GPT_OSS_YARN["beta_fast"], GPT_OSS_YARN["beta_slow"], GPT_OSS_YARN["truncate"],
    )  # fmt: skip
    # attention sinks, sliding window (0.6.2: (sliding_window - 1, 0), 0.3.1: (sliding_window, 0))
    assert oss["softmax_type"] == "learnable" and oss["window_size"] in ((127, 0), (128, 0))
    # YaRN on an MLA provider is not translated: refused, not dropped
    with pytest.raises(CompatibilityError, match="YaRN"):
        provider_settings({**MLA_CONFIG, "rope_scaling": yarn})
