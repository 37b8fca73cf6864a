"""ZeroMQ relay tree: owners -> one root in the rollout cluster -> balanced k-ary tree of nodes.

Every node binds one ROUTER socket. Senders (owners, the coordinator, parent nodes) connect a
DEALER to it and send two-frame messages: a JSON header frame and, for payloads, the payload
frame (sent and received without copies). Two message types:

- ``payload`` {attempt, version, payload_id}: the node validates the frame against the header
  (payload id, sizes; no decoding), suppresses duplicates by payload id, queues it for its local
  receivers (``deliver``) and for every child, and answers a *queueing acknowledgement* at once.
- ``manifest`` {attempt, version, payload_ids}: the node forwards it to its children, tells its
  local receivers once every listed payload was delivered locally (``on_manifest``), and answers a
  *completion acknowledgement* once every listed payload was delivered locally and every child
  acknowledged the manifest for its subtree, or once its deadline passed. A child that does not
  answer in time, or a missing payload, makes the acknowledgement ``complete: false`` with the
  node named in ``failed``; the acknowledgements aggregate up to the root, so the coordinator
  sees a dead or slow node anywhere in the tree as a failed attempt naming it.
- ``abandon`` {version, attempt, reason}: the coordinator gave the attempt up (its owners
  failed); every node forwards it and tells its local receivers (``on_abandon``), so engines
  that stream the attempt stop waiting.

A node process (`main`) spools payloads into its ``deliver_dir`` as they arrive, and the
manifest / abandon notices as ``manifest-v<version>-a<attempt>.json`` /
``abandoned-v<version>-a<attempt>.json``; engines read the spool either after the tree's
completion (`read_spool`) or while payloads still arrive (`stream_spool`, pipelined).

Back-pressure: socket high-water marks bound queued messages, and `RelaySender` keeps at most
`window` unacknowledged payloads in flight. V_cross accounting: the root counts the payload bytes
it receives from outside the rollout cluster (`bytes_in`); with one root per cluster this equals
V_payload per attempt.

Security: with `CurveKeys` every node is a CURVE server and accepts only clients whose public
key is in its allow-list (ZAP authentication); traffic is encrypted. Keys are provisioned as
described in docs/operations.md (one key pair per node and per owner, public keys distributed
out of band).

Limitations:
1. One attempt's manifest per message; payloads of several attempts may interleave.
2. Nodes keep delivered payload ids until `forget(attempt)` (a coordinator calls it on commit).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shared_codec.format import peek_header
from shared_codec.transport.store import TransportError


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


def _client(
    ctx: Any, address: str, keys: CurveKeys | None, server_public: bytes | None, hwm: int
) -> Any:
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


@dataclass
class _Pending:
    """A manifest a node is waiting to complete."""

    reply_to: bytes
    ids: set[str]
    deadline: float
    header: dict = field(default_factory=dict)
    child_acks: dict[str, dict | None] = field(default_factory=dict)
    local_done: bool = False  # on_manifest called


class RelayNode:
    """One node of the tree (see the module docstring). Run `serve()` in a thread or process."""

    def __init__(
        self,
        name: str,
        bind: str,
        *,
        children: list[tuple[str, str, bytes | None]] = (),  # type: ignore[assignment]
        deliver: Callable[[bytes], None] | None = None,
        keys: CurveKeys | None = None,
        hwm: int = 64,
        child_timeout_s: float = 10.0,
        on_manifest: Callable[[dict], None] | None = None,
        on_abandon: Callable[[dict], None] | None = None,
    ) -> None:
        """`deliver(payload)`: hand a payload to this node's receivers; `on_manifest(header)`:
        every payload the manifest lists was delivered here; `on_abandon(header)`: the attempt
        was abandoned. All three run on the node's thread, in arrival order."""
        self.name = name
        self.on_manifest = on_manifest or (lambda h: None)
        self.on_abandon = on_abandon or (lambda h: None)
        self.bind = bind
        self.children = list(children)  # (name, address, server public key)
        self.deliver = deliver or (lambda p: None)
        self.keys = keys
        self.hwm = hwm
        self.child_timeout_s = child_timeout_s
        self.delivered: dict[int, set[str]] = {}
        self.bytes_in = 0
        self.duplicates = 0
        self._stop = threading.Event()
        self.ready = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def forget(self, attempt: int) -> None:
        self.delivered.pop(attempt, None)

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
            name: _client(ctx, addr, self.keys, pub, self.hwm) for name, addr, pub in self.children
        }
        poller = zmq.Poller()
        poller.register(server, zmq.POLLIN)
        for s in kids.values():
            poller.register(s, zmq.POLLIN)
        outstanding: dict[str, dict[str, float]] = {n: {} for n in kids}  # child -> msg id -> t
        failed_children: set[str] = set()
        pending: dict[int, _Pending] = {}
        self.ready.set()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(50))
                if server in events:
                    frames = server.recv_multipart(copy=False)
                    ident, header = frames[0].bytes, json.loads(frames[1].bytes)
                    if header["type"] == "payload":
                        ack = self._on_payload(
                            header,
                            frames[2] if len(frames) > 2 else None,
                            kids,
                            outstanding,
                            failed_children,
                        )
                        server.send_multipart([ident, json.dumps(ack).encode()])
                    elif header["type"] == "manifest":
                        attempt = int(header["attempt"])
                        p = _Pending(
                            ident,
                            set(header["payload_ids"]),
                            time.monotonic() + float(header.get("timeout_s", 30)),
                            header,
                        )
                        for name, s in kids.items():
                            if name in failed_children:
                                p.child_acks[name] = {"complete": False, "failed": [name]}
                                continue
                            sub = dict(
                                header, timeout_s=max(0.5, float(header.get("timeout_s", 30)) - 1.0)
                            )
                            try:
                                s.send_multipart([json.dumps(sub).encode()], flags=zmq.NOBLOCK)
                                p.child_acks[name] = None
                            except zmq.Again:
                                failed_children.add(name)
                                p.child_acks[name] = {"complete": False, "failed": [name]}
                        pending[attempt] = p
                    elif header["type"] == "abandon":
                        for s in kids.values():  # best effort: a dead child is failed anyway
                            try:
                                s.send_multipart([json.dumps(header).encode()], flags=zmq.NOBLOCK)
                            except zmq.Again:
                                pass
                        self.on_abandon(header)
                        reply = {"type": "abandon_ack", "attempt": header["attempt"]}
                        server.send_multipart([ident, json.dumps(reply).encode()])
                    elif header["type"] == "forget":
                        self.forget(int(header["attempt"]))
                        server.send_multipart([ident, b'{"ok": true}'])
                for name, s in kids.items():
                    if s in events:
                        reply = json.loads(s.recv())
                        if reply.get("type") == "payload_ack":
                            outstanding[name].pop(reply["payload_id"], None)
                        elif reply.get("type") == "abandon_ack":
                            pass
                        elif reply.get("type") == "manifest_ack":
                            p2 = pending.get(int(reply["attempt"]))
                            if p2 is not None:
                                p2.child_acks[name] = reply
                now = time.monotonic()
                for name, msgs in outstanding.items():
                    if msgs and now - min(msgs.values()) > self.child_timeout_s:
                        failed_children.add(name)
                for attempt, p in list(pending.items()):
                    done = self._try_complete(attempt, p, failed_children, now)
                    if done is not None:
                        server.send_multipart([p.reply_to, json.dumps(done).encode()])
                        del pending[attempt]
        finally:
            for s in kids.values():
                s.close(0)
            server.close(0)
            if auth is not None:
                auth.stop()
            ctx.term()

    def _on_payload(
        self, header: dict, frame: Any, kids: dict, outstanding: dict, failed_children: set[str]
    ) -> dict:
        pid, attempt = header["payload_id"], int(header["attempt"])
        data = frame.buffer if frame is not None else b""
        try:  # header only: receivers verify digests and keys when they stage
            h = peek_header(bytes(data), verify=False)
        except Exception as e:  # a malformed frame is refused, never forwarded
            return {
                "type": "payload_ack",
                "payload_id": pid,
                "ok": False,
                "node": self.name,
                "error": str(e),
            }
        if h.payload_id_hex != pid:
            return {
                "type": "payload_ack",
                "payload_id": pid,
                "ok": False,
                "node": self.name,
                "error": "payload id does not match the header frame",
            }
        seen = self.delivered.setdefault(attempt, set())
        if pid in seen:
            self.duplicates += 1
            return {
                "type": "payload_ack",
                "payload_id": pid,
                "ok": True,
                "duplicate": True,
                "node": self.name,
            }
        seen.add(pid)
        self.bytes_in += len(data)
        self.deliver(bytes(data))
        import zmq

        for name, s in kids.items():
            if name in failed_children:
                continue
            try:  # never block the node on a dead child: a full queue fails that child
                s.send_multipart(
                    [json.dumps(header).encode(), frame], copy=False, flags=zmq.NOBLOCK
                )
            except zmq.Again:
                failed_children.add(name)
                continue
            outstanding[name][pid] = time.monotonic()
        return {"type": "payload_ack", "payload_id": pid, "ok": True, "node": self.name}

    def _try_complete(
        self, attempt: int, p: _Pending, failed_children: set[str], now: float
    ) -> dict | None:
        have = self.delivered.get(attempt, set())
        missing = p.ids - have
        if not missing and not p.local_done:
            p.local_done = True
            self.on_manifest(p.header)
        for name in failed_children:
            if p.child_acks.get(name) is None:
                p.child_acks[name] = {"complete": False, "failed": [name]}
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
                failed += a.get("failed", [])
        return {
            "type": "manifest_ack",
            "attempt": attempt,
            "complete": not failed,
            "failed": failed,
            "node": self.name,
        }


