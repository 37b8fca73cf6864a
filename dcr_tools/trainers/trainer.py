"""A small reference trainer for tests, benchmarks and the demo: CPU layer, process group, a
GPTModel loaded from an HF checkpoint through the bridge, Megatron DDP + Megatron Adam, and two
kinds of real optimizer steps: `Trainer.step` (next-token loss on a deterministic random batch)
and `Trainer.pg_step` (a REINFORCE-style policy-gradient step on sampled completions).

Production jobs use their own training stack; DCR needs only their model chunks and optimizer.

Limitations:
1. PP=1; every rank of a TP group must pass the same samples to `pg_step` (the owner service
   broadcasts them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dcr_hooks import cpu_compat

SEQ = 16


def start(ckpt: str, tp: int, ep: int) -> tuple[dict, Any, dict[str, torch.Tensor]]:
    """Initialise this rank and return (HF config, GPTModel loaded with the fixture, HF tensors)."""
    cpu_compat.enable()
    dist.init_process_group("gloo")
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dcr_tools.trainers.model import ParallelLayout, build_gpt_model
    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.conversion import hf_getter, load_hf_weights
    from shared_codec.checkpoint import load_checkpoint

    ParallelLayout(tp=tp, ep=ep).initialize()
    model_parallel_cuda_manual_seed(1234)
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    hf = load_checkpoint(ckpt)
    model = build_gpt_model(cfg, ParallelLayout(tp=tp, ep=ep))
    load_hf_weights(model, architecture_of(cfg), hf_getter(hf))
    return cfg, model, hf


class Trainer:
    """Megatron DDP + Megatron Adam; `step(i)` runs one real training step."""

    def __init__(self, model: Any, cfg: dict, *, distributed_optimizer: bool, lr: float) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg = cfg
        self.ddp = DDP(
            model.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
            ),
            model,
        )
        self.opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                bf16=True,
                weight_decay=0.0,
                clip_grad=1.0,
                use_distributed_optimizer=distributed_optimizer,
            ),
            [self.ddp],
        )
        self.dp_rank = ps.get_data_parallel_rank()
        self.pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)

    def step(self, i: int) -> tuple[float, float]:
        """One step on a deterministic random batch (different per DP rank): (loss, grad norm)."""
        from megatron.core.distributed import finalize_model_grads

        g = torch.Generator().manual_seed(100 + i * 10 + self.dp_rank)
        batch = torch.randint(0, self.cfg["vocab_size"], (2, SEQ + 1), generator=g)
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        loss = self.ddp(batch[:, :-1], self.pos, attention_mask=None, labels=batch[:, 1:])
        loss = loss.float().mean()
        loss.backward()
        finalize_model_grads([self.ddp])
        ok, grad_norm, _ = self.opt.step()
        if not ok:
            raise AssertionError(f"optimizer step {i} skipped")
        return float(loss.item()), float(grad_norm)

    def pg_step(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One policy-gradient step. Each sample: ``prompt`` and ``completion`` (token ids) and
        ``advantage``; the loss is the advantage-weighted negative log-likelihood of the
        completion tokens, averaged over completion tokens (REINFORCE with a baseline)."""
        from megatron.core.distributed import finalize_model_grads

        if not samples:
            raise ValueError("pg_step needs at least one sample")
        seqs = [list(s["prompt"]) + list(s["completion"]) for s in samples]
        width = max(len(x) for x in seqs)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        weight = torch.zeros(len(seqs), width - 1, dtype=torch.float32)
        for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
            tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            start = len(s["prompt"]) - 1  # label position of the first completion token
            weight[i, start : len(seq) - 1] = float(s["advantage"])
        n_tokens = max(1, sum(len(s["completion"]) for s in samples))
        pos = torch.arange(width - 1).unsqueeze(0).expand(len(seqs), width - 1)
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        nll = self.ddp(tokens[:, :-1], pos, attention_mask=None, labels=tokens[:, 1:])
        loss = (nll.float() * weight).sum() / n_tokens
        loss.backward()
        finalize_model_grads([self.ddp])
        ok, grad_norm, _ = self.opt.step()
        if not ok:
            raise RuntimeError("optimizer step skipped (non-finite gradients)")
        return {"pg_loss": float(loss.item()), "grad_norm": float(grad_norm or 0.0)}
