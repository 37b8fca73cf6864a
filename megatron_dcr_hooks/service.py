"""Owner control service: a coordinator in another process drives the DCR hooks of a running
Megatron job (the `shared_codec.coordination.coordinator.Owners` of that job, client: `shared_codec.coordination.owners`).

Rank 0 (of the hook's ``groups.world``) binds a ZeroMQ REP socket; each request (an
`OwnerRequest`, shared_codec.coordination.protocol, as JSON) is broadcast to every rank as JSON
bytes in a uint8 tensor over that group (the hook's `ParallelGroups`; never the default group
implicitly; no pickle), checked on every rank (a malformed one is a ``ProtocolError`` reply
naming the field), run collectively, and rank 0 replies with an `OwnerReply`: ``{"ok": true,
...the op's reply (`BuildReply`, `VerifyReply`, ...)}`` or ``{"ok": false, "error": ...,
"error_type": ...}``. An error on any rank fails the whole request.

Built-in ops:
- ``build`` {version, attempt, retry}: ``hook.build`` with each rank's payloads sent into its
  payload sink (`TransportSpec.open_sink` on the service's transport spec, owner
  id = global rank); after every rank finished its sink, rank 0 seals the attempt (manifest or
  relay-tree completion). Reply: ``baseline_id``, summed payload bytes and count, element
  change rate, slowest build seconds.
- ``verify`` {version}: the candidate guard (`DCRHook.verify_candidate` on every rank); a moved
  shard anywhere fails it with ``error_type`` ``CandidateChanged``. Reply ``guard``:
  ``"scanned"``, ``"held"`` or ``"off"`` (``candidate_guard=False``). Held: the version was
  built in this same `serve` call and only ``verify``/``status`` ran since, on the thread of
  the hook's optimizer steps (or none seen yet). `serve` runs on the training thread and holds
  it, so the weights cannot have moved: the shard scan (as long as a build's detection) is
  skipped; the protocol checks still run (a second build of the version, e.g. a wrapped
  optimizer step, is still refused). After a user op, between two serves, or through a direct
  `handle` call the guard scans.
- ``commit`` {version}: owners advance their baselines to the built candidate (idempotent for
  the committed version; no second guard scan: ``verify`` ran before the compare-and-set).
  Under `serve` the reply goes out once the request is checked, and the trackers advance
  (an O(changed) scatter) right after it, before the next request is read: the record is
  already durable, so the coordinator need not wait for the scatter, and every later request
  (a build, a user op, ``status``) sees the advanced baseline. Should that scatter fail, every
  later request fails naming it (the job must restart from its checkpoint).
- ``abort`` {version, attempt}: keep the committed baseline.
- ``status``; ``stop`` (reply, then `serve` returns; rank 0's socket stays bound, so requests
  sent while the job trains are answered by the next `serve`; `close` unbinds it).
User ops (an RL loop's ``train``, ``export``, ...) are `handlers`: ``name -> fn(request) ->
dict``, called on every rank; rank 0's result is the reply.

Limitations:
1. One request at a time (REP); the coordinator's timeout must cover a whole build.
2. The transport must be reachable from every trainer rank (each sends its own payloads).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch

from megatron_dcr_hooks.collectives import all_gather, all_reduce, broadcast
from megatron_dcr_hooks.groups import RankGroup
from megatron_dcr_hooks.hook import DCRHook
from shared_codec.coordination.protocol import (
    AbortReply,
    BuildReply,
    CommitReply,
    Guard,
    OwnerOp,
    OwnerReply,
    OwnerRequest,
    StatusReply,
    VerifyReply,
)
from shared_codec.coordination.wire import Message
from shared_codec.errors import CandidateChanged, OwnerBuildError, ProtocolError
from shared_codec.transport.base import Seal
from shared_codec.transport.spec import Role, TransportSpec

#: a job's own op: takes the request's plain object, returns the reply's fields
Handler = Callable[[dict[str, Any]], dict[str, Any]]


def _broadcast_json(obj: Any, world: RankGroup) -> Any:
    """Rank 0's JSON-able `obj` on every rank of `world` (length, then bytes)."""
    g = world.group
    if world.rank == 0:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    n = broadcast(n, g)
    if world.rank != 0:
        data = torch.empty(int(n[0]), dtype=torch.uint8)
    data = broadcast(data, g)
    return json.loads(bytes(data.numpy()).decode())


def _gather_json(obj: Any, world: RankGroup) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, on every rank of `world` (no pickle)."""
    g = world.group
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = all_gather(torch.tensor([data.numel()], dtype=torch.int64), g, world.size)
    width = int(max(int(x[0]) for x in sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = all_gather(padded, g, world.size)
    return [json.loads(bytes(t[: int(k[0])].numpy()).decode()) for t, k in zip(out, sizes)]


def _candidate_version(hook: DCRHook) -> int | None:
    """The version of the hook's uncommitted candidate (`DCRHook.candidate`), None if none."""
    return None if hook.candidate is None else hook.candidate.version