class _Allow:
    """ZAP CURVE credentials provider: accept only the configured client public keys."""

    def __init__(self, keys: CurveKeys) -> None:
        self.allowed = set(keys.allowed)

    def callback(self, domain: str, key: bytes) -> bool:
        import zmq.utils.z85

        return zmq.utils.z85.encode(key) in self.allowed or key in self.allowed


class RelaySender:
    """An owner's (or the coordinator's) connection to the root."""

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
        self.sock = _client(self.ctx, root, keys, root_public, hwm)
        self.window = window
        self.ack_timeout_s = ack_timeout_s
        self.inflight: dict[str, float] = {}
        self.bytes_sent = 0
        self.root = root

    def _recv(self, timeout_s: float) -> dict:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TransportError(
                f"relay root {self.root} did not acknowledge within "
                f"{timeout_s:.1f}s (dead, slow or refusing this peer)"
            )
        return json.loads(self.sock.recv())

    def send(self, payload: bytes, *, attempt: int | None = None) -> None:
        """Send one payload; blocks while `window` payloads are unacknowledged."""
        h = peek_header(payload, verify=False)
        header = {
            "type": "payload",
            "attempt": attempt if attempt is not None else h.meta.attempt,
            "version": h.meta.version,
            "payload_id": h.payload_id_hex,
        }
        while len(self.inflight) >= self.window:
            self._take_ack()
        self.sock.send_multipart([json.dumps(header).encode(), payload], copy=False)
        self.inflight[h.payload_id_hex] = time.monotonic()
        self.bytes_sent += len(payload)

    def _take_ack(self) -> None:
        ack = self._recv(self.ack_timeout_s)
        if ack.get("type") != "payload_ack":
            return
        if not ack.get("ok"):
            raise TransportError(
                f"relay node {ack.get('node')} refused payload "
                f"{ack.get('payload_id')}: {ack.get('error')}"
            )
        self.inflight.pop(ack["payload_id"], None)

    def flush(self) -> None:
        while self.inflight:
            self._take_ack()

    def complete(
        self,
        attempt: int,
        payload_ids: list[str],
        timeout_s: float = 30.0,
        version: int | None = None,
    ) -> dict:
        """Send the attempt's manifest; returns the tree's completion acknowledgement, or raises
        TransportError naming the failed nodes. `version` lets nodes tell streaming engines
        (`stream_spool`) that the attempt is complete locally."""
        self.flush()
        header: dict[str, Any] = {
            "type": "manifest",
            "attempt": attempt,
            "payload_ids": payload_ids,
            "timeout_s": timeout_s,
        }
        if version is not None:
            header["version"] = version
        self.sock.send_multipart([json.dumps(header).encode()])
        deadline = time.monotonic() + timeout_s + 5
        while True:
            ack = self._recv(max(0.1, deadline - time.monotonic()))
            if ack.get("type") == "manifest_ack" and int(ack["attempt"]) == attempt:
                break
        if not ack["complete"]:
            raise TransportError(
                f"attempt {attempt} failed in the relay tree: {', '.join(ack['failed'])}"
            )
        return ack

    def abandon(self, version: int, attempt: int, reason: str, timeout_s: float = 10.0) -> None:
        """Tell the tree that (`version`, `attempt`) was given up (the coordinator, when the
        owners' build failed); waits for the root's acknowledgement."""
        header = {"type": "abandon", "version": version, "attempt": attempt, "reason": reason}
        self.sock.send_multipart([json.dumps(header).encode()])
        deadline = time.monotonic() + timeout_s
        while True:
            ack = self._recv(max(0.1, deadline - time.monotonic()))
            if ack.get("type") == "abandon_ack" and int(ack["attempt"]) == attempt:
                return

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def read_spool(directory: str, version: int, attempt: int) -> list[bytes]:
    """The payloads of (`version`, `attempt`) that a relay node process spooled into
    `directory` (its ``deliver_dir``), in (owner, sequence) order. Call it after the tree's
    completion acknowledgement for the attempt: then every listed payload is there. Headers are
    checked here only for routing; receivers validate payloads fully when staging."""
    from pathlib import Path

    found = []
    for f in sorted(Path(directory).glob("*.bin")):
        data = f.read_bytes()
        try:
            m = peek_header(data, verify=False).meta
        except Exception as e:  # a spool only holds what the node validated; report, skip none
            raise TransportError(f"spooled payload {f.name} is unreadable: {e}") from None
        if (m.version, m.attempt) == (version, attempt):
            found.append(((m.owner, m.sequence), data))
    return [data for _, data in sorted(found, key=lambda x: x[0])]


