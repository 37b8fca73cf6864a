"""The owner hook and its config in-process: explicit process groups, enums, frozen config.

A one-rank gloo process group is created directly (``ProcessGroupGloo``), never registered as
torch's default group, and handed to `DCRHook` through `ParallelGroups`; megatron-core's
``parallel_state`` is never initialized and `ParallelGroups.from_megatron` is made to fail. So a
hook that reached for a global process group or a parallel_state getter below its constructor
would fail here. The model is a FAKE: a module with three bf16 parameters whose FAKE bridge
mappings are one affine column layout, one replicated norm and one residual padded embedding
(tests/unit/megatron/test_affine_units.py tests the probe itself). The oracle is bitwise: records
applied to the fake canonical export of v0 give the export of v1.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import megatron_dcr_hooks.detection as detection_mod
import megatron_dcr_hooks.hook as hook_mod
import megatron_dcr_hooks.residual as residual_mod
import shared_codec.scan as scan_mod
from megatron_dcr_hooks.conversion import ParamTask
from megatron_dcr_hooks.groups import ParallelGroups, RankGroup, takes_host_tensors
from megatron_dcr_hooks.hook import ConstructionMode, DCRConfig, DCRHook, enable_dcr
from megatron_dcr_hooks.tasks import TaskKind, classify_tasks
from shared_codec.checkpoint import bits_equal
from shared_codec.decode import decode_payload
from shared_codec.errors import CandidateChanged, DCRError, OwnerBuildError, ProtocolError
from shared_codec.records import Kind, apply_items
from tests.device_only import device_only_group

# -- DCRConfig -----------------------------------------------------------------------------------


def test_config_mode_takes_the_enum_or_its_letter() -> None:
    for letter in "XPF":
        c = DCRConfig(mode=letter)
        assert c.mode is ConstructionMode(letter) and c.mode == letter
    assert DCRConfig().mode is ConstructionMode.X
    assert DCRConfig(mode=ConstructionMode.F).mode is ConstructionMode.F
    with pytest.raises(ValueError, match=r"one of X, P, F, not 'Q'"):
        DCRConfig(mode="Q")
    with pytest.raises(ValueError):
        DCRConfig(mode="x")


def test_config_is_frozen_and_keyword_only() -> None:
    c = DCRConfig(
        architecture="Qwen3ForCausalLM", overwrite_only={"a.weight"}, force_residual=["QKVMapping"]
    )
    assert c.overwrite_only == frozenset({"a.weight"}) and isinstance(c.overwrite_only, frozenset)
    assert c.force_residual == ("QKVMapping",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.mode = ConstructionMode.P  # type: ignore[misc]
    with pytest.raises(TypeError):
        DCRConfig("qwen3")  # type: ignore[misc]
    with pytest.raises(ValueError, match="not a str"):
        DCRConfig(overwrite_only="a.weight")
    assert dataclasses.replace(c, mode="P").mode is ConstructionMode.P


def test_task_kind_is_a_str_enum() -> None:
    assert TaskKind("affine") is TaskKind.AFFINE and TaskKind.RESIDUAL == "residual"


# -- the hook on explicit groups -----------------------------------------------------------------


class FakeColumn:
    """FAKE one-rank ColumnParallelMapping: the canonical tensor is the shard."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {"col.weight": x.clone()}


class FakeNorm:
    """FAKE ReplicatedMapping."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {"norm.weight": x.clone()}


class FakePadded:
    """FAKE padded embedding (one padding row no source id fills): residual."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {"emb.weight": torch.cat([x, torch.zeros_like(x[:1])], 0)}


