"""Megatron rank program for tests/integration/test_callback.py (torchrun, gloo): a training loop that
fires Megatron-Bridge's own callback events, through Bridge's own ``CallbackManager``, exactly
where Bridge's ``train()`` fires them, with `DCRCallback` in served mode.

Why not Bridge's ``pretrain()`` itself: it cannot be imported on these machines. It needs
nvidia-resiliency-ext, and the newest release the package registry serves for this platform
(0.4.1) breaks megatron-core 0.19.2's ``dist_checkpointing`` at import (``nvidia_resiliency_ext``
has no ``__version__``); past that, ``megatron.bridge.training.train`` imports nvidia-modelopt,
and its setup path needs the compiled dataset helpers, a tokenizer and CUDA-only code. So the
loop below is Bridge's ``train()`` reduced to what the callbacks see: the same events in the
same order with the same ``CallbackContext`` fields (``state`` is a stand-in: building Bridge's
``GlobalState`` needs the same imports), around a real Megatron step (DDP, ``finalize_model_
grads``, Megatron's mixed-precision optimizer, ``skipped_iter = not update_successful``).

A skipped step is the optimizer's own refusal: the optimizer has a constant loss scale of 1.0
(``OptimizerConfig.loss_scale``, bit-identical to no scaling), so its grad scaler checks for
non-finite gradients; step ``--skip`` puts an ``inf`` into one gradient after the backward pass.

Rank 0 exports the v0 weights (the engines' start) before training; the service's ``export``
op writes the current weights for the test's dense references. Every rank writes a report.
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dcr_tools.trainers.trainer import SEQ, start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--v0", required=True, help="rank 0 exports the starting weights here")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1, help="this step's update is refused")
    ap.add_argument("--report", required=True)
    args = ap.parse_args()

    cfg, model, _ = start(args.ckpt, args.tp, 1)
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_dcr_hooks import DCRCallback, DCRConfig, ServiceSpec
    from megatron_dcr_hooks.bridge_loader import import_bridge_module
    from megatron_dcr_hooks.bridge_registry import architecture_of
    from megatron_dcr_hooks.conversion import export_hf_weights
    from shared_codec.checkpoint import combined_digest, save_checkpoint, state_digests

    callbacks = import_bridge_module("megatron.bridge.training.callbacks")
    rank = dist.get_rank()
    arch = architecture_of(cfg)
    ddp = DDP(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=3e-4, bf16=True, weight_decay=0.0, clip_grad=1.0, loss_scale=1.0
        ),
        [ddp],
    )

    def export(req: dict[str, Any]) -> dict[str, Any]:
        tensors = export_hf_weights(model, arch)
        if rank == 0:
            save_checkpoint(tensors, req["path"], like=args.ckpt)
        dist.barrier()
        return {"path": req["path"]}

    export({"path": args.v0})
    dcr = DCRCallback(
        DCRConfig(architecture=arch, bucket_bytes=1 << 14),
        service=ServiceSpec(
            transport=json.loads(args.store), endpoint=args.endpoint, handlers={"export": export}
        ),
    )
    # what pretrain(..., callbacks=[dcr]) does with the list: Bridge's own normalisation
    manager = callbacks.normalize_callbacks([dcr])
    state = types.SimpleNamespace(train_state=types.SimpleNamespace(step=0))

    def context(**fields: Any) -> Any:
        return callbacks.CallbackContext(
            state=state,
            model=[ddp],
            user_state=manager.user_state,
            optimizer=opt,
            scheduler=None,
            **fields,
        )

    def digest() -> str:
        return combined_digest(state_digests({n: p.detach() for n, p in model.named_parameters()}))

    skipped_unchanged = None
    if callbacks.should_fire(manager, "on_train_start"):
        manager.fire("on_train_start", context())
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    for step in range(args.steps):
        manager.fire("on_train_step_start", context())
        # Bridge's train_step: zero grads, forward/backward, finalize, optimizer.step()
        g = torch.Generator().manual_seed(100 + step)
        batch = torch.randint(0, cfg["vocab_size"], (2, SEQ + 1), generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(batch[:, :-1], pos, attention_mask=None, labels=batch[:, 1:]).float().mean()
        loss.backward()
        finalize_model_grads([ddp])
        before = digest() if step == args.skip else None
        if step == args.skip:
            next(p for p in ddp.parameters() if p.requires_grad).main_grad.view(-1)[0] = float(
                "inf"
            )
        update_successful, grad_norm, _ = opt.step()
        if step == args.skip:
            skipped_unchanged = (not update_successful) and digest() == before
        state.train_state.step += 1
        manager.fire(
            "on_train_step_end",
            context(
                loss_dict={"lm loss": loss.detach()},
                grad_norm=grad_norm,
                skipped_iter=not bool(update_successful),
            ),
        )
    if callbacks.should_fire(manager, "on_train_end"):
        manager.fire("on_train_end", context())
    report = {
        "rank": rank,
        "steps": dcr.steps,
        "skipped_steps": dcr.skipped_steps,
        "built": dcr.built,
        "committed_version": dcr.hook.committed_version if dcr.hook else None,
        "skipped_step_left_weights_unchanged": skipped_unchanged,
        "registered_events": sorted(e for e in manager.events if manager.has_callbacks(e)),
    }
    Path(f"{args.report}.rank{rank}").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
