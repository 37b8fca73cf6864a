"""The RPC error contract of `DCRWorkerExtension` (docs/protocol.md, "Errors"), with a FAKE
loader (pure unit test, labelled as such; the real-engine tests are test_receiver.py): every
bad argument - wrong type or count, an unknown keyword, an unknown store kind, a dtype the codec
does not carry, a negative version or attempt - is an ``ok: False`` reply carrying a
``ProtocolError`` on the rank, never an exception that escapes into vLLM's executor, and changes
nothing (digest, state and the prewarm table before == after)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.test_receiver_units import CANON, FakeLoaderModel
from vllm_dcr_plugin import cpu_compat
from vllm_dcr_plugin.receiver import Receiver

_enabled = cpu_compat._state["enabled_by_extension"]
from vllm_dcr_plugin.extension import DCRWorkerExtension  # noqa: E402

# importing the extension marks this process as serving DCR; the unit tests' process does not
cpu_compat._state["enabled_by_extension"] = _enabled

TABLE = [[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()]
_EXPECT = {"version": 1, "base_version": 0, "payload_ids": ["ab" * 16]}


def _extension() -> DCRWorkerExtension:
    """FAKE worker: the extension with a receiver over the fake loader model (no vLLM)."""
    ext = DCRWorkerExtension()
    ext.rank = 0  # type: ignore[attr-defined]
    ext._dcr_state = Receiver(FakeLoaderModel(), rank={"rank": 0})  # type: ignore[attr-defined]
    return ext


def _snapshot(ext: DCRWorkerExtension) -> tuple:
    rx = ext._dcr_receiver()
    status = ext.dcr_status()
    return ext.dcr_digest()["digest"], status, dict(rx.tensors), rx.scratch is not None


def test_bad_arguments_are_protocol_error_replies_that_change_nothing(tmp_path: Path) -> None:
    ext = _extension()
    assert ext.dcr_prewarm(TABLE, 0)["ok"]
    store = {"kind": "dir", "root": str(tmp_path / "store")}
    before = _snapshot(ext)
    calls = {
        "attempt not an int": ("dcr_apply", ("one",), {}),
        "attempt a float": ("dcr_apply", (1.5,), {}),
        "negative attempt": ("dcr_apply", (-1,), {}),
        "verify not a bool": ("dcr_apply", (0,), {"verify": "maybe"}),
        "old fault argument, positional": ("dcr_apply", (0, False, 5), {}),
        "old fault argument, keyword": ("dcr_apply", (0,), {"fail_after_items": 2}),
        "expect not a dict": ("dcr_apply", (0,), {"expect": [1]}),
        "expect without ids": ("dcr_apply", (0,), {"expect": {"version": 1, "base_version": 0}}),
        "expect unknown key": ("dcr_apply", (0,), {"expect": {**_EXPECT, "count": 1}}),
        "expect ids not hex": ("dcr_apply", (0,), {"expect": {**_EXPECT, "payload_ids": ["zz"]}}),
        "expect id too short": ("dcr_apply", (0,), {"expect": {**_EXPECT, "payload_ids": ["ab"]}}),
        "expect id listed twice": (
            "dcr_apply",
            (0,),
            {"expect": {**_EXPECT, "payload_ids": ["ab" * 16, "ab" * 16]}},
        ),
        "expect negative version": ("dcr_apply", (0,), {"expect": {**_EXPECT, "version": -1}}),
        "expect on another base": ("dcr_apply", (0,), {"expect": {**_EXPECT, "base_version": 3}}),
        "missing argument": ("dcr_commit", (), {}),
        "negative version": ("dcr_commit", (-1,), {}),
        "abort of a bool": ("dcr_abort", (True,), {}),
        "unknown store kind": ("dcr_fetch", ({"kind": "ftp", "root": "/x"}, 1, 0), {}),
        "store spec not JSON": ("dcr_fetch", ("{not json", 1, 0), {}),
        "store spec without root": ("dcr_fetch", ({"kind": "dir"}, 1, 0), {}),
        "store spec a list": ("dcr_fetch", ([1, 2], 1, 0), {}),
        "fetch negative version": ("dcr_fetch", (store, -2, 0), {}),
        "fetch zero timeout": ("dcr_fetch", (store, 1, 0, 0), {}),
        "apply opts not a dict": ("dcr_fetch", (store, 1, 0, 5.0, "yes"), {}),
        "apply opts with a fault": ("dcr_fetch", (store, 1, 0, 5.0, {"kill_after_items": 1}), {}),
        "old kill_after_payloads": ("dcr_fetch", (store, 1, 0, 5.0, None, {"verify": True}), {}),
        "bad dtype name": ("dcr_prewarm", ([["t.weight", "bfloat17", [6, 4]]],), {}),
        "negative dimension": ("dcr_prewarm", ([["t.weight", "bfloat16", [-6, 4]]],), {}),
        "short table entry": ("dcr_prewarm", ([["t.weight", "bfloat16"]],), {}),
        "table not a list": ("dcr_prewarm", ("t.weight",), {}),
        "prewarm negative version": ("dcr_prewarm", (TABLE, -1), {}),
        "payloads not bytes": ("dcr_stage", ([1, 2],), {}),
        "payloads a string": ("dcr_stage", ("abc",), {}),
        "dense load of a missing path": ("dcr_dense_load", (str(tmp_path / "nope"), 1), {}),
        "dense load negative version": ("dcr_dense_load", (str(tmp_path), -1), {}),
        "reset_peak not a bool": ("dcr_memory", ("sometimes",), {}),
        "unknown placement mode": ("dcr_set_placement", ("fast",), {}),
        "placement mode not a string": ("dcr_set_placement", (1,), {}),
    }
    for what, (method, args, kwargs) in calls.items():
        reply = getattr(ext, method)(*args, **kwargs)
        assert reply["ok"] is False, (what, reply)
        assert reply["error"].startswith("ProtocolError: "), (what, reply)
        assert reply["rank"] == 0, (what, reply)
        assert _snapshot(ext) == before, what
    # the receiver still works: an empty apply is allowed and changes nothing
    ack = ext.dcr_apply(0, verify="true")
    assert ack["ok"] and ack["items"] == 0 and ack["verified"] is True
    assert _snapshot(ext) == before


def test_missing_model_is_a_protocol_error_reply() -> None:
    reply = DCRWorkerExtension().dcr_status()
    assert reply["ok"] is False and reply["error"].startswith("ProtocolError: "), reply
    assert "no loaded model" in reply["error"]


def test_bad_store_spec_past_the_boundary_is_a_protocol_error(tmp_path: Path) -> None:
    """A direct receiver call (no RPC boundary) with a spec `open_store` refuses."""
    from shared_codec.errors import ProtocolError

    rx = Receiver(FakeLoaderModel(), rank={"rank": 0})
    rx.prewarm(TABLE)
    with pytest.raises(ProtocolError, match="bad store spec"):
        rx.fetch({"kind": "nfs", "root": str(tmp_path)}, 1, 0, timeout_s=1)
    assert rx.status()["state"] == "clean"
