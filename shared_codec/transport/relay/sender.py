"""`RelaySender`: an owner's or the coordinator's connection to the root of a relay tree, and
`RelaySink`, the transport's sink on it (`shared_codec.transport.base.PayloadSink`).

Call order: ``send(payload)`` for each payload (version and attempt come from its header; at
most `window` unacknowledged payloads in flight), ``flush()`` (every payload queued by the
root), then, by the party that closes the attempt, ``complete(version, attempt, payload_ids)``
(the tree's completion acknowledgement, or TransportError naming the failed nodes) or
``abandon(version, attempt, reason)``; ``close()`` last. ``forget(before_version)`` (the
coordinator's retention, after a commit) may be sent on any sender.

Limitations:
1. Not thread-safe: one sender per thread.
2. A root that answers nothing within `ack_timeout_s` is reported as dead, slow or refusing this
   peer (a CURVE root silently drops clients not on its allow-list).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from shared_codec.format import peek_header
from shared_codec.transport.base import Seal, SinkReport
from shared_codec.transport.relay.messages import (
    Abandon,
    AbandonAck,
    Forget,
    ForgetAck,
    Manifest,
    ManifestAck,
    Message,
    Payload,
    PayloadAck,
    Refused,
    decode,
    encode,
)
from shared_codec.transport.relay.node import CurveKeys, connect_client
from shared_codec.transport.store import TransportError

if TYPE_CHECKING:
    from shared_codec.transport.spec import TransportSpec


class RelaySender:
    """See the module docstring."""

    def __init__(
        self,
        root: str,
        *,
        keys: CurveKeys | None = None,
        root_public: bytes | None = None,
        window: int = 16,
        ack_timeout_s: float = 10.0,
        hwm: int = 64,
    ) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = connect_client(self.ctx, root, keys, root_public, hwm)
        self.window = window
        self.ack_timeout_s = ack_timeout_s
        self.inflight: dict[str, float] = {}
        self.bytes_sent = 0
        self.root = root

    def _recv(self, timeout_s: float) -> Message:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TransportError(
                f"relay root {self.root} did not acknowledge within "
                f"{timeout_s:.1f}s (dead, slow or refusing this peer)"
            )
        msg = decode(self.sock.recv())
        if isinstance(msg, Refused):
            raise TransportError(f"relay node {msg.node} refused a message: {msg.error}")
        return msg

    def send(self, payload: bytes) -> None:
        """Send one payload; blocks while `window` payloads are unacknowledged."""
        h = peek_header(payload, verify=False)
        header = Payload(
            version=h.meta.version, attempt=h.meta.attempt, payload_id=h.payload_id_hex
        )
        while len(self.inflight) >= self.window:
            self._take_ack()
        self.sock.send_multipart([encode(header), payload], copy=False)
        self.inflight[h.payload_id_hex] = time.monotonic()
        self.bytes_sent += len(payload)

    def _take_ack(self) -> None:
        ack = self._recv(self.ack_timeout_s)
        if not isinstance(ack, PayloadAck):
            return
        if not ack.ok:
            raise TransportError(
                f"relay node {ack.node} refused payload {ack.payload_id}: {ack.error}"
            )
        self.inflight.pop(ack.payload_id, None)

    def flush(self) -> None:
        while self.inflight:
            self._take_ack()

    def complete(
        self,
        version: int,
        attempt: int,
        payload_ids: list[str],
        timeout_s: float = 30.0,
        base_version: int | None = None,
    ) -> ManifestAck:
        """Send the attempt's manifest (with the base version it is a delta on, when given);
        returns the tree's completion acknowledgement, or raises TransportError naming the
        failed nodes."""
        self.flush()
        msg = Manifest(
            version=version,
            attempt=attempt,
            payload_ids=tuple(payload_ids),
            timeout_s=timeout_s,
            base_version=base_version,
        )
        self.sock.send_multipart([encode(msg)])
        deadline = time.monotonic() + timeout_s + 5
        while True:
            ack = self._recv(max(0.1, deadline - time.monotonic()))
            if isinstance(ack, ManifestAck) and (ack.version, ack.attempt) == (version, attempt):
                break
        if not ack.complete:
            raise TransportError(
                f"version {version} attempt {attempt} failed in the relay tree: "
                + ", ".join(ack.failed)
            )
        return ack

    def abandon(self, version: int, attempt: int, reason: str, timeout_s: float = 10.0) -> None:
        """Tell the tree that (`version`, `attempt`) was given up (the coordinator, when the
        owners' build failed); waits for the root's acknowledgement."""
        self.sock.send_multipart([encode(Abandon(version=version, attempt=attempt, reason=reason))])
        deadline = time.monotonic() + timeout_s
        while True:
            ack = self._recv(max(0.1, deadline - time.monotonic()))
            if isinstance(ack, AbandonAck) and (ack.version, ack.attempt) == (version, attempt):
                return

    def forget(self, before_version: int, timeout_s: float = 10.0) -> ForgetAck:
        """Retention: every node drops what versions below `before_version` left (the root
        answers once it did; it forwards the message down the tree, best effort)."""
        self.sock.send_multipart([encode(Forget(before_version=before_version))])
        deadline = time.monotonic() + timeout_s
        while True:
            ack = self._recv(max(0.1, deadline - time.monotonic()))
            if isinstance(ack, ForgetAck) and ack.before_version == before_version:
                return ack

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def sender_for(spec: TransportSpec, timeout_s: float) -> RelaySender:
    """A sender to the root a relay transport spec names (CURVE when it carries a secret)."""
    assert spec.kind == "relay" and spec.root is not None
    keys = None
    if spec.secret:
        if not spec.public:
            raise ValueError("a relay spec with a CURVE 'secret' needs its 'public' key too")
        keys = CurveKeys(spec.public.encode(), spec.secret.encode())
    return RelaySender(
        spec.root,
        keys=keys,
        root_public=spec.root_public.encode() if spec.root_public else None,
        window=spec.window or 16,
        ack_timeout_s=timeout_s,
    )


class RelaySink:
    """`base.PayloadSink` on a relay tree (spec kind ``relay``): payloads go to the root, the
    seal is the tree's manifest (`RelaySender.complete`: returns once every node holds every
    listed payload), the abandon is the abandon message. Without an owner (the coordinator)
    it sends nothing; the connection is opened on first use."""

    def __init__(
        self, spec: TransportSpec, *, version: int, attempt: int, owner: int | None = None
    ) -> None:
        self.spec = spec
        self.version, self.attempt, self.owner = version, attempt, owner
        self.timeout_s = spec.timeout_s or 60.0
        self._sender: RelaySender | None = None
        self._ids: list[str] = []

    @property
    def sender(self) -> RelaySender:
        if self._sender is None:
            self._sender = sender_for(self.spec, self.timeout_s)
        return self._sender

    def send(self, payload: bytes) -> None:
        if self.owner is None:
            raise ValueError("a sink opened without an owner cannot send payloads")
        m = peek_header(payload, verify=False)
        if (m.meta.version, m.meta.attempt, m.meta.owner) != (
            self.version,
            self.attempt,
            self.owner,
        ):
            raise ValueError(
                f"payload {m.payload_id_hex} is for version {m.meta.version} attempt "
                f"{m.meta.attempt} owner {m.meta.owner}, sink is "
                f"{self.version}/{self.attempt}/{self.owner}"
            )
        self.sender.send(payload)
        self._ids.append(m.payload_id_hex)

    def finish(self) -> SinkReport:
        if self._sender is None:
            return SinkReport(payload_ids=(), bytes=0)
        self._sender.flush()
        return SinkReport(payload_ids=tuple(self._ids), bytes=self._sender.bytes_sent)

    def seal(self, seal: Seal) -> None:
        self.sender.complete(
            self.version,
            self.attempt,
            list(seal.payload_ids),
            self.timeout_s,
            base_version=seal.base_version,
        )

    def abandon(self, reason: str) -> None:
        self.sender.abandon(self.version, self.attempt, reason, timeout_s=self.timeout_s)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def __enter__(self) -> RelaySink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
