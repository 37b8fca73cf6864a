"""The control-plane protocol: every message the coordinator, the engines and the owners
exchange, typed, versioned and checked where it arrives (wire.py: `Message.parse` raises
`ProtocolError` naming the message and the field).

Exchanges (docs/protocol.md has the state machines):

- Engines, per rank (the ``dcr_*`` RPCs through vLLM's ``collective_rpc``): every answer is a
  `RankReply` envelope (``rpc``, ``rank``, ``ok``, ``error``, the protocol version) around the
  RPC's own fields: `RankAck` for ``dcr_apply`` (and ``dcr_fetch``'s ``"ack"``), `FetchReply`
  for ``dcr_fetch``, `DigestReply` for ``dcr_digest``. The native weight-transfer backend
  answers with per-rank `RankReport` records in the control store instead.
- Engines, per engine: the `EngineAck` an engine handle gives the coordinator for an attempt,
  merged from its ranks by one rule (`EngineAck.merge`); the engine's digest is `engine_digest`
  over its ranks' digests.
- Owners (the owner service's ZeroMQ REP socket): an `OwnerRequest` per op, answered by an
  `OwnerReply` envelope (``ok``, ``error``, ``error_type``: a class of the DCR error tree) around
  `BuildReply`, `VerifyReply`, `CommitReply`, `AbortReply` or `StatusReply`.

Versions: an envelope names its protocol version in ``protocol`` (`PROTOCOL_VERSION`). Version
1 is the format the envelopes had before the field existed: its senders may leave the field
out (the receivers' ``dcr_*`` replies and native reports do), and an envelope without it is
version 1. Any other version is refused; a later version's senders must send the field.

Limitations:
1. A rank's free-form reports (the prewarm capability report, status, metrics) travel in the
   envelope's ``extra``; only the fields the control plane acts on are typed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Self

from shared_codec.coordination.wire import Message
from shared_codec.errors import DCRError, ProtocolError, error_class

PROTOCOL_VERSION = 1


class _Versioned(Message):
    """An envelope: checks ``protocol`` after parsing."""

    __slots__ = ()

    @classmethod
    def parse(cls, raw: Any, *, what: str | None = None) -> Self:
        msg = super().parse(raw, what=what)
        if msg.protocol != PROTOCOL_VERSION:  # type: ignore[attr-defined]
            raise ProtocolError(
                f"{what or cls.NAME}: protocol must be {PROTOCOL_VERSION}, got {msg.protocol}"  # type: ignore[attr-defined]
            )
        return msg


# -- engines, per rank ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class AckTimings(Message):
    """Where an apply's time went (``total_s`` only when it ran to its end)."""

    NAME = "ACK timings"
    OMIT_NONE = ("total_s",)
    decode_s: float = 0.0
    apply_s: float = 0.0
    apply_cpu_s: float = 0.0
    total_s: float | None = None


