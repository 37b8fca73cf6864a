"""verl's own classes drive DCR on two gloo ranks (TP=2), run by torch.distributed.run on the verl
environment (.venv-verl): the ``dcr`` checkpoint engine made as verl's ``init_model`` makes it
(``import_external_libs`` + ``CheckpointEngineRegistry.new`` with ``engine_kwargs.dcr``), verl's
``ActorRolloutRefWorker.update_weights`` (the undecorated coroutine, as verl's own CPU tests
call it) and ``execute_checkpoint_engine``, and DCR's ``DCRCheckpointEngineManager`` (verl's
``CheckpointEngineManager`` subclass) on rank 0, against a ``vllm serve`` with backend ``dcr``.

LABELLED STAND-INS (what Ray and GPUs provide in a verl job):
- `GlooWorkerGroup`: verl's ``RayWorkerGroup`` dispatch (ONE_TO_ALL / DP_COMPUTE) over the two
  gloo ranks: rank 0 broadcasts each call, every rank runs verl's worker method, rank 0 gathers
  the results (a failure on any rank raises on rank 0, as ``ray.get`` does).
- `MegatronExport`: verl's ``MegatronEngine.get_per_tensor_param`` (Megatron-Bridge's
  ``export_hf_weights``: every canonical tensor on every rank through the bridge's mapping
  classes; megatron-bridge's ``AutoBridge`` does not import on these CPU machines).
- `HttpReplica`: verl's ``RolloutReplica`` (``server_address``; abort and resume through the
  server's own ``/pause?mode=abort`` and ``/resume``).

Rank 0 writes ``result.json``: per step the manager's metrics, vLLM's ``/weight_checker``
checksums after the sync and after a dense load of the same export (the oracle), and the
bad-input case.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import requests
import torch.distributed as dist

from tests.integration.frameworks._program import arguments, await_restart, checksums


class MegatronExport:
    """LABELLED STAND-IN for verl's MegatronEngine (module docstring)."""

    def __init__(self, module: Any, cfg: dict[str, Any]) -> None:
        self.module, self.cfg = module, cfg
        self.extra: list = []
        self.truncate: str | None = None  # a tensor handed over one row short

    def get_per_tensor_param(self) -> tuple[Any, None]:
        from megatron_dcr_hooks.conversion import iter_hf_export

        def stream() -> Any:
            for name, t in iter_hf_export(self.module, self.cfg):
                yield name, (t[:-1] if name == self.truncate else t)
            yield from self.extra

        return stream(), None


class HttpReplica:
    """LABELLED STAND-IN for verl's RolloutReplica (module docstring)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.server_address = url.removeprefix("http://")
        self.calls: list[str] = []

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self.calls.append("abort")
        requests.post(self.url + "/pause", params={"mode": "abort"}, timeout=300).raise_for_status()

    async def resume_generation(self) -> None:
        self.calls.append("resume")
        requests.post(self.url + "/resume", timeout=300).raise_for_status()


class GlooWorkerGroup:
    """LABELLED STAND-IN for verl's RayWorkerGroup over the gloo ranks (module docstring)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.world_size = dist.get_world_size()

    def run(self, call: dict[str, Any]) -> Any:
        """Every rank: one verl worker method (rank `r` gets element r of list arguments)."""
        from verl.workers.engine_workers import ActorRolloutRefWorker as W

        rank = dist.get_rank()
        if call["op"] == "update_weights":  # a Ray actor runs it on its own event loop
            coro = W.update_weights.__wrapped__(self.worker, **call["kwargs"])
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                return pool.submit(asyncio.run, coro).result()
        kwargs = {k: v[rank] for k, v in call["kwargs"].items()}
        return W.execute_checkpoint_engine.__wrapped__(self.worker, call["method"][rank], **kwargs)

    def call(self, call: dict[str, Any]) -> list[Any]:
        """Rank 0: broadcast `call`, run it here too, gather every rank's result."""
        box = [call]
        dist.broadcast_object_list(box, src=0)
        return gathered(self.run, call)

    def execute_checkpoint_engine(self, method: list[str], **kwargs: list) -> list[Any]:
        return self.call({"op": "execute", "method": method, "kwargs": kwargs})

    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> list[Any]:
        return self.call(
            {"op": "update_weights", "kwargs": {"global_steps": global_steps, "mode": mode}}
        )