# spool directory -> {file name: (version, attempt)}: payload files are immutable (named by
# payload id), so a process reads each one's header once
_SPOOL_ROUTES: dict[str, dict[str, tuple[int, int]]] = {}


def _marker(kind: str, version: int, attempt: int) -> str:
    return f"{kind}-v{version:012d}-a{attempt:06d}.json"


def stream_spool(
    directory: str, version: int, attempt: int, timeout_s: float = 60.0, poll_s: float = 0.01
) -> Iterator[bytes]:
    """Yield the payloads of (`version`, `attempt`) from a node's spool as they arrive
    (pipelined engines), until the node's manifest notice says every listed payload is here;
    raises TransportError when the attempt was abandoned, when the spool holds a payload of the
    attempt that the manifest does not list, or at `timeout_s` without a manifest notice."""
    from pathlib import Path

    root = Path(directory)
    seen: set[str] = set()  # file names looked at in this call
    known = _SPOOL_ROUTES.setdefault(str(root.resolve()), {})  # earlier calls' files
    ids: set[str] = set()  # payload ids of this attempt yielded
    deadline, delay = time.monotonic() + timeout_s, poll_s
    while True:
        abandoned = root / _marker("abandoned", version, attempt)
        if abandoned.exists():
            why = json.loads(abandoned.read_text()).get("reason", "")
            raise TransportError(
                f"version {version} attempt {attempt} was abandoned by the coordinator: {why}"
            )
        manifest_file = root / _marker("manifest", version, attempt)
        manifest = json.loads(manifest_file.read_text()) if manifest_file.exists() else None
        fresh = sorted(f for f in root.glob("*.bin") if f.name not in seen) if root.exists() else []
        for f in fresh:
            seen.add(f.name)
            if f.name in known and known[f.name] != (version, attempt):
                continue  # another attempt's payload, read by an earlier call
            data = f.read_bytes()
            try:
                h = peek_header(data, verify=False)
            except Exception as e:
                raise TransportError(f"spooled payload {f.name} is unreadable: {e}") from None
            known[f.name] = (h.meta.version, h.meta.attempt)
            if (h.meta.version, h.meta.attempt) == (version, attempt):
                ids.add(h.payload_id_hex)
                yield data
        if manifest is not None:
            stray = ids - set(manifest["payload_ids"])
            if stray:
                raise TransportError(
                    f"version {version} attempt {attempt}: {len(stray)} spooled payload(s) not "
                    f"listed by the manifest (first: {sorted(stray)[0]})"
                )
            if set(manifest["payload_ids"]) <= ids:
                return
            # the notice is written only after local delivery: a later listing will have them
        if time.monotonic() > deadline:
            raise TransportError(
                f"no manifest notice for version {version} attempt {attempt} in {directory} "
                f"after {timeout_s:.0f}s: owners, the tree or the coordinator did not finish"
            )
        if fresh:
            delay = poll_s
        else:
            time.sleep(delay)
            delay = min(0.05, delay * 1.5)


