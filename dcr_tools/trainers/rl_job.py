"""A Megatron trainer job that serves DCR: ``python -m torch.distributed.run --nproc_per_node N
-m dcr_tools.trainers.rl_job --ckpt HF_DIR --tp T --endpoint tcp://HOST:PORT (--store SPEC |
--relay tcp://ROOT:PORT)``.

Every rank loads the HF checkpoint into a GPTModel through the bridge (`trainer.py`), attaches
the DCR owner hook (mode X, no optimizer wrapping: the coordinator decides when to build; with
``--quantization FMT`` it sends quantized deltas for engines serving that format), and serves the owner service (`service.py`) with the loop's own ops:

- ``pg_step`` {samples: [{prompt, completion, advantage}]}: one policy-gradient optimizer step;
- ``train`` {step}: one next-token optimizer step on a deterministic random batch;
- ``export`` {path}: the bridge's full HF export written by rank 0 (dense-refit references and
  the checkpoints restarted receivers restore from);
- ``inject`` {rate, seed}: change a uniform share `rate` of every parameter's elements by
  relative amplitude 1e-2, identically on replicas (benchmarks).

Used by the demo (`dcr demo`) and the coordinator tests. CPU only here (gloo, the CPU layer).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch.distributed as dist


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="HF checkpoint directory (the v0 policy)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--endpoint", required=True, help="ZeroMQ address rank 0 binds")
    ap.add_argument("--store", default="", help="store spec (JSON) the payloads go to")
    ap.add_argument("--relay", default="", help="relay-tree root address the payloads go to")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--bucket-bytes", type=int, default=1 << 16)
    ap.add_argument("--min-bucket-bytes", type=int, default=1 << 16, help="the taper's floor")
    ap.add_argument(
        "--quantization", default="", help="the engines' quantized format (DCRConfig.quantization)"
    )
    ap.add_argument(
        "--overwrite-only", default="", help="comma-separated tensors the engines take no XOR for"
    )
    args = ap.parse_args(argv)

    from dcr_tools.trainers.trainer import Trainer, start

    cfg, model, _ = start(args.ckpt, args.tp, 1)
    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.conversion import export_hf_weights
    from megatron_dcr_hooks.hook import DCRConfig, DCRHook
    from megatron_dcr_hooks.service import Handler, OwnerService
    from shared_codec.checkpoint import save_checkpoint

    trainer = Trainer(model, cfg, distributed_optimizer=False, lr=args.lr)
    hook = DCRHook(
        [model],
        DCRConfig(
            architecture=architecture_of(cfg),
            wrap_step=False,
            bucket_bytes=args.bucket_bytes,
            min_bucket_bytes=args.min_bucket_bytes,
            quantization=args.quantization or None,
            overwrite_only=frozenset(n for n in args.overwrite_only.split(",") if n),
        ),
    )

    def train(req: dict[str, Any]) -> dict[str, Any]:
        loss, grad_norm = trainer.step(int(req["step"]))
        return {"loss": loss, "grad_norm": grad_norm}

    def pg_step(req: dict[str, Any]) -> dict[str, Any]:
        return trainer.pg_step(list(req["samples"]))

    def export(req: dict[str, Any]) -> dict[str, Any]:
        tensors = export_hf_weights(model, architecture_of(cfg))
        if dist.get_rank() == 0:
            save_checkpoint(tensors, req["path"], like=args.ckpt)
        dist.barrier()
        return {"path": req["path"], "tensors": len(tensors)}

    def inject(req: dict[str, Any]) -> dict[str, Any]:
        from dcr_tools.bench.construct import inject as perturb

        perturb(model, float(req["rate"]), int(req.get("seed", 0)))
        return {"rate": float(req["rate"])}

    handlers: dict[str, Handler] = {
        "train": train,
        "pg_step": pg_step,
        "export": export,
        "inject": inject,
    }
    if bool(args.store) == bool(args.relay):
        raise SystemExit("rl_trainer: give exactly one of --store SPEC and --relay ADDRESS")
    # one sink spec either way (shared_codec.transport.spec): a store, or the relay tree's root
    transport = args.store or {"kind": "relay", "root": args.relay}
    service = OwnerService(hook, transport, args.endpoint, handlers)
    service.serve()
    service.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
