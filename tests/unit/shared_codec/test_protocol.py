"""The control-plane protocol (shared_codec/coordination/protocol.py), table-driven: every
message round-trips through its plain JSON object (and JSON text) unchanged, and a malformed
one is refused with a `ProtocolError` that names the message and the field. Pure unit test."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shared_codec.coordination import protocol as p
from shared_codec.coordination.wire import Message
from shared_codec.errors import CandidateChanged, DCRError, OwnerBuildError, ProtocolError

ACK = p.RankAck(
    ok=True,
    attempt=1,
    rank=0,
    target_version=3,
    payloads=2,
    items=5,
    elements_written=40,
    fallbacks={"stale": 1},
    post_apply_mismatches=0,
    verified=True,
    timings=p.AckTimings(decode_s=0.1, apply_s=0.2, apply_cpu_s=0.15, total_s=0.4),
)
FAILED_ACK = p.RankAck(
    ok=False, attempt=1, rank=1, target_version=None, error="x", partial_item="w.weight"
)
REPORT = p.RankReport(
    ok=True, rank=0, world_size=2, state="applied", committed_version=2, extra={"gate": {}}
)

#: one instance of every message (each class at least once)
EXAMPLES: dict[str, Message] = {
    "ack timings": p.AckTimings(decode_s=0.5),
    "rank ack": ACK,
    "merged rank ack": p.RankAck.merge([ACK, FAILED_ACK]),
    "rank reply": p.RankReply(rpc="dcr_digest", ok=True, rank=1, extra={"digest": "ab"}),
    "failed rank reply": p.RankReply(rpc="dcr_apply", ok=False, error="E: x", internal=True),
    "fetch reply": p.FetchReply(payloads=3, bytes=90, staged=3, fetch_seconds=0.2, ack=ACK),
    "digest reply": p.DigestReply(rank=0, digest="ab", tensors={"w": "cd"}, extra={"tp_rank": 0}),
    "rank report": REPORT,
    "engine ack (rpc)": p.EngineAck.merge([ACK, FAILED_ACK], pipelined=True, fetch_s=1.0),
    "engine ack (native)": p.EngineAck.merge([REPORT], pipelined=False),
    "owner request": p.OwnerRequest(op="build", version=4, attempt=1, retry=True),
    "custom owner request": p.OwnerRequest(op="train", extra={"step": 3}),
    "owner reply": p.OwnerReply(ok=True, seconds=0.1, extra={"committed_version": 2}),
    "owner error": p.OwnerReply(ok=False, error="rank 1: x", error_type="CandidateChanged"),
    "build reply": p.BuildReply(baseline_id="owners-v3", version=4, attempt=0, payloads=7),
    "verify reply": p.VerifyReply(version=4, guard=p.Guard.HELD),
    "commit reply": p.CommitReply(committed_version=4),
    "abort reply": p.AbortReply(committed_version=3),
    "status reply": p.StatusReply(committed_version=3, candidate=4, world=2),
}


def test_every_message_class_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES.values()} == set(p.MESSAGES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_round_trip(name: str) -> None:
    msg = EXAMPLES[name]
    wire = msg.to_wire()
    assert type(msg).parse(wire) == msg
    assert type(msg).parse(json.loads(json.dumps(wire))) == msg  # through JSON text
    assert type(msg).parse(msg) is msg  # a checked message passes as it is
    for key, value in wire.items():  # the read view is the wire value
        assert msg[key] == value and msg.get(key) == value and key in msg


#: (message class, a valid object, the change that breaks it, words the error must contain)
MALFORMED: list[tuple[type[Message], dict[str, Any], dict[str, Any], str]] = [
    (p.RankAck, ACK.to_wire(), {"items": "5"}, "rank ACK: items must be an integer"),
    (p.RankAck, ACK.to_wire(), {"ok": 1}, "rank ACK: ok must be a boolean"),
    (p.RankAck, ACK.to_wire(), {"attempt": True}, "rank ACK: attempt must be an integer"),
    (p.RankAck, ACK.to_wire(), {"fallbacks": {"a": "1"}}, "fallbacks.a must be an integer"),
    (p.RankAck, ACK.to_wire(), {"timings": {"apply_s": "x"}}, "timings: apply_s must be a number"),
    (p.RankAck, ACK.to_wire(), {"elements": 3}, "unknown field 'elements'"),
    (p.RankAck, {"ok": True, "rank": 0}, {}, "missing field 'attempt'"),
    (p.RankReply, {"ok": True, "rpc": "dcr_digest"}, {"rpc": None}, "rpc must be a string"),
    (p.RankReply, {"ok": True, "rank": 0}, {}, "missing field 'rpc'"),
    (p.RankReply, {"ok": True, "rpc": "x"}, {"protocol": 2}, "protocol must be 1, got 2"),
    (p.RankReply, {"ok": True, "rpc": "x"}, {"rank": -0.5}, "rank must be an integer"),
    (p.FetchReply, {"payloads": 1}, {"ack": {"ok": True}}, "ack: missing field 'attempt'"),
    (p.DigestReply, {"digest": "a"}, {"tensors": ["w"]}, "tensors must be an object"),
    (p.RankReport, REPORT.to_wire(), {"world_size": "2"}, "world_size must be an integer"),
    (p.EngineAck, {"ok": True}, {"ranks": [{"ok": True}]}, "ranks[0]: missing field"),
    (p.EngineAck, {"ok": True}, {"payloads": 1.5}, "payloads must be an integer"),
    (p.OwnerRequest, {"op": "build"}, {"version": "4"}, "version must be an integer"),
    (p.OwnerReply, {"ok": False}, {"error_type": 7}, "error_type must be a string"),
    (p.BuildReply, {"baseline_id": "b"}, {"payload_bytes": -0.1}, "payload_bytes must be an"),
    (p.BuildReply, {"payloads": 3}, {}, "missing field 'baseline_id'"),
    (p.VerifyReply, {"version": 1, "guard": "held"}, {"guard": "maybe"}, "guard must be one of"),
    (p.CommitReply, {"committed_version": 1}, {"committed_version": None}, "must be an integer"),
    (p.StatusReply, {"committed_version": 1}, {"world": [2]}, "world must be an integer"),
]


@pytest.mark.parametrize(
    "cls,good,change,says", MALFORMED, ids=[f"{c.__name__}-{s}" for c, _, _, s in MALFORMED]
)
def test_malformed_messages_are_refused_naming_the_field(
    cls: type[Message], good: dict[str, Any], change: dict[str, Any], says: str
) -> None:
    if change:
        cls.parse(good)  # the valid object passes
    with pytest.raises(ProtocolError) as e:
        cls.parse({**good, **change})
    assert str(e.value).startswith(f"{cls.NAME}: ") and says in str(e.value), str(e.value)


def test_not_an_object_is_refused() -> None:
    for bad in ([1], "x", None, 3):
        with pytest.raises(ProtocolError, match="build reply: expected a JSON object"):
            p.BuildReply.parse(bad)


def test_rank_ack_merge_rule() -> None:
    """Counts and timings summed, the first failure's error and partial item, ok only if every
    part was, the first known target version, the number of parts."""
    later = p.RankAck(ok=True, attempt=1, rank=1, target_version=None, items=2)
    merged = p.RankAck.merge([FAILED_ACK, later])
    assert not merged.ok and merged.error == "x" and merged.partial_item == "w.weight"
    assert merged.items == 2 and merged.pipelined_parts == 2 and merged.target_version is None
    assert p.RankAck.merge([ACK, later]).target_version == 3
    with pytest.raises(ProtocolError):
        p.RankAck.merge([])
    assert "pipelined_parts" not in ACK.to_wire()  # only merged ACKs carry it
    assert "total_s" not in p.AckTimings().to_wire()  # only an apply that ran to its end


def test_engine_ack_merge_rule() -> None:
    """ok only when every rank's is; the error names each failed rank; elements written are
    summed over the ranks (a native report counts its update's ACK)."""
    ack = p.EngineAck.merge([ACK, FAILED_ACK])
    assert not ack.ok and ack.error == "rank 1: x" and ack.elements_written == 40
    native = p.EngineAck.merge(
        [p.RankReport(ok=True, rank=r, extra={"ack": ACK.to_wire()}) for r in (0, 1)]
    )
    assert native.ok and native.error is None and native.elements_written == 80
    bad = p.RankReport(ok=False, rank=1, error="no manifest")
    assert p.EngineAck.merge([REPORT, bad]).error == "rank 1: no manifest"
    assert not p.EngineAck.failed("fetch failed").ok


def test_engine_digest_is_rank_ordered() -> None:
    assert p.engine_digest([(1, "b"), (0, "a")]) == p.engine_digest([(0, "a"), (1, "b")])
    assert p.engine_digest([(0, "b"), (1, "a")]) != p.engine_digest([(0, "a"), (1, "b")])


def test_owner_error_replies_raise_their_dcr_class() -> None:
    for name, cls in (
        ("CandidateChanged", CandidateChanged),
        ("OwnerBuildError", OwnerBuildError),
        ("ProtocolError", ProtocolError),
        ("KeyError", DCRError),  # not of the DCR tree: the base class
        (None, DCRError),
    ):
        reply = p.OwnerReply(ok=False, error="rank 0: boom", error_type=name)
        with pytest.raises(cls, match="owner service 'verify' failed: rank 0: boom") as e:
            reply.raise_for("verify")
        assert type(e.value) is cls
    p.OwnerReply(ok=True).raise_for("verify")  # an ok reply raises nothing


def test_owner_replies_of_the_builtin_ops() -> None:
    assert set(p.OWNER_REPLIES) == {"build", "verify", "commit", "abort", "status"}
    assert p.OwnerRequest(op="commit", version=3).require("version") == 3
    with pytest.raises(ProtocolError, match="owner request 'commit': missing field 'version'"):
        p.OwnerRequest(op="commit").require("version")
