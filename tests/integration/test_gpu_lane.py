"""The GPU lane: the device-dependent paths, run on "cpu" always and on "cuda" where there is one.

Every test is parametrized over the device that holds the model's parameters. The "cpu" case
runs in the default suite; the "cuda" case is marked ``gpu`` and skipped with its reason on a
machine without CUDA (``make test-gpu`` runs only the cuda cases; ``scripts/gpu_lane.sh`` on a
device machine). The oracles are bitwise and computed on the host, independently of the device:

1. change detection (megatron_dcr_hooks/detection.py): trackers stay host copies; host
   parameters are scanned in place by the compiled scan, device parameters on the device
   against the tracker streamed in chunks (`DeviceScan`). The real `DCRHook` on the FAKE
   one-rank model of tests/unit/megatron/test_hook_units.py (plus an FP32 parameter), its
   parameters on the device, must emit exactly the changed indices and bits numpy finds; and
   `DeviceScan` on the device must give exactly what the compiled scan of a host copy gives;
2. the direct scatter (vllm_dcr_plugin/apply.py `scatter_direct`): the compiled numpy scatter
   on CPU, torch index ops on any other device, into strided destination views at offsets;
3. the intercept path (intercept.py, capability.py, placement.py, apply.py) through the real
   `Receiver` with a FAKE loader whose parameters live on the device; the scratch buffer stays
   on the host (as in vLLM), so every loader copy is a host -> device ``copy_``;
4. the receiver on the device (device.py): refits keep every parameter's storage address (CUDA
   graphs replay on the addresses they captured) and each ACK follows a synchronize of the
   parameters' device (none on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from megatron_dcr_hooks.hook import DCRHook
from shared_codec.buckets import encode_items
from shared_codec.errors import CandidateChanged
from shared_codec.format import PayloadMeta
from shared_codec.records import Kind, diff_tensors, make_item
from shared_codec.scan import DeviceScan, changed_bits
from tests.unit.megatron.test_hook_units import (  # noqa: F401 - `groups` is a fixture
    FakeModel,
    FakeNorm,
    _config,
    _items,
    groups,
)
from vllm_dcr_plugin import device as dcr_device
from vllm_dcr_plugin.intercept import ViewGeom, flat_storage_bits
from vllm_dcr_plugin.receiver import Receiver
from vllm_dcr_plugin.scatter import count_mismatches, scatter_direct

NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False); run make test-gpu on a GPU"
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)],
    ),
]
_INT = {2: torch.int16, 4: torch.int32}


def _host_bits(t: torch.Tensor) -> np.ndarray:
    """A host copy of the stored bits of `t` (any device), flattened, as unsigned integers."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(_INT[t.element_size()])
    return flat.numpy().view(np.uint16 if t.element_size() == 2 else np.uint32).copy()


def _flip(t: torch.Tensor, idx: list[int], mask: int) -> None:
    """XOR `mask` into the stored bits of `t`'s elements `idx`, on `t`'s device."""
    bits = t.detach().view(_INT[t.element_size()]).reshape(-1)
    m = torch.tensor(mask).to(bits.dtype)
    bits[torch.tensor(idx, device=t.device)] ^= m


# -- 1. change detection on device parameters ---------------------------------------------------


class FakeFloatNorm:
    """FAKE ReplicatedMapping for an FP32 parameter."""

    def megatron_to_hf(self, x: torch.Tensor, module: Any) -> dict[str, torch.Tensor]:
        return {"fnorm.weight": x.clone()}


