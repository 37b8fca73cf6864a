"""Membership through the native weight-transfer backend ``dcr``: `add_engine` / `remove_engine`
of `DCRTrainerWeightTransferEngine`, with FAKES (pure unit test, labelled as such: a FAKE vLLM
worker holding a receiver over the fake loader model, a FAKE trainer client that calls the real
worker engine in this process where vLLM's HTTP routes would, FAKE owners that publish the
delta between two in-memory versions; the same calls against a real ``vllm serve`` are in
tests/integration/vllm/test_native_transfer.py).

An engine removed between transitions is sent nothing and left out of the commit record; added
back, it is dense-loaded with the committed version from ``checkpoint_for`` (here a callable
giving a context manager, as the replica's lease does) and refitted from the next transition.
A bad argument is a ``ProtocolError`` naming it, raised before the engine is called or a record
written."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shared_codec.checkpoint import save_checkpoint
from shared_codec.errors import ProtocolError
from shared_codec.format import PayloadMeta, encode_payload
from shared_codec.records import Kind, diff_tensors
from shared_codec.transport.publish import publish_attempt
from shared_codec.transport.spec import open_store
from tests.unit.vllm.test_exactly_once import REFIT, TABLE, _versions
from tests.unit.vllm.test_native_contract import FakeWorker, RecordingClient
from tests.unit.vllm.test_receiver_units import _assert_holds
from vllm_dcr_plugin import worker as dcr_worker
from vllm_dcr_plugin.transfer.trainer_engine import (
    DCRTrainerInitInfo,
    DCRTrainerWeightTransferEngine,
)
from vllm_dcr_plugin.transfer.worker_engine import DCRWeightTransferEngine


def _lineage() -> list[dict[str, torch.Tensor]]:
    """v0, v1 (test_exactly_once's pair) and v2 (v1 moved again)."""
    v0, v1 = _versions()
    v2 = {n: t.clone() for n, t in v1.items()}
    for t in v2.values():
        flat = t.reshape(-1)
        flat[1::2] = (flat[1::2].float() * 0.5 - 0.125).to(flat.dtype)
    return [v0, v1, v2]


class LoopbackClient:
    """FAKE vLLM trainer client: calls the worker engine in this process, as vLLM's HTTP routes
    call it in the worker; records the calls."""

    def __init__(self, worker_engine: DCRWeightTransferEngine) -> None:
        self.engine = worker_engine
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init_weight_transfer_engine")
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.calls.append("start_weight_update")
        self.engine.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.calls.append("update_weights")
        self.engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish_weight_update")
        self.engine.finish_weight_update()


class LineageOwners:
    """FAKE owners: attempt a of version v publishes the delta v-1 -> v of the refit tensors
    (overwrites for the fake loader's overwrite-only ones), as one owner, then seals it."""

    def __init__(self, lineage: list[dict[str, torch.Tensor]], transport: dict[str, Any]) -> None:
        self.lineage, self.transport = lineage, transport
        self.builds: list[tuple[int, int, bool]] = []

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        self.builds.append((version, attempt, retry))
        old, new = self.lineage[version - 1], self.lineage[version]
        items = [
            diff_tensors(
                n, old[n], new[n], owner=0,
                kind=Kind.XOR if n == "d.weight" and not retry else Kind.OVERWRITE,
            )
            for n in REFIT
        ]  # fmt: skip
        payloads = [
            encode_payload([item], PayloadMeta(
                version=version, base_version=version - 1, attempt=attempt, owner=0, sequence=i,
            ))
            for i, item in enumerate(items)
        ]  # fmt: skip
        publish_attempt(
            self.transport, version=version, attempt=attempt, base_version=version - 1,
            payloads={0: payloads},
        )  # fmt: skip
        return {"baseline_id": f"v{version - 1}", "payloads": len(items)}

    def verify(self, version: int) -> None:
        pass

    def commit(self, version: int) -> None:
        pass

    def abort(self, version: int, attempt: int) -> None:
        pass


@pytest.fixture
def worker_engine() -> Iterator[DCRWeightTransferEngine]:
    """A real `DCRWeightTransferEngine` over the FAKE worker (FAKE vLLM configs)."""
    worker = FakeWorker()
    saved = dcr_worker._state["worker"]
    dcr_worker._state["worker"] = weakref.ref(worker)
    config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=1), model_config=None)
    model = worker.model_runner.model
    eng = DCRWeightTransferEngine(
        SimpleNamespace(backend="dcr"),
        config,
        None,  # type: ignore[arg-type]
        model,
    )
    eng._fake_worker = worker  # type: ignore[attr-defined]  # keep it alive
    try:
        yield eng
    finally:
        dcr_worker._state["worker"] = saved