def gathered(fn: Any, call: dict[str, Any]) -> list[Any]:
    """Run `fn(call)` on this rank; every rank's (ok, result or error) on every rank; raise
    on rank 0 when any rank failed (as ray.get re-raises a task's error)."""
    try:
        mine = (True, fn(call))
    except Exception as e:  # reported to rank 0
        mine = (False, f"{type(e).__name__}: {e}")
        traceback.print_exc()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [(r, res) for r, (ok, res) in enumerate(every) if not ok]
    if failed and dist.get_rank() == 0:
        raise RuntimeError(f"worker group call {call.get('op')} failed on ranks {failed}")
    return [res for _, res in every]


def main() -> None:
    a = arguments()
    out = Path(a.out)

    from dcr_tools.trainers.model import ParallelLayout
    from dcr_tools.trainers.trainer import Trainer, start_chunks
    from megatron_dcr_hooks.conversion import export_hf_weights
    from shared_codec.checkpoint import save_checkpoint

    cfg, chunks, _ = start_chunks(a.ckpt, ParallelLayout(tp=2))
    rank = dist.get_rank()
    trainer = Trainer(chunks[0], cfg, distributed_optimizer=False, lr=3e-4)

    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig
    from verl.workers.engine_workers import ActorRolloutRefWorker

    store = {"kind": "dir", "root": a.store}
    ce_cfg = CheckpointEngineConfig(
        backend="dcr",
        custom_backend_module="vllm_dcr_plugin.frameworks.verl",
        engine_kwargs={
            "dcr": {
                "control": store,
                "transport": store,
                "baseline": a.ckpt,
                "checkpoint_for": str(out / "dense{version}"),
                "verify": True,
            }
        },
    )
    # as verl's ActorRolloutRefWorker.init_model makes its checkpoint engine
    import_external_libs(ce_cfg.custom_backend_module or None)
    engine = CheckpointEngineRegistry.new(
        ce_cfg.backend,
        is_master=rank == 0,
        bucket_size=ce_cfg.update_weights_bucket_megabytes << 20,
        **ce_cfg.engine_kwargs.get(ce_cfg.backend, {}),
    )
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.config = SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=ce_cfg))
    export = MegatronExport(chunks[0], cfg)
    worker.actor = SimpleNamespace(engine=export)
    worker.checkpoint_engine = engine
    group = GlooWorkerGroup(worker)

    def dense(version: int) -> dict[str, Any]:
        """The export now, saved as the version's checkpoint (``checkpoint_for``); with the
        server a member, its checksums after the sync and after a dense load of the export."""
        state = export_hf_weights(chunks[0], cfg)  # a collective
        if rank != 0:
            return {}
        path = save_checkpoint(state, out / f"dense{version}", like=a.ckpt)
        if not engine.engine.coordinator.engines:
            return {}
        after = checksums(a.url)
        engine.engine.coordinator.engines[0].initialize(version, str(path))
        return {"after": after, "dense": checksums(a.url)}

    def local(call: dict[str, Any]) -> Any:
        if call["op"] == "train":
            return trainer.step(call["step"])[0]
        if call["op"] == "dense":
            return dense(call["version"])
        if call["op"] == "extra":
            export.extra = [tuple(x) for x in call["pairs"]]
            export.truncate = call.get("truncate")
            return None
        return group.run(call)

    if rank != 0:  # a Ray worker: runs what rank 0 dispatches until told to stop
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0]["op"] == "stop":
                break
            gathered(local, box[0])
        dist.destroy_process_group()
        return

    def both(call: dict[str, Any]) -> list[Any]:
        dist.broadcast_object_list([call], src=0)
        return gathered(local, call)

    try:
        drive(a, both, engine, group, ce_cfg, out)
    finally:  # rank 1 leaves its loop also when rank 0 failed
        dist.broadcast_object_list([{"op": "stop"}], src=0)
        dist.destroy_process_group()


