"""Rank program for tests/integration/megatron/test_gemma3_builder.py (torchrun, gloo, TP = world size).

Builds the CPU Gemma-3 model (dcr_tools/trainers/gemma3.py) from the tiny ``gemma3`` fixture,
runs one forward pass over 20 tokens (longer than the fixture's sliding window of 8), gathers
the vocabulary-parallel logits, and on rank 0 compares them with transformers'
``Gemma3ForCausalLM`` (eager attention) on the same checkpoint, once as it is and once with the
sliding window removed from the reference. Writes a JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dcr_tools.trainers.model import ParallelLayout
from dcr_tools.trainers.trainer import start_chunks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--report", required=True)
    args = ap.parse_args()

    layout = ParallelLayout(tp=int(os.environ["WORLD_SIZE"]))
    cfg, chunks, _ = start_chunks(args.ckpt, layout)
    model = chunks[0].eval()
    ids = torch.randint(0, cfg["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        local = model(ids, pos, attention_mask=None).float().contiguous()  # [b, s, v / tp]
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    megatron = torch.cat(parts, dim=-1)
    if dist.get_rank() == 0:
        from transformers import Gemma3ForCausalLM

        ref = Gemma3ForCausalLM.from_pretrained(
            args.ckpt, dtype=torch.bfloat16, attn_implementation="eager"
        ).eval()
        with torch.no_grad():
            windowed = ref(ids).logits.float()
            # transformers 5 builds the sliding mask from the config, the layers keep a copy
            ref.config.sliding_window = 10**6
            for layer in ref.model.layers:
                layer.self_attn.sliding_window = None
            unwindowed = ref(ids).logits.float()
        report = {
            "shape": list(megatron.shape),
            "ref_shape": list(windowed.shape),
            "max_abs_logit": float(windowed.abs().max()),
            "max_abs_diff": float((megatron - windowed).abs().max()),
            "max_abs_diff_without_window": float((megatron - unwindowed).abs().max()),
            "argmax_agree": float((megatron.argmax(-1) == windowed.argmax(-1)).float().mean()),
        }
        Path(args.report).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
