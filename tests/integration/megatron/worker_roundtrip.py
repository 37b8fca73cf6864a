"""Megatron rank program for tests/integration/megatron/test_megatron_cpu.py (run under torchrun, gloo).

Builds the tiny HF fixture as a Megatron GPTModel, loads it through megatron-bridge's mapping
classes, checks every local shard against an independent slice formula, exports back to HF
names (bit-exact round trip), compares logits with transformers, then runs real optimizer steps
with the Megatron optimizer and Megatron DDP. Rank 0 writes a JSON report; any failed check
raises, so the job exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dcr_tools.trainers.trainer import Trainer, start


def expected_shard(
    local_name: str,
    global_name: str,
    hf: dict,
    cfg: dict,
    tp: int,
    tp_rank: int,
    etp: int,
    etp_rank: int,
):
    """Independent slice formula (from ENVIRONMENT.md), not the bridge's code."""
    n = global_name
    L = lambda s: hf[s]  # noqa: E731
    m = n.split(".")
    if n == "embedding.word_embeddings.weight":
        return torch.chunk(L("model.embed_tokens.weight"), tp, 0)[tp_rank]
    if n == "output_layer.weight":
        return torch.chunk(L("lm_head.weight"), tp, 0)[tp_rank]
    if n == "decoder.final_layernorm.weight":
        return L("model.norm.weight")
    i = m[2]
    p = f"model.layers.{i}."
    rest = ".".join(m[3:])
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.router.weight": "mlp.gate.weight",
    }
    if rest in simple:
        return L(p + simple[rest])
    if rest == "self_attention.linear_qkv.weight":
        d, h = cfg["head_dim"], cfg["hidden_size"]
        ng, nh = cfg["num_key_value_heads"], cfg["num_attention_heads"]
        q = L(p + "self_attn.q_proj.weight").reshape(ng, nh // ng * d, h)
        k = L(p + "self_attn.k_proj.weight").reshape(ng, d, h)
        v = L(p + "self_attn.v_proj.weight").reshape(ng, d, h)
        fused = torch.cat([q, k, v], dim=1)
        per = ng // tp
        return fused[tp_rank * per : (tp_rank + 1) * per].reshape(-1, h)
    if rest == "self_attention.linear_proj.weight":
        return torch.chunk(L(p + "self_attn.o_proj.weight"), tp, 1)[tp_rank]
    if rest == "mlp.linear_fc1.weight":
        g = torch.chunk(L(p + "mlp.gate_proj.weight"), tp, 0)[tp_rank]
        u = torch.chunk(L(p + "mlp.up_proj.weight"), tp, 0)[tp_rank]
        return torch.cat([g, u], 0)
    if rest == "mlp.linear_fc2.weight":
        return torch.chunk(L(p + "mlp.down_proj.weight"), tp, 1)[tp_rank]
    if rest.startswith("mlp.experts.local_experts."):
        e = m[6]  # global expert index; experts split over expert-TP like dense MLPs
        if rest.endswith("linear_fc1.weight"):
            g = torch.chunk(L(p + f"mlp.experts.{e}.gate_proj.weight"), etp, 0)[etp_rank]
            u = torch.chunk(L(p + f"mlp.experts.{e}.up_proj.weight"), etp, 0)[etp_rank]
            return torch.cat([g, u])
        return torch.chunk(L(p + f"mlp.experts.{e}.down_proj.weight"), etp, 1)[etp_rank]
    raise AssertionError(f"no slice formula for {n}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--report", required=True)
    args = ap.parse_args()

    cfg, model, hf = start(args.ckpt, args.tp, args.ep)
    from megatron.core import parallel_state as ps

    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.conversion import conversion_tasks, export_hf_weights
    from shared_codec.checkpoint import bits_equal

    rank = dist.get_rank()
    model_type = architecture_of(cfg)
    tasks = conversion_tasks(model, model_type)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    report: dict = {
        "rank": rank,
        "tp": tp,
        "dp": ps.get_data_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "shards_checked": 0,
    }

    # 1. every local shard against the independent slice formula
    for t in tasks:
        want = expected_shard(
            t.local_name,
            t.global_name,
            hf,
            cfg,
            tp,
            tp_rank,
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
        )
        if not bits_equal(t.param.detach(), want.to(t.param.dtype)):
            raise AssertionError(f"rank {rank}: shard {t.local_name} ({t.global_name}) differs")
        report["shards_checked"] += 1

    # 2. round trip without training: export == fixture, bit for bit
    exported = export_hf_weights(model, model_type)
    if set(exported) != set(hf):
        raise AssertionError(f"export names differ: {sorted(set(exported) ^ set(hf))[:5]}")
    bad = [n for n in hf if not bits_equal(exported[n], hf[n])]
    if bad:
        raise AssertionError(f"rank {rank}: round trip not bit-exact for {bad[:5]}")
    report["roundtrip_tensors"] = len(exported)

    # 3. logits against transformers
    seq = 16
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg["vocab_size"], (2, seq), generator=gen)
    pos = torch.arange(seq).unsqueeze(0).expand(2, seq)
    model.eval()
    with torch.no_grad():
        local_logits = model(ids, pos, attention_mask=None)
    parts = [torch.empty_like(local_logits) for _ in range(tp)]
    dist.all_gather(parts, local_logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    meg = torch.cat(parts, dim=-1).float()
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = ref_model(ids).logits.float()
    scale = ref.abs().max().item()
    max_err = (meg - ref).abs().max().item()
    agree = (meg.argmax(-1) == ref.argmax(-1)).float().mean().item()
    report.update({"logits_max_abs_err": max_err, "logits_scale": scale, "argmax_agreement": agree})
    if max_err > 0.05 * scale + 1e-3:
        raise AssertionError(f"logits differ from transformers: max err {max_err} vs scale {scale}")

    # 4. real optimizer steps (Megatron DDP + Megatron optimizer)
    model.train()
    trainer = Trainer(model, cfg, distributed_optimizer=args.distributed_optimizer, lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for step in range(args.steps):
        loss, grad_norm = trainer.step(step)
        losses.append(loss)
    changed = sum(
        int((p.detach().view(torch.int16) != before[n].view(torch.int16)).sum())
        for n, p in model.named_parameters()
    )
    total = sum(p.numel() for p in model.parameters())
    report.update(
        {
            "losses": losses,
            "changed_elements": changed,
            "elements": total,
            "grad_norm": float(grad_norm),
        }
    )
    if changed == 0:
        raise AssertionError("optimizer steps changed no stored bits")
    # replicated tensors stay bitwise identical across TP ranks after training
    exported = export_hf_weights(model, model_type)
    for n in sorted(exported):
        t = exported[n].contiguous()
        ref_t = t.clone()
        dist.broadcast(ref_t, src=0)
        if not bits_equal(t, ref_t):
            raise AssertionError(f"rank {rank}: exported {n} differs from rank 0 after training")
    report["post_train_export_consistent"] = True
    if rank == 0:
        Path(args.report).write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
