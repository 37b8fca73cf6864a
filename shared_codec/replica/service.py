"""``dcr replica serve``: the replica's HTTP service in the rollout cluster. It serves the
coordinator's receiver calls (`ReplicaReceiver` behind HTTP; client.py is the coordinator's
handle) and the committed checkpoints to restores and joins, file by file with range reads,
each download under a lease (docs/replica.md, "Service").

Endpoints (JSON bodies and answers; an error is ``{"ok": false, "error", "error_type"}`` with
status 400 for a refused request, 404 for an unknown lease or file, 500 otherwise):

| method, path | body | answer |
|---|---|---|
| ``POST /replica/apply`` | ``{"version", "attempt", "timeout_s"}`` | the `EngineAck` |
| ``POST /replica/commit`` | ``{"version"}`` | ``{"ok": true}`` |
| ``POST /replica/abort`` | ``{"attempt"}`` | ``{"ok": true}`` |
| ``POST /replica/restore`` | ``{"version"}`` | ``{"ok": true}`` |
| ``GET /replica/digest`` | | ``{"digest"}`` |
| ``GET /replica/status`` | | ``ReplicaStatus.to_json``, ``served`` (leases, bytes), ``bytes_in`` |
| ``POST /replica/leases`` | ``{"version", "ttl_s"}`` | ``{"lease", "version", "files": [{"path", "size"}]}`` |
| ``GET /replica/leases/<id>/files/<path>`` | header ``Range: bytes=a-b`` | the bytes (206 with a range) |
| ``DELETE /replica/leases/<id>`` | | ``{"ok": true}`` |

A lease holds its version's slot unchanged (`leases.lease`) until it is deleted or its
``ttl_s`` (default 600 s, renewed by every file read) runs out; only the files it lists are
served, so no other path under the root can be read.

Limitations:
1. Plain HTTP on the rollout cluster's network (no TLS, no authentication): bind it to an
   interface only that cluster reaches.
2. One range per request (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from shared_codec.errors import ArgumentError, DCRError, ReplicaError
from shared_codec.replica import durable, leases
from shared_codec.replica.receiver import ReplicaReceiver
from shared_codec.replica.transition import nonneg

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass
class _Lease:
    version: int
    path: Path
    files: dict[str, int]  # relative path -> size
    stack: ExitStack
    expires: float
    ttl_s: float


class ReplicaService:
    """The HTTP service of one replica (module docstring). ``start()`` binds and serves on a
    thread; `url` is then its base URL; ``stop()`` releases every lease."""

    def __init__(self, receiver: ReplicaReceiver, host: str = "127.0.0.1", port: int = 0) -> None:
        self.receiver = receiver
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        #: what restores and joins read: leases opened, file bytes sent
        self.served = {"leases": 0, "bytes": 0}
        service = self

        class Handler(_Handler):
            owner = service

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else host
        return f"http://{name}:{port}"

    def start(self) -> ReplicaService:
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="dcr-replica-http", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        with self._lock:
            for lease in self._leases.values():
                lease.stack.close()
            self._leases.clear()

    # -- leases ----------------------------------------------------------------------------------
    def open_lease(self, version: Any, ttl_s: Any, holder: str) -> dict[str, Any]:
        version = nonneg(version, "version")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= 86400:
            raise ArgumentError(f"ttl_s must be a number of seconds in (0, 86400], got {ttl_s!r}")
        self.sweep()
        stack = ExitStack()
        try:
            path = stack.enter_context(
                leases.lease(self.receiver.root, version, timeout_s=5.0, holder=holder)
            )
            files = {str(rel): (path / rel).stat().st_size for rel in durable.files_of(path)}
        except BaseException:
            stack.close()
            raise
        lease_id = uuid.uuid4().hex
        with self._lock:
            self.served["leases"] += 1
            self._leases[lease_id] = _Lease(
                version=version, path=path, files=files, stack=stack,
                expires=time.monotonic() + ttl_s, ttl_s=float(ttl_s),
            )  # fmt: skip
        return {
            "lease": lease_id,
            "version": version,
            "files": [{"path": p, "size": s} for p, s in sorted(files.items())],
        }

    def lease(self, lease_id: str) -> _Lease:
        self.sweep()
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise KeyError(f"lease {lease_id!r} is not held (expired or released)")
            lease.expires = time.monotonic() + lease.ttl_s
            return lease

    def release(self, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise KeyError(f"lease {lease_id!r} is not held (expired or released)")
        lease.stack.close()

    def sweep(self) -> None:
        """Release the leases whose time ran out."""
        now = time.monotonic()
        with self._lock:
            gone = [k for k, v in self._leases.items() if v.expires < now]
            dropped = [self._leases.pop(k) for k in gone]
        for lease in dropped:
            lease.stack.close()


class _Handler(BaseHTTPRequestHandler):
    owner: ReplicaService
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    # -- plumbing --------------------------------------------------------------------------------
    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, e: BaseException) -> None:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        self._json(status, {"ok": False, "error": msg, "error_type": type(e).__name__})

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b"{}"
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ArgumentError(f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ArgumentError("the request body must be a JSON object")
        return body

    def _run(self, fn: Any) -> None:
        try:
            fn()
        except KeyError as e:
            self._error(HTTPStatus.NOT_FOUND, e)
        except (DCRError, ValueError, TypeError) as e:
            self._error(HTTPStatus.BAD_REQUEST, e)
        except Exception as e:  # a bug or an I/O error: say so, keep serving
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, e)

    # -- routes ----------------------------------------------------------------------------------
    def do_POST(self) -> None:  # noqa: N802 - the base's name
        self._run(self._post)

    def _post(self) -> None:
        rx, body = self.owner.receiver, self._body()
        path = self.path.rstrip("/")
        if path == "/replica/apply":
            ack = rx.apply(
                nonneg(body.get("version"), "version"),
                nonneg(body.get("attempt"), "attempt"),
                _seconds(body.get("timeout_s", 600.0)),
            )
            self._json(HTTPStatus.OK, ack.to_wire())
        elif path in ("/replica/commit", "/replica/restore"):
            version = nonneg(body.get("version"), "version")
            (rx.commit if path.endswith("commit") else rx.restore)(version)
            self._json(HTTPStatus.OK, {"ok": True})
        elif path == "/replica/abort":
            rx.abort(nonneg(body.get("attempt"), "attempt"))
            self._json(HTTPStatus.OK, {"ok": True})
        elif path == "/replica/leases":
            holder = f"http {self.client_address[0]}"
            got = self.owner.open_lease(body.get("version"), body.get("ttl_s", 600.0), holder)
            self._json(HTTPStatus.OK, got)
        else:
            raise KeyError(f"no such endpoint: POST {self.path}")

    def do_DELETE(self) -> None:  # noqa: N802
        def go() -> None:
            m = re.fullmatch(r"/replica/leases/([0-9a-f]{32})", self.path)
            if m is None:
                raise KeyError(f"no such endpoint: DELETE {self.path}")
            self.owner.release(m.group(1))
            self._json(HTTPStatus.OK, {"ok": True})

        self._run(go)

    def do_GET(self) -> None:  # noqa: N802
        self._run(self._get)

    def _get(self) -> None:
        rx = self.owner.receiver
        if self.path == "/replica/digest":
            self._json(HTTPStatus.OK, {"digest": rx.digest()})
        elif self.path == "/replica/status":
            with self.owner._lock:
                served = dict(self.owner.served)
            status = {**rx.status().to_json(), "served": served, "bytes_in": rx.bytes_in}
            self._json(HTTPStatus.OK, status)
        elif m := re.fullmatch(r"/replica/leases/([0-9a-f]{32})/files/(.+)", self.path):
            self._file(m.group(1), unquote(m.group(2)))
        else:
            raise KeyError(f"no such endpoint: GET {self.path}")

    def _file(self, lease_id: str, rel: str) -> None:
        lease = self.owner.lease(lease_id)
        size = lease.files.get(rel)
        if size is None:
            raise KeyError(f"{rel!r} is not a file of version {lease.version}")
        start, end = 0, size  # [start, end)
        ranged = self.headers.get("Range")
        if ranged:
            start, end = _range(ranged, size)
        self.send_response(HTTPStatus.PARTIAL_CONTENT if ranged else HTTPStatus.OK)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        self.wfile.flush()
        with open(lease.path / rel, "rb") as f:  # sendfile: no copy through Python
            sent = self.connection.sendfile(f, start, end - start)
        if sent != end - start:
            raise ReplicaError(f"{rel}: sent {sent} of {end - start} bytes (file shorter?)")
        with self.owner._lock:
            self.owner.served["bytes"] += end - start


def _seconds(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
        raise ArgumentError(f"timeout_s must be a number of seconds in (0, 86400], got {v!r}")
    return float(v)


def _range(header: str, size: int) -> tuple[int, int]:
    """``[start, end)`` of one byte range of a file of `size` bytes; ArgumentError otherwise."""
    m = _RANGE.match(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        raise ArgumentError(f"Range: one range 'bytes=a-b' expected, got {header!r}")
    a, b = m.group(1), m.group(2)
    if not a:  # the last n bytes
        start, end = max(0, size - int(b)), size
    else:
        start, end = int(a), size if not b else min(size, int(b) + 1)
    if start >= size or start >= end:
        raise ArgumentError(f"Range: {header!r} is outside the file's {size} bytes")
    return start, end


def serve(receiver: ReplicaReceiver, host: str, port: int) -> None:
    """Serve until interrupted (``dcr replica serve``)."""
    service = ReplicaService(receiver, host, port)
    print(json.dumps({"url": service.url, "root": str(receiver.root)}), flush=True)
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
        receiver.close()


__all__ = ["ReplicaService", "serve"]
