"""A real refit cluster on loopback for coordinator tests: a 2-rank Megatron trainer job (TP=2,
gloo) serving the DCR owner service, `vllm serve` receivers with the DCR worker extension, and
one directory store holding payloads, manifests, attempt and commit records. With
``replica=True`` the rollout cluster also keeps the canonical replica (shared_codec/replica),
bootstrapped from the initial checkpoint the engines serve: it is a required receiver of every
transition and the engines restore from it (its lease); the trainer's exports are then only
the test's oracle."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcr_tools import faults
from dcr_tools.procs import ServeProcess, base_env, free_port, kill_group, start_rl_job
from shared_codec.checkpoint import tensor_table
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.coordination.engines import HttpEngine
from shared_codec.coordination.owners import RemoteOwners
from shared_codec.replica import ReplicaStore
from shared_codec.replica.receiver import ReplicaReceiver
from shared_codec.transport.store import DirectoryStore


class Cluster:
    def __init__(
        self,
        ckpt: Path,
        tmp: Path,
        receivers: int = 2,
        replica: bool = False,
        quantization: str | None = None,
    ) -> None:
        """`quantization`: the engines serve the library's quantized checkpoint in that format
        (`write_quantized_model` of each BF16 export: `checkpoint_for`), and the trainer job
        sends quantized deltas (``--quantization``; the scales overwrite-only, as the engines'
        prewarm reports them)."""
        self.ckpt, self.tmp = ckpt, tmp
        self.quantization = quantization
        self.replica: ReplicaReceiver | None = None
        if replica:
            with ReplicaStore(tmp / "replica") as store:
                store.bootstrap(ckpt)  # the rollout cluster's own copy, never the trainer's
        self.store_spec = {"kind": "dir", "root": str(tmp / "store")}
        self.store = DirectoryStore(tmp / "store")
        self.ckpts = tmp / "ckpts"
        self.n_receivers = receivers
        self.trainer: subprocess.Popen | None = None
        self.servers: list[ServeProcess] = []
        self.receivers: list[HttpEngine] = []
        self.owners: RemoteOwners | None = None

    def checkpoint_for(self, version: int) -> str:
        """The checkpoint the engines hold at `version` (quantized: `export` writes it)."""
        return str(self.ckpts / (f"q{version}" if self.quantization else f"v{version}"))

    def export(self, version: int) -> str:
        """The trainer's export of the current weights as `version` (and, for quantized
        engines, its quantized checkpoint); returns `checkpoint_for(version)`."""
        assert self.owners is not None
        self.owners.call("export", path=str(self.ckpts / f"v{version}"))
        if self.quantization:
            from dcr_tools.fixtures import write_quantized_model

            write_quantized_model(
                self.ckpts / f"v{version}", self.checkpoint_for(version), self.quantization
            )
        return self.checkpoint_for(version)

    def fault_plan(self, receiver: int) -> Path:
        """The fault plan file engine `receiver`'s environment names (``DCR_FAULT_PLAN``)."""
        return self.tmp / f"faults-engine{receiver}.json"

    def arm_fault(self, receiver: int, **fault: int) -> None:
        """Arm a test-only fault on engine `receiver` for its next attempt, fired once (e.g.
        ``kill_after_items=3``; see vllm_dcr_plugin.faults)."""
        faults.arm(self.fault_plan(receiver), **fault)

    def start(self) -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        quantized: list[str] = []
        serve = self.ckpt
        if self.quantization:
            from dcr_tools.fixtures import write_quantized_model
            from shared_codec.checkpoint import load_checkpoint
            from shared_codec.quantized import quantizes, scale_name

            scales = sorted(scale_name(n) for n in load_checkpoint(self.ckpt) if quantizes(n))
            quantized = ["--quantization", self.quantization, "--overwrite-only", ",".join(scales)]
            serve = write_quantized_model(self.ckpt, self.tmp / "serve-q0", self.quantization)
        self.trainer = start_rl_job(
            self.ckpt,
            endpoint,
            ["--store", json.dumps(self.store_spec)],
            *quantized,
            log=self.tmp / "trainer.log",
        )
        self.servers = [
            ServeProcess(
                serve,
                free_port(),
                log=self.tmp / f"serve{i}.log",
                # VLLM_PLUGINS=dcr: the general plugin and the /dcr/* endpoint plugin
                env=base_env(**{faults.ENV: str(self.fault_plan(i)), "VLLM_PLUGINS": "dcr"}),
            )
            for i in range(self.n_receivers)
        ]
        urls = [s.start(timeout_s=420) for s in self.servers]
        self.owners = RemoteOwners(endpoint, timeout_s=300)
        self.owners.call("status", timeout_s=300)  # the trainer job is up
        self.export(0)
        table = tensor_table(self.checkpoint_for(0))
        restore_from: Callable[[int], Any] = self.checkpoint_for
        if (self.tmp / "replica").is_dir():
            self.replica = ReplicaReceiver(self.tmp / "replica", self.store_spec)
            restore_from = self.replica.checkpoints()
        self.receivers = [
            HttpEngine(
                f"engine{i}",
                url,
                store=self.store_spec,
                checkpoint_for=restore_from,
                tensors=table,
                launcher=self.servers[i].start,
                verify=True,
            )
            for i, url in enumerate(urls)
        ]
        for r in self.receivers:
            r.restore(0)  # dense load of v0 (replica or export) + prewarm: clean at v0

    @property
    def members(self) -> list[Any]:
        """The coordinator's receivers: the replica (when kept) first, then the engines."""
        return ([self.replica] if self.replica is not None else []) + list(self.receivers)

    def coordinator(self, **config: float) -> Coordinator:
        assert self.owners is not None
        return Coordinator(
            self.store,
            self.owners,
            self.members,
            CoordinatorConfig(**config),  # type: ignore[arg-type]
            log=lambda m: print(f"[coordinator] {m}", flush=True),
            transport=self.store_spec,  # pipelined: receivers fetch + apply during the build
        )

    def dense_digest(self, version: int, receiver: int = 0) -> str:
        """Digest after a dense load of the version's export on a receiver (the reference).
        Leaves that receiver clean at `version`."""
        r = self.receivers[receiver]
        r.rpc("dcr_dense_load", self.checkpoint_for(version), version)
        r.reset_prefix_cache()
        return r.digest()

    def stop(self) -> None:
        if self.owners is not None:
            try:
                self.owners.stop(timeout_s=30)
            except Exception:
                pass
        if self.trainer is not None:
            deadline = time.monotonic() + 30
            while self.trainer.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            kill_group(self.trainer)
        for s in self.servers:
            s.stop()
        if self.replica is not None:
            self.replica.close()