def drive(a: Any, both: Any, engine: Any, group: Any, ce_cfg: Any, out: Path) -> None:
    """Rank 0: the steps, the bad stream, the next sync (module docstring)."""
    from dcr_tools import faults
    from vllm_dcr_plugin.frameworks.verl import DCRCheckpointEngineManager

    replica = HttpReplica(a.url)
    manager = DCRCheckpointEngineManager(config=ce_cfg, actor_wg=group, replicas=[replica])
    result: dict[str, Any] = {"engine": type(engine).__name__, "steps": []}
    for step in range(1, a.steps + 1):
        both({"op": "train", "step": step})
        metrics = manager.update_weights(global_steps=step)  # verl's trainer calls this
        entry = {"metrics": metrics}
        entry.update(both({"op": "dense", "version": step})[0])
        result["steps"].append(entry)
    # bad streams: refused on every rank through verl's calls, the server untouched
    both({"op": "train", "step": a.steps + 1})
    before = checksums(a.url)

    def refused(case: str, extra: dict[str, Any]) -> None:
        both({"op": "extra", "pairs": [], **extra})
        try:
            manager.update_weights(global_steps=a.steps + 1)
            result[case] = {"error": None}
        except RuntimeError as e:
            result[case] = {"error": str(e)}
        result[case].update(
            unchanged=checksums(a.url) == before,
            committed=engine.engine.coordinator.committed_version(),
        )

    refused("unknown_name", {"pairs": [["model.layers.7.mlp.extra.weight", None]]})
    refused("wrong_shape", {"truncate": "model.norm.weight"})  # a tensor one row short
    both({"op": "extra", "pairs": []})
    # the server fails part-way through the next update: the overwrite retry repairs it
    faults.arm(a.fault_plan, fail_after_items=2)
    metrics = manager.update_weights(global_steps=a.steps + 1)
    entry = {"metrics": metrics}
    entry.update(both({"op": "dense", "version": a.steps + 1})[0])
    result["after_refusal"] = entry
    result["replica_calls"] = list(replica.calls)
    # membership follows verl's replicas: removed, a version without it, added back (joined
    # by a dense load of the committed version's checkpoint), then a sync to it
    v = a.steps + 1
    manager.remove_replicas([replica])
    both({"op": "train", "step": v + 1})
    before = checksums(a.url)
    metrics = manager.update_weights(global_steps=v + 1)
    both({"op": "dense", "version": v + 1})
    record = engine.engine.coordinator.commits.current()
    result["without_replica"] = {
        "metrics": metrics,
        "receivers": list(record.receivers),
        "unchanged": checksums(a.url) == before,
    }
    manager.add_replicas([replica])
    both({"op": "train", "step": v + 2})
    metrics = manager.update_weights(global_steps=v + 2)
    entry = {"metrics": metrics, "members": list(engine.engine.members)}
    entry.update(both({"op": "dense", "version": v + 2})[0])
    result["rejoined"] = entry
    if a.chaos:
        # the server dies mid-apply (SIGKILL of its worker): evicted, the version commits without
        # it; restarted (by the test, as verl restarts a replica), it joins at the committed version
        faults.arm(a.fault_plan, kill_after_items=2)
        both({"op": "train", "step": v + 3})
        metrics = manager.update_weights(global_steps=v + 3)
        both({"op": "dense", "version": v + 3})
        record = engine.engine.coordinator.commits.current()
        result["killed"] = {
            "metrics": metrics,
            "receivers": list(record.receivers),
            "members": list(engine.engine.members),
        }
        await_restart(out)
        both({"op": "train", "step": v + 4})
        metrics = manager.update_weights(global_steps=v + 4)
        entry = {"metrics": metrics, "members": list(engine.engine.members)}
        entry.update(both({"op": "dense", "version": v + 4})[0])
        result["restarted"] = entry
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
