"""From an attempt's payloads to the log record the replica writes: decode and validate every
payload with the codec, then compute per canonical tensor the changed flat indices, their
committed bits (read from the committed slot) and their staged bits.

Validation, all before anything is written (a refusal changes nothing):
1. each payload decodes (`decode.decode_payload`: digest, keyed when the store has a secret,
   format, payload id, every length and index, the body) against the checkpoint's tensor sizes;
2. its header's version, attempt and base version are the stage's (`base_version` is the
   replica's committed version: a stale or foreign payload is refused);
3. every item's dtype and shape are its destination tensor's;
4. no payload id appears twice, and no element is XORed by two items of the attempt (applying
   a repeated XOR would restore the old bits: docs/protocol.md, "Exactly once").

Items are applied in (owner, sequence) order, as receivers do: an XOR item flips the bits it
names, an OVERWRITE item sets them; elements whose staged bits equal their committed bits are
dropped from the record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared_codec.decode import decode_payload
from shared_codec.errors import ArgumentError, PayloadError
from shared_codec.format import Payload
from shared_codec.records import DeltaItem, Kind
from shared_codec.replica.layout import SlotFiles, TensorLoc
from shared_codec.replica.log import Record, TensorChange


def nonneg(value: Any, what: str) -> int:
    """`value` when it is an int in [0, 2^63), else `ArgumentError` naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ArgumentError(f"{what} must be an integer in [0, 2^63), got {value!r}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class StageResult:
    """What a stage wrote: the staged (version, attempt) over `base_version` and how much it
    changed (the staged state's digest is `ReplicaStore.digest(version)`, hashed on demand)."""

    version: int
    attempt: int
    base_version: int
    payloads: int
    tensors: int
    elements: int
    seconds: float


def decode_attempt(
    payloads: Sequence[bytes],
    *,
    version: int,
    attempt: int,
    base_version: int,
    layout: dict[str, TensorLoc],
    key: bytes | None,
) -> list[Payload]:
    """The decoded payloads of (version, attempt) in (owner, sequence) order; `PayloadError`
    naming the payload and field for the first one refused (module docstring, 1-4)."""
    sizes = {name: loc.numel for name, loc in layout.items()}
    seen: dict[bytes, int] = {}
    out: list[Payload] = []
    for i, data in enumerate(payloads):
        p = decode_payload(data, key=key, destinations=sizes)
        label = f"payload {p.header.payload_id_hex}"
        if p.payload_id in seen:
            raise PayloadError(
                f"{label}: field payload_id: payloads[{i}] repeats payloads[{seen[p.payload_id]}]"
                " (a duplicate); nothing staged"
            )
        seen[p.payload_id] = i
        m = p.meta
        for field, got, want in (
            ("base_version", m.base_version, base_version),
            ("version", m.version, version),
            ("attempt", m.attempt, attempt),
        ):
            if got != want:
                raise PayloadError(
                    f"{label}: field {field}: {got}, the replica stages {field} {want} (a stale "
                    "or foreign payload); nothing staged"
                )
        for j, item in enumerate(p.items):
            loc = layout[item.name]
            if item.dtype != loc.dtype or tuple(item.shape) != loc.shape:
                raise PayloadError(
                    f"{label}: field items[{j}] ({item.name}): {item.dtype}{list(item.shape)}, "
                    f"the checkpoint holds {loc.dtype}{list(loc.shape)}; nothing staged"
                )
        out.append(p)
    out.sort(key=lambda p: (p.meta.owner, p.meta.sequence))
    return out


def _merged(items: list[tuple[str, DeltaItem]]) -> tuple[np.ndarray, list[Any]]:
    """The sorted unique indices the items of one tensor name, and where each item's indices
    are in them. Items whose index ranges follow each other (one item, or a tensor split
    across buckets: the usual cases; each item's indices are strictly increasing, as
    `locations.decode_locations` checks) are concatenated as they are; overlapping ones merge
    with a sort."""
    spans = [it.indices for _, it in items]
    if all(a[-1] < b[0] for a, b in zip(spans, spans[1:], strict=False) if a.size and b.size):
        ends = np.cumsum([0, *(s.shape[0] for s in spans)])
        return np.concatenate(spans), [slice(a, b) for a, b in zip(ends, ends[1:], strict=False)]
    idx = np.unique(np.concatenate(spans))
    return idx, [np.searchsorted(idx, s) for s in spans]


def build_record(
    decoded: Sequence[Payload],
    *,
    version: int,
    attempt: int,
    base_version: int,
    committed: SlotFiles,
) -> Record:
    """The record of the attempt: per tensor (sorted by name), the elements it changes with
    their committed bits (read from `committed`) and staged bits. O(entries) memory."""
    by_tensor: dict[str, list[tuple[str, DeltaItem]]] = {}
    for p in decoded:
        for item in p.items:
            if item.count:
                by_tensor.setdefault(item.name, []).append((p.header.payload_id_hex, item))
    changes = []
    for name in sorted(by_tensor):
        items = by_tensor[name]
        idx, at = _merged(items)
        old = committed.read(name, idx)
        new = old.copy()
        xored = np.zeros(idx.shape[0], dtype=bool)
        for (pid, it), pos in zip(items, at, strict=True):
            if it.kind == Kind.XOR:
                again = np.flatnonzero(xored[pos])
                if again.size:
                    raise PayloadError(
                        f"payload {pid}: field items ({name}).indices: element "
                        f"{int(it.indices[again[0]])} is already XORed by another item of "
                        f"attempt {attempt}; nothing staged"
                    )
                xored[pos] = True
                new[pos] ^= it.values
            else:
                new[pos] = it.values
        keep = new != old
        if keep.any():
            changes.append(
                TensorChange(
                    name=name,
                    dtype=items[0][1].dtype,
                    indices=idx[keep],
                    old=old[keep],
                    new=new[keep],
                )  # fmt: skip
            )
    return Record(
        version=version, base_version=base_version, attempt=attempt, changes=tuple(changes)
    )
