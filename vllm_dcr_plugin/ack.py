"""The ACK of an apply: what one rank reports for (part of) an attempt.

Contract: `Tally` is the mutable count an apply keeps while it runs; `Tally.ack` freezes it into
an `Ack`; `Ack.to_dict` is the plain reply of ``dcr_apply`` (and ``dcr_fetch``'s ``"ack"``) as
docs/protocol.md lists it; `Ack.merge` folds the ACKs of one attempt applied in several parts
(pipelined fetch) into one.

Limitations:
1. ``timings.total_s`` is present only when the apply ran to its end (also when the post-apply
   check then failed it); a merged ACK always has it (the parts' sum).
2. ``timings.apply_cpu_s`` is the applying thread's CPU time over the spans of ``apply_s``: the
   apply's work without the waits for a core that ``apply_s`` includes when other processes
   (a pipelined build on the same machine) compete for the CPUs. Work in other threads (torch
   intra-op pools) is not in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared_codec.errors import ProtocolError

_COUNTS = (
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
class Ack:
    """One rank's reply for (part of) an attempt. `post_apply_mismatches` is None unless
    `verified`; `partial_item` names the item a loader failure may have left half-written;
    `plan_items` / `loader_items`: items replayed through the placement plan / applied through
    ``load_weights``; `fallbacks`: direct-path items that went through the loader, by reason
    (apply.apply_staged); `pipelined_parts` is set on merged ACKs only."""

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
    decode_s: float = 0.0
    apply_s: float = 0.0
    apply_cpu_s: float = 0.0
    total_s: float | None = None
    error: str | None = None
    partial_item: str | None = None
    pipelined_parts: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The plain reply (key order and keys as the protocol has always sent them)."""
        timings = {
            "decode_s": self.decode_s,
            "apply_s": self.apply_s,
            "apply_cpu_s": self.apply_cpu_s,
        }
        if self.total_s is not None:
            timings["total_s"] = self.total_s
        out: dict[str, Any] = {
            "ok": self.ok,
            "attempt": self.attempt,
            "rank": self.rank,
            "target_version": self.target_version,
            **{k: getattr(self, k) for k in _COUNTS},
            "fallbacks": dict(self.fallbacks),
            "post_apply_mismatches": self.post_apply_mismatches,
            "verified": self.verified,
            "timings": timings,
            "error": self.error,
            "partial_item": self.partial_item,
        }
        if self.pipelined_parts is not None:
            out["pipelined_parts"] = self.pipelined_parts
        return out

    @classmethod
    def merge(cls, acks: Sequence[Ack]) -> Ack:
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
            **{k: sum(getattr(a, k) for a in acks) for k in _COUNTS},
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
            decode_s=sum(a.decode_s for a in acks),
            apply_s=sum(a.apply_s for a in acks),
            apply_cpu_s=sum(a.apply_cpu_s for a in acks),
            total_s=sum(a.total_s or 0.0 for a in acks),
            error=bad.error if bad is not None else last.error,
            partial_item=bad.partial_item if bad is not None else last.partial_item,
            pipelined_parts=len(acks),
        )


@dataclass(slots=True, kw_only=True)
class Tally:
    """What an apply has done so far (mutable while it runs); `ack` freezes it."""

    attempt: int
    rank: int
    target_version: int | None
    verify: bool
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
    mismatches: int = 0
    decode_s: float = 0.0
    apply_s: float = 0.0
    apply_cpu_s: float = 0.0
    total_s: float | None = None
    partial_item: str | None = None
    touched: bool = False  # a batch reached the loader: weights may have changed

    def ack(self, *, ok: bool, error: str | None = None) -> Ack:
        return Ack(
            ok=ok,
            attempt=self.attempt,
            rank=self.rank,
            target_version=self.target_version,
            **{k: getattr(self, k) for k in _COUNTS},
            fallbacks=dict(self.fallbacks),
            post_apply_mismatches=self.mismatches if self.verify else None,
            verified=self.verify,
            decode_s=self.decode_s,
            apply_s=self.apply_s,
            apply_cpu_s=self.apply_cpu_s,
            total_s=self.total_s,
            error=error,
            partial_item=self.partial_item,
        )
