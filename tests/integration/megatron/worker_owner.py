"""Megatron rank program for tests/integration/megatron/test_owner.py (torchrun, gloo).

Loads the tiny fixture into Megatron GPTModel chunks (any parallel layout: TP, PP with virtual
stages, EP, ETP, SP, distributed optimizer, and CP in the process groups only: the CPU model
runs the whole sequence on every CP rank, dcr_tools/trainers/model.py limitation 4; EP x ETP
needs ``--dispatcher allgather`` on gloo, limitation 5 there), attaches DCR hooks in modes X, P
and F, runs real optimizer steps, builds the deltas, and writes every rank's payloads to a
directory. Rank 0 then checks them against the bridge's full HF export: applied to the v0 export
they give the v1 export bit for bit (every tensor), for every mode; no destination is emitted
twice; a step-less build emits nothing; a partial attempt followed by an overwrite retry gives
v2 exactly. Hooks P and F run on a world group that rejects CPU tensors (the device-only TEST
DOUBLE standing in for NCCL, tests/device_only.py), hook X on the gloo world.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dcr_tools.trainers.model import ParallelLayout
from dcr_tools.trainers.trainer import Trainer, start_chunks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline stage")
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None, help="expert tensor parallel size")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism (TP > 1)")
    ap.add_argument(
        "--dispatcher",
        default="",
        help="MoE token dispatcher (default: the builder's alltoall; allgather for EP x ETP)",
    )
    ap.add_argument("--distributed-optimizer", action="store_true")
    ap.add_argument("--overlap-param-gather", action="store_true", help="lazy parameter all-gather")
    ap.add_argument(
        "--check-skip", action="store_true", help="a non-finite step must publish nothing"
    )
    ap.add_argument("--force-residual", default="")
    ap.add_argument(
        "--overwrite-only",
        default="",
        help="canonical tensors to send as overwrites (the receivers' prewarm overwrite_only)",
    )
    ap.add_argument("--dir", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--save-exports", default="", help="rank 0 writes the v0/v1 exports here")
    args = ap.parse_args()

    layout = ParallelLayout(
        tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep, sp=args.sp,
        expert_tp=args.etp,
    )  # fmt: skip
    overrides = {"moe_token_dispatcher_type": args.dispatcher} if args.dispatcher else {}
    cfg, model, _ = start_chunks(args.ckpt, layout, **overrides)
    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.conversion import export_hf_weights
    from megatron_dcr_hooks.hook import DCRConfig, DCRHook, enable_dcr
    from shared_codec.checkpoint import bits_equal, load_checkpoint, save_checkpoint
    from shared_codec.decode import decode_payload
    from shared_codec.dtypes import tensor_bits
    from shared_codec.records import Kind, apply_items

    rank = dist.get_rank()
    mtype = architecture_of(cfg)
    trainer = Trainer(
        model,
        cfg,
        distributed_optimizer=args.distributed_optimizer or args.overlap_param_gather,
        lr=3e-4,
        overlap_param_gather=args.overlap_param_gather,
        loss_scale=1.0 if args.check_skip else None,  # makes the optimizer check for NaN
    )
    opt = trainer.opt
    force = tuple(x for x in args.force_residual.split(",") if x)
    common = {
        "architecture": mtype,
        "bucket_bytes": 4096,
        "wrap_step": False,
        "force_residual": force,
        "overwrite_only": frozenset(x for x in args.overwrite_only.split(",") if x),
        "hf_config": cfg,  # DeepSeek-V3's bridge builds its mapping registry from the config
    }
    chunks = trainer.chunks  # DDP-wrapped, as a Megatron training loop holds them
    # hooks P and F get a world group that rejects CPU tensors, as an NCCL world does (TEST
    # DOUBLE, tests/device_only.py; megatron's own groups stay gloo for the CPU model): their
    # reductions must run on a gloo group the hook creates; hook X reduces over the gloo world
    from megatron_dcr_hooks.groups import ParallelGroups, RankGroup, takes_host_tensors
    from tests.device_only import device_only_world

    nccl_like = RankGroup(group=device_only_world(), rank=rank, size=dist.get_world_size())
    on_double = ParallelGroups.from_megatron().replace(world=nccl_like)
    hooks = {m: DCRHook(chunks, DCRConfig(mode=m, **common), groups=on_double) for m in ("P", "F")}
    # mode X through enable_dcr: the wrapped optimizer step builds version 1 automatically
    hooks["X"] = enable_dcr(chunks, opt, DCRConfig(mode="X", **{**common, "wrap_step": True}))
    v0 = export_hf_weights(model, cfg)

    def train_step(step: int) -> None:
        trainer.step(step)  # opt.step is wrapped: hook X builds its delta after the step

    def export() -> dict:
        """The oracle: the bridge's export of the updated parameters. With a lazy parameter
        all-gather the oracle finishes it first (the hooks above built before this)."""
        if args.overlap_param_gather:
            for c in trainer.chunks:
                c.start_param_sync(force_sync=True)
        return export_hf_weights(model, cfg)

    train_step(0)
    reports = {"X": hooks["X"].last_report}
    assert reports["X"] is not None and reports["X"].version == 1
    for m in ("P", "F"):
        reports[m] = hooks[m].build(1, 0)
    v1 = export()
    out = Path(args.dir)

    def dump(tag: str, payloads: list[bytes]) -> None:
        d = out / tag
        d.mkdir(parents=True, exist_ok=True)
        for i, p in enumerate(payloads):
            (d / f"rank{rank}_{i:04d}.bin").write_bytes(p)

    for m, h in hooks.items():
        dump(f"v1_{m}", h.payloads)
        h.payloads.clear()
        h.commit()
    # a build without a step emits nothing
    quiet = {m: h.build(2, 0) for m, h in hooks.items() if m != "X"}
    quiet_items = torch.tensor([sum(r.items for r in quiet.values())])
    dist.all_reduce(quiet_items)
    for h in hooks.values():
        h.payloads.clear()
        h.abort()
    # v1 -> v2: an attempt whose payloads are half applied, then an overwrite retry
    hx = hooks["X"]
    train_step(1)  # hook X built attempt 0 of version 2
    v2 = export()
    dump("v2_attempt0", hx.payloads)
    hx.payloads.clear()
    hx.abort()
    retry = hx.build(2, 1, retry=True)
    dump("v2_retry", hx.payloads)
    hx.payloads.clear()
    skip: dict = {}
    if args.check_skip:
        hx.commit()
        before = hx.last_report
        skip["ok"] = trainer.skipped_step(2)  # wrapped step: nothing may be built
        skip["payloads"] = len(hx.payloads)
        skip["built"] = hx.last_report is not before
        after = export()
        skip["params_unchanged"] = all(bits_equal(after[n], v2[n]) for n in v2)
    info: dict = {m: {**h.report(), "build": vars(reports[m])} for m, h in hooks.items()}
    info["world"] = {  # where each hook's reductions ran
        m: {
            "world_takes_cpu": takes_host_tensors(h.groups.world.group),
            "reduced_over_world": h.groups.cpu_world is h.groups.world,
        }
        for m, h in hooks.items()
    }
    from megatron.core import parallel_state as ps

    # who sees context parallelism: megatron's groups, DDP's gradient reduction group, DCR's
    # holder group, and the model's own CP group (1: the CPU attention never splits the
    # sequence, dcr_tools/trainers/model.py limitation 4)
    info["groups"] = {
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "dp_cp": ps.get_data_parallel_world_size(with_context_parallel=True),
        "ddp_reduce": trainer.chunks[0].dp_cp_group.size(),
        "dcr_holders": hooks["X"].groups.dp.size,
        "model_cp": model[0].pg_collection.cp.size(),
        "attention_cp": model[0].config.context_parallel_size,
    }
    moe_layers = [
        m for c in model for m in c.modules() if getattr(m, "token_dispatcher", None) is not None
    ]
    info["moe"] = {  # which dispatcher trained, and the expert groups it ran over
        "dispatchers": sorted({type(m.token_dispatcher).__name__ for m in moe_layers}),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "expert_dp": ps.get_expert_data_parallel_world_size(),
    }
    infos = [None] * dist.get_world_size()
    dist.all_gather_object(infos, info)  # test harness only: small plain dicts
    dist.barrier()
    if rank == 0 and args.save_exports:
        save_checkpoint(v0, Path(args.save_exports) / "v0", like=args.ckpt)
        save_checkpoint(v1, Path(args.save_exports) / "v1", like=args.ckpt)
    if rank == 0:

        def load(tag: str):
            items = []
            for f in sorted((out / tag).glob("*.bin")):
                items += decode_payload(f.read_bytes()).items
            return items

        result: dict = {
            "ranks": infos,
            "quiet_items": int(quiet_items[0]),
            "skip": skip,
            "retry_overwrite_only": None,
            # checkpoint tensors the export does not produce (DCR converts parameters only)
            "not_exported": sorted(set(load_checkpoint(args.ckpt)) - set(v0)),
        }
        for m in ("X", "P", "F"):
            items = load(f"v1_{m}")
            dests: set = set()
            dup = 0
            for it in items:
                keys = {(it.name, int(i)) for i in it.indices}
                dup += len(keys & dests)
                dests |= keys
            state = {k: v.clone() for k, v in v0.items()}
            apply_items(state, items)
            bad = [n for n in v1 if not bits_equal(state[n], v1[n])]
            # every dtype (DeepSeek-V3's router bias is an fp32 buffer), compared as stored bits
            changed = sum(int((tensor_bits(v0[n]) != tensor_bits(v1[n])).sum()) for n in v0)
            result[m] = {
                "items": len(items),
                "entries": sum(i.count for i in items),
                "xor_entries": sum(i.count for i in items if i.kind == Kind.XOR),
                "duplicate_destinations": dup,
                "mismatched_tensors": bad,
                "canonical_changed_elements": changed,
                "canonical_elements": sum(t.numel() for t in v1.values()),
                "tensors": len(v1),
            }
        a0, rt = load("v2_attempt0"), load("v2_retry")
        state = {k: v.clone() for k, v in v1.items()}
        apply_items(state, a0[: len(a0) // 2])  # a partial attempt
        apply_items(state, rt)
        result["retry_overwrite_only"] = all(i.kind == Kind.OVERWRITE for i in rt)
        result["retry_mismatched"] = [n for n in v2 if not bits_equal(state[n], v2[n])]
        result["retry_entries"] = retry.entries
        result["v2_differs_from_v1"] = any(not bits_equal(v1[n], v2[n]) for n in v1)
        Path(args.report).write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
