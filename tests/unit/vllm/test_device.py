"""Waiting for the device before an ACK, and keeping storage addresses (vllm_dcr_plugin/device.py),
with FAKES (pure unit test, labelled as such): a FAKE accelerator (``torch.accelerator``'s
functions replaced by recorders) and FAKE tensors that only say which device they are on, since
this machine has no GPU; the receiver and the native engine over the fake loader model of
test_receiver_units.py. The real CUDA run is tests/integration/test_gpu_lane.py (marked gpu), the
real vLLM engine run tests/integration/vllm/test_receiver.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shared_codec.errors import LoaderConditionError
from tests.unit.vllm.test_exactly_once import _encode, _items, _publish, _receiver, _versions
from tests.unit.vllm.test_native_contract import (  # noqa: F401 - `engine` is a fixture
    _UPDATE,
    _init,
    _report,
    engine,
)
from tests.unit.vllm.test_receiver_units import _assert_holds
from vllm_dcr_plugin import device
from vllm_dcr_plugin.transfer import reports


class FakeDeviceModule(torch.nn.Module):
    """FAKE: parameters and buffers that only say which device holds them."""

    def __init__(self, params: list[str], buffers: list[str]) -> None:
        super().__init__()
        self._fake_params = [SimpleNamespace(device=torch.device(d)) for d in params]
        self._fake_buffers = [SimpleNamespace(device=torch.device(d)) for d in buffers]

    def parameters(self, recurse: bool = True):  # type: ignore[override]
        return iter(self._fake_params)

    def buffers(self, recurse: bool = True):  # type: ignore[override]
        return iter(self._fake_buffers)


@pytest.fixture
def accelerator(monkeypatch):
    """A FAKE accelerator of type `kind` (None: no accelerator, as on this machine); records
    the devices ``torch.accelerator.synchronize`` is called with."""
    calls: list[torch.device] = []
    state = {"kind": None}

    def current(check_available: bool = False):
        return None if state["kind"] is None else torch.device(state["kind"])

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: state["kind"] is not None)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", current)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda d=None: calls.append(d))
    return SimpleNamespace(calls=calls, state=state)


def test_host_models_are_not_synchronized(accelerator) -> None:
    model = torch.nn.Linear(3, 2)
    assert device.synchronize(model) == [] and accelerator.calls == []
    # an accelerator present, the model on the host: still nothing to wait for
    accelerator.state["kind"] = "cuda"
    assert device.synchronize(model) == [] and accelerator.calls == []
    assert device.settle(model) is None


def test_each_accelerator_device_of_the_model_is_synchronized_once(accelerator) -> None:
    accelerator.state["kind"] = "cuda"
    model = FakeDeviceModule(["cuda:1", "cpu", "cuda:0", "cuda:1", "meta"], ["cuda:0", "cpu"])
    assert device.synchronize(model) == ["cuda:0", "cuda:1"]
    assert accelerator.calls == [torch.device("cuda:0"), torch.device("cuda:1")]
    # tensors of another device type than the accelerator's are not waited for
    accelerator.calls.clear()
    accelerator.state["kind"] = "xpu"
    assert device.synchronize(model) == [] and accelerator.calls == []


def test_settle_returns_the_device_error_as_text(accelerator, monkeypatch) -> None:
    accelerator.state["kind"] = "cuda"

    def failing(d=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.accelerator, "synchronize", failing)
    out = device.settle(FakeDeviceModule(["cuda:0"], []))
    assert out == "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_storage_pointers_name_parameters_and_buffers() -> None:
    model = torch.nn.BatchNorm1d(4)
    ptrs = device.storage_pointers(model)
    assert set(ptrs) == {"weight", "bias"} | {
        f"buffer:{n}" for n in ("running_mean", "running_var", "num_batches_tracked")
    }
    assert ptrs["weight"] == model.weight.data_ptr() != 0


class _Recorder:
    """Replaces device.synchronize: records, per call, what `probe()` saw at that moment."""

    def __init__(self, probe) -> None:
        self.probe, self.seen = probe, []

    def __call__(self, model: torch.nn.Module) -> list[str]:
        self.seen.append(self.probe())
        return []


def test_apply_synchronizes_after_its_writes_and_keeps_storage(monkeypatch) -> None:
    rx, v0, v1, report = _receiver()
    before = device.storage_pointers(rx.model)
    rec = _Recorder(lambda: rx.digest()["digest"])
    monkeypatch.setattr(device, "synchronize", rec)
    staged = rx.stage(_encode(_items(v0, v1, report)))
    assert staged["staged"] and not staged["rejected"], staged
    ack = rx.apply(0, verify=True)
    assert ack["ok"] and ack["items"] == 3, ack
    # one wait, after every write (the weights then were already those the ACK reports)
    assert rec.seen == [rx.digest()["digest"]]
    _assert_holds(rx.model, v1)  # type: ignore[arg-type]
    assert device.storage_pointers(rx.model) == before


def test_a_device_error_after_the_writes_fails_the_ack_and_leaves_the_receiver_dirty(
    monkeypatch, tmp_path: Path
) -> None:
    rx, v0, v1, report = _receiver()

    def failing(model: torch.nn.Module) -> list[str]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    rx.stage(_encode(_items(v0, v1, report)))
    monkeypatch.setattr(device, "synchronize", failing)
    ack = rx.apply(0)
    assert ack["ok"] is False, ack
    assert ack["error"] == (
        "device error after the writes: RuntimeError: CUDA error: an illegal memory access "
        "was encountered"
    )
    assert rx.status()["state"] == "dirty"
    # a dense load whose writes the device then fails leaves it dirty, with the reason
    from shared_codec.checkpoint import save_checkpoint

    save_checkpoint(v0, tmp_path / "v0")
    with pytest.raises(LoaderConditionError, match="the device reported an error after"):
        rx.dense_load(str(tmp_path / "v0"), 0)
    assert rx.status()["state"] == "dirty"
    monkeypatch.undo()
    assert rx.dense_load(str(tmp_path / "v0"), 0)["committed_version"] == 0
    assert rx.status()["state"] == "clean"


def test_native_update_waits_before_its_report(engine, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    """The native engine's ``update_weights`` (vLLM's base: receive, then synchronize) waits
    for the device before the report that is its ACK is written."""
    engine.init_transfer_engine(engine.parse_init_info(_init(tmp_path, "sync")))
    assert _report(tmp_path, reports.init_step("sync"))["ok"]
    rx = engine._receiver()
    v0, v1 = _versions()
    _publish(
        tmp_path / "source", _encode(_items(v0, v1, {"overwrite_only": rx.found.overwrite_only}))
    )
    key = tmp_path / "control" / reports.key("engine0", reports.update_step(1, 0), 0)
    before = device.storage_pointers(rx.model)
    rec = _Recorder(lambda: key.exists())
    monkeypatch.setattr(device, "synchronize", rec)
    engine.update_weights(_UPDATE)  # pipelined: one wait per part applied
    rep = json.loads(key.read_text())
    assert rep["ok"], rep
    assert rec.seen and not any(rec.seen)  # every wait came before the report
    _assert_holds(rx.model, v1)  # type: ignore[arg-type]
    assert device.storage_pointers(rx.model) == before