class Rig:
    """A native trainer engine over the loopback client, with `checkpoint_for` a callable that
    gives a context manager (recording when each version's checkpoint is held)."""

    def __init__(self, tmp: Path, worker_engine: DCRWeightTransferEngine, **info: Any) -> None:
        self.lineage = _lineage()
        self.paths = [save_checkpoint(v, tmp / f"v{i}") for i, v in enumerate(self.lineage)]
        self.held: list[tuple[str, int]] = []
        self.store = {"kind": "dir", "root": str(tmp / "store")}
        self.control = open_store(self.store)
        self.owners = LineageOwners(self.lineage, self.store)
        self.client = LoopbackClient(worker_engine)
        self.model = worker_engine._receiver().model
        settings = {
            "rank": 0,
            "control": self.store,
            "transport": self.store,
            "owners": self.owners,
            "tensors": TABLE,
            "checkpoint_for": self.lease,
            "dense_load_at_init": True,
            **info,
        }
        self.engine = DCRTrainerWeightTransferEngine.trainer_init(
            DCRTrainerInitInfo(**settings), client=self.client
        )

    @contextmanager
    def _held(self, version: int) -> Iterator[Path]:
        self.held.append(("enter", version))
        try:
            yield self.paths[version]
        finally:
            self.held.append(("exit", version))

    def lease(self, version: int) -> Any:
        return self._held(version)

    def keys(self) -> list[str]:
        return sorted(self.control.list(""))


def test_remove_then_add_back_dense_loads_the_committed_version(
    worker_engine: DCRWeightTransferEngine, tmp_path: Path
) -> None:
    rig = Rig(tmp_path, worker_engine)
    engine = rig.engine
    assert rig.held == [("enter", 0), ("exit", 0)]  # the init's dense load, under the lease
    assert engine.members == ("engine0",)
    rx = worker_engine._receiver()
    _assert_holds(rig.model, rig.lineage[0])

    # removed: v1 commits without it; it is sent nothing and keeps v0
    handle = engine.remove_engine("engine0")
    assert handle is not None and handle.name == "engine0"
    assert engine.members == ()
    rig.client.calls.clear()
    res = engine.send_weights()
    assert res is not None and res.version == 1 and res.record.receivers == ()
    assert rig.client.calls == [] and rig.owners.builds == [(1, 0, False)]
    assert rx.committed_version == 0
    _assert_holds(rig.model, rig.lineage[0])

    # added back: a dense load of committed v1 under its lease, then included from v2
    record = engine.add_engine("engine0", rig.client)
    assert record is not None and record.version == 1
    assert rig.held[-2:] == [("enter", 1), ("exit", 1)]
    assert rig.client.calls[0] == "init_weight_transfer_engine"
    assert engine.members == ("engine0",)
    assert rx.committed_version == 1 and rx.state == "clean"
    _assert_holds(rig.model, rig.lineage[1])
    res = engine.send_weights()
    assert res is not None and res.version == 2 and res.retries == 0
    assert res.record.receivers == ("engine0",) and res.record.digests["engine0"]
    assert rx.committed_version == 2
    _assert_holds(rig.model, rig.lineage[2])  # the delta v1 -> v2 applied on the dense v1


