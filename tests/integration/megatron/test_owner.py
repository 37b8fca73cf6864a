"""Owner side on real megatron-core ranks (2 or 4 gloo ranks, torchrun): after real optimizer
steps the emitted records, applied to the v0 canonical export, equal the bridge's v1 export bit
for bit in modes X, P and F; no destination is emitted twice across owners; the ranks' owned
elements add up to the canonical element count (one owner per element); a step-less build emits
nothing; a partial attempt plus an overwrite retry is exact. `LAYOUTS` runs the same checks on
parallel layouts (PP, virtual pipeline stages, SP, ETP, TPxPP, CP in the process groups, EP x
ETP with the allgather MoE dispatcher: README, "Parallel layouts") and the distributed optimizer
with ``overlap_param_gather``. Rank program: worker_owner.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dcr_tools.procs import run_torchrun

WORKER = Path(__file__).with_name("worker_owner.py")


def _slow(case: tuple) -> Any:
    return pytest.param(case, marks=pytest.mark.slow)


_OSS_EXPERTS = ["--force-residual", "GPTOSSMLPGateUpProjMapping,GPTOSSMLPDownProjMapping"]

CASES = [
    ("tp2", "qwen3", 2, 1, []),
    ("dp2-distopt", "qwen3", 1, 1, ["--distributed-optimizer"]),
    ("moe-ep2", "qwen3-moe", 1, 2, []),
    ("tp2-qkv-residual", "qwen3", 2, 1, ["--force-residual", "QKVMapping"]),
    ("tied-tp2", "qwen3-tied", 2, 1, []),
    ("llama-tp2", "llama", 2, 1, []),  # Llama-3 style: untied, no QK-norm
    ("qwen2-tp2", "qwen2", 2, 1, []),  # Qwen2: QKV biases
    # DeepSeek-V3: MLA, a dense first layer, routed + shared experts; MoE with TP=2 turns on
    # SP, experts are TP-split (ETP=TP); the router's expert bias is a persistent fp32 buffer
    # updated outside the optimizer. ~50-90 s here (MLA's 512-wide latent), so slow lane
    _slow(("deepseek-v3-tp2", "deepseek-v3", 2, 1, [])),
    # Gemma-3: 5 sliding-window layers + 1 global, norms fused into linear_qkv / linear_fc1
    # (layer_norm_weight) and after linear_proj / linear_fc2 (post_layernorm), zero-centred
    # gammas, tied embeddings (dcr_tools/trainers/gemma3.py)
    ("gemma3-tp2", "gemma3", 2, 1, []),
    # GPT-OSS: YaRN RoPE, attention sinks (learnable softmax offsets, TP-split), q/k/v/o and
    # router biases, experts with biases and the clamped GLU, stacked in one HF tensor per
    # layer (megatron-bridge's grouped export); MoE with TP=2 turns on SP; experts are whole on
    # each rank (ETP=1: megatron allows expert biases only there)
    ("gpt-oss-tp2", "gpt-oss", 2, 1, ["--etp", "1"]),
    # the stacked experts through residual conversion (grouped tasks convert as whole groups)
    _slow(("gpt-oss-tp2-experts-residual", "gpt-oss", 2, 1, ["--etp", "1", *_OSS_EXPERTS])),
    # Nemotron-H (hybrid Mamba-2 / attention / MLP, pattern M*M-): megatron-core's HybridModel
    # with local specs; the Mamba scan kernels are dcr_tools/trainers/mamba_reference.py's
    # labelled plain-PyTorch stand-in (mamba_ssm is CUDA-only). in_proj [z x B C dt] and
    # conv1d [x B C] are per-component TP splits; A_log and D are fp32 parameters. Both lanes:
    # HybridModel (megatron-core 0.19.2 / bridge 0.6.2) and MambaModel (0.16.1 / bridge 0.3.1)
    ("nemotron-h-tp2", "nemotron-h", 2, 1, []),
]

#: kind -> (oldest megatron-bridge that converts its CPU model, why older ones do not)
NEEDS_BRIDGE = {
    "deepseek-v3": (
        "0.4",
        "megatron-bridge 0.3.1's DeepSeek mappings (models/deepseek/common.py) cover grouped-GEMM "
        "experts (experts.linear_fc1.weight*) only, not the local SequentialMLP experts "
        "(experts.local_experts.*) the CPU builder makes",
    ),
    "gemma3": (
        "0.6.2",
        "megatron-bridge 0.3.1's Gemma3 provider_bridge (models/gemma/gemma3_bridge.py) loads "
        "the HF config again with AutoConfig.from_pretrained(hf_pretrained._model_name_or_path) "
        "and reads rope_local_base_freq / rope_theta at the config's top level (transformers 4 "
        "layout), so it cannot run on a transformers 5 config dict; 0.6.2 is the oldest checked "
        "that does",
    ),
    "gpt-oss": (
        "0.6",
        "megatron-bridge 0.3.1's GPT-OSS bridge stacks the per-expert exports into one HF "
        "tensor in its bridge-level maybe_modify_converted_hf_weight, which DCR's conversion "
        "does not call (0.6.2 marks the mappings is_grouped_export, which DCR stacks); checked "
        "on 0.6.2 only",
    ),
}


def _trainer_bridge_version() -> str:
    """megatron-bridge's version in the interpreter trainer ranks run on."""
    import subprocess

    from dcr_tools.procs import trainer_python

    probe = "from importlib.metadata import version; print(version('megatron-bridge'))"
    out = subprocess.run(
        [trainer_python(), "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.strip()


def _needs_bridge(kind: str) -> None:
    """Skip, saying why, a family the trainer's megatron-bridge cannot convert (NEEDS_BRIDGE)."""
    if kind in NEEDS_BRIDGE:
        from packaging.version import Version

        oldest, why = NEEDS_BRIDGE[kind]
        if Version(_trainer_bridge_version()) < Version(oldest):
            pytest.skip(why)


def _case_id(case) -> str:
    return (case.values[0] if hasattr(case, "values") else case)[0]


@pytest.mark.megatron
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_owner_records_reproduce_the_bridge_export(case, tiny_models, tmp_path: Path) -> None:
    _, kind, tp, ep, extra = case
    _needs_bridge(kind)
    report = tmp_path / "report.json"
    run_torchrun(
        WORKER,
        ["--ckpt", str(tiny_models[kind]), "--tp", str(tp), "--ep", str(ep),
         "--dir", str(tmp_path / "p"), "--report", str(report), *extra],
        tmp=tmp_path,
    )  # fmt: skip
    r = json.loads(report.read_text())
    _check_report(r, extra)
    assert r["not_exported"] == []  # every checkpoint tensor is converted (buffers included)


def _check_report(r: dict, extra: list[str]) -> None:
    changed = r["X"]["canonical_changed_elements"]
    assert changed > 0
    for mode in ("X", "P", "F"):
        m = r[mode]
        assert m["mismatched_tensors"] == [], (mode, m["mismatched_tensors"])
        assert m["duplicate_destinations"] == 0
        assert m["entries"] == changed  # every changed element exactly once, nothing more
    assert r["X"]["xor_entries"] > 0
    assert r["P"]["xor_entries"] == 0 and r["F"]["xor_entries"] == 0
    assert r["quiet_items"] == 0
    for info in r["ranks"]:  # P and F on the NCCL-like world reduced over a gloo group of theirs
        assert info["world"]["X"] == {"world_takes_cpu": True, "reduced_over_world": True}
        for mode in ("P", "F"):
            assert info["world"][mode] == {"world_takes_cpu": False, "reduced_over_world": False}
    assert r["v2_differs_from_v1"] and r["retry_overwrite_only"]
    assert r["retry_mismatched"] == []
    for rank_info in r["ranks"]:
        x = rank_info["X"]
        if "--force-residual" in extra:
            assert x["residual_tasks"] > 0 and x["affine_share"] < 1.0
            assert x["residual_bytes"] > 0
        else:
            assert x["affine_share"] == 1.0 and x["residual_tasks"] == 0
        assert 0 < x["build"]["element_change_rate"] <= 1
    # ownership: exactly one owner per unique source element, so the ranks' owned elements add
    # up to the canonical element count
    owned = sum(info["X"]["build"]["owned_elements"] for info in r["ranks"])
    assert owned == r["X"]["canonical_elements"]


_TP2_EP2_ETP2 = ["--tp", "2", "--ep", "2", "--etp", "2"]

# id, kind, layers, ranks, worker args. Default lane: PP=2 and virtual stages on a dense and a
# MoE family, the lazy parameter gather and CP=2 (~12-35 s each); the rest in the slow lane.
LAYOUTS = [
    ("pp2", "qwen3", 2, 2, ["--pp", "2"]),
    ("vpp2", "qwen3", 4, 2, ["--pp", "2", "--vpp", "2"]),
    ("moe-pp2", "qwen3-moe", 2, 2, ["--pp", "2"]),
    ("distopt-overlap", "qwen3", 2, 2, ["--overlap-param-gather", "--check-skip"]),
    _slow(("tied-pp2", "qwen3-tied", 2, 2, ["--pp", "2"])),
    _slow(("sp-tp2", "qwen3", 2, 2, ["--tp", "2", "--sp"])),
    _slow(("moe-tp2-etp2-sp", "qwen3-moe", 2, 2, ["--tp", "2"])),  # MoE + TP forces SP; ETP=TP
    _slow(("moe-vpp2", "qwen3-moe", 4, 2, ["--pp", "2", "--vpp", "2"])),
    # EP=2 x ETP=2 (TP=2, SP forced, expert DP=1) with megatron's allgather dispatcher: the
    # default alltoall one all-gathers uneven token counts over expert TP when ETP > 1, which
    # gloo refuses; the expert parameter layout DCR reads is the same under either dispatcher
    _slow(
        ("moe-tp2-ep2-etp2-sp", "qwen3-moe", 2, 4, [*_TP2_EP2_ETP2, "--dispatcher", "allgather"])
    ),
    _slow(("tp2-pp2", "qwen3", 2, 4, ["--tp", "2", "--pp", "2"])),
    _slow(("tp2-pp2-vpp2", "qwen3", 4, 4, ["--tp", "2", "--pp", "2", "--vpp", "2"])),
    # CP=2 (DP=1) with the distributed optimizer: megatron's groups, DDP's gradient reduction,
    # the optimizer's shards and DCR's holder groups span DP x CP = 2 ranks, but the attention
    # is NOT context-parallel: megatron-core's local DotProductAttention refuses CP (TE only),
    # so the model is built with context_parallel_size=1 and each CP rank runs the whole
    # sequence (dcr_tools/trainers/model.py, limitation 4)
    ("cp2-distopt", "qwen3", 2, 2, ["--cp", "2", "--distributed-optimizer"]),
    # DeepSeek-V3 (MLA, dense first layer, routed + shared experts, the router's fp32 bias):
    # experts split over EP=2 (TP=1); and PP=2, which puts the dense layer and the MoE layer on
    # different stages (~50-90 s each: MLA's 512-wide latent)
    _slow(("deepseek-v3-ep2", "deepseek-v3", 2, 2, ["--ep", "2"])),
    _slow(("deepseek-v3-pp2", "deepseek-v3", 2, 2, ["--pp", "2"])),
    # Gemma-3 (6 layers): SP (the fused pre-norms run on sequence shards before the linear's
    # all-gather, the post-norms after its reduce-scatter) and PP=2 (tied embeddings across
    # stages, the provider's embedding on the first stage only)
    _slow(("gemma3-sp-tp2", "gemma3", 6, 2, ["--tp", "2", "--sp"])),
    _slow(("gemma3-pp2", "gemma3", 6, 2, ["--pp", "2"])),
    # Nemotron-H (4 layers, M*M-): sequence parallelism at TP=2 (the Mamba mixer's in_proj
    # all-gathers the sequence, out_proj reduce-scatters it), and DP=2 with the distributed
    # optimizer (A_log and D are fp32 parameters in the optimizer's shards)
    ("nemotron-h-sp-tp2", "nemotron-h", 4, 2, ["--tp", "2", "--sp"]),
    ("nemotron-h-dp2-distopt", "nemotron-h", 4, 2, ["--distributed-optimizer"]),
]


@pytest.mark.megatron
@pytest.mark.parametrize("case", LAYOUTS, ids=[_case_id(c) for c in LAYOUTS])
def test_owner_parallel_layouts(case, tiny_models, tmp_path: Path) -> None:
    _, kind, layers, ranks, extra = case
    _needs_bridge(kind)
    ckpt = tiny_models[kind]
    from dcr_tools.fixtures import spec_for, write_tiny_model

    if layers != spec_for(kind).num_hidden_layers:  # a virtual pipeline needs a layer per chunk
        ckpt = write_tiny_model(kind, tmp_path / "ckpt", seed=0, num_hidden_layers=layers)
    report = tmp_path / "report.json"
    run_torchrun(
        WORKER,
        ["--ckpt", str(ckpt), "--dir", str(tmp_path / "p"), "--report", str(report), *extra],
        tmp=tmp_path,
        nproc=ranks,
    )
    r = json.loads(report.read_text())
    _check_report(r, extra)
    if "--cp" in extra:
        cp = int(extra[extra.index("--cp") + 1])
        for info in r["ranks"]:
            g = info["groups"]
            assert g["cp"] == cp and g["dp_cp"] == g["dp"] * cp  # megatron's groups have CP
            assert g["ddp_reduce"] == g["dp_cp"] == g["dcr_holders"]  # reduced and owned over DPxCP
            assert g["model_cp"] == 1 and g["attention_cp"] == 1  # the sequence is not split
            assert info["X"]["build"]["owned_elements"] > 0  # each CP rank owns a share
    if "--dispatcher" in extra:
        want = {
            "allgather": "MoEAllGatherTokenDispatcher",
            "alltoall": "MoEAlltoAllTokenDispatcher",
        }
        dispatcher = want[extra[extra.index("--dispatcher") + 1]]
        for info in r["ranks"]:
            moe = info["moe"]
            assert moe["dispatchers"] == [dispatcher]  # every MoE layer trained with it
            for flag in ("ep", "etp"):
                if f"--{flag}" in extra:
                    assert moe[flag] == int(extra[extra.index(f"--{flag}") + 1])
            assert moe["ep"] * moe["etp"] * moe["expert_dp"] == ranks
    if "--check-skip" in extra:
        # a skipped iteration (non-finite gradients) publishes nothing and changes nothing
        assert r["skip"] == {"ok": False, "payloads": 0, "built": False, "params_unchanged": True}