class FakeModel(torch.nn.Module):
    """FAKE model: three bf16 parameters."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.col = torch.nn.Parameter(torch.randn(8, 16, generator=g).to(torch.bfloat16))
        self.col.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.norm = torch.nn.Parameter(torch.randn(16, generator=g).to(torch.bfloat16))
        self.emb = torch.nn.Parameter(torch.randn(6, 16, generator=g).to(torch.bfloat16))
        self.emb.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.maps = {"col": FakeColumn(), "norm": FakeNorm(), "emb": FakePadded()}

    def param_tasks(self) -> list[ParamTask]:
        return [
            ParamTask(local_name=n, global_name=n, param=p, module=self, mapping=self.maps[n])
            for n, p in self.named_parameters()
        ]

    def export(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for pt in self.param_tasks():
                out.update(pt.mapping.megatron_to_hf(pt.param.detach(), self))
        return out

    def perturb(self, seed: int, fraction: float = 0.2) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                mask = torch.rand(p.shape, generator=g) < fraction
                p[mask] += 0.5


@pytest.fixture(params=["gloo", "device-only-world"])
def groups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ParallelGroups:
    """One-rank groups on a gloo group that is NOT torch's default group; the hook's tasks come
    from the fake model; reaching for megatron-core's groups fails the test. The
    "device-only-world" case gives the hook a world group that rejects CPU tensors, as NCCL
    does (TEST DOUBLE, tests/device_only.py): the hook's reductions must go elsewhere."""

    def no_megatron() -> ParallelGroups:
        raise AssertionError("ParallelGroups.from_megatron() called below the constructor")

    def fake_build_tasks(
        chunks: list[FakeModel], architecture: str, groups: ParallelGroups, **kw: Any
    ):
        return classify_tasks(chunks[0].param_tasks(), groups, **kw)

    monkeypatch.setattr(ParallelGroups, "from_megatron", staticmethod(no_megatron))
    monkeypatch.setattr(hook_mod, "build_tasks", fake_build_tasks)
    assert not dist.is_initialized()
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    one = RankGroup(group=pg, rank=0, size=1)
    if request.param == "gloo":
        return ParallelGroups(world=one, tp=one, dp=one, ep=one, expert_dp=one, pp=one)
    world = RankGroup(group=device_only_group(), rank=0, size=1)
    return ParallelGroups(world=world, tp=one, dp=one, ep=one, expert_dp=one, pp=one)


def _items(payloads: list[bytes]) -> list[Any]:
    return [it for p in payloads for it in decode_payload(p).items]


def _config(**kw: Any) -> DCRConfig:
    return DCRConfig(**{"wrap_step": False, "bucket_bytes": 1024, "encode_threads": 0, **kw})


@pytest.mark.parametrize("mode", ["X", "P", "F"])
def test_hook_builds_exact_deltas_on_the_given_groups(groups: ParallelGroups, mode: str) -> None:
    model = FakeModel()
    hook = DCRHook([model], _config(mode=mode), groups=groups)
    assert hook.groups.world is groups.world and hook.rank == 0 and hook.world == 1
    # on a gloo world the hook reduces over it; on a world that takes no CPU tensors (the
    # device-only double) over a gloo group of its own, never over the world
    assert (hook.groups is groups) == takes_host_tensors(groups.world.group)
    assert takes_host_tensors(hook.groups.cpu_world.group)
    kinds = {t.param_task.local_name: t.kind for t in hook.tasks}
    assert kinds == {"col": TaskKind.AFFINE, "norm": TaskKind.AFFINE, "emb": TaskKind.RESIDUAL}
    v0 = model.export()
    model.perturb(1)
    v1 = model.export()
    rep = hook.build(1)
    items = _items(hook.payloads)
    state = {k: v.clone() for k, v in v0.items()}
    apply_items(state, items)
    assert all(bits_equal(state[n], v1[n]) for n in v1)
    changed = sum(int((v0[n].view(torch.int16) != v1[n].view(torch.int16)).sum()) for n in v0)
    assert rep.entries == changed > 0
    xor = sum(i.count for i in items if i.kind == Kind.XOR)
    assert (xor > 0) == (mode == "X")
    assert 0 < rep.element_change_rate <= 1  # all-reduced over groups.world
    hook.payloads.clear()
    hook.commit()
    assert hook.committed_version == 1
    quiet = hook.build(2)  # nothing changed since the commit
    assert quiet.items == 0 and _items(hook.payloads) == []