def test_add_and_remove_engine_refuse_bad_arguments_before_calling_anything(
    worker_engine: DCRWeightTransferEngine, tmp_path: Path
) -> None:
    rig = Rig(tmp_path, worker_engine)
    engine = rig.engine
    keys = rig.keys()
    bad_adds: dict[str, tuple[Any, Any, str]] = {
        "name slash": ("a/b", RecordingClient(), "engine name must be 1-128 characters"),
        "name empty": ("", RecordingClient(), "engine name must be"),
        "name not text": (7, RecordingClient(), "engine name must be"),
        "member": ("engine0", RecordingClient(), "engine name 'engine0' is already a member"),
        "no client": ("engine1", None, "client must be one VLLMWeightSyncClient"),
        "client mapping": ("engine1", {"x": RecordingClient()}, "client must be one"),
    }
    for what, (name, client, says) in bad_adds.items():
        with pytest.raises(ProtocolError, match="add_engine: bad arguments: ") as e:
            engine.add_engine(name, client)
        assert says in str(e.value), (what, str(e.value))
        for c in client.values() if isinstance(client, dict) else [client]:
            assert c is None or c.calls == [], what
    for name, says in (("a/b", "engine name must be"), ("engine1", "is not a member")):
        with pytest.raises(ProtocolError, match=f"remove_engine: bad arguments: .*{says}"):
            engine.remove_engine(name)
    assert engine.members == ("engine0",) and rig.keys() == keys and rig.owners.builds == []

    # without checkpoint_for no engine can join: refused before the engine is called
    plain = DCRTrainerWeightTransferEngine.trainer_init(
        DCRTrainerInitInfo(
            rank=0,
            control={"kind": "dir", "root": str(tmp_path / "plain")},
            transport={"kind": "dir", "root": str(tmp_path / "plain")},
            owners=rig.owners,  # type: ignore[arg-type]
            tensors=TABLE,
        ),
        client={"e0": rig.client},
    )
    plain_store = open_store({"kind": "dir", "root": str(tmp_path / "plain")})
    plain_keys = sorted(plain_store.list(""))
    client = RecordingClient()
    with pytest.raises(ProtocolError, match="add_engine: bad arguments: .*checkpoint_for"):
        plain.add_engine("engine1", client)  # type: ignore[arg-type]
    assert client.calls == [] and plain.members == ("e0",)
    assert sorted(plain_store.list("")) == plain_keys

    # other trainer ranks: nothing, None
    other = DCRTrainerWeightTransferEngine.trainer_init(
        DCRTrainerInitInfo(rank=1, control=rig.store, transport=rig.store, tensors=TABLE),
        client=client,
    )
    assert other.add_engine("engine1", client) is None  # type: ignore[arg-type]
    assert other.remove_engine("engine0") is None and other.members == ()
    assert client.calls == [] and rig.keys() == keys


def test_trainer_init_refuses_a_checkpoint_for_that_is_neither_template_nor_callable(
    tmp_path: Path,
) -> None:
    store = {"kind": "dir", "root": str(tmp_path / "control")}
    client = RecordingClient()
    for given in (5, b"/c/{version}", ["/c/{version}"]):
        info = DCRTrainerInitInfo(
            rank=0,
            control=store,
            transport=store,
            owners="tcp://127.0.0.1:1",
            tensors=TABLE,
            checkpoint_for=given,  # type: ignore[arg-type]
        )
        with pytest.raises(
            ProtocolError, match="trainer_init: bad arguments: .*checkpoint_for must be a path "
        ) as e:
            DCRTrainerWeightTransferEngine.trainer_init(info, client=client)
        assert "or a callable" in str(e.value)
    assert client.calls == [] and not (tmp_path / "control").exists()
