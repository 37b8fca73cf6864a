"""The coordinator's client for a trainer job's owner service (`megatron_dcr_hooks.service`).

`RemoteOwners(endpoint)` implements `shared_codec.coordination.coordinator.Owners` over one ZeroMQ REQ
socket: typed requests and replies (`protocol.OwnerRequest` / `OwnerReply` around the op's own
reply, as JSON; no pickle). A request that gets no reply within its timeout
raises `DCRError` and the socket is replaced (a REQ socket cannot send again before it receives),
so a slow or dead trainer job fails the attempt instead of wedging the coordinator.

Limitations:
1. One outstanding request at a time (the service is a REP socket).
"""

from __future__ import annotations

import json
from typing import Any

from shared_codec.coordination.protocol import (
    AbortReply,
    BuildReply,
    CommitReply,
    OwnerOp,
    OwnerReply,
    OwnerRequest,
    StatusReply,
    VerifyReply,
)
from shared_codec.errors import DCRError


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
        """Send one `OwnerRequest`; return the checked `OwnerReply` as its plain object (the
        op's fields at the top level), or raise the service's error as its DCR class
        (`OwnerReply.raise_for`). The built-in ops below return their typed replies."""
        return self.request(op, timeout_s, **fields).to_wire()

    def request(self, op: str, timeout_s: float | None = None, **fields: Any) -> OwnerReply:
        """`call`, returning the checked `OwnerReply` (the op's fields in ``extra``)."""
        import zmq

        known = {k: fields.pop(k) for k in ("version", "attempt", "retry") if k in fields}
        request = OwnerRequest(op=op, extra=fields, **known)
        sock = self._socket()
        sock.send(json.dumps(request.to_wire()).encode())
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            self.close()
            raise DCRError(
                f"owner service at {self.endpoint}: no reply to {op!r} in {timeout:.0f}s"
            )
        raw = sock.recv()
        try:
            reply = OwnerReply.parse(json.loads(raw), what=f"owner service {op!r} reply")
        except ValueError as e:  # not JSON
            raise DCRError(f"owner service {op!r}: a reply that is not JSON: {e}") from None
        reply.raise_for(op)
        return reply

    # -- coordinator Owners protocol -------------------------------------------------------------
    def build(self, version: int, attempt: int, retry: bool) -> BuildReply:
        reply = self.request(OwnerOp.BUILD, version=version, attempt=attempt, retry=retry)
        return BuildReply.parse(reply.extra)

    def verify(self, version: int) -> VerifyReply:
        return VerifyReply.parse(self.request(OwnerOp.VERIFY, version=version).extra)

    def commit(self, version: int) -> None:
        CommitReply.parse(self.request(OwnerOp.COMMIT, version=version).extra)

    def abort(self, version: int, attempt: int) -> None:
        AbortReply.parse(self.request(OwnerOp.ABORT, version=version, attempt=attempt).extra)

    def status(self) -> StatusReply:
        return StatusReply.parse(self.request(OwnerOp.STATUS).extra)

    def stop(self, timeout_s: float = 60.0) -> None:
        try:
            self.request(OwnerOp.STOP, timeout_s=timeout_s)
        finally:
            self.close()
