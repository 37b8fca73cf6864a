"""`DCRCallback` in Megatron-Bridge's callback system, end to end: a real Megatron model and
optimizer on 2 gloo ranks (TP=2, on the trainer interpreter: Python 3.12, megatron-core 0.19,
megatron-bridge 0.6 when `make setup` built it), Bridge's own ``CallbackManager`` firing the
training events where Bridge's ``train()`` fires them (tests/integration/megatron/worker_callback.py says
why not a real ``pretrain()`` run), the callback serving the owner service after every
successful step; the coordinator refits a real `vllm serve` engine. Every committed version is
bit-exact against a dense load of the trainer's export of it; the skipped step (the optimizer's
own non-finite-gradient refusal) publishes nothing, so 4 steps with one skipped give versions
1-3 and no attempt beyond them."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from dcr_tools.procs import (
    REPO,
    ServeProcess,
    base_env,
    free_port,
    kill_group,
    torchrun_cmd,
)
from shared_codec.checkpoint import tensor_table
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.coordination.engines import HttpEngine
from shared_codec.coordination.owners import RemoteOwners
from shared_codec.transport.store import DirectoryStore

STEPS, SKIP = 4, 1  # steps 0, 2, 3 update the weights -> versions 1, 2, 3


@pytest.mark.megatron
@pytest.mark.vllm
def test_bridge_callback_refits_every_successful_step_bit_exactly(
    tiny_models, tmp_path: Path
) -> None:
    ckpt = tiny_models["qwen3"]
    spec = {"kind": "dir", "root": str(tmp_path / "store")}
    exports = tmp_path / "exports"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    report = tmp_path / "report.json"
    cmd = torchrun_cmd(
        "tests.integration.megatron.worker_callback",
        ["--ckpt", str(ckpt), "--tp", "2", "--endpoint", endpoint, "--store", json.dumps(spec),
         "--v0", str(exports / "v0"), "--steps", str(STEPS), "--skip", str(SKIP),
         "--report", str(report)],
    )  # fmt: skip
    with open(tmp_path / "trainer.log", "ab") as log_f:
        trainer = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**base_env(), "OMP_NUM_THREADS": "1"},
            stdout=log_f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = ServeProcess(ckpt, free_port(), log=tmp_path / "serve.log", env=base_env())
    owners = RemoteOwners(endpoint, timeout_s=300)
    refits = []
    try:
        url = server.start(timeout_s=420)
        owners.call("status", timeout_s=420)  # step 0 done: the callback serves
        engine = HttpEngine(
            "engine0",
            url,
            store=spec,
            checkpoint_for=lambda v: str(exports / f"v{v}"),
            tensors=tensor_table(exports / "v0"),
            launcher=server.start,
            verify=True,
        )
        engine.restore(0)  # dense load of the trainer's v0 export + prewarm
        v0_digest = engine.digest()
        coord = Coordinator(
            DirectoryStore(tmp_path / "store"),
            owners,
            [engine],  # type: ignore[list-item]
            CoordinatorConfig(),
            log=lambda m: print(f"[coordinator] {m}", flush=True),
            transport=spec,
        )
        coord.initialize("v0")
        for version in range(1, STEPS - 1 + 1):
            if version > 1:
                status = owners.call("status", timeout_s=300)  # the next successful step
                assert status["committed_version"] == version - 1
            owners.call("export", path=str(exports / f"v{version}"))
            result = coord.refit()
            assert result.version == version and result.retries == 0
            delta_digest = engine.digest()
            engine.rpc("dcr_dense_load", str(exports / f"v{version}"), version)
            engine.reset_prefix_cache()
            refits.append(
                {
                    "version": version,
                    "payload_bytes": result.attempts[0].owners["payload_bytes"],
                    "delta": delta_digest,
                    "dense": engine.digest(),
                }
            )
            owners.stop()  # releases the trainer to its next step
        trainer.wait(timeout=300)
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-4000:]
    finally:
        owners.close()
        kill_group(trainer)
        server.stop()

    assert [r["version"] for r in refits] == [1, 2, 3]
    for r in refits:
        assert r["delta"] == r["dense"], r  # bit-exact against a dense load of the export
        assert r["payload_bytes"] > 0
    digests = [v0_digest, *(r["dense"] for r in refits)]
    assert len(set(digests)) == len(digests)  # every version moved the weights
    for rank in (0, 1):
        rep = json.loads(Path(f"{report}.rank{rank}").read_text())
        assert rep["steps"] == STEPS - 1 and rep["skipped_steps"] == 1
        assert rep["built"] == [1, 2, 3] and rep["committed_version"] == 3
        assert rep["skipped_step_left_weights_unchanged"] is True
        assert {"on_train_start", "on_train_step_start", "on_train_step_end"} <= set(
            rep["registered_events"]
        )
    # the skipped step published nothing: every key in the store (payloads, manifests,
    # attempts, commit records) belongs to versions 0-3, and versions 1-3 are committed
    store = tmp_path / "store"
    versions = {
        int(v)
        for p in store.rglob("*")
        for v in re.findall(r"v(\d{12})", str(p.relative_to(store)))
    }
    assert {1, 2, 3} <= versions <= {0, 1, 2, 3}, sorted(versions)
