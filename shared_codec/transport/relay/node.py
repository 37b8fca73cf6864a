"""One relay node (`RelayNode`), its CURVE key material and the tree shape.

A node binds one ROUTER socket; senders (owners, the coordinator, its parent) connect DEALERs
to it. For each message (`messages.py`) it:

- `Payload`: checks the frame against the header (payload id; no decoding), suppresses
  duplicates by payload id per (version, attempt), hands it to ``deliver`` and forwards it to
  every child, and answers a `PayloadAck` at once (a queueing acknowledgement).
- `Manifest`: forwards it to its children, calls ``on_manifest`` once every listed payload was
  delivered locally, and answers a `ManifestAck` once, in addition, every child acknowledged
  its subtree, or once its deadline passed: a child that did not answer in time, or a missing
  payload, makes the ack ``complete: false`` naming the node in ``failed``.
- `Abandon`: forwards it (best effort), calls ``on_abandon``, answers an `AbandonAck`.
- `Forget` (retention): forwards it (best effort), drops the delivered sets and pending
  manifests of versions below ``before_version``, calls ``on_forget`` (the spool removes their
  files) and answers a `ForgetAck`; from then on payloads of those versions are refused and
  their manifests fail (a straggler cannot refill the spool). Forgetting is cumulative: a node
  that missed one forgets the same versions with the next.
- anything malformed: answers `Refused` with the reason and keeps serving.

Back-pressure: socket high-water marks bound queued messages; a child whose queue is full, or
that leaves a payload unacknowledged for ``child_timeout_s``, is failed (never blocks the node).

Limitations:
1. A node keeps the delivered payload ids of every version it has not been told to forget
   (the coordinator sends `Forget` after each commit, `Coordinator.retain`).
2. One manifest per (version, attempt) is pending at a time; a second replaces the first.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared_codec.format import peek_header
from shared_codec.transport.relay.messages import (
    Abandon,
    AbandonAck,
    Forget,
    ForgetAck,
    Manifest,
    ManifestAck,
    Payload,
    PayloadAck,
    Refused,
    RelayMessageError,
    decode,
    encode,
)

Key = tuple[int, int]  # (version, attempt)


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """CURVE key material (Z85 bytes). `allowed` are the client public keys a server accepts."""

    public: bytes
    secret: bytes
    allowed: tuple[bytes, ...] = ()

    @staticmethod
    def generate() -> CurveKeys:
        import zmq

        public, secret = zmq.curve_keypair()
        return CurveKeys(public, secret)


def tree_children(index: int, n: int, k: int) -> list[int]:
    """Children of node `index` in a balanced k-ary tree over nodes 0..n-1 (0 is the root)."""
    return [c for c in range(k * index + 1, k * index + k + 1) if c < n]


def connect_client(
    ctx: Any, address: str, keys: CurveKeys | None, server_public: bytes | None, hwm: int
) -> Any:
    """A DEALER connected to a node (a CURVE client when `keys` is given)."""
    import zmq

    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.SNDHWM, hwm)
    s.setsockopt(zmq.RCVHWM, hwm)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        if server_public is None:
            raise ValueError("CURVE client needs the server's public key")
        s.curve_publickey, s.curve_secretkey = keys.public, keys.secret
        s.curve_serverkey = server_public
    s.connect(address)
    return s


class _Allow:
    """ZAP CURVE credentials provider: accept only the configured client public keys."""

    def __init__(self, keys: CurveKeys) -> None:
        self.allowed = set(keys.allowed)

    def callback(self, domain: str, key: bytes) -> bool:
        import zmq.utils.z85

        return zmq.utils.z85.encode(key) in self.allowed or key in self.allowed


@dataclass
class _Pending:
    """A manifest a node is waiting to complete."""

    reply_to: bytes
    manifest: Manifest
    deadline: float
    child_acks: dict[str, ManifestAck | None] = field(default_factory=dict)
    local_done: bool = False  # on_manifest called


def _failed_ack(m: Manifest, name: str) -> ManifestAck:
    return ManifestAck(
        version=m.version, attempt=m.attempt, complete=False, failed=(name,), node=name
    )


class RelayNode:
    """One node of the tree (see the module docstring). Run `serve()` in a thread or process."""

    def __init__(
        self,
        name: str,
        bind: str,
        *,
        children: list[tuple[str, str, bytes | None]] | None = None,
        deliver: Callable[[bytes], None] | None = None,
        keys: CurveKeys | None = None,
        hwm: int = 64,
        child_timeout_s: float = 10.0,
        on_manifest: Callable[[Manifest], None] | None = None,
        on_abandon: Callable[[Abandon], None] | None = None,
        on_forget: Callable[[Forget], int] | None = None,
    ) -> None:
        """`children`: (name, address, server public key or None). `deliver(payload)`: hand a
        payload to this node's receivers; `on_manifest(manifest)`: every payload it lists was
        delivered here; `on_abandon(abandon)`: the attempt was given up; `on_forget(forget)`:
        remove what versions below ``forget.before_version`` left (returns the number of files
        removed). All four run on the node's thread, in arrival order."""
        self.name = name
        self.bind = bind
        self.children = list(children or [])
        self.deliver = deliver or (lambda p: None)
        self.on_manifest = on_manifest or (lambda m: None)
        self.on_abandon = on_abandon or (lambda a: None)
        self.on_forget = on_forget or (lambda f: 0)
        self.forgotten_before = 0  # versions below this were forgotten (retention)
        self.keys = keys
        self.hwm = hwm
        self.child_timeout_s = child_timeout_s
        self.delivered: dict[Key, set[str]] = {}
        self.bytes_in = 0
        self.duplicates = 0
        self._stop = threading.Event()
        self.ready = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def serve(self) -> None:
        import zmq

        ctx = zmq.Context()
        auth = None
        server = ctx.socket(zmq.ROUTER)
        server.setsockopt(zmq.RCVHWM, self.hwm)
        server.setsockopt(zmq.SNDHWM, self.hwm)
        server.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve_callback(domain="*", credentials_provider=_Allow(self.keys))
            server.curve_server = True
            server.curve_publickey, server.curve_secretkey = self.keys.public, self.keys.secret
        server.bind(self.bind)
        kids = {
            name: connect_client(ctx, addr, self.keys, pub, self.hwm)
            for name, addr, pub in self.children
        }
        poller = zmq.Poller()
        poller.register(server, zmq.POLLIN)
        for s in kids.values():
            poller.register(s, zmq.POLLIN)
        self._outstanding: dict[str, dict[str, float]] = {n: {} for n in kids}  # child->id->t
        self._failed_children: set[str] = set()
        pending: dict[Key, _Pending] = {}
        self.ready.set()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(50))
                if server in events:
                    frames = server.recv_multipart(copy=False)
                    reply = self._on_message(frames, kids, pending)
                    if reply is not None:
                        server.send_multipart([frames[0].bytes, encode(reply)])
                for name, s in kids.items():
                    if s in events:
                        self._on_child_reply(name, s.recv(), pending)
                now = time.monotonic()
                for name, msgs in self._outstanding.items():
                    if msgs and now - min(msgs.values()) > self.child_timeout_s:
                        self._failed_children.add(name)
                for key, p in list(pending.items()):
                    done = self._try_complete(p, now)
                    if done is not None:
                        server.send_multipart([p.reply_to, encode(done)])
                        del pending[key]
        finally:
            for s in kids.values():
                s.close(0)
            server.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()

    def _on_message(
        self, frames: list[Any], kids: dict[str, Any], pending: dict[Key, _Pending]
    ) -> Any:
        """Handle one client message; returns the reply (None: answered later)."""
        import zmq

        try:
            if len(frames) < 2:
                raise RelayMessageError("relay message without a header frame")
            msg = decode(frames[1].bytes)
        except RelayMessageError as e:
            return Refused(node=self.name, error=str(e))
        if isinstance(msg, Payload):
            return self._on_payload(msg, frames, kids)
        if isinstance(msg, Manifest):
            if msg.version < self.forgotten_before:
                return ManifestAck(
                    version=msg.version,
                    attempt=msg.attempt,
                    complete=False,
                    failed=(f"{self.name} (version {msg.version} was forgotten: retention)",),
                    node=self.name,
                )
            p = _Pending(frames[0].bytes, msg, time.monotonic() + msg.timeout_s)
            sub = encode(dataclasses.replace(msg, timeout_s=max(0.5, msg.timeout_s - 1.0)))
            for name, s in kids.items():
                if name in self._failed_children:
                    p.child_acks[name] = _failed_ack(msg, name)
                    continue
                try:
                    s.send_multipart([sub], flags=zmq.NOBLOCK)
                    p.child_acks[name] = None
                except zmq.Again:
                    self._failed_children.add(name)
                    p.child_acks[name] = _failed_ack(msg, name)
            pending[(msg.version, msg.attempt)] = p
            return None
        if isinstance(msg, Abandon):
            for s in kids.values():  # best effort: a dead child is failed anyway
                try:
                    s.send_multipart([encode(msg)], flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
            self.on_abandon(msg)
            return AbandonAck(version=msg.version, attempt=msg.attempt)
        if isinstance(msg, Forget):
            return self._on_forget(msg, kids, pending)
        return Refused(node=self.name, error=f"a node does not accept {msg.KIND.value} messages")

    def _on_forget(
        self, msg: Forget, kids: dict[str, Any], pending: dict[Key, _Pending]
    ) -> ForgetAck:
        import zmq

        for s in kids.values():  # best effort: forgetting is cumulative, the next one catches up
            try:
                s.send_multipart([encode(msg)], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
        self.forgotten_before = max(self.forgotten_before, msg.before_version)
        old = [k for k in self.delivered if k[0] < self.forgotten_before]
        for k in old:
            del self.delivered[k]
        for k in [k for k in pending if k[0] < self.forgotten_before]:
            del pending[k]  # its sender gave up long ago (a newer version was committed)
        removed = int(self.on_forget(msg))
        return ForgetAck(
            before_version=msg.before_version, node=self.name, removed=removed, keys=len(old)
        )

    def _on_child_reply(self, name: str, frame: bytes, pending: dict[Key, _Pending]) -> None:
        try:
            reply = decode(frame)
        except RelayMessageError:
            self._failed_children.add(name)  # a child that talks nonsense is a failed child
            return
        if isinstance(reply, PayloadAck):
            self._outstanding[name].pop(reply.payload_id, None)
        elif isinstance(reply, ManifestAck):
            p = pending.get((reply.version, reply.attempt))
            if p is not None:
                p.child_acks[name] = reply
        elif isinstance(reply, ForgetAck | AbandonAck):
            pass  # best-effort notices: nothing waits on a child's answer
        elif isinstance(reply, Refused):
            self._failed_children.add(name)

    def _on_payload(self, msg: Payload, frames: list[Any], kids: dict[str, Any]) -> PayloadAck:
        import zmq

        pid = msg.payload_id
        data = frames[2].buffer if len(frames) > 2 else b""
        try:  # header only: receivers verify digests and keys when they stage
            h = peek_header(bytes(data), verify=False)
        except Exception as e:  # a malformed frame is refused, never forwarded
            return PayloadAck(payload_id=pid, ok=False, node=self.name, error=str(e))
        if h.payload_id_hex != pid or (h.meta.version, h.meta.attempt) != (
            msg.version,
            msg.attempt,
        ):
            return PayloadAck(
                payload_id=pid,
                ok=False,
                node=self.name,
                error="payload id, version or attempt does not match the header frame",
            )
        if msg.version < self.forgotten_before:
            return PayloadAck(
                payload_id=pid,
                ok=False,
                node=self.name,
                error=(
                    f"version {msg.version} was forgotten (retention: versions below "
                    f"{self.forgotten_before}); a stale payload is not spooled"
                ),
            )
        seen = self.delivered.setdefault((msg.version, msg.attempt), set())
        if pid in seen:
            self.duplicates += 1
            return PayloadAck(payload_id=pid, ok=True, duplicate=True, node=self.name)
        seen.add(pid)
        self.bytes_in += len(data)
        self.deliver(bytes(data))
        for name, s in kids.items():
            if name in self._failed_children:
                continue
            try:  # never block the node on a dead child: a full queue fails that child
                s.send_multipart([frames[1], frames[2]], copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                self._failed_children.add(name)
                continue
            self._outstanding[name][pid] = time.monotonic()
        return PayloadAck(payload_id=pid, ok=True, node=self.name)

    def _try_complete(self, p: _Pending, now: float) -> ManifestAck | None:
        m = p.manifest
        have = self.delivered.get((m.version, m.attempt), set())
        missing = set(m.payload_ids) - have
        if not missing and not p.local_done:
            p.local_done = True
            self.on_manifest(m)
        for name in self._failed_children:
            if p.child_acks.get(name) is None:
                p.child_acks[name] = _failed_ack(m, name)
        waiting = [n for n, a in p.child_acks.items() if a is None]
        if (missing or waiting) and now < p.deadline:
            return None
        failed: list[str] = []
        if missing:
            failed.append(f"{self.name} (missing {len(missing)} payloads)")
        for name in waiting:
            failed.append(f"{name} (no answer before the deadline)")
        for a in p.child_acks.values():
            if a is not None:
                failed += a.failed
        return ManifestAck(
            version=m.version,
            attempt=m.attempt,
            complete=not failed,
            failed=tuple(failed),
            node=self.name,
        )
