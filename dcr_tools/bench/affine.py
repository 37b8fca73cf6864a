"""``dcr bench affine``: the affine share of canonical weight bytes per verified family.

Runs as a 2-rank gloo job (torchrun, TP=2; GPT-OSS with expert TP 1, `LAYOUTS`). For each verified family (the fixture kinds) it
builds the tiny model from the bridge's provider settings, classifies every conversion task by
probing the bridge (``tasks.build_tasks``: affine = a pure placement of source elements), once as
DCR runs (every mapping that is affine is projected) and once with ``QKVMapping`` forced residual
(the paper's setting for its 96.3%). Reported per family: the share measured on the tiny model,
and the share projected to a published model size: the measured classification of each canonical
tensor (layer and expert indices folded) weighted by that tensor's bytes at the published shape
(``fixtures.canonical_shapes`` with the published dimensions). Rank 0 prints the table and
writes the JSON.

Limitations:
1. The projection assumes the published model has the same tensor set as the tiny fixture of its
   family (true for these dense and MoE configs; checked: every projected name is classified).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

#: fixture kind -> (published model, its dimensions as fixture overrides)
PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "Llama-3.1-8B",
        {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128},
    ),
    "qwen2": (
        "Qwen2-7B",
        {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
         "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
         "head_dim": 128},
    ),
    "qwen3": (
        "Qwen3-8B",
        {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
         "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128},
    ),
    "qwen3-moe": (
        "Qwen3-30B-A3B",
        {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
         "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
         "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
         "moe_intermediate_size": 768},
    ),
    # text-only Gemma3ForCausalLM; these dimensions give its 999,885,952 parameters
    "gemma3": (
        "Gemma-3-1B",
        {"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
         "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 256},
    ),
    # DeepSeek-V2-Lite's dimensions (15.7B; no query LoRA, like the fixture: DeepSeek-V3's own
    # q_lora_rank 1536 adds tensors the fixture does not have) in the V3 layout the fixture has
    # (plus the router's score-correction bias per MoE layer)
    "deepseek-v3": (
        "DeepSeek-V2-Lite dims",
        {"vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
         "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
         "num_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
         "extra": {"n_shared_experts": 2, "qk_nope_head_dim": 128, "v_head_dim": 128}},
    ),
    # gpt-oss-20b's config.json: 24 layers, 32 experts (top-4), 64 query / 8 KV heads of 64
    "gpt-oss": (
        "gpt-oss-20b",
        {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
         "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
         "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4},
    ),
    # Nemotron-H-8B-Base-8K's config.json: 52 layers (24 Mamba-2, 4 attention, 24 MLP)
    "nemotron-h": (
        "Nemotron-H-8B",
        {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 21504,
         "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128,
         "extra": {"hybrid_override_pattern": NEMOTRON_H_8B_PATTERN, "mamba_num_heads": 128,
                   "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128}},
    ),
}  # fmt: skip

SETTINGS = {"dcr": (), "qkv_residual": ("QKVMapping",)}

#: per family, `ParallelLayout` fields other than TP=2: megatron-core allows GPT-OSS's biased
#: experts only at expert TP 1 (``transformer_config.py``: "Bias in Moe is only supported when
#: ETP==1")
LAYOUTS: dict[str, dict[str, Any]] = {"gpt-oss": {"expert_tp": 1}}


def fold(name: str) -> str:
    """Canonical name with layer and expert indices replaced by ``*``."""
    return re.sub(r"\.\d+\.", ".*.", name)


def classify(model: Any, config: dict[str, Any], force: tuple[str, ...]) -> dict[str, Any]:
    """Measured classification (folded canonical name -> affine?) and the tiny model's share.
    `config`: the HF config (bridges such as Nemotron-H's build their registry from it)."""
    from megatron_dcr_hooks.groups import ParallelGroups
    from megatron_dcr_hooks.tasks import TaskKind, affine_share, build_tasks

    tasks = build_tasks(model, config, ParallelGroups.from_megatron(), force_residual=force)
    kinds: dict[str, bool] = {}
    for t in tasks:
        for name in t.hf_shapes:
            affine = t.kind is TaskKind.AFFINE
            prev = kinds.setdefault(fold(name), affine)
            if prev != affine:
                raise AssertionError(f"{fold(name)} is affine in one layer and not in another")
    return {"kinds": kinds, "tiny": affine_share(tasks)}


def projected_share(kind: str, kinds: dict[str, bool]) -> dict[str, float]:
    from dcr_tools.fixtures import canonical_shapes, spec_for

    shapes = canonical_shapes(spec_for(kind, **PUBLISHED[kind][1]))
    total = affine = 0
    for name, shape in shapes.items():
        folded = fold(name)
        if folded not in kinds:
            raise AssertionError(f"{name} of the published shape was not classified")
        nbytes = int(np.prod(shape)) * 2  # bf16
        total += nbytes
        affine += nbytes if kinds[folded] else 0
    return {"affine_bytes": affine, "canonical_bytes": total, "affine_share": affine / total}


def main() -> int:
    ap = argparse.ArgumentParser(prog="dcr bench affine")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from megatron_dcr_hooks import cpu_compat

    cpu_compat.enable()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dcr_tools.fixtures import hf_config, spec_for
    from dcr_tools.trainers.model import ParallelLayout, build_gpt_chunks
    from megatron_dcr_hooks.bridge_registry import architecture_of

    layout: ParallelLayout | None = None
    rows = []
    for kind in PUBLISHED:
        want = ParallelLayout(tp=2, **LAYOUTS.get(kind, {}))
        if want != layout:
            if layout is not None:
                parallel_state.destroy_model_parallel()
            layout = want
            layout.initialize()
            model_parallel_cuda_manual_seed(1234)
        cfg = hf_config(spec_for(kind))
        arch = architecture_of(cfg)
        (model,) = build_gpt_chunks(cfg, layout)
        row: dict[str, Any] = {
            "family": kind,
            "architecture": arch,
            "published": PUBLISHED[kind][0],
        }
        for setting, force in SETTINGS.items():
            c = classify(model, cfg, force)
            row[setting] = {
                "tiny": c["tiny"],
                "published": projected_share(kind, c["kinds"]),
                "residual_tensors": sorted(k for k, v in c["kinds"].items() if not v),
            }
        rows.append(row)
    if dist.get_rank() == 0:
        print(f"{'family':10s} {'architecture':24s} {'published':15s} "
              f"{'DCR tiny':>9s} {'DCR pub':>8s} {'QKV-res tiny':>13s} {'QKV-res pub':>12s}")  # fmt: skip
        for r in rows:
            print(
                f"{r['family']:10s} {r['architecture']:24s} {r['published']:15s} "
                f"{100 * r['dcr']['tiny']['affine_share']:8.2f}% "
                f"{100 * r['dcr']['published']['affine_share']:7.2f}% "
                f"{100 * r['qkv_residual']['tiny']['affine_share']:12.2f}% "
                f"{100 * r['qkv_residual']['published']['affine_share']:11.2f}%"
            )
        if args.json:
            Path(args.json).write_text(json.dumps({"families": rows}, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
