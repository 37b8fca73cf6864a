"""The coordinator's client for a trainer job's owner service (`megatron_dcr_hooks.service`).

`RemoteOwners(endpoint)` implements `shared_codec.coordination.coordinator.Owners` over one ZeroMQ REQ
socket (JSON requests and replies, no pickle). A request that gets no reply within its timeout
raises `DCRError` and the socket is replaced (a REQ socket cannot send again before it receives),
so a slow or dead trainer job fails the attempt instead of wedging the coordinator.

Limitations:
1. One outstanding request at a time (the service is a REP socket).
"""

from __future__ import annotations

import json
from typing import Any

from shared_codec.errors import CandidateChanged, DCRError


class RemoteOwners:
    """Owners handle over ZeroMQ (see the module docstring)."""

    def __init__(self, endpoint: str, *, timeout_s: float = 600.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._sock: Any = None

    def _socket(self) -> Any:
        import zmq

        if self._sock is None:
            self._sock = zmq.Context.instance().socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def call(self, op: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request; return the reply or raise DCRError with the service's error."""
        import zmq

        sock = self._socket()
        sock.send(json.dumps({"op": op, **fields}).encode())
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            self.close()
            raise DCRError(
                f"owner service at {self.endpoint}: no reply to {op!r} in {timeout:.0f}s"
            )
        reply = json.loads(sock.recv())
        if not reply.get("ok"):
            error = DCRError
            if reply.get("error_type") == "CandidateChanged":
                error = CandidateChanged
            raise error(f"owner service {op!r} failed: {reply.get('error')}")
        return dict(reply)

    # -- coordinator Owners protocol -------------------------------------------------------------
    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        return self.call("build", version=version, attempt=attempt, retry=retry)

    def verify(self, version: int) -> dict[str, Any]:
        return self.call("verify", version=version)

    def commit(self, version: int) -> None:
        self.call("commit", version=version)

    def abort(self, version: int, attempt: int) -> None:
        self.call("abort", version=version, attempt=attempt)

    def stop(self, timeout_s: float = 60.0) -> None:
        try:
            self.call("stop", timeout_s=timeout_s)
        finally:
            self.close()