class FakeMixedModel(FakeModel):
    """FAKE: test_hook_units' model (bf16 column, norm, padded embedding) plus an FP32 norm."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.fnorm = torch.nn.Parameter(torch.randn(96, generator=g))
        self.maps["fnorm"] = FakeFloatNorm()


# element -> bit mask, chosen so a float compare would miss some: sign of zero, NaN payloads,
# the lowest mantissa bit, and a 4-aligned word that changes in all four lanes (col[64:68])
_COL = {0: 0x8000, 5: 0x0001, 63: 0x7F80, 64: 0x0100, 65: 0x0001, 66: 0x4000, 67: 0x8000, 127: 1}
_FNORM = {0: 0x80000000, 17: 0x00000001, 95: 0x7FC00001}
_EMB = {3: 0x0002, 90: 0x8000}


@pytest.mark.parametrize("device", DEVICES)
def test_hook_detects_exact_bits_of_device_parameters(groups, device: str) -> None:  # noqa: F811
    model = FakeMixedModel().to(device)
    with torch.no_grad():
        model.col.view(torch.int16).reshape(-1)[:2] = 0  # +0.0 (its sign bit flips below)
        model.fnorm[95] = float("nan")
    hook = DCRHook([model], _config(), groups=groups)
    assert {p.device.type for p in model.parameters()} == {device}
    assert {t.device.type for t in hook.trackers.values()} == {"cpu"}  # host baseline
    before = {n: _host_bits(p) for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, flips in (("col", _COL), ("fnorm", _FNORM), ("emb", _EMB)):
            for i, mask in flips.items():
                _flip(getattr(model, name), [i], mask)
    after = {n: _host_bits(p) for n, p in model.named_parameters()}

    rep = hook.build(1)
    items = {it.name: it for it in _items(hook.payloads)}
    assert set(items) == {"col.weight", "fnorm.weight", "emb.weight"}  # norm did not change
    for name, flips in (("col", _COL), ("fnorm", _FNORM), ("emb", _EMB)):
        ref = np.flatnonzero(before[name] != after[name])
        assert ref.tolist() == sorted(flips)  # the oracle sees every flip
        item = items[f"{name}.weight"]
        np.testing.assert_array_equal(item.indices, ref)
        if name == "emb":  # residual: overwrites of the converted (padded) tensor
            assert item.kind == Kind.OVERWRITE
            np.testing.assert_array_equal(item.values, after[name][ref])
        else:  # affine, identity map: XOR masks of the stored bits
            assert item.kind == Kind.XOR
            np.testing.assert_array_equal(item.values, before[name][ref] ^ after[name][ref])
    assert rep.changed_elements == len(_COL) + len(_FNORM)  # the affine shards' scan
    assert rep.entries == rep.changed_elements + len(_EMB)

    # the candidate guard re-reads the device parameters: one more sign flip is seen
    with torch.no_grad():
        _flip(model.fnorm, [40], 0x80000000)
    with pytest.raises(CandidateChanged, match="fnorm"):
        hook.commit()
    with torch.no_grad():
        _flip(model.fnorm, [40], 0x80000000)
    hook.build(1)
    hook.payloads.clear()
    hook.commit()  # the guard re-reads the device parameters; trackers take the build's delta
    for t in hook.tasks:
        if t.index in hook.trackers:
            assert hook.trackers[t.index].device.type == "cpu"
            assert (_host_bits(hook.trackers[t.index]) == _host_bits(t.param)).all()
    assert hook.build(2).items == 0


# -- 2. the direct scatter into device views -----------------------------------------------------

View = Callable[[torch.Tensor], torch.Tensor]
# (item view the loader copies from, destination view of the (6, 10) parameter), same shape
GEOMETRIES: dict[str, tuple[View, View]] = {
    "row_slice_at_offset": (lambda w: w[1:3], lambda p: p[1:3, 3:8]),
    "transposed_source": (lambda w: w.t(), lambda p: p[0:5, 6:10]),
    "transposed_destination": (lambda w: w, lambda p: p.t()[2:6, 1:6]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_streamed_detection_on_device_equals_the_host_scan(device: str, dtype: torch.dtype) -> None:
    """Both detection paths on the same shard: `DeviceScan` on `device` (the tracker streamed in
    small chunks, so many chunk boundaries) and the compiled scan of a host copy give the same
    indices, bits and baseline bits."""
    g = torch.Generator().manual_seed(3)
    n = 100_003
    base = torch.randn(n, generator=g).to(dtype)
    cur = base.clone()
    hit = torch.rand(n, generator=g) < 0.01
    cur[hit] += 1.0
    want = changed_bits(cur, base)  # host path
    got = DeviceScan(4096)(cur.to(device), base)  # device path
    for w, h in zip(want, got, strict=True):
        assert w.dtype == h.dtype
        np.testing.assert_array_equal(w, h)
    assert got[0].size == int(
        (cur.view(_INT[cur.element_size()]) != base.view(_INT[cur.element_size()])).sum()
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", [Kind.XOR, Kind.OVERWRITE], ids=["xor", "overwrite"])
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_scatter_direct_into_device_views(
    device: str, dtype: torch.dtype, kind: Kind, geometry: str
) -> None:
    src_of, dest_of = GEOMETRIES[geometry]
    it = _INT[torch.finfo(dtype).bits // 8]
    rng = np.random.default_rng(7)
    info = np.iinfo(np.int16 if it is torch.int16 else np.int32)
    host = torch.from_numpy(rng.integers(info.min, info.max, (6, 10), dtype=info.dtype))
    idx = np.sort(rng.choice(20, 9, replace=False))
    vals = rng.integers(info.min, info.max, idx.size, dtype=info.dtype)
    item = make_item("w", dtype, (4, 5), 0, kind, idx, vals)

    # oracle on the host: XOR the item's mask (or overwrite its entries) through the two views
    ref = host.clone()
    mask = torch.zeros(4, 5, dtype=it)
    mask.view(-1)[torch.from_numpy(idx)] = torch.from_numpy(vals)
    hit = torch.zeros(4, 5, dtype=torch.bool)
    hit.view(-1)[torch.from_numpy(idx)] = True
    dv, sm, sh = dest_of(ref), src_of(mask), src_of(hit)
    if kind == Kind.XOR:
        dv.bitwise_xor_(sm)
    else:
        dv[sh] = sm[sh]
    assert not torch.equal(ref, host)  # the oracle moves bits

    src = ViewGeom.of(src_of(torch.zeros(4, 5, dtype=dtype)))  # offsets within the item
    for verify in (False, True):
        checks: list = []
        target = host.view(dtype).to(device, copy=True)
        dest = dest_of(target)
        n = scatter_direct(item, src, flat_storage_bits(dest), ViewGeom.of(dest), checks, verify)
        assert n == int(sh.sum())
        assert torch.equal(target.view(it).cpu(), ref), f"verify={verify}"
        if verify:
            assert checks and all(c.device.type == device for c in checks[0])
            assert count_mismatches(checks) == 0
            r, c = (int(x) for x in sh.nonzero()[0])  # an element the scatter wrote
            dest.view(it)[r, c].bitwise_not_()  # a later write over it is counted
            assert count_mismatches(checks) == 1


# -- 3. the intercept path with a fake loader on the device -------------------------------------


class FakeDeviceLoader(torch.nn.Module):
    """FAKE for unit tests: a vLLM-style ``load_weights`` over parameters on `device` that
    narrows fused parameters at offsets, copies into a transposed destination view, selects a
    row, and casts (the masked overwrite path). The items come from host scratch, so every
    write is a host -> device ``copy_`` when `device` is not the CPU."""

    def __init__(self, device: str) -> None:
        super().__init__()

        def z(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), False)

        self.qkv = z(12, 8)  # fused q, k, v rows
        self.wt = z(4, 6, dtype=torch.float32)  # stored transposed
        self.rows = z(2, 5)  # row 1 is "r.weight"
        self.c = z(10, dtype=torch.float32)  # bf16 canonical, kept in fp32

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, w in weights:
            if name in ("q.weight", "k.weight", "v.weight"):
                start = 4 * "qkv".index(name[0])
                self.qkv.narrow(0, start, 4).copy_(w)
                loaded.add("qkv")
            elif name == "wt.weight":
                self.wt.t().copy_(w)
                loaded.add("wt")
            elif name == "r.weight":
                self.rows[1].copy_(w)
                loaded.add("rows")
            elif name == "c.weight":
                self.c.copy_(w.to(torch.float32))
                loaded.add("c")
        return loaded


CANON = {
    "q.weight": ((4, 8), torch.bfloat16),
    "k.weight": ((4, 8), torch.bfloat16),
    "v.weight": ((4, 8), torch.bfloat16),
    "wt.weight": ((6, 4), torch.float32),
    "r.weight": ((5,), torch.bfloat16),
    "c.weight": ((10,), torch.bfloat16),
}


def _canonical(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dt) for n, (s, dt) in CANON.items()}


def _canonical_v1() -> dict[str, torch.Tensor]:
    """v0 with every third element of every tensor changed."""
    v1 = _canonical(0)
    for t in v1.values():
        flat = t.reshape(-1)
        flat[::3] = (flat[::3].float() * 1.5 + 0.25).to(flat.dtype)
    return v1


def _bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().view(_INT[p.element_size()]) for n, p in model.named_parameters()}


def _refit(device: str, placement: str) -> tuple[dict, dict, dict, dict]:
    """Dense-load v0 on `device`, prewarm, apply the v0 -> v1 delta with verify; returns the
    prewarm report, the plan's recorded copies, the ACK and the parameters' bits."""
    v0, v1 = _canonical(0), _canonical_v1()
    model = FakeDeviceLoader(device)
    with torch.no_grad():
        model.load_weights(v0.items())
    rx = Receiver(model, rank={"rank": 0}, placement=placement)
    table = [[n, str(dt).removeprefix("torch."), list(s)] for n, (s, dt) in CANON.items()]
    report = rx.prewarm(table, committed_version=0)
    assert rx.plan is not None
    items = [
        diff_tensors(
            n, v0[n], v1[n], kind=Kind.OVERWRITE if n in report["overwrite_only"] else Kind.XOR
        )
        for n in CANON
    ]
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    st = rx.stage(encode_items(items, meta))
    assert len(st["staged"]) == 1 and not st["rejected"], st
    ack = rx.apply(0, verify=True)
    assert {p.device.type for p in model.parameters()} == {device}
    return report, dict(rx.plan.tensors), ack, _bits(model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["plan", "loader"])
def test_intercepted_apply_on_device_matches_the_cpu_run(device: str, placement: str) -> None:
    report, plan, ack, bits = _refit(device, placement)
    assert set(report["overwrite_only"]) == {"c.weight"} and report["unsupported"] == {}
    assert ack["ok"] and ack["post_apply_mismatches"] == 0, ack
    if placement == "plan":  # the five direct tensors replay; the cast one takes the loader
        assert ack["plan_items"] == 5 and ack["loader_items"] == 1, ack
    else:
        assert ack["plan_items"] == 0 and ack["loader_items"] == 6, ack
    expected = FakeDeviceLoader("cpu")  # a dense load of v1 on the host
    with torch.no_grad():
        expected.load_weights(_canonical_v1().items())
    assert all(torch.equal(bits[n], b) for n, b in _bits(expected).items())
    # the loader's recorded copies (offsets, shapes, strides) do not depend on the device
    cpu_report, cpu_plan, cpu_ack, cpu_bits = _refit("cpu", placement)
    assert plan == cpu_plan and len(plan) == 5
    assert {k: report[k] for k in ("overwrite_only", "planned", "plan_entries")} == {
        k: cpu_report[k] for k in ("overwrite_only", "planned", "plan_entries")
    }
    assert ack["elements_written"] == cpu_ack["elements_written"]
    assert all(torch.equal(bits[n], cpu_bits[n]) for n in bits)


# -- 4. the receiver on the device: storage kept, the device waited for before each ACK ----------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["plan", "loader"])
def test_applies_keep_storage_and_wait_for_the_device_before_the_ack(
    device: str, placement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real `Receiver` over the FAKE loader on `device`: two refits (v0 -> v1 with XOR and
    overwrite items, then v1 -> v0 all overwrites) keep every parameter's ``data_ptr`` (the
    addresses CUDA graphs capture), and each ACK follows ``torch.accelerator.synchronize`` on
    the parameters' device (vllm_dcr_plugin/device.py); on the host nothing is waited for."""
    waited: list[str] = []
    real = torch.accelerator.synchronize

    def recording(d: Any = None) -> None:
        waited.append(str(d))
        real(d)

    monkeypatch.setattr(torch.accelerator, "synchronize", recording)
    v0, v1 = _canonical(0), _canonical_v1()
    model = FakeDeviceLoader(device)
    with torch.no_grad():
        model.load_weights(v0.items())
    rx = Receiver(model, rank={"rank": 0}, placement=placement)
    table = [[n, str(dt).removeprefix("torch."), list(s)] for n, (s, dt) in CANON.items()]
    report = rx.prewarm(table, committed_version=0)
    before = dcr_device.storage_pointers(model)
    for version, (a, b, all_overwrite) in enumerate(((v0, v1, False), (v1, v0, True)), start=1):
        items = [
            diff_tensors(
                n, a[n], b[n],
                kind=Kind.OVERWRITE if all_overwrite or n in report["overwrite_only"] else Kind.XOR,
            )
            for n in CANON
        ]  # fmt: skip
        meta = PayloadMeta(
            version=version, base_version=version - 1, attempt=0, owner=0, sequence=0
        )
        assert rx.stage(encode_items(items, meta))["staged"]
        waited.clear()
        ack = rx.apply(0, verify=True)
        assert ack["ok"] and ack["post_apply_mismatches"] == 0, ack
        assert waited == ([] if device == "cpu" else [f"{device}:0"]), waited
        rx.commit(version)
        assert dcr_device.storage_pointers(model) == before, f"version {version}"
    expected = FakeDeviceLoader("cpu")  # back at v0: a dense load of v0 on the host
    with torch.no_grad():
        expected.load_weights(v0.items())
    bits = _bits(model)
    assert all(torch.equal(bits[n], b) for n, b in _bits(expected).items())