def main(argv: list[str] | None = None) -> int:
    """Run one relay node process: ``python -m shared_codec.transport.relay CONFIG_JSON``.

    Config keys: name, bind, children ([[name, address, server_public_z85 or null]]),
    deliver_dir (payloads written there as <payload id>.bin), public/secret/allowed (Z85,
    optional: CURVE), child_timeout_s.
    """
    import os
    import sys
    from pathlib import Path

    cfg = json.loads((argv or sys.argv[1:])[0])
    keys = None
    if cfg.get("secret"):
        keys = CurveKeys(
            cfg["public"].encode(),
            cfg["secret"].encode(),
            tuple(k.encode() for k in cfg.get("allowed", [])),
        )
    out = Path(cfg["deliver_dir"])
    out.mkdir(parents=True, exist_ok=True)

    def deliver(payload: bytes) -> None:
        pid = peek_header(payload, verify=False).payload_id_hex
        tmp = out / f".{pid}.tmp"
        tmp.write_bytes(payload)
        os.replace(tmp, out / f"{pid}.bin")
        with open(out / "delivery.log", "a") as log:
            log.write(pid + "\n")

    def notice(kind: str) -> Callable[[dict], None]:
        def write(header: dict) -> None:
            if "version" not in header:  # an old sender: nothing for streaming engines
                return
            name = _marker(kind, int(header["version"]), int(header["attempt"]))
            tmp = out / f".{name}.tmp"
            tmp.write_text(json.dumps(header))
            os.replace(tmp, out / name)

        return write

    node = RelayNode(
        cfg["name"],
        cfg["bind"],
        children=[(n, a, p.encode() if p else None) for n, a, p in cfg.get("children", [])],
        deliver=deliver,
        on_manifest=notice("manifest"),
        on_abandon=notice("abandoned"),
        keys=keys,
        child_timeout_s=float(cfg.get("child_timeout_s", 5.0)),
    )
    node.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