@pytest.mark.parametrize("mode", ["X", "P"])
def test_the_streamed_device_scan_gives_the_same_payload_bytes(
    groups: ParallelGroups, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detection's device path (`DeviceScan`, the baseline streamed in 40-byte chunks), forced
    onto these host parameters, emits exactly the payload bytes of the host path."""
    out: dict[str, list[bytes]] = {}
    for path in ("host", "streamed"):
        if path == "streamed":

            def streamed(shard: torch.Tensor, tracker: torch.Tensor, scan: Any = None) -> Any:
                assert scan is not None  # the hook passes its own scan
                return scan(shard, tracker)

            monkeypatch.setattr(detection_mod, "changed_bits", streamed)  # the guard's path
            monkeypatch.setattr(hook_mod, "changed_bits", streamed)
        model = FakeModel()
        hook = DCRHook([model], _config(mode=mode, detect_chunk_bytes=40), groups=groups)
        model.perturb(1)
        hook.build(1)
        hook.verify_candidate(1)
        hook.commit()
        model.perturb(2, fraction=0.01)
        hook.build(2)
        out[path] = list(hook.payloads)
    assert out["host"] and out["streamed"] == out["host"]


class FakeNamed:
    """FAKE one-rank ColumnParallelMapping with its own canonical name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {self.name: x.clone()}


class FakeAffineModel(FakeModel):
    """FAKE model: four bf16 column-parallel parameters of different sizes, all affine."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        g = torch.Generator().manual_seed(1)
        self.maps = {}
        for name, shape in {"a": (8, 16), "b": (64, 64), "c": (4, 16), "d": (32, 64)}.items():
            p = torch.nn.Parameter(torch.randn(*shape, generator=g).to(torch.bfloat16))
            p.tensor_model_parallel = True  # type: ignore[attr-defined]
            self.register_parameter(name, p)
            self.maps[name] = FakeNamed(f"{name}.weight")


def test_build_scans_large_shards_first_and_tapers_its_last_buckets(
    groups: ParallelGroups,
) -> None:
    raw: dict[int, list[int]] = {}
    for floor in (256, 4096):
        model = FakeAffineModel()
        hook = DCRHook([model], _config(bucket_bytes=4096, min_bucket_bytes=floor), groups=groups)
        assert [t.param_task.local_name for t in hook.scan_order] == ["b", "d", "a", "c"]
        v0 = model.export()
        model.perturb(3, fraction=0.3)
        v1 = model.export()
        hook.build(1)
        payloads = [decode_payload(p) for p in hook.payloads]
        raw[floor] = [sum(it.raw_bytes for it in d.items) for d in payloads]
        state = {k: v.clone() for k, v in v0.items()}
        apply_items(state, [it for d in payloads for it in d.items])
        assert all(bits_equal(state[n], v1[n]) for n in v1)
        assert [d.meta.sequence for d in payloads] == list(range(len(payloads)))
    # no taper (floor = bucket): full buckets (to the last whole 10-byte record) and one
    # remainder; with it the sizes halve at the end of the build, the last below the floor
    assert all(r > 4096 - 10 for r in raw[4096][:-1]) and sum(raw[256]) == sum(raw[4096])
    tail = raw[256][-4:]
    assert tail == sorted(tail, reverse=True) and raw[256][-1] <= 256
    assert len(raw[256]) > len(raw[4096])


def test_failed_attempt_then_overwrite_retry_is_exact(groups: ParallelGroups) -> None:
    model = FakeModel()
    hook = DCRHook([model], _config(), groups=groups)
    v0 = model.export()
    model.perturb(2)
    v1 = model.export()
    hook.build(1, 0)
    a0 = _items(hook.payloads)
    hook.payloads.clear()
    hook.abort()
    assert hook.committed_version == 0
    hook.build(1, 1, retry=True)
    retry = _items(hook.payloads)
    assert retry and all(i.kind == Kind.OVERWRITE for i in retry)
    state = {k: v.clone() for k, v in v0.items()}
    apply_items(state, a0[: len(a0) // 2])  # a partial attempt
    apply_items(state, retry)
    assert all(bits_equal(state[n], v1[n]) for n in v1)


def test_out_of_order_calls_are_protocol_errors(groups: ParallelGroups) -> None:
    hook = DCRHook([FakeModel()], _config(), groups=groups)
    with pytest.raises(ProtocolError, match="without a built candidate"):
        hook.commit()
    hook.build(1)
    hook.commit()
    with pytest.raises(ProtocolError, match="<= committed 1"):
        hook.build(1)


@pytest.mark.parametrize("mode", ["X", "F"])
@pytest.mark.parametrize("moved", ["col", "norm", "emb"])
def test_candidate_guard_refuses_commit_and_retry_after_the_weights_moved(
    groups: ParallelGroups, mode: str, moved: str
) -> None:
    """An optimizer step between build and commit: commit() and the overwrite retry refuse
    (naming the parameter), nothing advances or is emitted; a build from the current weights
    records the new candidate, which then commits."""
    model = FakeModel()
    hook = DCRHook([model], _config(mode=mode), groups=groups)
    baseline = {i: t.clone() for i, t in hook.trackers.items()}
    residual = {n: t.clone() for n, t in hook.residual_baseline.items()}
    model.perturb(6)
    hook.build(1, 0)
    hook.verify_candidate(1)  # unchanged: passes, twice
    hook.verify_candidate(1)
    with torch.no_grad():  # the "optimizer step": one element of one parameter
        getattr(model, moved).view(-1)[3] += 1.0
    with pytest.raises(CandidateChanged, match=rf"changed after version 1 was built \({moved}\)"):
        hook.commit()
    assert hook.committed_version == 0
    assert all(torch.equal(baseline[i], t) for i, t in hook.trackers.items())
    assert all(torch.equal(residual[n], t) for n, t in hook.residual_baseline.items())

    hook.build(1, 0)  # the trainer rebuilds the version from its current weights
    hook.payloads.clear()
    getattr(model, moved).data.view(-1)[5] += 1.0
    with pytest.raises(CandidateChanged, match=moved):
        hook.build(1, 1, retry=True)
    assert hook.payloads == []  # refused before emitting anything

    v0 = {n: t.clone() for n, t in FakeModel().export().items()}
    hook.build(1, 2, retry=True)  # the stale record was dropped: builds from the weights now
    state = dict(v0)
    apply_items(state, _items(hook.payloads))
    assert all(bits_equal(state[n], t) for n, t in model.export().items())
    hook.commit()
    assert hook.committed_version == 1


@pytest.mark.parametrize("mode", ["X", "P"])
def test_commit_advances_the_trackers_to_the_built_candidate_without_reading_the_shards(
    groups: ParallelGroups, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`commit` scatters the build's recorded changed indices and new bits into the trackers:
    they then hold exactly the parameters' stored bits, and with ``verify=False`` (the owner
    service after the compare-and-set) no shard is read at all."""
    model = FakeModel()
    hook = DCRHook([model], _config(mode=mode), groups=groups)
    for seed in (11, 12):
        model.perturb(seed)
        hook.build(hook.committed_version + 1)
        hook.payloads.clear()
        with monkeypatch.context() as m:  # commit must not detect: any scan fails the test
            m.setattr(scan_mod, "changed_indices", _no_scan)  # the scans (issue 29
            m.setattr(residual_mod, "changed_indices", _no_scan)  # split them out of hook.py)
            hook.commit(verify=False)
        params = {t.index: t.param for t in hook.tasks}
        assert hook.trackers and all(
            torch.equal(tr.view(torch.int16), params[i].detach().view(torch.int16))
            for i, tr in hook.trackers.items()
        )
        assert hook.build(hook.committed_version + 1).items == 0  # nothing left to ship
        hook.abort()


def test_commit_after_the_record_is_durable_advances_to_what_was_built(
    groups: ParallelGroups,
) -> None:
    """The weights move after the coordinator's pre-CAS verify: ``commit(verify=False)``
    advances the trackers to the candidate the engines hold (not to the moved weights), and
    the next build ships exactly the later movement: engines stay bit-exact."""
    model = FakeModel()
    hook = DCRHook([model], _config(), groups=groups)
    state = {n: t.clone() for n, t in model.export().items()}  # an engine at v0
    model.perturb(21)
    hook.build(1)
    hook.verify_candidate(1)  # the coordinator's guard, then its compare-and-set
    apply_items(state, _items(hook.payloads))
    hook.payloads.clear()
    with torch.no_grad():  # an async trainer steps before the owners heard of the commit
        model.col.view(-1)[3] += 1.0
        model.emb.view(-1)[7] += 1.0
    hook.commit(verify=False)
    assert hook.committed_version == 1
    hook.build(2)
    items = _items(hook.payloads)
    assert {i.name for i in items} == {"col.weight", "emb.weight"}
    apply_items(state, items)
    assert all(bits_equal(state[n], t) for n, t in model.export().items())


def _no_scan(*a: Any) -> Any:
    raise AssertionError("commit scanned a shard")


def test_candidate_guard_sees_a_new_value_at_an_index_the_build_already_changed(
    groups: ParallelGroups,
) -> None:
    """Same changed indices, one different bit: the guard compares the values too."""
    model = FakeModel()
    hook = DCRHook([model], _config(), groups=groups)
    model.perturb(6)
    hook.build(1)
    col = next(t for t in hook.tasks if t.param_task.local_name == "col")
    first = int(hook._delta[col.index][0][0])  # an element this build changed
    with torch.no_grad():
        model.col.view(-1)[first] = -model.col.view(-1)[first]
    with pytest.raises(CandidateChanged, match=r"\(col\)"):
        hook.verify_candidate(1)


def test_candidate_guard_off_checks_nothing(groups: ParallelGroups) -> None:
    """``candidate_guard=False`` (a trainer that never steps between build and commit): no
    fingerprints, verify and commit do not scan, and the builds stay exact."""
    model = FakeModel()
    hook = DCRHook([model], _config(candidate_guard=False), groups=groups)
    v0 = model.export()
    model.perturb(9)
    v1 = model.export()
    hook.build(1, 0)
    assert hook._built is not None and hook._built[1] == {}  # nothing recorded to check
    state = dict(v0)
    apply_items(state, _items(hook.payloads))
    assert all(bits_equal(state[n], v1[n]) for n in v1)
    hook.verify_candidate(1)  # checks nothing
    hook.commit()
    assert hook.committed_version == 1


def test_verify_without_a_build_of_that_version_is_a_protocol_error(
    groups: ParallelGroups,
) -> None:
    hook = DCRHook([FakeModel()], _config(), groups=groups)
    with pytest.raises(ProtocolError, match="no build of version 1"):
        hook.verify_candidate(1)
    hook.build(1)
    with pytest.raises(ProtocolError, match=r"no build of version 2 to verify \(last build: 1\)"):
        hook.verify_candidate(2)


def test_sink_failure_is_an_owner_build_error_and_keeps_the_baseline(
    groups: ParallelGroups,
) -> None:
    def broken(payload: bytes) -> None:
        raise OSError("store unreachable")

    model = FakeModel()
    hook = DCRHook([model], _config(sink=broken), groups=groups)
    before = {i: t.clone() for i, t in hook.trackers.items()}
    model.perturb(3)
    with pytest.raises(OwnerBuildError, match="store unreachable"):
        hook.build(1)
    assert hook.committed_version == 0
    assert all(torch.equal(before[i], t) for i, t in hook.trackers.items())


def test_a_hook_needs_model_chunks(groups: ParallelGroups) -> None:
    with pytest.raises(ValueError, match="at least one"):
        DCRHook([], _config(), groups=groups)


def test_local_layer_indices_become_global_through_layer_number() -> None:
    from megatron_dcr_hooks.conversion import global_layer_name

    class Layer(torch.nn.Module):
        def __init__(self, number: int) -> None:
            super().__init__()
            self.layer_number = number  # 1-based and global, as megatron's TransformerLayer
            self.w = torch.nn.Parameter(torch.zeros(1))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(5), Layer(6)])  # a chunk of layers 4-5

    class Chunk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = Block()

    root = Chunk()
    assert global_layer_name(root, "decoder.layers.1.w") == "decoder.layers.5.w"
    assert global_layer_name(root, "decoder.layers.0.w") == "decoder.layers.4.w"
    assert global_layer_name(root, "embedding.word_embeddings.weight") == (
        "embedding.word_embeddings.weight"
    )


