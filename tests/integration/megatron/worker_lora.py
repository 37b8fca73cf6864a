"""Megatron rank program for tests/integration/megatron/test_lora_owner.py (torchrun, gloo).

Builds the tiny Llama as a Megatron GPTModel at TP = world size, applies megatron-bridge's LoRA
(megatron_dcr_hooks.lora), and trains the adapters for a few steps. After every step each rank
hands the adapter's PEFT tensors (the bridge's gathered export) to the named-tensor owner;
rank 0 builds, verifies and commits the version's payloads on the transport and writes the
trainer's adapter of that version as a PEFT directory (the test's oracle). Rank 0 writes a JSON
report; a failed check raises, so the job exits non-zero.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="the tiny HF checkpoint (its config.json)")
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--report", required=True)
    args = ap.parse_args()

    from megatron_dcr_hooks import cpu_compat

    cpu_compat.enable()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dcr_tools.trainers.model import ParallelLayout, build_gpt_model
    from megatron_dcr_hooks.lora import MegatronLoRA
    from shared_codec.errors import CompatibilityError
    from shared_codec.named import NamedOwnerConfig, NamedTensorOwner
    from shared_codec.peft import write_adapter

    layout = ParallelLayout(tp=world)
    layout.initialize()
    model_parallel_cuda_manual_seed(1234)
    cfg = json.loads((Path(args.ckpt) / "config.json").read_text())
    try:
        lora = MegatronLoRA(cfg, dim=8, alpha=16)
    except CompatibilityError as e:  # megatron-bridge 0.3.1 (the Python 3.11 trainer lane)
        if rank == 0:
            Path(args.report).write_text(json.dumps({"unsupported": str(e)}))
        dist.destroy_process_group()
        return
    chunks = lora.apply([build_gpt_model(cfg, layout)])
    trainable = [p for c in chunks for p in c.parameters() if p.requires_grad]
    with torch.no_grad():  # lora_B starts at zero: give the adapter an effect from step 0
        for p in trainable:
            p.normal_(0.0, 0.05)
    optimizer = torch.optim.SGD(trainable, lr=0.5)
    store = {"kind": "dir", "root": args.store}
    out = Path(args.out)

    tensors = lora.adapter_tensors(chunks)
    config = lora.peft_config(args.ckpt, list(tensors))
    owner = NamedTensorOwner(
        store, tensors, group=dist.group.WORLD, config=NamedOwnerConfig(encode_threads=0)
    )
    report: dict = {"world": world, "tensors": {n: list(t.shape) for n, t in tensors.items()}}
    if rank == 0:
        write_adapter(out / "v0", config, tensors)
    gen = torch.Generator().manual_seed(7)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, cfg["vocab_size"], (2, 16), generator=gen)
        positions = torch.arange(16).expand(2, 16)
        loss = chunks[0](tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tensors = lora.adapter_tensors(chunks)  # a collective: every rank
        owner.take_weights(tensors.items())  # a collective: every rank
        if rank == 0:
            built = owner.build(step, 0, False)
            owner.verify(step)
            owner.commit(step)
            write_adapter(out / f"v{step}", config, tensors)
            report.setdefault("builds", []).append(built.to_wire())
            report.setdefault("losses", []).append(float(loss))
        dist.barrier()
    if rank == 0:
        Path(args.report).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
