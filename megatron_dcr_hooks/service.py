"""Owner control service: a coordinator in another process drives the DCR hooks of a running
Megatron job (the `shared_codec.coordination.coordinator.Owners` of that job, client: `shared_codec.coordination.owners`).

Rank 0 (of the hook's ``groups.world``) binds a ZeroMQ REP socket; each request (a JSON object
with ``"op"``) is broadcast to every rank as JSON bytes in a uint8 tensor over that group (the
hook's `ParallelGroups`; never the default group implicitly; no pickle),
every rank runs it collectively, and rank 0 replies ``{"ok": true, ...}`` or
``{"ok": false, "error": ...}``. An error on any rank fails the whole request.

Built-in ops:
- ``build`` {version, attempt, retry}: ``hook.build`` with each rank's payloads uploaded by an
  `ObjectPublisher` (owner id = global rank); after every rank finished its uploads and owner
  list, rank 0 writes the attempt manifest. Reply: ``baseline_id``, summed payload bytes,
  element change rate, slowest build seconds.
- ``commit`` {version}: owners advance their baselines (idempotent for the committed version).
- ``abort`` {version, attempt}: keep the committed baseline.
- ``status``; ``stop`` (reply, then `serve` returns).
User ops (an RL loop's ``train``, ``export``, ...) are `handlers`: ``name -> fn(request) ->
dict``, called on every rank; rank 0's result is the reply.

Limitations:
1. One request at a time (REP); the coordinator's timeout must cover a whole build.
2. The store must be reachable from every trainer rank (each uploads its own payloads).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_dcr_hooks.groups import RankGroup
from megatron_dcr_hooks.hook import DCRHook
from shared_codec.errors import OwnerBuildError, ProtocolError
from shared_codec.transport.objects import ObjectPublisher, write_manifest
from shared_codec.transport.store import ObjectStore

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def _broadcast_json(obj: Any, world: RankGroup) -> Any:
    """Rank 0's JSON-able `obj` on every rank of `world` (length, then bytes)."""
    g = world.group
    if world.rank == 0:
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, group=g, group_src=0)
    if world.rank != 0:
        data = torch.empty(int(n[0]), dtype=torch.uint8)
    dist.broadcast(data, group=g, group_src=0)
    return json.loads(bytes(data.numpy()).decode())


