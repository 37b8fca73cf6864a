"""Placement plan replay with a FAKE loader (pure unit tests, labelled as such: the real-engine
oracle is test_receiver.py, which runs every case in both placement modes). The fake loader has
the direct-path shapes real vLLM loaders produce (fused slices, a column-split narrow, a
transposed destination view, a padding fill) plus a fill that meets a copy destination (kept on
the loader path), so replay is compared bit for bit with the loader path and with dense loads."""

from __future__ import annotations

import pytest
import torch

from shared_codec.buckets import encode_items
from shared_codec.format import PayloadMeta
from shared_codec.records import Kind, diff_tensors
from vllm_dcr_plugin.receiver import Receiver

CANON = {
    "q.weight": (6, 4),
    "k.weight": (2, 4),
    "row.weight": (4, 8),  # column split: this "rank" keeps columns 2..5
    "tr.weight": (3, 5),  # stored transposed, copied through a transposed view
    "emb.weight": (5, 4),  # padded to 7 rows with a zero fill
    "meet.weight": (4,),  # FakeMeetModel: a no-op fill over part of the copied region
}


class FakePlacementModel(torch.nn.Module):
    """FAKE: a vLLM-style load_weights with direct-path copies (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()

        def p(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16), False)

        self.qk, self.row, self.tr, self.emb, self.meet = p(8, 4), p(4, 4), p(5, 3), p(7, 4), p(4)
        self.calls = 0

    def load_weights(self, weights):  # noqa: ANN001
        self.calls += 1
        loaded = set()
        for name, w in weights:
            if name == "q.weight":
                self.qk[:6].copy_(w)
                loaded.add("qk")
            elif name == "k.weight":
                self.qk[6:].copy_(w)
                loaded.add("qk")
            elif name == "row.weight":
                self.row.copy_(w.narrow(1, 2, 4))
                loaded.add("row")
            elif name == "tr.weight":
                self.tr.t().copy_(w)
                loaded.add("tr")
            elif name == "emb.weight":
                self.emb[:5].copy_(w)
                self.emb[5:].fill_(0)
                loaded.add("emb")
            elif name == "meet.weight":
                self.meet.copy_(w)
                loaded.add("meet")
        return loaded


class FakeMeetModel(FakePlacementModel):
    """FAKE: like FakePlacementModel, but `meet` gets a no-op fill over part of its copy."""

    def load_weights(self, weights):  # noqa: ANN001
        rest = []
        for name, w in weights:
            if name == "meet.weight":
                self.calls += 1
                self.meet[2:].fill_(-2.0)  # equal to the resident bits there (see _versions)
                self.meet.copy_(w)
                continue
            rest.append((name, w))
        loaded = super().load_weights(rest)
        return loaded | {"meet"}


def _versions(n: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in range(n):
        g = torch.Generator().manual_seed(seed if seed == 0 else 7)
        v = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in CANON.items()}
        if seed:  # change every third element of v0
            v = {k: t.clone() for k, t in out[0].items()}
            for t in v.values():
                f = t.reshape(-1)
                f[seed % 3 :: 3] = (f[seed % 3 :: 3].float() * 1.5 + 0.25).to(t.dtype)
        v["meet.weight"][2:] = -2.0
        out.append(v)
    return out


def _bits(model: torch.nn.Module) -> dict[str, bytes]:
    return {n: bytes(p.detach().view(torch.uint8).numpy()) for n, p in model.named_parameters()}


def _dense(cls: type, v: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = cls()
    m.load_weights(list(v.items()))
    return m


def _refit(cls: type, placement: str, verify: bool) -> tuple[Receiver, list[dict]]:
    vs = _versions(3)
    model = _dense(cls, vs[0])
    rx = Receiver(model, rank={"rank": 0}, placement=placement)
    rx.prewarm([[n, "bfloat16", list(s)] for n, s in CANON.items()])
    acks = []
    for a, b, kind in ((0, 1, Kind.XOR), (1, 2, Kind.OVERWRITE)):
        items = [diff_tensors(n, vs[a][n], vs[b][n], owner=0, kind=kind) for n in CANON]
        meta = PayloadMeta(version=b, base_version=a, attempt=0, owner=0, sequence=0)
        assert rx.stage(encode_items([i for i in items if i.count], meta))["staged"]
        model.calls = 0
        acks.append(rx.apply(0, verify=verify))
        acks[-1]["loader_calls"] = model.calls
        assert acks[-1]["ok"], acks[-1]
        assert _bits(model) == _bits(_dense(cls, vs[b])), (placement, a, b)
        rx.commit(b)
    return rx, acks


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("placement", ["plan", "loader"])
def test_both_placement_modes_are_bit_exact_with_dense_loads(placement: str, verify: bool) -> None:
    rx, acks = _refit(FakePlacementModel, placement, verify)
    for ack in acks:
        assert ack["items"] == len(CANON)
        if verify:
            assert ack["post_apply_mismatches"] == 0
        if placement == "plan":  # every tensor is direct: no loader call at all
            assert ack["plan_items"] == len(CANON) and ack["loader_items"] == 0
            assert ack["loader_calls"] == 0 and ack["fallbacks"] == {}
        else:
            assert ack["plan_items"] == 0 and ack["loader_items"] == len(CANON)
            assert ack["loader_calls"] >= 1 and ack["fallbacks"] == {"loader_mode": len(CANON)}
    text = rx.metrics.text()
    want = {"plan": 2 * len(CANON), "loader": 0}
    if placement == "loader":
        want = {"plan": 0, "loader": 2 * len(CANON)}
        assert f'dcr_placement_fallbacks_total{{reason="loader_mode"}} {2.0 * len(CANON)}' in text
    for path, n in want.items():
        assert f'dcr_placement_items_total{{path="{path}"}} {float(n)}' in text


def test_plan_entries_are_the_loader_copies() -> None:
    vs = _versions(1)
    rx = Receiver(_dense(FakePlacementModel, vs[0]), rank={"rank": 0})
    report = rx.prewarm([[n, "bfloat16", list(s)] for n, s in CANON.items()])
    assert report["planned"] == len(CANON) and report["plan_entries"] == len(CANON)
    plan = rx.plan
    assert plan is not None
    (k,) = plan.tensors["k.weight"]
    assert (k.param, k.dest.offset, k.dest.shape) == ("qk", 24, (2, 4))
    (row,) = plan.tensors["row.weight"]  # the narrow of the item, not of the destination
    assert (row.src.offset, row.src.stride, row.dest.stride) == (2, (8, 1), (4, 1))
    (tr,) = plan.tensors["tr.weight"]
    assert tr.dest.stride == (1, 3) and tr.src.stride == (5, 1)


def test_a_fill_meeting_a_copy_keeps_the_tensor_on_the_loader_path() -> None:
    rx, acks = _refit(FakeMeetModel, "plan", True)
    assert rx.plan is not None and "meet.weight" in rx.plan.excluded
    assert "fill_.Scalar into meet meets a copy destination" in rx.plan.excluded["meet.weight"]
    for ack in acks:
        assert ack["plan_items"] == len(CANON) - 1 and ack["loader_items"] == 1
        assert ack["fallbacks"] == {"not_planned": 1}


def test_stale_plan_falls_back_counted_and_verify_plan_renews_it(caplog) -> None:
    vs = _versions(2)
    model = _dense(FakePlacementModel, vs[0])
    rx = Receiver(model, rank={"rank": 0})
    rx.prewarm([[n, "bfloat16", list(s)] for n, s in CANON.items()])
    # something outside DCR moves a planned parameter to new storage (same bits)
    model.qk.data = model.qk.data.clone()
    items = [diff_tensors(n, vs[0][n], vs[1][n], owner=0, kind=Kind.XOR) for n in CANON]
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    rx.stage(encode_items(items, meta))
    with caplog.at_level("WARNING"):
        ack = rx.apply(0, verify=True)
    assert ack["ok"] and ack["post_apply_mismatches"] == 0, ack
    # q and k write qk: through the loader, into the new storage; the rest replayed
    assert ack["fallbacks"] == {"stale": 2} and ack["plan_items"] == len(CANON) - 2
    assert "placement plan stale for 2 tensors" in caplog.text
    assert 'dcr_placement_fallbacks_total{reason="stale"} 2.0' in rx.metrics.text()
    assert _bits(model) == _bits(_dense(FakePlacementModel, vs[1]))
    rx.commit(1)
    before = _bits(model)
    res = rx.verify_plan()
    assert _bits(model) == before  # the re-trace is side-effect free
    assert not res["matches"] and set(res["stale_before"]) == {"q.weight", "k.weight"}
    assert set(res["differences"]) == {"q.weight", "k.weight"}
    assert "parameter storage or geometry differs" in res["differences"]["q.weight"]
    assert "dcr_plan_mismatches_total 2.0" in rx.metrics.text()
    again = rx.verify_plan()
    assert again["matches"] and again["differences"] == {} and again["stale_before"] == {}


def test_unknown_placement_mode_is_refused(monkeypatch) -> None:
    with pytest.raises(ValueError, match="placement mode 'fast'"):
        Receiver(FakePlacementModel(), rank={"rank": 0}, placement="fast")
    monkeypatch.setenv("DCR_PLACEMENT", "loader")
    assert Receiver(FakePlacementModel(), rank={"rank": 0}).placement == "loader"
