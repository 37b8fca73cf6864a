"""`HttpEngine` against replies out of step (no engine: its HTTP post is replaced by a script).

vLLM 0.32's ``collective_rpc`` replies are not tagged: a call that timed out inside the executor
answers later and the next call reads that answer. Found by tests/integration/test_chaos.py (the S3 endpoint
hung past the engines' deadline: the coordinator's dense load read the late ``dcr_fetch``
error). The handle must refuse to trust the engine and `restore` must restart it."""

from __future__ import annotations

from typing import Any

import pytest

from shared_codec.coordination.engines import HttpEngine
from shared_codec.errors import EngineUnreachable, ProtocolError


class Scripted(HttpEngine):
    """An `HttpEngine` whose ``POST /collective_rpc`` answers from `script` (a list of reply
    lists, or exceptions to raise); records the methods it was asked for."""

    def __init__(self, script: list[Any], launcher: Any = None) -> None:
        super().__init__(
            "e0",
            "http://127.0.0.1:9",
            store={"kind": "dir", "root": "/nonexistent"},
            checkpoint_for=lambda v: f"/ckpt/v{v}",
            tensors=[],
            launcher=launcher,
        )
        self.script = list(script)
        self.asked: list[str] = []

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
        if path != "/collective_rpc":
            return None
        assert body is not None
        self.asked.append(body["method"])
        nxt = self.script.pop(0)
        if isinstance(nxt, Exception):
            raise nxt
        return {"results": nxt}

    def healthy(self, timeout: float = 5.0) -> bool:
        return True


def _ok(rpc: str, **extra: Any) -> list[dict[str, Any]]:
    return [{"ok": True, "rank": 0, "rpc": rpc, **extra}]


def test_own_replies_pass_and_untagged_replies_are_refused() -> None:
    """Every reply names its RPC: one without ``"rpc"`` is malformed (no plugin ever sent
    one, issue 29), refused naming the field."""
    e = Scripted([_ok("dcr_digest", digest="a"), [{"ok": True, "rank": 0, "digest": "b"}]])
    assert e.rpc("dcr_digest")[0]["digest"] == "a"
    with pytest.raises(ProtocolError, match="missing field 'rpc'"):
        e.rpc("dcr_digest")
    assert not e.out_of_step


def test_a_stale_reply_marks_the_engine_out_of_step_and_later_calls_are_refused() -> None:
    late = [{"ok": False, "rank": 0, "rpc": "dcr_fetch", "error": "TransportError: no manifest"}]
    e = Scripted([late])
    with pytest.raises(EngineUnreachable, match="late reply of an earlier dcr_fetch"):
        e.rpc("dcr_dense_load", "/ckpt/v3", 3)
    with pytest.raises(EngineUnreachable, match="out of step"):
        e.abort(0)  # refused at once: nothing sent
    assert e.asked == ["dcr_dense_load"]


def test_a_call_timed_out_inside_vllm_marks_out_of_step_and_restore_restarts() -> None:
    timed_out = EngineUnreachable(
        "receiver e0: POST /collective_rpc -> HTTP 500: RPC call to dcr_fetch timed out."
    )
    launched: list[int] = []

    def launcher() -> str:
        launched.append(1)
        return "http://127.0.0.1:10"

    e = Scripted([timed_out, _ok("dcr_dense_load"), _ok("dcr_prewarm")], launcher=launcher)
    with pytest.raises(EngineUnreachable):
        e.rpc("dcr_fetch", "{}", 1, 0, 10.0, None)
    assert "dcr_fetch timed out" in e.out_of_step
    e.restore(0)  # healthy, but out of step: restarted before the dense load
    assert launched == [1] and e.base_url == "http://127.0.0.1:10"
    assert e.asked == ["dcr_fetch", "dcr_dense_load", "dcr_prewarm"] and not e.out_of_step


def test_restore_without_a_launcher_says_why() -> None:
    e = Scripted([[{"ok": True, "rank": 0, "rpc": "dcr_apply"}]])
    with pytest.raises(EngineUnreachable):
        e.rpc("dcr_digest")
    with pytest.raises(Exception, match="out of step .* no launcher"):
        e.restore(0)