class OwnerService:
    """Serves coordinator requests for one trainer job (every rank constructs one)."""

    def __init__(
        self,
        hook: DCRHook,
        transport: str | Mapping[str, Any],
        endpoint: str,
        handlers: dict[str, Handler] | None = None,
    ) -> None:
        """`transport`: the sink spec every rank sends its payloads to
        (`shared_codec.transport.spec`: kinds dir, s3, relay); `endpoint`: rank 0's REP
        address; `handlers`: user ops."""
        self.hook = hook
        self.transport = TransportSpec.parse(transport, role=Role.SINK)
        self.endpoint = endpoint
        self.handlers = dict(handlers or {})
        self.groups = hook.groups
        self.rank = hook.groups.world.rank
        self.world = hook.groups.world.size
        self._sock: Any = None
        # candidate guard held by the service (module docstring, ``verify``): (serve call,
        # version) of a build in the current serve with only verify / status since
        self._serves = 0
        self._serving = False
        self._held: tuple[int, int] | None = None
        # work a request leaves for after its reply (``commit``), and how it failed
        self._after_reply: Callable[[], None] | None = None
        self._broken = ""

    # -- ops (every rank) ----------------------------------------------------------------------
    def _build(self, req: OwnerRequest) -> BuildReply:
        """Every rank sends its payloads into its sink while constructing and finishes it;
        after every rank reported (errors included: collectives never diverge), rank 0 seals
        the attempt (the object-store manifest, or the relay tree's completion: every node
        holds every payload). An error anywhere fails the request on every rank."""
        version, attempt, retry = req.require("version"), req.require("attempt"), req.retry
        base = self.hook.committed_version
        error, rep, report = "", None, None
        with self.transport.open_sink(version=version, attempt=attempt, owner=self.rank) as sink:
            try:
                rep = self.hook.build(version, attempt, retry=retry, sink=sink.send)
                report = sink.finish()
            except Exception as e:  # reported after the collectives below, never between them
                error = f"{type(e).__name__}: {e}"
            per_rank = _gather_json(
                {
                    "ids": list(report.payload_ids) if report else [],
                    "bytes": report.bytes if report else 0,
                    "error": error,
                    "seconds": rep.seconds if rep else 0.0,
                },
                self.groups.cpu_world,
            )
            errors = [f"rank {i}: {r['error']}" for i, r in enumerate(per_rank) if r["error"]]
            seal_error = ""
            if self.rank == 0 and not errors:
                try:
                    sink.seal(
                        Seal(
                            base_version=base,
                            owners=tuple(range(self.world)),
                            payload_ids=tuple(i for r in per_rank for i in r["ids"]),
                        )
                    )
                except Exception as e:
                    seal_error = f"{type(e).__name__}: {e}"
            seal_error = _broadcast_json(seal_error, self.groups.cpu_world)
        if any(r["error"].startswith("CandidateChanged") for r in per_rank):
            raise CandidateChanged("; ".join(errors))
        if errors or seal_error:
            raise OwnerBuildError("; ".join(errors) or seal_error)
        assert rep is not None
        if self._serving and self.hook.step_thread in (None, threading.get_ident()):
            self._held = (self._serves, version)
        return BuildReply(
            baseline_id=f"owners-v{base}",
            version=version,
            attempt=attempt,
            retry=retry,
            payload_bytes=sum(int(r["bytes"]) for r in per_rank),
            payloads=sum(len(r["ids"]) for r in per_rank),
            build_s=max(float(r["seconds"]) for r in per_rank),
            element_change_rate=float(rep.element_change_rate),
        )

    def _commit(self, req: OwnerRequest) -> CommitReply:
        version = req.require("version")
        if self.hook.committed_version != version:
            candidate = _candidate_version(self.hook)
            if candidate != version:
                raise ProtocolError(
                    f"cannot commit version {version}: owners are at committed "
                    f"{self.hook.committed_version}, candidate {candidate}"
                )
            # verified before the compare-and-set (``verify``); the record is durable now, so
            # the owners advance to the candidate the engines hold without a second scan
            if self._serving:  # after the reply, before the next request (module docstring)
                self._after_reply = lambda: self.hook.commit(verify=False)
                return CommitReply(committed_version=version)
            self.hook.commit(verify=False)
        return CommitReply(committed_version=self.hook.committed_version)

    def _verify(self, req: OwnerRequest) -> VerifyReply:
        """The candidate guard before the coordinator's compare-and-set: every rank checks its
        shards (hook.verify_candidate); any moved shard fails the op with `CandidateChanged`
        on every rank, naming them all."""
        version = req.require("version")
        held = self._serving and self._held == (self._serves, version)
        error = ""
        try:
            self.hook.verify_candidate(version, scan=not held)
        except CandidateChanged as e:
            error = str(e)
        errors = [e for e in _gather_json(error, self.groups.cpu_world) if e]
        if errors:
            raise CandidateChanged("; ".join(errors))
        if not self.hook.config.candidate_guard:
            return VerifyReply(version=version, guard=Guard.OFF)
        return VerifyReply(version=version, guard=Guard.HELD if held else Guard.SCANNED)

    def _abort(self, req: OwnerRequest) -> AbortReply:
        self.hook.abort()
        return AbortReply(committed_version=self.hook.committed_version)

    def _status(self, req: OwnerRequest) -> StatusReply:
        return StatusReply(
            committed_version=self.hook.committed_version,
            candidate=_candidate_version(self.hook),
            world=self.world,
        )

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """Run one request (an `OwnerRequest`'s plain object) on this rank: the plain
        `OwnerReply` (the reply of rank 0 is what the client sees). A malformed request is a
        `ProtocolError` reply naming the field."""
        ops: dict[str, Callable[[OwnerRequest], Message]] = {
            OwnerOp.BUILD: self._build,
            OwnerOp.VERIFY: self._verify,
            OwnerOp.COMMIT: self._commit,
            OwnerOp.ABORT: self._abort,
            OwnerOp.STATUS: self._status,
        }
        op = req.get("op") if isinstance(req, dict) else None
        if op not in (OwnerOp.VERIFY, OwnerOp.STATUS):  # anything else may move the weights
            self._held = None
        t0 = time.perf_counter()
        try:
            if self._broken:
                raise OwnerBuildError(self._broken)
            request = OwnerRequest.parse(req)
            if request.op in ops:
                body = ops[request.op](request).to_wire()
            elif request.op in self.handlers:  # a job's own op: its handler takes the plain object
                body = self.handlers[request.op](req)
            else:
                known = sorted([*ops, *self.handlers])
                raise ValueError(f"unknown op {request.op!r}; known: {known} and 'stop'")
            reply = OwnerReply(ok=True, extra=body)
        except Exception as e:
            reply = OwnerReply(
                ok=False,
                error=f"rank {self.rank}: {type(e).__name__}: {e}",
                error_type=type(e).__name__,
            )
            traceback.print_exc()
        flag = torch.tensor([0 if reply.ok else 1], dtype=torch.int64)
        flag = all_reduce(flag, self.groups.cpu_world.group)  # an error on any rank fails it
        if reply.ok and int(flag[0]):
            reply = OwnerReply(ok=False, error=f"{op} failed on {int(flag[0])} other rank(s)")
            self._after_reply = None
        return dataclasses.replace(reply, seconds=time.perf_counter() - t0).to_wire()

    def _finish(self) -> None:
        """Run what the last request left for after its reply (this rank only, no
        collectives); a failure breaks the service: every later request fails naming it."""
        work, self._after_reply = self._after_reply, None
        if work is None:
            return
        try:
            work()
        except Exception as e:
            traceback.print_exc()
            self._broken = (
                f"rank {self.rank}: the owners' commit failed after its reply ({type(e).__name__}: "
                f"{e}); this job's DCR baseline is unusable: restart it from its checkpoint"
            )

    def _socket(self) -> Any:
        """Rank 0's REP socket, bound on the first `serve` and kept until `close`: a request
        sent while the job trains between two serves (a coordinator's ``status`` right after
        ``stop``) waits in its queue for the next serve instead of reaching a socket that is
        about to close (where it would be dropped, and the REQ client would wait forever)."""
        if self._sock is None:
            import zmq

            sock: Any = zmq.Context.instance().socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 2000)  # `close` still delivers a last ``stop`` reply
            sock.bind(self.endpoint)
            self._sock = sock
        return self._sock

    def close(self) -> None:
        """Unbind rank 0's socket (the job is done serving); a later `serve` binds again."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def serve(self) -> None:
        """Answer requests until ``stop`` (every rank calls; rank 0 owns the socket, which
        stays bound after ``stop``: `_socket`). An exception closes the socket.

        Call it on the training thread, with training paused until it returns (its requests
        run collectives on the job's groups): the candidate guard relies on it (``verify``)."""
        sock = self._socket() if self.rank == 0 else None
        self._serves += 1  # the job ran (trained) since any earlier serve: nothing is held
        self._held, self._serving = None, True
        try:
            while True:
                req: Any = None
                if sock is not None:
                    try:
                        req = json.loads(sock.recv())
                        if not isinstance(req, dict):
                            raise ValueError("request must be a JSON object")
                    except ValueError as e:
                        bad = OwnerReply(
                            ok=False, error=f"bad request: {e}", error_type="ProtocolError"
                        )
                        sock.send(json.dumps(bad.to_wire()).encode())
                        req = {"op": "_skip"}
                req = _broadcast_json(req, self.groups.cpu_world)
                if req.get("op") == "_skip":
                    continue
                if req.get("op") == OwnerOp.STOP:
                    if sock is not None:
                        stopped = OwnerReply(ok=True, extra={"stopped": True})
                        sock.send(json.dumps(stopped.to_wire()).encode())
                    return
                out = self.handle(req)
                if sock is not None:
                    sock.send(json.dumps(out).encode())
                self._finish()
        except BaseException:
            self.close()
            raise
        finally:
            self._finish()  # (an exception between a reply and its work)
            self._held, self._serving = None, False