def test_enable_dcr_passes_the_groups_and_wraps_the_step(groups: ParallelGroups) -> None:
    model = FakeModel()

    class FakeOptimizer:
        """FAKE Megatron optimizer: ``step`` returns (update_successful, grad_norm, zeros)."""

        def __init__(self) -> None:
            self.ok = True

        def step(self) -> tuple[bool, float, int]:
            if self.ok:  # a skipped step (non-finite gradients) leaves the weights alone
                model.perturb(4)
            return self.ok, 1.0, 0

    opt = FakeOptimizer()
    hook = enable_dcr([model], opt, _config(wrap_step=True), groups=groups)
    assert hook.groups.world is groups.world and hook.groups.tp is groups.tp
    opt.step()
    assert hook.last_report is not None and hook.last_report.version == 1
    opt.ok = False
    hook.last_report = None
    opt.step()  # a skipped step builds nothing
    assert hook.last_report is None
    hook.verify_candidate(1)
    opt.ok = True
    opt.step()  # another step before the commit: version 1 is built again
    with pytest.raises(CandidateChanged, match="version 1 was built again"):
        hook.commit()
    assert hook.committed_version == 0
    hook.build(1, 0)  # the coordinator's next attempt builds it from the current weights
    hook.commit()
    assert hook.committed_version == 1


