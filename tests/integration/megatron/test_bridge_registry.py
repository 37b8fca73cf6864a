"""The bridge is resolved from the HF architectures through megatron-bridge's own registrations
(no DCR model table): every architecture the installed bridge registers resolves, the mapping
registry and provider settings are the bridge's own, unknown architectures are clear errors.
In-process (imports the installed megatron-bridge modules); no ranks, no engine.

The trainer-environment probe (ranks' interpreter) is here; the in-process checks are in tests/unit/megatron/test_bridge_registry.py."""

from __future__ import annotations

import pytest

from megatron_dcr_hooks import bridge_loader

_TRAINER_PROBE = """
import json
from megatron_dcr_hooks import bridge_loader, bridge_registry, cpu_compat
from dcr_tools.trainers.providers import provider_record
found = bridge_registry.discover()
cfg = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 32, "intermediate_size": 128, "rms_norm_eps": 1e-6,
       "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "hidden_act": "silu",
       "torch_dtype": "bfloat16", "tie_word_embeddings": False, "max_position_embeddings": 512}
rec = provider_record(cfg)
from dcr_tools.fixtures import hf_config, spec_for
from dcr_tools.trainers.model import provider_settings
g3 = provider_settings(hf_config(spec_for("gemma3")))
refused = {}
for key, extra in (("softcap", {"final_logit_softcapping": 30.0}),
                   ("layer_types", {"layer_types": ["sliding_attention"] * 6})):
    try:
        provider_settings(hf_config(spec_for("gemma3", extra=extra)))
        refused[key] = ""
    except ValueError as e:
        refused[key] = str(e)
print(json.dumps({
    "core": cpu_compat.check_version(), "bridge": bridge_loader.check_version(),
    "registered": sorted(found.registrations), "unavailable": found.unavailable,
    "registries": {a: type(bridge_registry.mapping_registry_for(a)).__name__ for a in
                   ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2ForCausalLM",
                    "LlamaForCausalLM")},
    "qwen3": {"rotary_base": rec.rotary_base, "qk_layernorm": rec.qk_layernorm,
              "activation": rec.activation_func.__name__},
    "gemma3": {k: g3[k] for k in ("layernorm_zero_centered_gamma", "interleaved_attn_pattern",
               "qk_layernorm", "window_size", "softmax_scale", "rotary_base",
               "share_embeddings_and_output_weights", "normalization")},
    "gemma3_refused": refused,
}))
"""


@pytest.mark.megatron
def test_the_trainer_env_resolves_the_verified_families() -> None:
    """The same resolution in the trainer environment (`make setup`'s `.venv-trainer`: Python
    3.12, megatron-core 0.19.2, megatron-bridge 0.6.2), in a process of its own: both version
    checks pass, every verified family builds its registry, the provider settings are the
    bridge's own (RoPE base read from transformers 5's ``rope_parameters``), and only the
    bridge modules that need Transformer Engine are unavailable."""
    import json
    import subprocess
    import sys

    from dcr_tools.procs import REPO, base_env, trainer_python

    python = trainer_python()
    if python == sys.executable:
        pytest.skip(
            "trainer ranks run on this interpreter (no .venv-trainer, or DCR_TRAINER_PYTHON "
            "names it): the in-process tests above cover it"
        )
    out = subprocess.run(
        [python, "-W", "ignore", "-c", _TRAINER_PROBE],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["core"] in ("0.16.1", "0.19.2") and r["bridge"] in bridge_loader.CHECKED_BRIDGE
    if r["bridge"] == "0.6.2":
        assert len(r["registered"]) == 55, r["registered"]
        assert {"DeepseekV4ForCausalLM", "Qwen3_5MoeForCausalLM", "ExaoneMoEForCausalLM"} <= set(
            r["registered"]
        )
        assert all("transformer_engine" in e for e in r["unavailable"].values()), r["unavailable"]
    assert set(r["registries"].values()) == {"MegatronMappingRegistry"}
    assert r["qwen3"] == {"rotary_base": 1e6, "qk_layernorm": True, "activation": "silu"}
    if r["bridge"] == "0.6.2":
        # Gemma3ModelProvider's own defaults under its bridge's record (the fixture's config:
        # window 8, query_pre_attn_scalar 32, RoPE bases 1e4 local / 1e6 global)
        assert r["gemma3"] == {
            "layernorm_zero_centered_gamma": True, "interleaved_attn_pattern": [5, 1],
            "qk_layernorm": True, "window_size": 8, "softmax_scale": 1 / 32**0.5,
            "rotary_base": [1e4, 1e6], "share_embeddings_and_output_weights": True,
            "normalization": "RMSNorm",
        }  # fmt: skip
        # checkpoints the provider would not build faithfully are refused by name
        assert "final_logit_softcapping" in r["gemma3_refused"]["softcap"]
        assert "interleaved_attn_pattern" in r["gemma3_refused"]["layer_types"]