def _gather_json(obj: Any, world: RankGroup) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, on every rank of `world` (no pickle)."""
    g = world.group
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world.size)]
    dist.all_gather(sizes, n, group=g)
    width = int(max(int(x[0]) for x in sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    out = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(out, padded, group=g)
    return [json.loads(bytes(t[: int(k[0])].numpy()).decode()) for t, k in zip(out, sizes)]


class OwnerService:
    """Serves coordinator requests for one trainer job (every rank constructs one)."""

    def __init__(
        self,
        hook: DCRHook,
        store: ObjectStore | None,
        endpoint: str,
        handlers: dict[str, Handler] | None = None,
        relay: str | None = None,
        relay_timeout_s: float = 60.0,
    ) -> None:
        if (store is None) == (relay is None):
            raise ValueError("OwnerService needs exactly one transport: a store or a relay root")
        self.hook = hook
        self.store = store
        self.relay = relay
        self.relay_timeout_s = relay_timeout_s
        self._sender: Any = None
        self.endpoint = endpoint
        self.handlers = dict(handlers or {})
        self.groups = hook.groups
        self.rank = hook.groups.world.rank
        self.world = hook.groups.world.size

    # -- ops (every rank) ----------------------------------------------------------------------
    def _build(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.relay is not None:
            return self._build_relay(req)
        assert self.store is not None
        version, attempt = int(req["version"]), int(req["attempt"])
        retry = bool(req.get("retry", False))
        base = self.hook.committed_version
        pub = ObjectPublisher(self.store, version=version, attempt=attempt, owner=self.rank)
        try:
            rep = self.hook.build(version, attempt, retry=retry, sink=pub.send)
        finally:
            listing = pub.finish()
        stats = torch.tensor(
            [rep.payload_bytes, len(listing["payloads"]), rep.seconds], dtype=torch.float64
        )
        total = stats.clone()
        g = self.groups.world.group
        dist.all_reduce(total, group=g)
        slowest = stats.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=g)
        dist.barrier(group=g)  # every owner list exists before the manifest names it
        if self.rank == 0:
            write_manifest(
                self.store,
                version=version,
                base_version=base,
                attempt=attempt,
                owners=list(range(self.world)),
            )
        dist.barrier(group=g)
        return {
            "baseline_id": f"owners-v{base}",
            "version": version,
            "attempt": attempt,
            "retry": retry,
            "payload_bytes": int(total[0]),
            "payloads": int(total[1]),
            "build_s": float(slowest[2]),
            "element_change_rate": rep.element_change_rate,
        }

    def _build_relay(self, req: dict[str, Any]) -> dict[str, Any]:
        """Every rank streams its payloads to the relay root while constructing; rank 0 then
        sends the attempt's manifest (every rank's payload ids) and waits for the tree's
        completion acknowledgement (every node holds every payload, or the failed nodes)."""
        from shared_codec.format import peek_header
        from shared_codec.transport.relay import RelaySender

        version, attempt = int(req["version"]), int(req["attempt"])
        retry = bool(req.get("retry", False))
        base = self.hook.committed_version
        if self._sender is None:
            self._sender = RelaySender(str(self.relay), ack_timeout_s=self.relay_timeout_s)
        ids: list[str] = []
        sent = [0]

        def send(payload: bytes) -> None:
            self._sender.send(payload)
            ids.append(peek_header(payload, verify=False).payload_id_hex)
            sent[0] += len(payload)

        error = ""
        try:
            rep = self.hook.build(version, attempt, retry=retry, sink=send)
            self._sender.flush()
        except Exception as e:  # reported after the collectives below, never between them
            error, rep = f"{type(e).__name__}: {e}", None
        per_rank = _gather_json(
            {"ids": ids, "error": error, "seconds": rep.seconds if rep else 0}, self.groups.world
        )
        errors = [r["error"] for r in per_rank if r["error"]]
        ack_error = ""
        if self.rank == 0 and not errors:
            try:
                self._sender.complete(
                    attempt,
                    [i for r in per_rank for i in r["ids"]],
                    self.relay_timeout_s,
                    version=version,
                )
            except Exception as e:
                ack_error = f"{type(e).__name__}: {e}"
        ack_error = _broadcast_json(ack_error, self.groups.world)
        if errors or ack_error:
            raise OwnerBuildError("; ".join(errors) or ack_error)
        assert rep is not None
        total = torch.tensor([float(sent[0])], dtype=torch.float64)
        dist.all_reduce(total, group=self.groups.world.group)
        return {
            "baseline_id": f"owners-v{base}",
            "version": version,
            "attempt": attempt,
            "retry": retry,
            "payload_bytes": int(total[0]),
            "payloads": sum(len(r["ids"]) for r in per_rank),
            "build_s": max(float(r["seconds"]) for r in per_rank),
            "element_change_rate": rep.element_change_rate,
        }

    def _commit(self, req: dict[str, Any]) -> dict[str, Any]:
        version = int(req["version"])
        if self.hook.committed_version != version:
            if self.hook._candidate != version:
                raise ProtocolError(
                    f"cannot commit version {version}: owners are at committed "
                    f"{self.hook.committed_version}, candidate {self.hook._candidate}"
                )
            self.hook.commit()
        return {"committed_version": self.hook.committed_version}

    def _abort(self, req: dict[str, Any]) -> dict[str, Any]:
        self.hook.abort()
        return {"committed_version": self.hook.committed_version}

    def _status(self, req: dict[str, Any]) -> dict[str, Any]:
        return {
            "committed_version": self.hook.committed_version,
            "candidate": self.hook._candidate,
            "world": self.world,
        }

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """Run one request on this rank; the reply of rank 0 is what the client sees."""
        ops: dict[str, Handler] = {
            "build": self._build,
            "commit": self._commit,
            "abort": self._abort,
            "status": self._status,
            **self.handlers,
        }
        op = req.get("op")
        fn = ops.get(str(op))
        t0 = time.perf_counter()
        try:
            if fn is None:
                raise ValueError(f"unknown op {op!r}; known: {sorted(ops)} and 'stop'")
            out: dict[str, Any] = {"ok": True, **fn(req)}
        except Exception as e:
            out = {"ok": False, "error": f"rank {self.rank}: {type(e).__name__}: {e}"}
            traceback.print_exc()
        flag = torch.tensor([0 if out["ok"] else 1], dtype=torch.int64)
        dist.all_reduce(flag, group=self.groups.world.group)  # an error on any rank fails it
        if out["ok"] and int(flag[0]):
            out = {"ok": False, "error": f"{op} failed on {int(flag[0])} other rank(s)"}
        out["seconds"] = time.perf_counter() - t0
        return out

    def serve(self) -> None:
        """Answer requests until ``stop`` (every rank calls; rank 0 owns the socket)."""
        sock: Any = None
        if self.rank == 0:
            import zmq

            sock = zmq.Context.instance().socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(self.endpoint)
        try:
            while True:
                req: Any = None
                if sock is not None:
                    try:
                        req = json.loads(sock.recv())
                        if not isinstance(req, dict):
                            raise ValueError("request must be a JSON object")
                    except ValueError as e:
                        sock.send(json.dumps({"ok": False, "error": f"bad request: {e}"}).encode())
                        req = {"op": "_skip"}
                req = _broadcast_json(req, self.groups.world)
                if req.get("op") == "_skip":
                    continue
                if req.get("op") == "stop":
                    if sock is not None:
                        sock.send(json.dumps({"ok": True, "stopped": True}).encode())
                    return
                out = self.handle(req)
                if sock is not None:
                    sock.send(json.dumps(out).encode())
        finally:
            if sock is not None:
                sock.close(0)
