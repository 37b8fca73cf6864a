"""verl drives DCR: a ``dcr`` checkpoint engine registered through verl's own registry, and the
checkpoint manager that runs it (verl 0.9.1; no fork of verl, nothing patched).

What a verl user writes (docs/verl.md)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=dcr
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=vllm_dcr_plugin.frameworks.verl
    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dcr.control={kind: s3, ...}
    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dcr.transport={kind: s3, ...}
    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.dcr.baseline=${actor_rollout_ref.model.path}
    actor_rollout_ref.rollout.checkpoint_manager_class=vllm_dcr_plugin.frameworks.verl.DCRCheckpointEngineManager
    actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config={backend: dcr}
    # and VLLM_SERVER_DEV_MODE=1 in the rollout servers' environment (vLLM's RL routes)

How a sync runs (`DCRCheckpointEngineManager.update_weights`, on the driver):
1. abort the replicas' requests (verl's own ``abort_replicas``, saved for partial rollout);
2. every trainer rank's engine learns the replicas' HTTP addresses
   (``execute_checkpoint_engine("init_process_group", servers=...)``): engines added or
   removed since the last sync join or leave DCR's membership (a joining server is restored
   from ``checkpoint_for`` of the committed version);
3. ``actor_wg.update_weights(global_steps, mode="dcr")``: verl's worker hands its model
   engine's ``get_per_tensor_param()`` stream (full HF-named tensors on every rank) to
   `DCRCheckpointEngine.send_weights`: every rank diffs its share of the stream
   (`NamedTensorOwner`, a gloo group over the trainer world) and rank 0 runs one DCR
   transition to every server through vLLM's ``HTTPVLLMWeightSyncClient`` and the ``dcr``
   weight-transfer backend in the servers' workers (committed, or `RefitFailed` with the
   committed version in force on every server); its metrics come back to verl;
4. resume the replicas' generation (also after a failure). A replica that cannot be aborted
   or resumed (dead, restarting) is logged and counted (``dcr/replicas_unreachable``), never
   fails the sync: the coordinator evicts a dead server at its deadline (its restore fails),
   the version commits without it, and when verl passes it back it joins at the committed
   version (a dense load of ``checkpoint_for``).
verl's rollout-side ``CheckpointEngineWorker`` and its kv-cache release are not used: DCR
applies in place inside the vLLM workers.

Where the owner-local hook cannot go: verl 0.9.1 hands a custom backend only the exported
stream (``engine_workers.py``: only the built-in name ``delta_sharded`` is handed the
training engine), so this engine always uses the named-tensor owner.

Limitations:
1. ``receive_weights`` is refused (`NotImplementedError`): use the manager above, not verl's
   default manager, which would route weights through its rollout-side workers.
2. Servers are reached over HTTP (vLLM's RL routes, ``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineManager,
    CheckpointEngineRegistry,
)
from verl.utils.ray_utils import auto_await

BACKEND = "dcr"
VERL_VERSION = "0.9.1"

log = logging.getLogger("dcr.verl")


def _resolved(refs: Any) -> Any:
    """Results of a worker-group call: ``ray.get`` of object refs, anything else as is (a
    worker group that runs in-process)."""
    import ray

    if isinstance(refs, list) and refs and all(isinstance(r, ray.ObjectRef) for r in refs):
        return ray.get(refs)
    if isinstance(refs, ray.ObjectRef):
        return ray.get(refs)
    return refs


def server_name(index: int) -> str:
    return f"replica{index}"


@CheckpointEngineRegistry.register(BACKEND)
class DCRCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine ``dcr`` (module docstring). verl constructs it on every trainer
    rank (``is_master`` on rank 0) with ``engine_kwargs.dcr``: `control`, `transport` (DCR's
    store and payload transport specs), `baseline` (the model the servers started from: the
    committed checkpoint at version 0), `checkpoint_for` (path template of each committed
    version's canonical checkpoint: restores and joins; the baseline after a restart),
    `servers` (HTTP base URLs, when no manager passes them), `owner` (`NamedOwnerConfig`
    fields), and `DCRTrainerInitInfo`'s settings (`max_attempts`, `ack_timeout_s`, `verify`,
    `source`, ...). `bucket_size` is verl's bucket setting (DCR buckets its payloads itself)."""

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        *,
        control: Mapping[str, Any],
        transport: Mapping[str, Any],
        baseline: str | None = None,
        servers: Iterable[str] = (),
        owner: Mapping[str, Any] | None = None,
        timeout_s: float = 900.0,
        **info: Any,
    ) -> None:
        self.is_master = bool(is_master)
        self.config = {"control": dict(control), "transport": dict(transport), **info}
        self.baseline_path = baseline
        self.owner_config = dict(owner or {})
        self.timeout_s = float(timeout_s)
        self.servers: list[str] = list(servers)
        self.owner: Any = None  # NamedTensorOwner, at the first sync (collective)
        self.engine: Any = None  # rank 0: DCR's trainer engine, at the first sync
        self.members: dict[str, str] = {}  # server URL -> DCR engine name
        self.syncs = 0

    # -- verl's per-sync protocol (the manager calls these on every trainer rank) -----------
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list], dict[str, list]]:
        return {}, {}

    def init_process_group(self, servers: Iterable[str] | None = None, **_: Any) -> None:
        """The manager's servers for the next sync (HTTP base URLs)."""
        if servers is not None:
            self.servers = [str(s) for s in servers]

    def finalize(self) -> None:
        pass

    def receive_weights(self, global_steps: int | None = None) -> Any:
        raise NotImplementedError(
            "dcr applies in place inside the vLLM workers (weight-transfer backend dcr); use "
            "rollout.checkpoint_manager_class=vllm_dcr_plugin.frameworks.verl."
            "DCRCheckpointEngineManager, which needs no rollout-side checkpoint workers"
        )

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Every trainer rank: take the stream; rank 0: one DCR transition. The stream's
        collectives run on a worker thread pinned to this rank's device."""
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        return await asyncio.to_thread(self._send, weights, global_steps, device)

    def _send(self, weights: Any, global_steps: int | None, device: int | None) -> dict[str, Any]:
        if device is not None:
            torch.cuda.set_device(device)
        t0 = time.perf_counter()
        owner = self._owner()
        take = owner.take_weights(weights)
        self.syncs += 1
        if not self.is_master:
            return {}
        engine = self._engine()
        res = engine.send_weights()
        return {
            "dcr/version": res.version,
            "dcr/retries": res.retries,
            "dcr/payload_bytes": res.attempts[-1].owners.payload_bytes,
            "dcr/element_change_rate": take.element_change_rate,
            "dcr/seconds": time.perf_counter() - t0,
            "dcr/global_steps": -1 if global_steps is None else int(global_steps),
        }

    # -- lazily built state -------------------------------------------------------------------
    def _owner(self) -> Any:
        if self.owner is None:
            import torch.distributed as dist

            from shared_codec.named import NamedOwnerConfig, NamedTensorOwner
            from vllm_dcr_plugin.frameworks import committed_baseline

            baseline, committed = committed_baseline(
                {**self.config, "baseline": self.baseline_path}, None
            )
            group = None
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                group = dist.new_group(backend="gloo")  # DCR's host collectives
            self.owner = NamedTensorOwner(
                self.config["transport"],
                baseline,
                config=NamedOwnerConfig(**self.owner_config),
                group=group,
                committed_version=committed,
            )
            self._baseline = baseline
        return self.owner

    def _client(self, url: str) -> Any:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        return HTTPVLLMWeightSyncClient(url, timeout=self.timeout_s)

    def _engine(self) -> Any:
        """Rank 0: DCR's trainer engine over the current servers (built at the first sync;
        later syncs join added servers and let removed ones leave)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from shared_codec.checkpoint import tensor_table
        from shared_codec.errors import ArgumentError
        from vllm_dcr_plugin.transfer.trainer_engine import DCRTrainerInitInfo

        if self.engine is None:
            if not self.servers:  # later, none is a fleet scaled to zero: versions go on
                raise ArgumentError(
                    "dcr: no rollout servers (the manager passes them, or 'servers')"
                )
            self.members = {url: server_name(i) for i, url in enumerate(self.servers)}
            info = DCRTrainerInitInfo(
                rank=0,
                owners=self.owner,
                tensors=tensor_table(self._baseline),
                **self.config,
            )
            # DCR's trainer engine takes one client per engine name (trainer_engine.py)
            clients: Any = {name: self._client(url) for url, name in self.members.items()}
            self.engine = WeightTransferTrainerFactory.trainer_init(info, client=clients)
            return self.engine
        current = set(self.engine.members)
        for url in [u for u in self.members if u not in self.servers]:
            name = self.members.pop(url)
            if name in current:  # not already evicted by a failed restore
                self.engine.remove_engine(name)
        for url in self.servers:
            known = self.members.get(url)
            if known is not None and known in current:
                continue
            if known is not None:  # evicted (dead) and back again
                name = known
            else:  # a new server
                used = set(self.members.values())
                name = next(
                    server_name(i) for i in range(len(used) + 1) if server_name(i) not in used
                )
            self.engine.add_engine(name, self._client(url))  # joined at the committed version
            self.members[url] = name
        return self.engine


class DCRCheckpointEngineManager(CheckpointEngineManager):
    """verl's checkpoint manager for backend ``dcr`` (``rollout.checkpoint_manager_class``;
    module docstring): the same constructor as verl's (`config`, `actor_wg`, `replicas`)."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        super().__init__(config=config, actor_wg=actor_wg, replicas=replicas)
        if self.backend != BACKEND:
            raise ValueError(
                f"DCRCheckpointEngineManager drives checkpoint_engine.backend={BACKEND!r}, "
                f"got {self.backend!r}"
            )

    def server_urls(self) -> list[str]:
        """The replicas' HTTP base URLs (verl's ``RolloutReplica.server_address``)."""
        out = []
        for r in self.replicas:
            address = str(r.server_address)
            out.append(address if "://" in address else f"http://{address}")
        return out

    async def _each(self, what: str, calls: list[Any]) -> int:
        """Run one call per replica; a replica that fails it (dead, restarting) is logged and
        counted, never fails the sync: DCR's coordinator evicts a dead server at its deadline,
        and it joins again at the committed version once verl passes it back."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = 0
        for replica, r in zip(self.replicas, results):
            if isinstance(r, BaseException):
                failed += 1
                log.warning("dcr: %s failed on replica %s: %s", what, replica.server_address, r)
        return failed

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        unreachable = await self._each("abort", [r.abort_all_requests() for r in self.replicas])
        try:
            n = self.actor_wg.world_size
            urls = self.server_urls()
            _resolved(
                self.actor_wg.execute_checkpoint_engine(
                    ["init_process_group"] * n, servers=[urls] * n
                )
            )
            results = _resolved(
                self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
            )
        finally:
            resumed = await self._each("resume", [r.resume_generation() for r in self.replicas])
        metrics: dict[str, Any] = {"dcr/replicas_unreachable": max(unreachable, resumed)}
        for result in results[:n]:
            if isinstance(result, dict):
                metrics.update(result)
        return metrics


__all__ = ["DCRCheckpointEngine", "DCRCheckpointEngineManager", "server_name"]
