"""Receiver core with a FAKE loader (pure unit test, labelled as such: the integration tests in
test_receiver.py use real vLLM engines). The fake loader exercises loader paths the tiny Qwen3
models do not have: transposed and cast copies (masked overwrite path), padding fills, index
writes from the item, fills that would change weights, and parameter rebinding."""

from __future__ import annotations

import torch

from shared_codec.buckets import encode_items
from shared_codec.checkpoint import state_digests
from shared_codec.format import PayloadMeta
from shared_codec.records import Kind, apply_items, diff_tensors
from vllm_dcr_plugin.receiver import Receiver


class FakeLoaderModel(torch.nn.Module):
    """FAKE: a module with a vLLM-style load_weights covering unusual loader paths."""

    def __init__(self) -> None:
        super().__init__()
        z = torch.zeros
        self.t = torch.nn.Parameter(z(4, 6, dtype=torch.bfloat16), requires_grad=False)
        self.c = torch.nn.Parameter(z(10, dtype=torch.float32), requires_grad=False)
        self.d = torch.nn.Parameter(z(8, dtype=torch.bfloat16), requires_grad=False)
        self.e = torch.nn.Parameter(z(4, dtype=torch.bfloat16), requires_grad=False)
        self.f = torch.nn.Parameter(z(3, dtype=torch.bfloat16), requires_grad=False)
        self.g = torch.nn.Parameter(z(3, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("buf", torch.arange(5, dtype=torch.float32))

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name == "t.weight":  # stored transposed: a transformed (contiguous) copy
                self.t.copy_(w.t().contiguous())
                loaded.add("t")
            elif name == "c.weight":  # stored in fp32: a cast copy
                self.c.copy_(w.to(torch.float32))
                loaded.add("c")
            elif name == "d.weight":  # direct copy plus padding fill
                self.d[:5].copy_(w)
                self.d[5:].fill_(0)
                loaded.add("d")
            elif name == "e.weight":  # index write from the item
                self.e.index_copy_(0, torch.tensor([0, 2]), w)
                loaded.add("e")
            elif name == "f.weight":  # a fill that changes weights
                self.f.fill_(1.0)
                loaded.add("f")
            elif name == "g.weight":  # rebinding
                self.g.data = w.clone()
                loaded.add("g")
            elif name == "skip.weight":
                pass
        return loaded


CANON = {
    "t.weight": ((6, 4), torch.bfloat16),
    "c.weight": ((10,), torch.bfloat16),
    "d.weight": ((5,), torch.bfloat16),
    "e.weight": ((2,), torch.bfloat16),
    "f.weight": ((3,), torch.bfloat16),
    "g.weight": ((3,), torch.bfloat16),
    "skip.weight": ((7,), torch.bfloat16),
}


def _canonical(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dt) for n, (s, dt) in CANON.items()}


def _dense(model: FakeLoaderModel, tensors: dict[str, torch.Tensor]) -> None:
    model.load_weights(
        [(n, t) for n, t in tensors.items() if n in ("t.weight", "c.weight", "d.weight")]
    )


def test_fake_loader_paths_classified_and_applied_exactly() -> None:
    model = FakeLoaderModel()
    v0, v1 = _canonical(0), _canonical(0)
    for n in v1:  # change a few elements of every tensor
        flat = v1[n].reshape(-1)
        flat[::3] = (flat[::3].float() * 1.5 + 0.25).to(flat.dtype)
    _dense(model, v0)
    rx = Receiver(model, rank={"rank": 0})
    before = state_digests(dict(model.named_parameters()) | dict(model.named_buffers()))
    table = [[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()]
    report = rx.prewarm(table, committed_version=0)
    after = state_digests(dict(model.named_parameters()) | dict(model.named_buffers()))
    assert before == after  # side-effect free, rebinding undone
    assert report["skipped"] == ["skip.weight"]
    assert set(report["overwrite_only"]) == {"t.weight", "c.weight"}
    assert set(report["unsupported"]) == {"e.weight", "f.weight", "g.weight"}
    assert "rebinds" in report["unsupported"]["g.weight"]
    assert "index_copy" in report["unsupported"]["e.weight"]
    assert "would change resident bits" in report["unsupported"]["f.weight"]
    assert report["scratch_bytes"] == 2 * 24
    # only the direct tensor is planned (its padding fill lies outside its copy)
    assert report["planned"] == 1 and report["plan_entries"] == 1
    assert report["plan_excluded"] == {} and report["placement"] == "plan"

    refit = ("t.weight", "c.weight", "d.weight")
    items = []
    for n in refit:
        kind = Kind.OVERWRITE if n in report["overwrite_only"] else Kind.XOR
        items.append(diff_tensors(n, v0[n], v1[n], owner=0, kind=kind))
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    st = rx.stage(encode_items(items, meta))
    assert len(st["staged"]) == 1 and not st["rejected"]
    ack = rx.apply(0, verify=True)
    assert ack["ok"] and ack["post_apply_mismatches"] == 0, ack
    # d.weight replayed from the plan; t and c (masked path) through the loader, no fall back
    assert ack["plan_items"] == 1 and ack["loader_items"] == 2 and ack["fallbacks"] == {}, ack
    expected = FakeLoaderModel()
    _dense(expected, v1)
    for name in ("t", "c", "d"):
        assert torch.equal(
            getattr(model, name).view(torch.uint8), getattr(expected, name).view(torch.uint8)
        ), name
    # the same canonical change applied with the reference applier agrees
    ref = {n: v0[n].clone() for n in refit}
    apply_items(ref, items)
    assert all(torch.equal(ref[n].view(torch.int16), v1[n].view(torch.int16)) for n in refit)
    # metrics count what happened (Prometheus text exposition)
    rx.stage(encode_items(items, meta))  # the same payload again: a duplicate
    text = rx.metrics.text()
    assert 'dcr_payloads_total{result="staged"} 1.0' in text
    assert 'dcr_payloads_total{result="duplicate"} 1.0' in text
    assert 'dcr_applies_total{result="ok"} 1.0' in text
    assert f"dcr_elements_written_total {float(ack['elements_written'])}" in text
    assert "dcr_apply_seconds_count 1.0" in text
    rx.commit(1)
    assert "dcr_committed_version 1.0" in rx.metrics.text()


def test_stage_refuses_xor_for_overwrite_only_and_unsupported_tensors() -> None:
    model = FakeLoaderModel()
    rx = Receiver(model, rank={"rank": 0})
    rx.prewarm([[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()])
    v0, v1 = _canonical(0), _canonical(1)
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    for name, why in (("t.weight", "needs overwrites"), ("e.weight", "unsupported loader path")):
        item = diff_tensors(name, v0[name], v1[name], owner=0, kind=Kind.XOR)
        res = rx.stage(encode_items([item], meta))
        assert not res["staged"] and why in res["rejected"][0]["reason"]


def test_masked_path_rejects_nan_overwrites_without_writing() -> None:
    model = FakeLoaderModel()
    rx = Receiver(model, rank={"rank": 0})
    rx.prewarm([[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()])
    old = torch.zeros(6, 4, dtype=torch.bfloat16)
    new = old.clone()
    new[0, 0] = float("nan")
    item = diff_tensors("t.weight", old, new, owner=0, kind=Kind.OVERWRITE)
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    assert rx.stage(encode_items([item], meta))["staged"]
    before = model.t.detach().clone()
    ack = rx.apply(0)
    assert not ack["ok"] and "NaN overwrite values" in ack["error"]
    assert torch.equal(model.t.view(torch.int16), before.view(torch.int16))
    assert rx.scratch is not None and int(rx.scratch.count_nonzero()) == 0


def test_map_through_view_matches_brute_force() -> None:
    """The geometric mapping of canonical indices through copy views (slices, selects,
    transposes, narrow on any dim) agrees with copying an index-valued tensor."""
    import numpy as np

    from vllm_dcr_plugin.intercept import ViewGeom, map_through_view

    rng = np.random.default_rng(0)
    base = torch.arange(6 * 8 * 5, dtype=torch.int64).reshape(6, 8, 5)
    views = [
        base,
        base[2:5],
        base[:, 3:7],
        base[..., 1:4],
        base[4],
        base[:, 2],
        base.transpose(0, 1),
        base[1:5, 2:6, 0:3],
        base.select(2, 4),
        base.unbind(0)[3],
        base.reshape(48, 5)[10:30],
    ]
    for src in views:
        n = src.numel()
        dest_store = torch.zeros(2 * n + 7, dtype=torch.int64)
        if src.dim() >= 2 and rng.random() < 0.5:  # destination stored column-major
            dims = tuple(reversed(range(src.dim())))
            dest = dest_store[7 : 7 + n].view(tuple(reversed(src.shape))).permute(*dims)
        else:
            dest = dest_store[7 : 7 + n].view(src.shape)
        k = np.sort(rng.choice(base.numel(), size=80, replace=False)).astype(np.int64)
        valid, off = map_through_view(k, ViewGeom.of(src), ViewGeom.of(dest))
        # brute force: copy the index-valued view and read where each index landed
        probe = torch.full_like(dest_store, -1)
        probe.as_strided(dest.shape, dest.stride(), dest.storage_offset()).copy_(src)
        where = {int(v): i for i, v in enumerate(probe.tolist()) if v >= 0}
        want_valid = np.array([int(x) in where for x in k])
        assert np.array_equal(valid, want_valid)
        assert np.array_equal(off, np.array([where[int(x)] for x in k if int(x) in where]))


def test_metrics_served_over_http_when_port_is_set(monkeypatch) -> None:
    import urllib.request

    from dcr_tools.procs import free_port

    port = free_port()
    monkeypatch.setenv("DCR_METRICS_PORT", str(port - 1))
    rx = Receiver(FakeLoaderModel(), rank={"rank": 1})  # served on port - 1 + rank
    assert rx.metrics.server_port == port
    rx.metrics.dense_loads.inc()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    assert "dcr_dense_loads_total 1.0" in body and "dcr_applies_total" in body


def _assert_holds(model: FakeLoaderModel, tensors: dict[str, torch.Tensor]) -> None:
    """`model`'s refit tensors are bit for bit those of a dense load of `tensors`."""
    expected = FakeLoaderModel()
    _dense(expected, tensors)
    for name in ("t", "c", "d"):
        assert torch.equal(
            getattr(model, name).view(torch.uint8), getattr(expected, name).view(torch.uint8)
        ), name


def _one_payload_per_item(items, version: int, base: int, attempt: int) -> list[bytes]:
    out = []
    for seq, item in enumerate(items):
        meta = PayloadMeta(
            version=version, base_version=base, attempt=attempt, owner=0, sequence=seq
        )
        out.extend(encode_items([item], meta))
    return out


def test_pipelined_fetch_resolves_each_planned_parameter_once(tmp_path, monkeypatch) -> None:
    """The parts of one pipelined fetch share their plan checks (apply.PlanChecks): every
    planned parameter is looked up (and its geometry checked) once per fetch, not once per
    part; a later fetch looks it up again."""
    from shared_codec.transport import DirectoryStore, ObjectPublisher, write_manifest
    from vllm_dcr_plugin import apply as apply_mod
    from vllm_dcr_plugin import sources

    model = FakeLoaderModel()
    v0, v1 = _canonical(0), _canonical(0)
    _dense(model, v0)
    rx = Receiver(model, rank={"rank": 0}, placement="plan")
    report = rx.prewarm([[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()], 0)
    assert rx.plan is not None and report["planned"]
    planned = sorted(n for n in CANON if n in rx.plan.tensors)
    for n in planned:  # only these change, every element
        v1[n] = (v1[n].float() * 1.5 + 0.25).to(v1[n].dtype)
    items = [diff_tensors(n, v0[n], v1[n], owner=0, kind=Kind.XOR) for n in planned]
    looked_up: list[str] = []
    real = apply_mod.current_tensors

    def counting(model, names):
        names = list(names)
        looked_up.extend(names)
        return real(model, names)

    monkeypatch.setattr(apply_mod, "current_tensors", counting)
    real_prefetched = sources.prefetched

    def one_part_per_payload(make_source, depth=4):  # never batch: a part per payload
        it = real_prefetched(make_source, depth)
        it.ready = lambda: False  # type: ignore[method-assign]
        return it

    monkeypatch.setattr(sources, "prefetched", one_part_per_payload)
    store = DirectoryStore(tmp_path / "store")
    pub = ObjectPublisher(store, version=1, attempt=0, owner=0)
    from dataclasses import replace

    # every item split by index range over two payloads: two parts write each parameter
    halves = [
        replace(it, indices=it.indices[sl], values=it.values[sl])
        for it in items
        for sl in (slice(0, it.count // 2), slice(it.count // 2, None))
    ]
    for p in _one_payload_per_item(halves, 1, 0, 0):
        pub.send(p)
    pub.finish()
    write_manifest(store, version=1, base_version=0, attempt=0, owners=[0])
    res = rx.fetch({"kind": "dir", "root": str(tmp_path / "store")}, 1, 0, timeout_s=20,
                   apply={"verify": True})  # fmt: skip
    ack = res["ack"]
    assert ack["ok"] and ack["plan_items"] == len(halves) and ack["pipelined_parts"] > 2, ack
    assert looked_up and len(looked_up) == len(set(looked_up)), looked_up
    _assert_holds(model, v1)


def test_pipelined_fetch_applies_each_payload_before_the_manifest(tmp_path) -> None:
    """`fetch(..., apply=...)` over a directory store: payload 0 is applied while the owner
    has not published payload 1 or the manifest yet (the publisher waits for that, so a fetch
    that waited for the manifest would time out); the attempt then ends ``applied`` and exact.
    An attempt the coordinator abandons after a partial apply leaves the receiver dirty; the
    overwrite retry repairs it."""
    import threading

    import pytest

    from shared_codec.transport import DirectoryStore, ObjectPublisher, write_manifest
    from shared_codec.transport.objects import abandon_attempt
    from shared_codec.transport.store import TransportError

    model = FakeLoaderModel()
    v0, v1, v2 = _canonical(0), _canonical(0), _canonical(0)
    for n in v1:
        v1[n].reshape(-1)[::3] = (v1[n].reshape(-1)[::3].float() * 1.5 + 0.25).to(v1[n].dtype)
        v2[n] = v1[n].clone()
        v2[n].reshape(-1)[1::2] = (v2[n].reshape(-1)[1::2].float() - 0.5).to(v2[n].dtype)
    _dense(model, v0)
    rx = Receiver(model, rank={"rank": 0})
    report = rx.prewarm([[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()], 0)
    refit = ("d.weight", "t.weight", "c.weight")

    def items(a, b, retry=False):
        return [
            diff_tensors(
                n, a[n], b[n], owner=0,
                kind=Kind.OVERWRITE if retry or n in report["overwrite_only"] else Kind.XOR,
            )
            for n in refit
        ]  # fmt: skip

    store = DirectoryStore(tmp_path / "store")
    spec = {"kind": "dir", "root": str(tmp_path / "store")}
    seen: dict[str, object] = {}

    def owner(version, attempt, payloads, finish) -> None:
        pub = ObjectPublisher(store, version=version, attempt=attempt, owner=0)
        pub.send(payloads[0])
        pub._futures[0].result()  # payload 0 is in the store
        for _ in range(2000):  # until the receiver applied it (10 s at most)
            if rx.staging.applied_ids:
                break
            threading.Event().wait(0.005)
        seen["applied_before_rest"] = bool(rx.staging.applied_ids)
        seen["state_then"] = rx.state
        if finish:
            for p in payloads[1:]:
                pub.send(p)
            pub.finish()
            write_manifest(store, version=version, base_version=version - 1, attempt=attempt,
                           owners=[0])  # fmt: skip
        else:
            pub.finish()
            abandon_attempt(store, version=version, attempt=attempt, reason="owner 1 died")

    t = threading.Thread(
        target=owner, args=(1, 0, _one_payload_per_item(items(v0, v1), 1, 0, 0), True)
    )
    t.start()
    res = rx.fetch(spec, 1, 0, timeout_s=20, apply={"verify": True})
    t.join()
    assert seen == {"applied_before_rest": True, "state_then": "applying"}
    ack = res["ack"]
    assert ack["ok"] and ack["post_apply_mismatches"] == 0, ack
    # payload 0 alone, then 1 and 2 (together when 2 had arrived before 1 was applied; in the
    # closing part when the stream had ended too), then the closing part
    assert ack["payloads"] == 3 and ack["pipelined_parts"] in (2, 3, 4), ack
    assert ack["target_version"] == 1
    # the parts' CPU time is summed like their wall time, and is at most it (no waits inside)
    timings = ack["timings"]
    assert 0 < timings["apply_cpu_s"] <= timings["apply_s"] * 1.05 + 1e-3, timings
    assert rx.state == "applied"
    _assert_holds(model, v1)
    rx.commit(1)

    # abandoned after payload 0 was applied: the fetch fails, the receiver is dirty
    t = threading.Thread(
        target=owner, args=(2, 0, _one_payload_per_item(items(v1, v2), 2, 1, 0), False)
    )
    t.start()
    with pytest.raises(TransportError, match="abandoned by the coordinator: owner 1 died"):
        rx.fetch(spec, 2, 0, timeout_s=20, apply={"verify": False})
    t.join()
    assert rx.state == "dirty"
    rx.abort(0)
    # the retry: overwrites of the complete changed set, pipelined as well
    retry = _one_payload_per_item(items(v1, v2, retry=True), 2, 1, 1)
    pub = ObjectPublisher(store, version=2, attempt=1, owner=0)
    for p in retry:
        pub.send(p)
    pub.finish()
    write_manifest(store, version=2, base_version=1, attempt=1, owners=[0])
    ack = rx.fetch(spec, 2, 1, timeout_s=20, apply={"verify": True})["ack"]
    assert ack["ok"] and rx.state == "applied", ack
    _assert_holds(model, v2)
    rx.commit(2)


def test_prefetch_thread_ends_when_its_consumer_gives_up() -> None:
    """The pipelined fetch's background reader stops polling once the apply loop has left (a
    failed apply), instead of waiting out the attempt; errors reach the consumer."""
    import threading
    import time

    import pytest

    from vllm_dcr_plugin.sources import prefetched as _prefetched

    polls = []

    def source(stop: threading.Event):
        yield b"first"
        while not stop.is_set():  # like ObjectFetcher.stream waiting for the next object
            polls.append(1)
            time.sleep(0.01)

    def readers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "dcr-prefetch" and t.is_alive()]

    it = _prefetched(source)
    assert next(it) == b"first"
    assert readers()
    it.close()  # the consumer leaves
    deadline = time.monotonic() + 5
    while readers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not readers()
    assert polls  # it was polling before it stopped

    def failing(stop: threading.Event):
        yield b"a"
        raise OSError("link down")

    it = _prefetched(failing)
    assert next(it) == b"a"
    with pytest.raises(OSError, match="link down"):
        next(it)


def test_prefetched_says_whether_the_next_payload_has_arrived() -> None:
    """`Prefetched.ready`: True while a fetched payload waits (the pipelined fetch then stages
    it before applying), False while the source is still waiting for the next object."""
    import threading
    import time

    from vllm_dcr_plugin.sources import prefetched as _prefetched

    more = threading.Event()

    def source(stop: threading.Event):
        yield b"a"
        yield b"b"
        while not more.is_set() and not stop.is_set():
            time.sleep(0.005)
        yield b"c"

    it = _prefetched(source)
    assert next(it) == b"a"
    deadline = time.monotonic() + 5
    while not it.ready() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert it.ready()  # b is waiting
    assert next(it) == b"b"
    time.sleep(0.05)
    assert not it.ready()  # c is not there yet
    more.set()
    assert next(it) == b"c"
    assert list(it) == []


def test_staging_checks_the_destination_before_decompression(monkeypatch) -> None:
    import numpy as np

    from shared_codec import compression
    from shared_codec.format import encode_payload
    from shared_codec.records import make_item
    from vllm_dcr_plugin.staging import StagingArea, TensorSpec

    calls: list[int] = []
    real = compression.decompress_exact
    monkeypatch.setattr(
        compression, "decompress_exact", lambda f, n, c: calls.append(n) or real(f, n, c)
    )
    item = make_item(
        "w", "uint8", (4096,), 1, Kind.OVERWRITE, np.arange(4096), np.ones(4096, np.uint8)
    )
    data = encode_payload(
        [item], PayloadMeta(version=2, base_version=1, attempt=0, owner=1, sequence=0)
    )
    area = StagingArea()
    for spec, why in (
        (TensorSpec("uint8", (1024,)), "uint8[4096] in the payload"),
        (TensorSpec("int8", (4096,)), "on this receiver"),
    ):
        res = area.stage(
            [data], committed_version=1, tensors={"w": spec}, no_xor=set(), unsupported=set()
        )
        assert not res["staged"] and res["rejected"][0]["payload_id"] is not None
        assert why in res["rejected"][0]["reason"]
    assert calls == []
    res = area.stage(
        [data, "not bytes", 7],  # type: ignore[list-item]
        committed_version=1,
        tensors={"w": TensorSpec("uint8", (4096,))},
        no_xor=set(),
        unsupported=set(),
    )
    assert len(res["staged"]) == 1 and len(calls) == 1
    assert [r["index"] for r in res["rejected"]] == [1, 2]
    assert all("not bytes" in r["reason"] for r in res["rejected"])


def test_key_from_env_rejects_malformed_keys(monkeypatch) -> None:
    import pytest

    from shared_codec.errors import ProtocolError
    from vllm_dcr_plugin.config import key_from_env

    monkeypatch.setenv("DCR_PAYLOAD_KEY", "ab" * 65)
    with pytest.raises(ProtocolError, match="at most 64"):
        key_from_env()
    monkeypatch.setenv("DCR_PAYLOAD_KEY", "xyz")
    with pytest.raises(ProtocolError, match="hex"):
        key_from_env()
    monkeypatch.setenv("DCR_PAYLOAD_KEY", "ab" * 64)
    assert key_from_env() == b"\xab" * 64


def test_rpc_answers_malformed_keys_and_payloads_with_ok_false(monkeypatch) -> None:
    """A malformed payload key (too long, not hex) or payload (not bytes) is an ``ok: false``
    ProtocolError reply from the RPC, never a ValueError / TypeError out of it."""
    from vllm_dcr_plugin import cpu_compat

    # importing the extension marks this process as serving DCR: restore that afterwards
    monkeypatch.setitem(
        cpu_compat._state, "enabled_by_extension", cpu_compat._state["enabled_by_extension"]
    )
    from vllm_dcr_plugin import worker as dcr_worker
    from vllm_dcr_plugin.extension import DCRWorkerExtension

    # no vLLM distributed state in a unit test
    monkeypatch.setattr(dcr_worker, "ranks", lambda worker: {"rank": 0})

    class Worker(DCRWorkerExtension):
        rank = 0

        def __init__(self) -> None:
            self.model_runner = type("Runner", (), {"model": FakeLoaderModel(), "requests": {}})()

    for key, why in (("ab" * 65, "at most 64"), ("zz", "hex-encoded")):
        monkeypatch.setenv("DCR_PAYLOAD_KEY", key)
        reply = Worker().dcr_stage([b"x"])
        assert (
            reply["ok"] is False
            and reply["error"].startswith("ProtocolError")
            and why in reply["error"]
        )
    monkeypatch.delenv("DCR_PAYLOAD_KEY")
    w = Worker()
    table = [[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()]
    assert w.dcr_prewarm(table)["ok"] is True
    for bad in (["text"], [5], "bytes", None):
        reply = w.dcr_stage(bad)
        assert reply["ok"] is False and reply["error"].startswith("ProtocolError"), reply
    reply = w.dcr_stage([b"DCRP" + bytes(100)])
    assert reply["ok"] is True and reply["rejected"] and "payload" in reply["rejected"][0]["reason"]


def test_post_apply_check_holds_each_element_to_its_last_write() -> None:
    """Pure unit test of `apply.count_mismatches`: a loader that post-processes in place
    (vLLM's ``composed_weight_loader``: raw ``A_log`` copied into ``A``, then ``-exp`` over it)
    writes an element twice; only the last write is expected to stay. Disjoint writes into one
    storage (two items of one tensor) are all checked, and a real mismatch still counts."""
    from vllm_dcr_plugin.scatter import count_mismatches

    storage = torch.zeros(8, dtype=torch.int16)
    flat = storage.view(-1)
    first = (flat, torch.tensor([1, 2, 3]), torch.tensor([10, 20, 30], dtype=torch.int16))
    storage[torch.tensor([1, 2, 3])] = torch.tensor([10, 20, 30], dtype=torch.int16)
    second = (flat, torch.tensor([2, 3]), torch.tensor([-20, -30], dtype=torch.int16))
    storage[torch.tensor([2, 3])] = torch.tensor([-20, -30], dtype=torch.int16)
    other = (flat, torch.tensor([6]), torch.tensor([60], dtype=torch.int16))
    storage[6] = 60
    assert count_mismatches([first, second, other]) == 0
    assert count_mismatches([first]) == 2  # alone, the overwritten values no longer hold
    storage[1] = 11  # a real corruption
    assert count_mismatches([first, second, other]) == 1


class ComposedLoaderModel(torch.nn.Module):
    """FAKE: a loader that post-processes the whole parameter in place after loading it, as
    vLLM's ``composed_weight_loader`` does for Nemotron-H's ``A = -exp(A_log)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(6, dtype=torch.float32), requires_grad=False)

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name == "a_log":
                self.a.copy_(w)  # the sharded loader's plain copy
                self.a.data.copy_(-torch.exp(self.a.float()))  # then the transform, in place
                loaded.add("a")
        return loaded


def test_partial_overwrite_through_an_in_place_post_processing_loader() -> None:
    """Only some elements of ``a_log`` change: the loader's first (plain) copy sets the active
    positions, its in-place transform is written there only, and the unchanged positions keep
    their bits: the result equals a dense load of v1 (before, the transform was written over
    every position, applying ``-exp`` twice where ``a_log`` had not changed)."""
    g = torch.Generator().manual_seed(3)
    v0 = {"a_log": torch.randn(6, generator=g)}
    v1 = {"a_log": v0["a_log"].clone()}
    v1["a_log"][[0, 3]] += 0.5
    model = ComposedLoaderModel()
    model.load_weights(v0.items())
    rx = Receiver(model, rank={"rank": 0})
    report = rx.prewarm([["a_log", "float32", [6]]], committed_version=0)
    assert set(report["overwrite_only"]) == {"a_log"}, report
    item = diff_tensors("a_log", v0["a_log"], v1["a_log"], owner=0, kind=Kind.OVERWRITE)
    assert item.indices.tolist() == [0, 3]  # a partial overwrite
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    assert rx.stage(encode_items([item], meta))["staged"]
    ack = rx.apply(0, verify=True)
    assert ack["ok"] and ack["post_apply_mismatches"] == 0, ack
    expected = ComposedLoaderModel()
    expected.load_weights(v1.items())
    assert torch.equal(model.a.view(torch.int32), expected.a.view(torch.int32))
