"""What an apply has done so far, and the ACK it ends with.

Contract: `Tally` is the mutable count an apply keeps while it runs; `Tally.ack` freezes it into
the control plane's `RankAck` (shared_codec.coordination.protocol), whose ``to_wire`` is the
plain reply of ``dcr_apply`` (and ``dcr_fetch``'s ``"ack"``) as docs/protocol.md lists it and
whose ``merge`` folds the ACKs of one attempt applied in several parts (pipelined fetch).

Limitations:
1. ``timings.total_s`` is present only when the apply ran to its end (also when the post-apply
   check then failed it); a merged ACK always has it (the parts' sum).
2. ``timings.apply_cpu_s`` is the applying thread's CPU time over the spans of ``apply_s``: the
   apply's work without the waits for a core that ``apply_s`` includes when other processes
   (a pipelined build on the same machine) compete for the CPUs. Work in other threads (torch
   intra-op pools) is not in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared_codec.coordination.protocol import ACK_COUNTS, AckTimings, RankAck


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

    def ack(self, *, ok: bool, error: str | None = None) -> RankAck:
        return RankAck(
            ok=ok,
            attempt=self.attempt,
            rank=self.rank,
            target_version=self.target_version,
            **{k: getattr(self, k) for k in ACK_COUNTS},
            fallbacks=dict(self.fallbacks),
            post_apply_mismatches=self.mismatches if self.verify else None,
            verified=self.verify,
            timings=AckTimings(
                decode_s=self.decode_s,
                apply_s=self.apply_s,
                apply_cpu_s=self.apply_cpu_s,
                total_s=self.total_s,
            ),
            error=error,
            partial_item=self.partial_item,
        )