def test_owner_service_reduces_over_the_hooks_groups(
    groups: ParallelGroups, tmp_path: Path
) -> None:
    from megatron_dcr_hooks.service import OwnerService, _broadcast_json, _gather_json
    from shared_codec.transport.store import DirectoryStore

    model = FakeModel()
    hook = DCRHook([model], _config(), groups=groups)
    host = hook.groups.cpu_world  # the world on gloo; a gloo group of the hook's on the double
    assert _broadcast_json({"op": "x"}, host) == {"op": "x"}
    assert _gather_json([1, "a"], host) == [[1, "a"]]
    store = DirectoryStore(tmp_path / "payloads")
    svc = OwnerService(hook, {"kind": "dir", "root": str(tmp_path / "payloads")}, "inproc://unused")
    model.perturb(5)
    out = svc.handle({"op": "build", "version": 1, "attempt": 0})
    assert out["ok"], out
    assert out["payloads"] > 0 and out["baseline_id"] == "owners-v0"
    assert any(k.endswith("manifest.json") for k in store.list(""))
    bad = svc.handle({"op": "commit", "version": 2})
    assert not bad["ok"] and "ProtocolError" in bad["error"]
    assert svc.handle({"op": "verify", "version": 1})["ok"]
    assert svc.handle({"op": "commit", "version": 1})["committed_version"] == 1
    assert svc.handle({"op": "status"})["committed_version"] == 1
    model.perturb(7)
    assert svc.handle({"op": "build", "version": 2, "attempt": 0})["ok"]
    model.perturb(8)  # a step between build and commit
    moved = svc.handle({"op": "verify", "version": 2})
    assert not moved["ok"] and moved["error_type"] == "CandidateChanged", moved
    retry = svc.handle({"op": "build", "version": 2, "attempt": 1, "retry": True})
    assert retry["ok"]  # the stale record was dropped by the failed verify


