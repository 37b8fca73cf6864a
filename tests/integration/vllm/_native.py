"""What the native-backend tests share: one ``vllm serve`` with backend ``dcr`` and no worker
extension (`NativeServer`), and vLLM's trainer API over it with DCR's init info and the test-only
`CheckpointOwners` (`native_trainer`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import requests

from dcr_tools import faults
from dcr_tools.procs import ServeProcess, base_env, free_port
from shared_codec.checkpoint import tensor_table
from shared_codec.transport.spec import open_store
from tests.integration.vllm._owners import CheckpointOwners


class NativeServer:
    """A ``vllm serve`` of `versions[0]` (the canonical checkpoint of every version, in order)
    with backend ``dcr`` and `extra_args`, its fault plan at ``root/faults.json``."""

    def __init__(self, root: Path, versions: list[Path], extra_args: list[str]) -> None:
        self.root, self.versions = root, versions
        self.fault_plan = root / "faults.json"
        self.proc = ServeProcess(
            versions[0],
            free_port(),
            log=root / "serve.log",
            env=base_env(**{faults.ENV: str(self.fault_plan)}),
            extension=False,
            extra_args=["--weight-transfer-config", json.dumps({"backend": "dcr"}), *extra_args],
        )
        self.url = self.proc.start(timeout_s=420)

    def post(self, path: str, body: Any = None, **params: Any) -> Any:
        r = requests.post(self.url + path, json=body, params=params, timeout=300)
        r.raise_for_status()
        return r.json()

    def checksums(self) -> dict[str, str]:
        """vLLM's own ``/weight_checker`` checksums of the target model's weights."""
        return self.post("/weight_checker", {"action": "checksum"})["checksums"]

    def weight_version(self) -> str:
        return requests.get(self.url + "/weight_info", timeout=30).json()["weight_version"]


def native_trainer(server: NativeServer, tmp: Path, **config: Any) -> Any:
    """vLLM's trainer API with DCR's init info (what an orchestrator writes), starting the
    engine from a dense load of v0 (a module's engine may hold any version). Returns the trainer
    engine, its owners and the control store."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_dcr_plugin.transfer.trainer_engine import DCRTrainerInitInfo

    store = {"kind": "dir", "root": str(tmp / "store")}
    owners = CheckpointOwners(server.versions, store)
    info = DCRTrainerInitInfo(
        rank=0,
        control=store,
        transport=store,
        owners=owners,  # type: ignore[arg-type]
        tensors=tensor_table(server.versions[0]),
        checkpoint_for=str(server.root / "v{version}"),
        dense_load_at_init=True,
        **config,
    )
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(server.url, timeout=600)
    )
    return engine, owners, open_store(store)
