"""Exactly-once apply (docs/protocol.md, "Exactly once") with a FAKE loader (pure unit test,
labelled as such; the real-engine case is in test_receiver.py / receiver_program.py): a receiver
applies exactly the payload set an attempt's seal names and never XORs one destination element
twice in one attempt. Each refused case leaves the weights' digest unchanged and names the
payload ids in its error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shared_codec.errors import PayloadError, ProtocolError
from shared_codec.format import PayloadMeta, encode_payload
from shared_codec.records import DeltaItem, Kind, diff_tensors, make_item
from tests.unit.vllm.test_receiver_units import (
    CANON,
    FakeLoaderModel,
    _assert_holds,
    _canonical,
    _dense,
)
from vllm_dcr_plugin.receiver import Receiver
from vllm_dcr_plugin.staging import SealedSet

TABLE = [[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()]
REFIT = ("d.weight", "t.weight", "c.weight")  # d: XOR (direct path); t, c: overwrite-only


def _versions():
    v0, v1 = _canonical(0), _canonical(0)
    for n in v1:
        flat = v1[n].reshape(-1)
        flat[::2] = (flat[::2].float() * 1.5 + 0.25).to(flat.dtype)
    return v0, v1


def _receiver() -> tuple[Receiver, dict, dict, dict]:
    v0, v1 = _versions()
    model = FakeLoaderModel()
    _dense(model, v0)
    rx = Receiver(model, rank={"rank": 0})
    report = rx.prewarm(TABLE, 0)
    return rx, v0, v1, report


def _items(v0, v1, report) -> list[DeltaItem]:
    return [
        diff_tensors(
            n, v0[n], v1[n], owner=0,
            kind=Kind.OVERWRITE if n in report["overwrite_only"] else Kind.XOR,
        )
        for n in REFIT
    ]  # fmt: skip


def _encode(items, *, attempt: int = 0, sequence: int = 0) -> list[bytes]:
    """One payload per item, sequence numbers from `sequence` (another `sequence`: the same
    changes re-encoded under other payload ids)."""
    return [
        encode_payload(
            [it],
            PayloadMeta(version=1, base_version=0, attempt=attempt, owner=0, sequence=sequence + i),
        )
        for i, it in enumerate(items)
    ]


def _ids(rx: Receiver, payloads: list[bytes]) -> list[str]:
    from shared_codec.format import peek_header

    return [peek_header(p, verify=False).payload_id_hex for p in payloads]


def _expect(ids: list[str], attempt: int = 0) -> SealedSet:
    return SealedSet.of(version=1, attempt=attempt, base_version=0, payload_ids=ids)


def test_resequenced_xor_duplicate_is_rejected_before_any_write() -> None:
    rx, v0, v1, report = _receiver()
    digest0 = rx.digest()["digest"]
    items = _items(v0, v1, report)
    first, again = _encode(items), _encode(items, sequence=10)
    assert set(_ids(rx, first)).isdisjoint(_ids(rx, again))  # id dedupe cannot catch it
    res = rx.stage(first + again)
    assert res["staged"] == _ids(rx, first + again[1:])
    # the XOR payload of the re-encoding is refused (d.weight), naming both ids; the
    # overwrite-only re-encodings are idempotent and pass the ledger (the seal refuses them)
    assert [r["payload_id"] for r in res["rejected"]] == [_ids(rx, again)[0]]
    reason = res["rejected"][0]["reason"]
    assert "d.weight" in reason and _ids(rx, first)[0] in reason and "already XORs" in reason
    assert rx.digest()["digest"] == digest0
    # the manifest that named the re-encoding too: the attempt is refused, nothing written
    with pytest.raises(ProtocolError, match="missing 1: " + _ids(rx, again)[0]):
        rx.apply(0, expect=_expect(_ids(rx, first + again)))
    # the manifest of the original: the re-encoded overwrite payloads are extras
    with pytest.raises(ProtocolError, match="extra 2: ") as e:
        rx.apply(0, expect=_expect(_ids(rx, first)))
    assert all(pid in str(e.value) for pid in _ids(rx, again)[1:])
    assert rx.digest()["digest"] == digest0 and rx.state == "clean"
    # what the old code applied twice with an ok ACK: after a clean restage, once and exact
    rx.abort(0)
    assert rx.stage(_encode(items, attempt=1))["staged"]
    ack = rx.apply(1, verify=True, expect=_expect(_ids(rx, _encode(items, attempt=1)), 1))
    assert ack["ok"] and ack["payloads"] == 3, ack
    _assert_holds(rx.model, v1)  # type: ignore[arg-type]
    # a re-encoding arriving after the apply is still refused (the ledger keeps applied ones)
    late = rx.stage(_encode(items[:1], attempt=1, sequence=50))
    assert not late["staged"] and "already XORs" in late["rejected"][0]["reason"]


def test_extra_payload_is_refused_by_the_sealed_set() -> None:
    rx, v0, v1, report = _receiver()
    digest0 = rx.digest()["digest"]
    payloads = _encode(_items(v0, v1, report))
    extra = encode_payload(  # a valid payload of the attempt that the manifest does not name
        [
            make_item(
                "d.weight",
                "bfloat16",
                (5,),
                1,
                Kind.OVERWRITE,
                np.array([4]),
                np.array([7], np.uint16),
            )
        ],
        PayloadMeta(version=1, base_version=0, attempt=0, owner=1, sequence=0),
    )
    assert len(rx.stage([*payloads, extra])["staged"]) == 4
    with pytest.raises(ProtocolError, match=f"extra 1: {_ids(rx, [extra])[0]}"):
        rx.apply(0, expect=_expect(_ids(rx, payloads)))
    assert rx.digest()["digest"] == digest0 and rx.state == "clean"


def test_missing_payload_is_refused_by_the_sealed_set() -> None:
    rx, v0, v1, report = _receiver()
    digest0 = rx.digest()["digest"]
    payloads = _encode(_items(v0, v1, report))
    assert len(rx.stage(payloads[:-1])["staged"]) == 2
    with pytest.raises(ProtocolError, match=f"missing 1: {_ids(rx, payloads[-1:])[0]}"):
        rx.apply(0, expect=_expect(_ids(rx, payloads)))
    assert rx.digest()["digest"] == digest0 and rx.state == "clean"
    # a sealed set for another version or base is refused too
    wrong = SealedSet.of(version=2, attempt=0, base_version=0, payload_ids=_ids(rx, payloads[:-1]))
    with pytest.raises(ProtocolError, match="sealed set is version 2"):
        rx.apply(0, expect=wrong)
    stale = SealedSet.of(version=1, attempt=0, base_version=1, payload_ids=_ids(rx, payloads))
    with pytest.raises(ProtocolError, match="sealed on base version 1; .* committed version is 0"):
        rx.apply(0, expect=stale)
    assert rx.digest()["digest"] == digest0 and rx.state == "clean"


def test_split_xor_items_pass_and_overlapping_ones_do_not() -> None:
    """One tensor's XOR changes split over two payloads (disjoint) are fine; two items of one
    payload that XOR the same element are refused."""
    rx, v0, v1, report = _receiver()
    d = diff_tensors("d.weight", v0["d.weight"], v1["d.weight"], owner=0, kind=Kind.XOR)
    assert d.count >= 2

    def part(sel):
        return make_item("d.weight", "bfloat16", (5,), 0, Kind.XOR, d.indices[sel], d.values[sel])

    lo, hi = part(slice(0, 1)), part(slice(1, None))
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    both = encode_payload([lo, d], meta)
    res = rx.stage([both])
    assert "another of its own items" in res["rejected"][0]["reason"]
    split = [
        encode_payload([lo], meta),
        encode_payload(
            [hi], PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=1)
        ),
    ]
    assert len(rx.stage(split)["staged"]) == 2
    assert rx.apply(0, expect=_expect(_ids(rx, split)))["ok"]
    assert rx.staging.ledgers[0].elements == d.count


def test_sealed_set_listing_is_validated() -> None:
    with pytest.raises(ProtocolError, match="listed twice"):
        SealedSet.of(version=1, attempt=0, base_version=0, payload_ids=["ab" * 16] * 2)
    with pytest.raises(ProtocolError, match="not hex"):
        SealedSet.of(version=1, attempt=0, base_version=0, payload_ids=["xy" * 16])
    assert SealedSet.of(version=1, attempt=0, base_version=None, payload_ids=[]).count == 0


def _publish(root: Path, payloads: list[bytes], *, attempt: int = 0) -> dict:
    from shared_codec.transport import DirectoryStore, ObjectPublisher, write_manifest

    store = DirectoryStore(root)
    pub = ObjectPublisher(store, version=1, attempt=attempt, owner=0)
    for p in payloads:
        pub.send(p)
    pub.finish()
    write_manifest(store, version=1, base_version=0, attempt=attempt, owners=[0])
    return {"kind": "dir", "root": str(root)}


def test_fetch_applies_only_the_sealed_set(tmp_path: Path) -> None:
    """A plain fetch records the manifest's set: a payload staged beside it fails the fetch and
    a later apply (nothing written); an owner that published the same changes twice under two
    sequence numbers fails the fetch at staging."""
    rx, v0, v1, report = _receiver()
    digest0 = rx.digest()["digest"]
    items = _items(v0, v1, report)
    payloads = _encode(items)
    spec = _publish(tmp_path / "a", payloads)
    extra = _encode(items[1:2], sequence=20)  # an overwrite re-encoding, staged by hand
    assert rx.stage(extra)["staged"]
    with pytest.raises(ProtocolError, match=f"extra 1: {_ids(rx, extra)[0]}"):
        rx.fetch(spec, 1, 0, timeout_s=10)
    with pytest.raises(ProtocolError, match="extra 1: "):
        rx.apply(0)  # held to the recorded seal
    assert rx.digest()["digest"] == digest0 and rx.state == "clean"

    # the owner's bug: the manifest lists the same XOR changes twice
    rx2, *_ = _receiver()
    spec = _publish(tmp_path / "b", payloads + _encode(items[:1], sequence=30))
    with pytest.raises(PayloadError, match="already XORs"):
        rx2.fetch(spec, 1, 0, timeout_s=10)
    assert rx2.digest()["digest"] == digest0 and rx2.state == "clean"

    # the sealed set alone: fetched, applied once, exact
    rx3, *_ = _receiver()
    spec = _publish(tmp_path / "c", payloads)
    assert rx3.fetch(spec, 1, 0, timeout_s=10)["staged"] == 3
    assert rx3.apply(0, verify=True)["ok"]
    _assert_holds(rx3.model, v1)  # type: ignore[arg-type]


def test_pipelined_fetch_refuses_payloads_beyond_the_seal(tmp_path: Path) -> None:
    """Pipelined, payloads are applied before the seal is known; one the seal does not name
    fails the attempt at its end (the receiver is dirty: the overwrite retry repairs it)."""
    rx, v0, v1, report = _receiver()
    items = _items(v0, v1, report)
    payloads = _encode(items)
    spec = _publish(tmp_path / "a", payloads[:2])  # the manifest names two of the three
    assert rx.stage(payloads[2:])["staged"]  # the third arrives beside the transport
    d0 = rx.digest()["digest"]
    with pytest.raises(ProtocolError, match=f"extra 1: {_ids(rx, payloads[2:])[0]}"):
        rx.fetch(spec, 1, 0, timeout_s=10, apply={"verify": False})
    # dirty when a payload was applied before the seal; clean and unchanged when every payload
    # had arrived before the first apply (what has arrived is applied together, after the
    # seal's check when the stream has already ended)
    assert rx.state in ("dirty", "clean")
    if rx.state == "clean":
        assert rx.digest()["digest"] == d0


def test_http_engine_plain_apply_is_held_to_the_manifest(tmp_path: Path) -> None:
    """`HttpEngine(pipelined=False)` passes the manifest's set to ``dcr_apply``: over a FAKE
    HTTP server that hands vLLM's ``/collective_rpc`` JSON to a real `DCRWorkerExtension` (fake
    loader), a payload staged beside the attempt makes the ACK fail naming it, and the weights
    are unchanged; the sealed set alone applies and is exact."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from shared_codec.coordination.engines import HttpEngine
    from tests.unit.vllm.test_rpc_contract import _extension

    ext, *_ = _extension()
    assert ext.dcr_prewarm(TABLE, 0)["ok"]
    rx = ext._dcr_receiver()
    _dense(rx.model, _versions()[0])  # type: ignore[arg-type]
    digest0 = rx.digest()["digest"]
    calls: list[dict] = []

    class Worker(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:  # quiet
            pass

        def _reply(self, body: dict | None) -> None:
            raw = json.dumps(body).encode() if body is not None else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self._reply(None)

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/collective_rpc":
                return self._reply(None)
            req = json.loads(body)
            calls.append(req)
            self._reply({"results": [getattr(ext, req["method"])(*req["args"])]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Worker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        v0, v1 = _versions()
        items = _items(v0, v1, {"overwrite_only": rx.found.overwrite_only})
        payloads = _encode(items)
        spec = _publish(tmp_path / "store", payloads)
        engine = HttpEngine(
            "fake",
            f"http://127.0.0.1:{server.server_address[1]}",
            store=spec,
            checkpoint_for=str,
            tensors=TABLE,
            pipelined=False,
        )
        extra = _encode(items[1:2], sequence=40)
        assert rx.stage(extra)["staged"]
        ack = engine.apply(1, 0, timeout_s=10)
        assert not ack["ok"] and f"extra 1: {_ids(rx, extra)[0]}" in ack["error"], ack
        assert rx.digest()["digest"] == digest0
        rx.abort(0)
        spec = _publish(tmp_path / "store", _encode(items, attempt=1), attempt=1)
        ack = engine.apply(1, 1, timeout_s=10)
        assert ack["ok"], ack
        expect = calls[-1]["args"][2]
        assert calls[-1]["method"] == "dcr_apply"
        assert expect == {
            "version": 1,
            "base_version": 0,
            "payload_ids": _ids(rx, _encode(items, attempt=1)),
        }
        _assert_holds(rx.model, v1)  # type: ignore[arg-type]
    finally:
        server.shutdown()
        server.server_close()
