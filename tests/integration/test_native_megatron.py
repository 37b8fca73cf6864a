"""The native backend ``dcr`` end to end: a real 2-rank Megatron trainer job (TP=2, gloo) serving
the DCR owner service, one ``vllm serve`` started with ``--weight-transfer-config '{"backend":
"dcr"}'`` and no DCR worker extension, and an orchestrator that uses only vLLM's trainer API
(``WeightTransferTrainerFactory.trainer_init`` + ``HTTPVLLMWeightSyncClient``).

Refit 1 is clean; during refit 2 the engine is killed mid-apply: the attempt fails naming it, the
launcher restarts it, the trainer engine re-inits it with a dense load of v1 and the overwrite
retry commits v2. Every version equals a dense load of the trainer's export by vLLM's own
``/weight_checker`` checksums.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from dcr_tools import faults
from dcr_tools.procs import ServeProcess, base_env, free_port
from shared_codec.checkpoint import tensor_table
from tests.integration._cluster import Cluster


def _checksums(url: str) -> dict[str, str]:
    r = requests.post(url + "/weight_checker", json={"action": "checksum"}, timeout=300)
    r.raise_for_status()
    return r.json()["checksums"]


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_orchestrator_switches_nccl_to_dcr(tiny_models, tmp_path: Path) -> None:
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_dcr_plugin.transfer.trainer_engine import DCRTrainerInitInfo

    cluster = Cluster(tiny_models["qwen3"], tmp_path, receivers=0)  # the trainer job only
    plan = tmp_path / "faults.json"
    server = ServeProcess(
        tiny_models["qwen3"],
        free_port(),
        log=tmp_path / "serve.log",
        env=base_env(**{faults.ENV: str(plan)}),
        extension=False,
        extra_args=["--weight-transfer-config", json.dumps({"backend": "dcr"})],
    )
    try:
        cluster.start()
        assert cluster.owners is not None
        url = server.start(timeout_s=420)

        def relaunch(name: str) -> HTTPVLLMWeightSyncClient:
            return HTTPVLLMWeightSyncClient(server.start(timeout_s=420), timeout=600)

        info = DCRTrainerInitInfo(
            rank=0,
            control=cluster.store_spec,
            transport=cluster.store_spec,
            owners=cluster.owners,  # type: ignore[arg-type]
            tensors=tensor_table(cluster.checkpoint_for(0)),
            checkpoint_for=str(cluster.ckpts / "v{version}"),
            dense_load_at_init=True,
            ack_timeout_s=240,
            launcher=relaunch,
        )
        engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(url, timeout=600)
        )
        native = engine.coordinator.engines[0]

        def check_exact(version: int) -> None:
            refit = _checksums(server.base_url)
            cluster.owners.call("export", path=cluster.checkpoint_for(version))
            native.initialize(version, cluster.checkpoint_for(version))  # dense reference
            assert _checksums(server.base_url) == refit

        # refit 1: clean, pipelined, one attempt
        cluster.owners.call("train", step=1)
        res = engine.send_weights()
        assert res.version == 1 and res.retries == 0 and res.attempts[0].owners["payloads"] > 1
        check_exact(1)

        # refit 2: the engine dies mid-apply; restarted, dense-loaded at v1, the retry commits
        cluster.owners.call("train", step=2)
        faults.arm(plan, kill_after_items=3)
        res = engine.send_weights()
        first = res.attempts[0]
        assert not first.ok and first.unreachable == {"engine0"}, first.failed
        assert res.retries == 1 and res.attempts[1].retry and res.record.version == 2
        check_exact(2)
        assert requests.get(server.base_url + "/weight_info", timeout=30).json() == {
            "weight_version": "2"
        }
    finally:
        server.stop()
        cluster.stop()