def test_owner_service_socket_stays_bound_between_serves(
    groups: ParallelGroups, tmp_path: Path
) -> None:
    """Real ZeroMQ sockets on loopback, the real `OwnerService` over the FAKE model's hook: a
    coordinator's ``status`` sent right after ``stop``, while the job trains, reaches a socket
    that is still bound and is answered by the next serve. (A socket closed after each
    ``stop`` could take that request during its last moments and drop it: the REQ client then
    waited its whole timeout, seen once under CI load in tests/integration/test_callback.py.)"""
    import socket
    import threading
    import time

    from megatron_dcr_hooks.service import OwnerService
    from shared_codec.coordination.owners import RemoteOwners

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"

    def listening() -> bool:
        time.sleep(0.3)  # ZeroMQ binds and closes a listener on its I/O thread
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    hook = DCRHook([FakeModel()], _config(), groups=groups)
    svc = OwnerService(hook, {"kind": "dir", "root": str(tmp_path / "payloads")}, endpoint)
    client = RemoteOwners(endpoint, timeout_s=20)
    first = threading.Thread(target=svc.serve)
    first.start()
    assert client.call("status")["committed_version"] == 0
    client.stop()
    first.join(timeout=20)
    assert not first.is_alive()
    assert listening()  # between serves (the job trains) the endpoint still accepts
    answered: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: answered.update(client.call("status")))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and not answered  # queued until the job serves again
    second = threading.Thread(target=svc.serve)
    second.start()
    waiter.join(timeout=20)
    assert answered["ok"] and answered["committed_version"] == 0
    client.stop()
    second.join(timeout=20)
    assert not second.is_alive()
    svc.close()
    assert not listening()
    client.close()


