"""From an attempt's payloads to the writes the replica stages: decode and validate every
payload with the codec, then compute per canonical tensor the changed flat indices and their
staged bits (from the committed bits, read from the committed slot). The log record is the
payloads themselves (log.py); `touched_of` gives the indices a record names when it is read
back.

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
not written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared_codec.decode import decode_payload
from shared_codec.errors import ArgumentError, PayloadError
from shared_codec.format import Payload
from shared_codec.records import DeltaItem, Kind
from shared_codec.replica.layout import SlotFiles, TensorLoc
from shared_codec.replica.log import LogCorrupt, Touched, read_record


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


class AttemptDecoder:
    """Decode and validate an attempt's payloads one by one, as they arrive (module docstring,
    1-4): a receiver decodes while it fetches, so its stage after the seal starts from decoded
    payloads. `add` raises `PayloadError` naming the payload and field for one refused.

    With `committed` (the committed slot, read-only; closed by `close`), `add` also computes
    each item's staged bits from the committed ones, so `changes` only concatenates them; when
    two items of a tensor may overlap (their index spans intersect: never for disjoint owners
    and buckets), `changes` computes everything again in (owner, sequence) order
    (`build_changes`), which also refuses an element XORed twice."""

    def __init__(
        self,
        *,
        version: int,
        attempt: int,
        base_version: int,
        layout: dict[str, TensorLoc],
        key: bytes | None,
        committed: SlotFiles | None = None,
    ) -> None:
        self.version, self.attempt, self.base_version = version, attempt, base_version
        self.layout, self.key, self.committed = layout, key, committed
        self._sizes = {name: loc.numel for name, loc in layout.items()}
        self._seen: dict[bytes, int] = {}
        self._decoded: list[Payload] = []
        # per tensor: (first index, last index, changed indices, their staged bits) per item
        self._parts: dict[str, list[tuple[int, int, np.ndarray, np.ndarray]]] = {}
        #: the payloads as received, in arrival order (what the log records)
        self.payloads: list[bytes] = []

    def __enter__(self) -> AttemptDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.committed is not None:
            self.committed.close()

    def add(self, data: bytes) -> None:
        i = len(self.payloads)
        p = decode_payload(data, key=self.key, destinations=self._sizes)
        label = f"payload {p.header.payload_id_hex}"
        if p.payload_id in self._seen:
            raise PayloadError(
                f"{label}: field payload_id: payloads[{i}] repeats "
                f"payloads[{self._seen[p.payload_id]}] (a duplicate); nothing staged"
            )
        m = p.meta
        for field, got, want in (
            ("base_version", m.base_version, self.base_version),
            ("version", m.version, self.version),
            ("attempt", m.attempt, self.attempt),
        ):
            if got != want:
                raise PayloadError(
                    f"{label}: field {field}: {got}, the replica stages {field} {want} (a stale "
                    "or foreign payload); nothing staged"
                )
        for j, item in enumerate(p.items):
            loc = self.layout[item.name]
            if item.dtype != loc.dtype or tuple(item.shape) != loc.shape:
                raise PayloadError(
                    f"{label}: field items[{j}] ({item.name}): {item.dtype}{list(item.shape)}, "
                    f"the checkpoint holds {loc.dtype}{list(loc.shape)}; nothing staged"
                )
        self._seen[p.payload_id] = i
        self._decoded.append(p)
        self.payloads.append(data)
        if self.committed is not None:
            for item in p.items:
                if item.count:
                    idx = item.indices
                    old = self.committed.read(item.name, idx)
                    new = old ^ item.values if item.kind == Kind.XOR else item.values
                    keep = new != old
                    part = (int(idx[0]), int(idx[-1]), idx[keep], new[keep])
                    self._parts.setdefault(item.name, []).append(part)

    def changes(self, committed: SlotFiles) -> tuple[Change, ...]:
        """What the attempt writes (`build_changes` of the decoded payloads against
        `committed`), from the staged bits `add` computed when it could."""
        if self.committed is None or any(_spans_meet(ps) for ps in self._parts.values()):
            return build_changes(self.decoded(), attempt=self.attempt, committed=committed)
        out = []
        for name in sorted(self._parts):
            parts = sorted(self._parts[name], key=lambda t: t[0])
            idx = np.concatenate([t[2] for t in parts])
            if idx.size:
                out.append(
                    Change(name=name, indices=idx, new=np.concatenate([t[3] for t in parts]))
                )
        return tuple(out)

    def decoded(self) -> list[Payload]:
        """The payloads added so far, decoded, in (owner, sequence) order."""
        return sorted(self._decoded, key=lambda p: (p.meta.owner, p.meta.sequence))


def _spans_meet(parts: list[tuple[int, int, np.ndarray, np.ndarray]]) -> bool:
    """Whether two items' index spans [first, last] intersect (they may share an element)."""
    spans = sorted((t[0], t[1]) for t in parts)
    return any(b[0] <= a[1] for a, b in zip(spans, spans[1:], strict=False))


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
    decoder = AttemptDecoder(
        version=version, attempt=attempt, base_version=base_version, layout=layout, key=key
    )
    for data in payloads:
        decoder.add(data)
    return decoder.decoded()


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


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Change:
    """One tensor's part of a staged attempt: sorted unique flat indices whose staged bits
    differ from the committed ones, and those staged bits."""

    name: str
    indices: np.ndarray
    new: np.ndarray


def _by_tensor(decoded: Sequence[Payload]) -> dict[str, list[tuple[str, DeltaItem]]]:
    by_tensor: dict[str, list[tuple[str, DeltaItem]]] = {}
    for p in decoded:
        for item in p.items:
            if item.count:
                by_tensor.setdefault(item.name, []).append((p.header.payload_id_hex, item))
    return by_tensor


def touched_of(decoded: Sequence[Payload]) -> tuple[Touched, ...]:
    """Per tensor (sorted by name) the sorted unique indices the decoded payloads' items name:
    every element a staged attempt may have written."""
    by_tensor = _by_tensor(decoded)
    return tuple(Touched(name=n, indices=_merged(by_tensor[n])[0]) for n in sorted(by_tensor))


def read_decoded(
    log_dir: Path, version: int, attempt: int, layout: dict[str, TensorLoc], key: bytes | None
) -> list[Payload]:
    """The payloads of the record of (`version`, `attempt`) read back from the log and decoded
    again (`LogCorrupt` when the record is missing, torn, foreign or refused)."""
    rec = read_record(log_dir, version, attempt)
    try:
        return decode_attempt(
            rec.payloads, version=version, attempt=attempt, base_version=rec.base_version,
            layout=layout, key=key,
        )  # fmt: skip
    except PayloadError as e:
        raise LogCorrupt(f"record v{version}/a{attempt}: a payload is refused: {e}") from None


def read_touched(
    log_dir: Path, version: int, attempt: int, *, layout: dict[str, TensorLoc], key: bytes | None
) -> tuple[Touched, ...]:
    """`touched_of` the record of (`version`, `attempt`) read back from the log."""
    return touched_of(read_decoded(log_dir, version, attempt, layout, key))


def build_changes(
    decoded: Sequence[Payload], *, attempt: int, committed: SlotFiles
) -> tuple[Change, ...]:
    """What the attempt writes: per tensor (sorted by name), the elements it changes and their
    staged bits (from the committed bits read from `committed`); `PayloadError` (nothing
    written) for an element XORed twice. O(entries) memory."""
    by_tensor = _by_tensor(decoded)
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
            changes.append(Change(name=name, indices=idx[keep], new=new[keep]))
    return tuple(changes)
