"""`publish_attempt`: one process publishing a whole attempt for every owner it holds, through
the transport's own sinks (base.py, call order): each owner's payloads into its sink
(``send``, then ``finish``: durable at the first hop), then the seal naming every owner and
every payload id. For owner groups that live in one process (a framework's named-tensor
owner, benchmarks, labelled test stand-ins); the ranks of a trainer job each open their own
sink and rank 0 seals (megatron_dcr_hooks.service).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shared_codec.transport.base import Seal
from shared_codec.transport.spec import open_sink


def publish_attempt(
    spec: Any,
    *,
    version: int,
    attempt: int,
    base_version: int,
    payloads: Mapping[int, Sequence[bytes]],
) -> tuple[str, ...]:
    """Send `payloads` (owner -> that owner's payloads, each encoded for (`version`,
    `attempt`) by that owner) on the transport `spec` names, then seal the attempt on
    `base_version`. Returns the payload ids the seal lists, owner by owner."""
    ids: list[str] = []
    for owner in sorted(payloads):
        with open_sink(spec, version=version, attempt=attempt, owner=owner) as sink:
            for p in payloads[owner]:
                sink.send(p)
            ids += sink.finish().payload_ids
    with open_sink(spec, version=version, attempt=attempt) as sink:
        sink.seal(
            Seal(base_version=base_version, owners=tuple(sorted(payloads)), payload_ids=tuple(ids))
        )
    return tuple(ids)


__all__ = ["publish_attempt"]
