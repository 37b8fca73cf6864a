"""Tiny-model fixtures: deterministic bytes, the shapes the issue asks for, loadable offline."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from dcr_tools.fixtures import FAMILIES, KINDS, canonical_shapes, spec_for, write_tiny_model
from shared_codec.checkpoint import bits_equal, load_checkpoint, tensor_digest


def _file_digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_bytes_other_seed_other_weights(kind: str, tmp_path: Path) -> None:
    a = write_tiny_model(kind, tmp_path / "a", seed=3)
    b = write_tiny_model(kind, tmp_path / "b", seed=3)
    c = write_tiny_model(kind, tmp_path / "c", seed=4)
    assert _file_digests(a) == _file_digests(b)
    wa, wc = load_checkpoint(a), load_checkpoint(c)
    assert set(wa) == set(wc)
    assert all(not bits_equal(wa[n], wc[n]) for n in wa)


def test_fixture_shapes(tiny_models: dict[str, Path]) -> None:
    dense = load_checkpoint(tiny_models["qwen3"])
    cfg = json.loads((tiny_models["qwen3"] / "config.json").read_text())
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert "lm_head.weight" in dense and not cfg["tie_word_embeddings"]
    tied = load_checkpoint(tiny_models["qwen3-tied"])
    tcfg = json.loads((tiny_models["qwen3-tied"] / "config.json").read_text())
    assert tcfg["tie_word_embeddings"] and "lm_head.weight" not in tied
    assert tied["model.embed_tokens.weight"].shape[0] == 500 and 500 % 64 != 0  # vLLM pads it
    moe = load_checkpoint(tiny_models["qwen3-moe"])
    mcfg = json.loads((tiny_models["qwen3-moe"] / "config.json").read_text())
    assert (mcfg["num_experts"], mcfg["num_experts_per_tok"]) == (8, 2)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in moe
    llama = load_checkpoint(tiny_models["llama"])
    assert "lm_head.weight" in llama  # untied
    assert not any("q_norm" in n or n.endswith(".bias") for n in llama)  # no QK-norm, no bias
    qwen2 = load_checkpoint(tiny_models["qwen2"])
    assert "model.layers.0.self_attn.k_proj.bias" in qwen2  # QKV biases
    assert not any("q_norm" in n for n in qwen2)
    gemma3 = load_checkpoint(tiny_models["gemma3"])
    gcfg = json.loads((tiny_models["gemma3"] / "config.json").read_text())
    assert gcfg["tie_word_embeddings"] and "lm_head.weight" not in gemma3
    assert gcfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert {"model.layers.5.pre_feedforward_layernorm.weight",
            "model.layers.5.post_feedforward_layernorm.weight",
            "model.layers.5.self_attn.q_norm.weight"} <= set(gemma3)  # fmt: skip
    # zero-centred norms (applied as 1 + w): stored near 0
    assert all(float(t.float().abs().mean()) < 0.5 for n, t in gemma3.items() if "norm" in n)
    nemo = load_checkpoint(tiny_models["nemotron-h"])
    ncfg = json.loads((tiny_models["nemotron-h"] / "config.json").read_text())
    assert ncfg["hybrid_override_pattern"] == "M*M-"  # Mamba-2, attention, Mamba-2, MLP
    assert (
        "backbone.layers.0.mixer.A_log" in nemo and "backbone.layers.2.mixer.conv1d.weight" in nemo
    )
    assert "backbone.layers.1.mixer.q_proj.weight" in nemo
    assert "backbone.layers.3.mixer.up_proj.weight" in nemo
    for kind in KINDS:
        arch = json.loads((tiny_models[kind] / "config.json").read_text())["architectures"]
        assert arch == [FAMILIES[kind][0]]
    for kind, weights in (
        ("qwen3", dense),
        ("qwen3-tied", tied),
        ("qwen3-moe", moe),
        ("llama", llama),
        ("qwen2", qwen2),
        ("deepseek-v3", load_checkpoint(tiny_models["deepseek-v3"])),
        ("gemma3", gemma3),
        ("gpt-oss", load_checkpoint(tiny_models["gpt-oss"])),
        ("nemotron-h", load_checkpoint(tiny_models["nemotron-h"])),
    ):
        shapes = canonical_shapes(spec_for(kind))
        assert {n: tuple(t.shape) for n, t in weights.items()} == shapes
        assert all(t.dtype == torch.bfloat16 for t in weights.values())


def _transformers_name(name: str) -> str:
    """transformers 5 renames Nemotron-H's ``backbone.`` prefix to ``model.`` when loading
    (transformers/conversion_mapping.py, ``"nemotron_h": [WeightRenaming("backbone.", "model.")``)."""
    return "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name


def test_loads_offline_with_transformers(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for kind in KINDS:
        path = tiny_models[kind]
        tok = AutoTokenizer.from_pretrained(path)
        cfg = AutoConfig.from_pretrained(path)
        assert len(tok) == cfg.vocab_size
        ids = tok("hello world the policy").input_ids
        assert ids and tok.decode(ids) == "hello world the policy"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        state = model.state_dict()
        ckpt = load_checkpoint(path)
        checked = 0
        for name, t in ckpt.items():
            if ".mlp.experts." in name:
                continue  # transformers 5 fuses experts into one [E, ...] parameter
            got = state[_transformers_name(name)]
            if got.dtype != t.dtype:  # DeepSeek-V3's router bias is kept in fp32 (widened)
                assert got.element_size() > t.element_size(), name
                got = got.to(t.dtype)  # a widening round-trips exactly
            assert tensor_digest(got) == tensor_digest(t), name
            checked += 1
        assert checked >= len(ckpt) // 4


def test_unknown_kind_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        write_tiny_model("gpt2", tmp_path)