def test_callback_under_bridges_callback_manager(groups: ParallelGroups) -> None:
    """`DCRCallback` registered by megatron-bridge's own ``CallbackManager`` (the installed
    bridge's ``normalize_callbacks``, what ``pretrain(callbacks=[...])`` does) with the events
    fired as Bridge's ``train()`` fires them, around a FAKE model's updates: attached at
    ``on_train_start``, a successful step builds the next version into the sink, a skipped one
    builds and publishes nothing, the commit advances; the plain hook API needs an attach."""
    from megatron_dcr_hooks.bridge_loader import import_bridge_module
    from megatron_dcr_hooks.callback import DCRCallback

    cb_mod = import_bridge_module("megatron.bridge.training.callbacks")
    model = FakeModel()
    # a DDP chunk that overlaps the param all-gather with the next forward: the hook forces it
    synced: list[bool] = []
    model.ddp_config = types.SimpleNamespace(overlap_param_gather=True)  # type: ignore[attr-defined]
    model.start_param_sync = lambda force_sync=False: synced.append(force_sync)  # type: ignore[attr-defined]
    sent: list[bytes] = []
    dcr = DCRCallback(_config(wrap_step=True, sink=sent.append), groups=groups)
    assert dcr.config.wrap_step is False  # the events are the step hook
    manager = cb_mod.normalize_callbacks([dcr])
    assert {"on_train_start", "on_train_step_start", "on_train_step_end"} <= {
        e for e in manager.events if manager.has_callbacks(e)
    }

    def fire(event: str, **fields: Any) -> None:
        ctx = cb_mod.CallbackContext(state=None, model=[model], user_state=manager.user_state)
        for k, v in fields.items():
            setattr(ctx, k, v)
        manager.fire(event, ctx)

    with pytest.raises(ProtocolError, match="before the first optimizer step"):
        fire("on_train_step_end", skipped_iter=False)
    v0 = model.export()
    fire("on_train_start")
    assert dcr.hook is not None and dcr.hook.groups.world is groups.world
    fire("on_train_step_start")
    model.perturb(5)  # the optimizer's update
    fire("on_train_step_end", skipped_iter=False)
    assert dcr.built == [1] and sent
    v1 = model.export()
    assert apply_items(v0, _items(sent)) > 0
    assert all(bits_equal(v0[n], v1[n]) for n in v1)  # the payloads take v0 to v1 exactly
    dcr.hook.commit()
    sent.clear()
    fire("on_train_step_start")
    fire("on_train_step_end", skipped_iter=True)  # refused update: weights unchanged
    assert sent == [] and dcr.skipped_steps == 1 and dcr.built == [1]
    assert synced == [True, True]  # by the hook: at attach and before the one build
    model.perturb(6)
    assert dcr.after_optimizer_step(skipped=False) is not None  # the plain hook: same object
    assert dcr.built == [1, 2] and dcr.steps == 2 and sent