ACK_COUNTS = (
    "payloads",
    "items",
    "skipped_items",
    "batches",
    "elements_written",
    "bytes",
    "compressed_bytes",
    "plan_items",
    "loader_items",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankAck(Message):
    """One rank's ACK for (part of) an attempt: the reply of ``dcr_apply``. `post_apply_mismatches`
    is None unless `verified`; `partial_item` names the item a loader failure may have left
    half-written; `plan_items` / `loader_items`: items replayed through the placement plan /
    applied through ``load_weights``; `fallbacks`: direct-path items that went through the
    loader, by reason; `pipelined_parts` is set on merged ACKs only."""

    NAME = "rank ACK"
    OMIT_NONE = ("pipelined_parts",)
    ok: bool
    attempt: int
    rank: int
    target_version: int | None
    payloads: int = 0
    items: int = 0
    skipped_items: int = 0
    batches: int = 0
    elements_written: int = 0
    bytes: int = 0
    compressed_bytes: int = 0
    plan_items: int = 0
    loader_items: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    post_apply_mismatches: int | None = None
    verified: bool = False
    timings: AckTimings = field(default_factory=AckTimings)
    error: str | None = None
    partial_item: str | None = None
    pipelined_parts: int | None = None

    @classmethod
    def merge(cls, acks: Sequence[RankAck]) -> RankAck:
        """One ACK for an attempt applied in several parts: counts and timings summed, the
        first failure's error and partial item, ``ok`` only if every part was, the first known
        target version; everything else from the last part."""
        if not acks:
            raise ProtocolError("no ACK to merge")
        last = acks[-1]
        bad = next((a for a in acks if not a.ok), None)
        return cls(
            ok=bad is None,
            attempt=last.attempt,
            rank=last.rank,
            target_version=next(
                (a.target_version for a in acks if a.target_version is not None), None
            ),
            **{k: sum(getattr(a, k) for a in acks) for k in ACK_COUNTS},
            fallbacks={
                why: sum(a.fallbacks.get(why, 0) for a in acks)
                for why in sorted({w for a in acks for w in a.fallbacks})
            },
            post_apply_mismatches=(
                sum(a.post_apply_mismatches or 0 for a in acks)
                if last.verified
                else last.post_apply_mismatches
            ),
            verified=last.verified,
            timings=AckTimings(
                decode_s=sum(a.timings.decode_s for a in acks),
                apply_s=sum(a.timings.apply_s for a in acks),
                apply_cpu_s=sum(a.timings.apply_cpu_s for a in acks),
                total_s=sum(a.timings.total_s or 0.0 for a in acks),
            ),
            error=bad.error if bad is not None else last.error,
            partial_item=bad.partial_item if bad is not None else last.partial_item,
            pipelined_parts=len(acks),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReply(_Versioned):
    """The envelope of every ``dcr_*`` answer: which RPC answered (``rpc``: vLLM 0.32's
    ``collective_rpc`` replies are not tagged, so a handle tells a late answer from its own),
    the rank, ``ok`` and ``error`` (``internal``: not a DCR error but a defect, logged on the
    rank), and the rank's weights state after the call (``weights``: what vLLM's engine core
    stamps ``weight_version`` from, vllm_dcr_plugin/versions.py; absent before the rank has a
    receiver); the RPC's own fields are in `extra` (`fields`)."""

    NAME = "rank reply"
    EXTRA = True
    OMIT_NONE = ("weights",)
    rpc: str
    ok: bool
    rank: int = 0
    error: str | None = None
    internal: bool = False
    weights: dict[str, Any] | None = None
    protocol: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The RPC's own fields with ``ok``, ``rank`` and ``error`` (what its body parses)."""
        return {"ok": self.ok, "rank": self.rank, "error": self.error, **self.extra}

    def failure(self) -> str:
        return f"rank {self.rank}: {self.error}"


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchReply(Message):
    """One rank's ``dcr_fetch``: what it fetched and staged; with a pipelined fetch, the
    attempt's merged ACK (`ack`). The rank's parallel coordinates travel in `extra`."""

    NAME = "fetch reply"
    EXTRA = True
    ok: bool = True
    rank: int = 0
    error: str | None = None
    payloads: int = 0
    bytes: int = 0
    staged: int = 0
    duplicates: int = 0
    fetch_seconds: float = 0.0
    seconds: float = 0.0
    ack: RankAck | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class DigestReply(Message):
    """One rank's ``dcr_digest``: the combined digest of its parameters and buffers, and the
    per-name digests (`tensors`)."""

    NAME = "digest reply"
    EXTRA = True
    ok: bool = True
    rank: int = 0
    error: str | None = None
    digest: str
    tensors: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport(_Versioned):
    """What one rank of the native backend wrote into the control store for one call
    (init, update, finish, restore): ``ok``, ``error``, the rank and world size, the receiver's
    state after the call; the call's own fields (``ack``, ``fetch``, ``gate``, ``digest``,
    ``committed``...) are in `extra`."""

    NAME = "rank report"
    EXTRA = True
    ok: bool
    rank: int
    world_size: int = 1
    error: str | None = None
    state: str | None = None
    committed_version: int | None = None
    target_version: int | None = None
    protocol: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def ack(self) -> RankAck | None:
        """The update's ACK (an ``update`` report that got as far as applying)."""
        raw = self.extra.get("ack")
        return None if raw is None else RankAck.parse(raw, what=f"rank {self.rank} report ack")


def engine_digest(ranks: Iterable[tuple[int, str]]) -> str:
    """One digest of an engine: SHA-256 over its ranks' digests in rank order."""
    h = hashlib.sha256()
    for _, digest in sorted(ranks):
        h.update(str(digest).encode())
    return h.hexdigest()


# -- engines, per engine -------------------------------------------------------------------------
def _written(entry: RankAck | RankReport) -> int:
    if isinstance(entry, RankAck):
        return entry.elements_written
    ack = entry.ack()
    return 0 if ack is None else ack.elements_written


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineAck(Message):
    """An engine's answer to an attempt (all its ranks): ``ok`` only when every rank's is,
    ``error`` naming each failed rank; `ranks` holds each rank's `RankAck` (the ``dcr_*``
    channels) or `RankReport` (the native backend). `pipelined`: applied as payloads arrived;
    `fetch_s`: until the last payload arrived (applies overlap), `apply_s`: the tail after it."""

    NAME = "engine ACK"
    ok: bool
    error: str | None = None
    ranks: tuple[Any, ...] = ()
    pipelined: bool = False
    fetch_s: float = 0.0
    apply_s: float = 0.0
    fetched_bytes: int = 0
    payloads: int = 0
    elements_written: int = 0

    @classmethod
    def merge(cls, ranks: Sequence[RankAck | RankReport], **measured: Any) -> EngineAck:
        """The merge rule: one ACK from every rank's (`measured`: the handle's own figures,
        `pipelined`, `fetch_s`, `apply_s`, `fetched_bytes`, `payloads`)."""
        errors = [f"rank {r.rank}: {r.error}" for r in ranks if not r.ok]
        return cls(
            ok=not errors,
            error="; ".join(errors) or None,
            ranks=tuple(ranks),
            elements_written=sum(_written(r) for r in ranks),
            **measured,
        )

    @classmethod
    def failed(cls, error: str) -> EngineAck:
        """An attempt the engine answered with an error before any rank ACKed."""
        return cls(ok=False, error=error)

    @classmethod
    def parse(cls, raw: Any, *, what: str | None = None) -> EngineAck:
        """As `Message.parse`; each entry of ``ranks`` keeps its kind (a `RankReport` has a
        ``world_size``, a `RankAck` an ``attempt``)."""
        if isinstance(raw, cls):
            return raw
        name = what or cls.NAME
        msg = super(EngineAck, cls).parse(raw, what=name)
        entries = tuple(
            RankReport.parse(r, what=f"{name}: ranks[{i}]")
            if isinstance(r, Mapping) and "world_size" in r
            else RankAck.parse(r, what=f"{name}: ranks[{i}]")
            for i, r in enumerate(msg.ranks)
        )
        return dataclasses.replace(msg, ranks=entries)


# -- owners --------------------------------------------------------------------------------------
class OwnerOp(StrEnum):
    """The owner service's ops (a job may register more: `OwnerService.handlers`)."""

    BUILD = "build"
    VERIFY = "verify"
    COMMIT = "commit"
    ABORT = "abort"
    STATUS = "status"
    STOP = "stop"


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerRequest(_Versioned):
    """One request to the owner service: the op, its version and attempt where it has them
    (`retry`: a build of overwrites only); a job's own ops carry their fields in `extra`."""

    NAME = "owner request"
    EXTRA = True
    op: str
    version: int | None = None
    attempt: int | None = None
    retry: bool = False
    protocol: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def require(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise ProtocolError(f"{self.NAME} {self.op!r}: missing field {name!r}")
        return int(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerReply(_Versioned):
    """The owner service's answer to one request: ``ok``, or ``error`` with ``error_type`` (the
    name of a class of the DCR error tree, `raise_for`); the op's own fields are in `extra`."""

    NAME = "owner reply"
    EXTRA = True
    ok: bool
    error: str | None = None
    error_type: str | None = None
    seconds: float = 0.0
    protocol: int = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def raise_for(self, op: str) -> None:
        """Raise the reply's error as its DCR class (`DCRError` for any other name)."""
        if not self.ok:
            error: type[DCRError] = error_class(self.error_type or "")
            raise error(f"owner service {op!r} failed: {self.error}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildReply(Message):
    """The owners built and published an attempt: the baseline it is a delta on, what was sent
    (`payloads`, `payload_bytes`), the slowest rank's construction (`build_s`) and the share
    of elements whose bits changed."""

    NAME = "build reply"
    baseline_id: str
    version: int = 0
    attempt: int = 0
    retry: bool = False
    payload_bytes: int = 0
    payloads: int = 0
    build_s: float = 0.0
    element_change_rate: float = 0.0


class Guard(StrEnum):
    """How the candidate guard answered: every shard ``scanned``; ``held`` (the service held
    the training thread since the build, nothing could move the weights); ``off``."""

    OFF = "off"
    HELD = "held"
    SCANNED = "scanned"


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyReply(Message):
    """The candidate guard passed for `version`."""

    NAME = "verify reply"
    version: int
    guard: Guard


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitReply(Message):
    """The owners' committed version after a commit (the trackers may advance right after the
    reply, before the next request is read)."""

    NAME = "commit reply"
    committed_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortReply(Message):
    NAME = "abort reply"
    committed_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusReply(Message):
    """The owners' committed version, the version built and not yet committed, the world size."""

    NAME = "status reply"
    committed_version: int
    candidate: int | None = None
    world: int = 1


#: the reply body of each built-in op
OWNER_REPLIES: dict[str, type[Message]] = {
    OwnerOp.BUILD: BuildReply,
    OwnerOp.VERIFY: VerifyReply,
    OwnerOp.COMMIT: CommitReply,
    OwnerOp.ABORT: AbortReply,
    OwnerOp.STATUS: StatusReply,
}

#: every message class, for tables and tests
MESSAGES: tuple[type[Message], ...] = (
    AckTimings,
    RankAck,
    RankReply,
    FetchReply,
    DigestReply,
    RankReport,
    EngineAck,
    OwnerRequest,
    OwnerReply,
    BuildReply,
    VerifyReply,
    CommitReply,
    AbortReply,
    StatusReply,
)
