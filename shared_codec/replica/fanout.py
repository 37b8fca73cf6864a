"""Read once per cluster: the replica is the rollout cluster's one fetcher. It reads each
attempt's payloads from the object store once (streaming: each payload as its object appears)
and forwards each at once to the root of the cluster's relay tree, whose nodes spool them for
the engines on their hosts (engines read a ``spool`` source); after the store's seal it
completes the attempt on the tree with the same payload ids and base version, so every node
spools exactly the sealed set. Bytes across the cluster boundary per refit: one payload set,
whatever the number of engines (docs/replica.md, "Read once per cluster").

Failure: an attempt abandoned at the store (the coordinator's abandon after a failed build), a
missing or foreign payload, or the store's timeout abandons the attempt down the tree too, so
engines waiting on their spools stop at once; a tree that does not complete (a dead node) is a
`TransportError` naming it: the replica's ACK fails and the coordinator retries.

Limitations:
1. Payloads are forwarded before the replica validates them (each engine validates what it
   stages, as with any transport); the replica's own stage validates the whole set after.
2. One relay sender per attempt (a connection to the root per `apply`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from shared_codec.transport.base import PayloadSource, SealedAttempt
from shared_codec.transport.spec import TransportSpec

log = logging.getLogger("dcr.replica")


@dataclass(frozen=True, slots=True, kw_only=True)
class Forwarded:
    """What one attempt's fan-out read and sent: the payloads (in arrival order), the store's
    seal, the bytes read from the store (= bytes sent to the tree's root)."""

    payloads: tuple[bytes, ...]
    sealed: SealedAttempt
    bytes_in: int


def relay_attempt(
    source: PayloadSource,
    tree: TransportSpec,
    version: int,
    attempt: int,
    timeout_s: float,
    *,
    each: Callable[[bytes], None] | None = None,
) -> Forwarded:
    """Stream (`version`, `attempt`) from `source` into the relay tree `tree` (module
    docstring); the tree's completion acknowledgement has returned when this does. `each`
    is called with every payload after it is forwarded (the replica decodes it there); what
    it raises abandons the attempt down the tree and is raised."""
    from shared_codec.transport.relay.sender import sender_for

    sender = sender_for(tree, tree.timeout_s or 60.0)
    payloads: list[bytes] = []
    try:
        try:
            for p in source.stream(version, attempt, timeout_s):
                sender.send(p)
                payloads.append(p)
                if each is not None:
                    each(p)
            sealed = source.sealed(version, attempt, timeout_s)
        except Exception as e:  # stop the engines waiting on their spools, then fail
            try:
                sender.abandon(version, attempt, f"replica fetcher: {e}", timeout_s=10.0)
            except Exception as again:  # the tree is gone too: its nodes time out
                log.warning("could not abandon v%d a%d down the tree: %s", version, attempt, again)
            raise
        sender.flush()
        sender.complete(
            version, attempt, list(sealed.payload_ids), tree.timeout_s or 60.0,
            base_version=sealed.base_version,
        )  # fmt: skip
    finally:
        sender.close()
    return Forwarded(
        payloads=tuple(payloads), sealed=sealed, bytes_in=sum(len(p) for p in payloads)
    )


__all__ = ["Forwarded", "relay_attempt"]