def test_owner_service_holds_the_guard_only_while_it_holds_the_training_thread(
    groups: ParallelGroups, tmp_path: Path
) -> None:
    """Real ZeroMQ sockets on loopback, the real `OwnerService` over the FAKE model's hook. A
    verify right after the build in the same serve call skips the shard scan (``guard`` held);
    after a user op (here one that moves a weight), or in a later serve (the job trained in
    between), it scans and refuses the moved candidate; a wrapped optimizer step's second
    build of the version is refused before any scan; optimizer steps seen on another thread
    than the serve's disable the hold. A commit is answered before the trackers advance (the
    next request sees them advanced); when that advance fails, every later request fails
    naming it and nothing else changes."""
    import socket
    import threading

    from megatron_dcr_hooks.service import OwnerService
    from shared_codec.coordination.owners import RemoteOwners

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    model = FakeModel()
    hook = DCRHook([model], _config(), groups=groups)

    def nudge(req: dict[str, Any]) -> dict[str, Any]:
        with torch.no_grad():
            model.col.view(-1)[int(req.get("at", 0))] += 1.0
        return {}

    def step(req: dict[str, Any]) -> dict[str, Any]:  # a wrapped optimizer step inside serve
        model.perturb(int(req["seed"]))
        hook.after_step()
        return {}

    svc = OwnerService(
        hook,
        {"kind": "dir", "root": str(tmp_path / "payloads")},
        endpoint,
        handlers={"nudge": nudge, "step": step},
    )
    client = RemoteOwners(endpoint, timeout_s=30)

    def serving() -> threading.Thread:
        t = threading.Thread(target=svc.serve)
        t.start()
        return t

    server = serving()
    model.perturb(5)
    assert client.build(1, 0, False)["payloads"] > 0
    assert client.call("status")["candidate"] == 1
    assert client.verify(1)["guard"] == "held" and hook.guard_scans == 0
    assert client.verify(1)["guard"] == "held" and hook.guard_held == 2
    client.call("nudge", at=3)  # a user op between build and verify: the guard scans
    with pytest.raises(CandidateChanged, match="col"):
        client.verify(1)
    assert hook.guard_scans == 1
    client.build(1, 1, True)  # rebuilt from the moved weights: held again
    assert client.verify(1)["guard"] == "held"
    client.commit(1)  # answered before the trackers advance; the next request after they did
    assert client.call("status")["committed_version"] == 1 == hook.committed_version

    model.perturb(6)
    client.build(2, 0, False)
    client.stop()
    server.join(timeout=30)
    with torch.no_grad():  # the job trains between two serves
        model.col.view(-1)[5] += 1.0
    server = serving()
    with pytest.raises(CandidateChanged, match="col"):
        client.verify(2)
    assert hook.guard_scans == 2
    client.build(2, 1, True)
    assert client.verify(2)["guard"] == "held"
    client.call("step", seed=7)  # builds version 2 again: refused without a scan
    with pytest.raises(CandidateChanged, match="built again"):
        client.verify(2)
    assert hook.guard_scans == 2
    hook.step_thread = -1  # steps seen on another thread: serve cannot hold the guard
    client.build(2, 2, True)
    assert client.verify(2)["guard"] == "scanned" and hook.guard_scans == 3
    baseline = {i: t.clone() for i, t in hook.trackers.items()}

    def broken_commit(*, verify: bool = True) -> None:
        raise RuntimeError("host memory gone")

    hook.commit = broken_commit  # type: ignore[method-assign]
    client.commit(2)  # the record is durable: the reply comes first
    with pytest.raises(DCRError, match="commit failed after its reply.*host memory gone"):
        client.call("status")
    with pytest.raises(DCRError, match="restart it from its checkpoint"):
        client.build(3, 0, False)
    assert all(torch.equal(baseline[i], t) for i, t in hook.trackers.items())
    client.stop()
    server.join(timeout=30)
    assert not server.is_alive()
    svc.close()
    client.close()
