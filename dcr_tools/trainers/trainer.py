"""A small reference trainer for tests, benchmarks and the demo: CPU layer, process group, a
GPTModel loaded from an HF checkpoint through the bridge, Megatron DDP + Megatron Adam, and two
kinds of real optimizer steps: `Trainer.step` (next-token loss on a deterministic random batch)
and `Trainer.pg_step` (a REINFORCE-style policy-gradient step on sampled completions).

Production jobs use their own training stack; DCR needs only their model chunks and optimizer.

With PP > 1 (`start_chunks`) `Trainer.step` runs megatron's pipeline schedule
(``get_forward_backward_func``: 1F1B, or interleaved with virtual stages) over the chunks.

Limitations:
1. `pg_step` is PP=1; every rank of a TP group must pass the same samples to it (the owner
   service broadcasts them).
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
    from dcr_tools.trainers.model import ParallelLayout

    cfg, chunks, hf = start_chunks(ckpt, ParallelLayout(tp=tp, ep=ep))
    return cfg, chunks[0], hf


def start_chunks(
    ckpt: str, layout: Any, **overrides: Any
) -> tuple[dict, list[Any], dict[str, torch.Tensor]]:
    """Initialise this rank for `layout` (a `ParallelLayout`) and return (HF config, this rank's
    model chunks loaded with the checkpoint, HF tensors). `overrides`: TransformerConfig fields
    set last (`model.transformer_config_from_hf`), e.g. ``moe_token_dispatcher_type``."""
    cpu_compat.enable()
    dist.init_process_group("gloo")
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dcr_tools.trainers.model import build_gpt_chunks
    from megatron_dcr_hooks.conversion import hf_getter, load_hf_weights
    from shared_codec.checkpoint import load_checkpoint

    layout.initialize()
    model_parallel_cuda_manual_seed(1234)
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    hf = load_checkpoint(ckpt)
    chunks = build_gpt_chunks(cfg, layout, **overrides)
    # the config, not only its architecture: some bridges build their registry from it
    load_hf_weights(chunks, cfg, hf_getter(hf))
    return cfg, chunks, hf


class Trainer:
    """Megatron DDP + Megatron Adam; `step(i)` runs one real training step."""

    def __init__(
        self,
        model: Any,
        cfg: dict,
        *,
        distributed_optimizer: bool,
        lr: float,
        overlap_param_gather: bool = False,
        loss_scale: float | None = None,
    ) -> None:
        """`model`: a GPTModel or a list of model chunks (pipeline stages of this rank).
        `overlap_param_gather` (distributed optimizer only): the updated parameters are
        all-gathered lazily, by forward pre-hooks of the next forward pass. `loss_scale`: a
        constant loss scale; with it the optimizer checks gradients for inf/NaN and skips the
        step (``step`` returns ok False) instead of applying them."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.cfg = cfg
        chunks = model if isinstance(model, list) else [model]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=distributed_optimizer,
            overlap_param_gather=overlap_param_gather,
            overlap_grad_reduce=overlap_param_gather,  # megatron requires both together
        )
        self.chunks = [
            DDP(c.config, ddp_config, c, disable_bucketing=(i > 0)) for i, c in enumerate(chunks)
        ]
        self.ddp = self.chunks[0]
        self.opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                bf16=True,
                weight_decay=0.0,
                clip_grad=1.0,
                use_distributed_optimizer=distributed_optimizer,
                overlap_param_gather=overlap_param_gather,
                loss_scale=loss_scale,
            ),
            self.chunks,
        )
        self.overlap_param_gather = overlap_param_gather
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        # batches are drawn on the host (the same tokens on any device), then moved to where the
        # parameters live: the CPU here, a GPU in the GPU lane (dcr_tools/bench/gpu_owner.py)
        self.device = next(chunks[0].parameters()).device
        self.pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ).to(self.device)

    def step(self, i: int) -> tuple[float, float]:
        """One step on a deterministic random batch (different per DP rank): (loss, grad norm)."""
        loss, ok, grad_norm = self._step(i, poison=False)
        if not ok:
            raise AssertionError(f"optimizer step {i} skipped")
        return loss, grad_norm

    def skipped_step(self, i: int) -> bool:
        """A step whose gradients are non-finite (one main gradient set to NaN after the
        backward pass): with a loss scale the optimizer skips it. Returns the optimizer's ok."""
        return self._step(i, poison=True)[1]

    def _step(self, i: int, *, poison: bool) -> tuple[float, bool, float]:
        from megatron.core.distributed import finalize_model_grads

        g = torch.Generator().manual_seed(100 + i * 10 + self.dp_rank)
        batch = torch.randint(0, self.cfg["vocab_size"], (2, SEQ + 1), generator=g).to(self.device)
        for c in self.chunks:
            c.zero_grad_buffer()
        self.opt.zero_grad()
        if self.pp > 1 or len(self.chunks) > 1 or self.overlap_param_gather:
            loss_value = self._pipeline_step(batch)
        else:
            loss = self.ddp(batch[:, :-1], self.pos, attention_mask=None, labels=batch[:, 1:])
            loss = loss.float().mean()
            loss.backward()
            finalize_model_grads([self.ddp])
            loss_value = float(loss.item())
        if poison:
            with torch.no_grad():
                next(iter(self.ddp.parameters())).main_grad.fill_(float("nan"))
        ok, grad_norm, _ = self.opt.step()
        return loss_value, bool(ok), float(grad_norm or 0.0)

    def _pipeline_step(self, batch: torch.Tensor) -> float:
        """Forward and backward through megatron's schedule (one microbatch per virtual stage
        at least, as the interleaved schedule needs); returns the loss on the last stage
        (0.0 elsewhere). Gradients are finalized by the schedule."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        config = self.chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [c.no_sync for c in self.chunks]
        config.grad_sync_func = [c.start_grad_sync for c in self.chunks]
        if len(self.chunks) == 1:
            config.no_sync_func = config.no_sync_func[0]
            config.grad_sync_func = config.grad_sync_func[0]
        n_micro = max(self.pp, len(self.chunks) * self.pp) if len(self.chunks) > 1 else 1
        micro = [batch] * n_micro
        pos = self.pos[:1]

        def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
            b = next(data_iterator)[:1]
            out = model(b[:, :-1], pos, attention_mask=None, labels=b[:, 1:])

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
                loss = output.float().mean()
                return loss, {"loss": loss.detach()}

            return out, loss_func

        data: Any = [iter(micro) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro)
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=n_micro,
            seq_length=SEQ,
            micro_batch_size=1,
            forward_only=False,
        )
        if not losses:
            return 0.0
        return float(sum(float(x["loss"]) for x in losses) / len(losses))

    def pg_step(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One policy-gradient step. Each sample: ``prompt`` and ``completion`` (token ids) and
        ``advantage``; the loss is the advantage-weighted negative log-likelihood of the
        completion tokens, averaged over completion tokens (REINFORCE with a baseline)."""
        from megatron.core.distributed import finalize_model_grads

        if not samples:
            raise ValueError("pg_step needs at least one sample")
        if self.pp > 1 or len(self.chunks) > 1:
            raise ValueError("pg_step runs one model chunk without pipeline parallelism (PP=1)")
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
        tokens, weight, pos = (t.to(self.device) for t in (tokens, weight, pos))
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
