"""`AdapterChannel`: the receiver contract for one LoRA adapter alias over DCR's
``dcr_adapter_*`` RPCs, so that the coordinator runs adapter-only refits as it runs base-weight
refits (attempts, the commit record, fencing, overwrite retries, restores).

It rides on an `RpcChannel` (HTTP, Ray or in-process: engines.py), its *transport*, and maps
the contract (docs/protocol.md, "LoRA adapters"):

- `load`: ``dcr_adapter_load(alias, path, version)``: the adapter directory of the committed
  version (the handle's ``checkpoint_for``), dense; a restore or a join. `tensors` is unused:
  the adapter's own tensors are its table;
- `deliver`: ``dcr_adapter_fetch``: every rank fetches the attempt into a candidate version;
  each rank's reply is its ACK;
- `send_commit`: ``dcr_adapter_commit``: the engine core activates the version once every
  rank answered; `send_abort`: ``dcr_adapter_abort``: the candidate leaves, the committed
  version stays active;
- `read_digest`: the ranks' digests of the committed adapter tensors (``dcr_adapter_status``),
  combined by `protocol.engine_digest`.

Usage::

    engine = EngineHandle("engine0", AdapterChannel(HttpChannel(url, store=spec), "policy"),
                          tensors=[], checkpoint_for=lambda v: f"/adapters/v{v}")
    Coordinator(control, owners, [engine], ...).refit()

Limitations:
1. One alias per channel (a handle per alias and engine).
2. The prefix cache needs no reset: the engine core resolves each request to one version, and
   block hashes include the adapter's name and path.
"""

from __future__ import annotations

import time
from typing import Any

from shared_codec.coordination.protocol import EngineAck, RankAck, RankReply, engine_digest
from shared_codec.coordination.rpc_channel import RpcChannel
from shared_codec.errors import DCRError, ProtocolError


class AdapterChannel:
    """The receiver contract for adapter `alias` over `transport` (module docstring)."""

    def __init__(self, transport: RpcChannel, alias: str) -> None:
        self.transport, self.alias = transport, alias

    @property
    def name(self) -> str:
        return self.transport.name

    def load(self, version: int, path: str | None, tensors: list) -> list[Any]:
        if path is None:
            raise ProtocolError(
                f"adapter {self.alias}: an engine is restored or joins by a dense load of the "
                "committed version's adapter directory; give checkpoint_for"
            )
        return self.transport.call_ok("dcr_adapter_load", [self.alias, path, version], 600.0)

    def deliver(
        self, version: int, attempt: int, timeout_s: float, *, pipelined: bool, verify: bool
    ) -> EngineAck:
        t0 = time.perf_counter()
        args = [self.alias, self.transport.store, version, attempt, timeout_s]
        replies = self.transport.call("dcr_adapter_fetch", args, timeout_s)
        acks = [_ack(r, version, attempt) for r in replies]
        fetched = [r.extra.get("fetch") or {} for r in replies]
        return EngineAck.merge(
            acks,
            pipelined=False,
            fetch_s=time.perf_counter() - t0,
            apply_s=0.0,
            fetched_bytes=sum(int(f.get("bytes", 0)) for f in fetched),
            payloads=max((int(f.get("payloads", 0)) for f in fetched), default=0),
        )

    def send_commit(self, version: int) -> None:
        self.transport.call_ok("dcr_adapter_commit", [self.alias, version], 600.0)

    def send_abort(self, attempt: int) -> None:
        self.transport.call_ok("dcr_adapter_abort", [self.alias, attempt], 600.0)

    def read_digest(self) -> str:
        replies = self.transport.call_ok("dcr_adapter_status", [], 600.0)
        digests = []
        for r in replies:
            held = (r.extra.get("adapters") or {}).get(self.alias)
            if not isinstance(held, dict) or not isinstance(held.get("digest"), str):
                raise DCRError(f"receiver {self.name}: rank {r.rank} holds no adapter {self.alias}")
            digests.append((r.rank, held["digest"]))
        return engine_digest(digests)

    def down(self) -> str:
        return self.transport.down()

    def can_relaunch(self) -> bool:
        return self.transport.can_relaunch()

    def relaunch(self) -> None:
        self.transport.relaunch()


def _ack(reply: RankReply, version: int, attempt: int) -> RankAck:
    """A rank's ``dcr_adapter_fetch`` answer as its ACK."""
    return RankAck(
        ok=reply.ok,
        attempt=attempt,
        rank=reply.rank,
        target_version=version if reply.ok else None,
        items=int(reply.extra.get("items", 0)),
        payloads=int((reply.extra.get("fetch") or {}).get("payloads", 0)),
        error=reply.error,
    )
