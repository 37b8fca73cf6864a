"""Megatron rank program for tests/integration/test_quantized_end_to_end.py (torchrun, gloo).

Loads the tiny fixture into Megatron GPTModel chunks at TP=2 and attaches one owner hook per
quantized format (`DCRConfig.quantization`, mode X; the engines report every scale as
overwrite-only: vLLM loads compressed-tensors scales as float32). It runs real optimizer steps
and writes every rank's payloads to a directory per format:
- ``<fmt>/v1``: step 0, attempt 0;
- ``<fmt>/v2_attempt0``: step 1's attempt 0, then aborted;
- ``<fmt>/v2_retry``: the overwrite retry of version 2 from the same weights.
Rank 0 writes the bridge's BF16 exports v0, v1 and v2 (the oracle's input) and a JSON report
with each hook's build reports and baseline memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from dcr_tools.trainers.model import ParallelLayout
from dcr_tools.trainers.trainer import Trainer, start_chunks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--formats", required=True, help="comma-separated FORMATS names")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--exports", required=True)
    args = ap.parse_args()

    cfg, model, _ = start_chunks(args.ckpt, ParallelLayout(tp=args.tp))
    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.conversion import export_hf_weights
    from megatron_dcr_hooks.hook import DCRConfig, DCRHook
    from shared_codec.checkpoint import save_checkpoint
    from shared_codec.quantized import quantizes, scale_name

    rank = dist.get_rank()
    trainer = Trainer(model, cfg, distributed_optimizer=False, lr=3e-4)
    v0 = export_hf_weights(model, cfg)
    scales = frozenset(scale_name(n) for n in v0 if quantizes(n))
    hooks = {
        fmt: DCRHook(
            trainer.chunks,
            DCRConfig(
                architecture=architecture_of(cfg),
                hf_config=cfg,
                bucket_bytes=4096,
                wrap_step=False,
                quantization=fmt,
                overwrite_only=scales,
            ),
        )  # fmt: skip
        for fmt in args.formats.split(",")
    }
    out = Path(args.dir)

    def dump(fmt: str, tag: str) -> None:
        d = out / fmt / tag
        d.mkdir(parents=True, exist_ok=True)
        for i, p in enumerate(hooks[fmt].payloads):
            (d / f"rank{rank}_{i:04d}.bin").write_bytes(p)
        hooks[fmt].payloads.clear()

    reports: dict = {fmt: {} for fmt in hooks}
    trainer.step(0)
    v1 = export_hf_weights(model, cfg)
    for fmt, h in hooks.items():
        reports[fmt]["v1"] = vars(h.build(1, 0))
        dump(fmt, "v1")
        h.commit()
    trainer.step(1)
    v2 = export_hf_weights(model, cfg)
    for fmt, h in hooks.items():
        reports[fmt]["v2_attempt0"] = vars(h.build(2, 0))
        dump(fmt, "v2_attempt0")
        h.abort()
        reports[fmt]["v2_retry"] = vars(h.build(2, 1, retry=True))
        dump(fmt, "v2_retry")
        h.commit()
        reports[fmt]["memory"] = h.baseline_bytes()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, reports)  # test harness only: small plain dicts
    if rank == 0:
        for tag, tensors in (("v0", v0), ("v1", v1), ("v2", v2)):
            save_checkpoint(tensors, Path(args.exports) / tag, like=args.ckpt)
        Path(args.report).write_text(json.dumps(gathered, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
