"""Staging: validate, deduplicate and hold payloads (compressed, in host memory) until apply.

`StagingArea.stage` checks each payload completely before keeping it: digest and key, format,
payload id, that its base version is the receiver's committed version, that its attempt is not
fenced, that every item names a tensor of the prewarm table with the same dtype and shape, that
XOR items only target tensors whose loader path takes XOR, and that the body decodes. Everything
but the last is checked on the header alone, before the body is decompressed: an item's count is
at most its shape's numel (format.py), so a payload declaring more entries than its destination
tensor holds is rejected before any body-sized allocation, and decoding memory stays within a
fixed multiple of the destination tensors' sizes (docs/format.md, "Decoder bounds"). A rejected
payload is not kept and changes nothing; a payload whose id was already staged or applied in the
current transition is reported as a duplicate and dropped (XOR twice would restore old bits).

Decoded records are kept next to the compressed bytes while their total raw size stays within
`keep_decoded_bytes` (default 256 MiB), so apply does not decode twice; beyond that budget only
the compressed bytes are kept and apply decodes again (staging memory = compressed size).

Also here: `tensor_specs` (the prewarm table, validated: `ProtocolError` for a malformed one)
and `key_from_env` (the payload secret, ``DCR_PAYLOAD_KEY``).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import Any

from shared_codec.dtypes import dtype_of
from shared_codec.errors import PayloadError, ProtocolError
from shared_codec.format import (
    DEFAULT_MAX_BODY,
    MAX_KEY_SIZE,
    Payload,
    PayloadHeader,
    decode_body,
    peek_header,
)
from shared_codec.records import Kind


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A canonical tensor as prewarm registered it."""

    dtype: str
    shape: tuple[int, ...]


KEY_ENV = "DCR_PAYLOAD_KEY"


def key_from_env() -> bytes | None:
    """The shared payload secret from ``DCR_PAYLOAD_KEY`` (hex, 1 to 64 bytes), if set;
    `ProtocolError` for anything else (not hex, or too long for a BLAKE2b key)."""
    raw = os.environ.get(KEY_ENV, "").strip()
    if not raw:
        return None
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise ProtocolError(f"{KEY_ENV} must be hex-encoded") from None
    if len(key) > MAX_KEY_SIZE:
        raise ProtocolError(
            f"{KEY_ENV} is {len(key)} bytes; a payload key is at most {MAX_KEY_SIZE}"
        )
    return key


def tensor_specs(table: object) -> dict[str, TensorSpec]:
    """The prewarm table ``[[name, dtype, shape], ...]`` as specs by name; `ProtocolError` (with
    the offending entry) for anything else: a non-list, a bad entry, a dtype the codec does not
    carry, a negative or non-integer dimension."""
    if not isinstance(table, list | tuple):
        raise ProtocolError(f"tensors must be a list of [name, dtype, shape], got {table!r:.80}")
    specs: dict[str, TensorSpec] = {}
    for entry in table:
        try:
            name, dtype, shape = entry
            if not isinstance(name, str) or not isinstance(shape, list | tuple):
                raise TypeError("name must be a string and shape a list")
            dims = tuple(_dim(s) for s in shape)
            specs[name] = TensorSpec(dtype_of(str(dtype)).name, dims)
        except (TypeError, ValueError, KeyError) as e:
            raise ProtocolError(f"bad tensor entry {entry!r:.120}: {e}") from None
    return specs


def _dim(s: Any) -> int:
    n = operator.index(s) if not isinstance(s, bool) else -1  # ints, numpy ints; not "3", 3.0
    if n < 0:
        raise ValueError(f"dimension {s!r} is not a non-negative integer")
    return int(n)


@dataclass
class StagedPayload:
    header: PayloadHeader
    data: bytes
    decoded: Payload | None = None


@dataclass
class StagingArea:
    """Per-receiver store of staged payloads, keyed by attempt then payload id."""

    key: bytes | None = None
    max_body: int = DEFAULT_MAX_BODY
    keep_decoded_bytes: int = 256 << 20
    staged: dict[int, dict[bytes, StagedPayload]] = field(default_factory=dict)
    applied_ids: set[bytes] = field(default_factory=set)
    fenced: set[int] = field(default_factory=set)

    decoded_bytes: int = 0  # raw bytes of the decoded records currently kept

    @property
    def staged_bytes(self) -> int:
        return sum(len(p.data) for per in self.staged.values() for p in per.values())

    def stage(
        self,
        payloads: list[bytes],
        *,
        committed_version: int,
        tensors: dict[str, TensorSpec],
        no_xor: set[str],
        unsupported: set[str],
    ) -> dict:
        """Validate and keep `payloads`; returns {"staged", "duplicates", "rejected"}.

        ``staged`` and ``duplicates`` are lists of payload ids (hex); ``rejected`` is a list of
        {"index", "payload_id", "reason"} in input order.
        """
        out: dict[str, list] = {"staged": [], "duplicates": [], "rejected": []}
        for i, raw in enumerate(payloads):
            try:
                if not isinstance(raw, bytes | bytearray | memoryview):
                    raise PayloadError(f"payload <{type(raw).__name__}>: field data: not bytes")
                data = bytes(raw)
                h = peek_header(data, key=self.key)
            except PayloadError as e:
                out["rejected"].append({"index": i, "payload_id": None, "reason": str(e)})
                continue
            pid = h.payload_id_hex
            # header against the destinations first: nothing body-sized is allocated for a
            # payload that names, shapes or sizes a tensor this receiver does not hold
            reason = self._check(h, committed_version, tensors, no_xor, unsupported)
            if not reason:
                try:
                    payload = decode_body(data, h, max_body=self.max_body)
                except PayloadError as e:
                    reason = str(e)
            if reason:
                out["rejected"].append({"index": i, "payload_id": pid, "reason": reason})
                continue
            per = self.staged.setdefault(h.meta.attempt, {})
            if h.payload_id in per or h.payload_id in self.applied_ids:
                out["duplicates"].append(pid)
                continue
            keep = self.decoded_bytes + h.body_raw_len <= self.keep_decoded_bytes
            if keep:
                self.decoded_bytes += h.body_raw_len
            per[h.payload_id] = StagedPayload(h, data, payload if keep else None)
            out["staged"].append(pid)
        return out

    def _check(
        self,
        h: PayloadHeader,
        committed_version: int,
        tensors: dict[str, TensorSpec],
        no_xor: set[str],
        unsupported: set[str],
    ) -> str | None:
        pid = h.payload_id_hex
        m = h.meta
        if m.base_version != committed_version:
            return (
                f"payload {pid}: base version {m.base_version} != committed version "
                f"{committed_version} (stale or foreign delta)"
            )
        if m.version <= m.base_version:
            return f"payload {pid}: target version {m.version} <= base version {m.base_version}"
        if m.attempt in self.fenced:
            return f"payload {pid}: attempt {m.attempt} was aborted (fenced)"
        for e in h.items:
            spec = tensors.get(e.name)
            if spec is None:
                return f"payload {pid}: unknown tensor {e.name!r} (not in the prewarm table)"
            if spec.dtype != e.dtype or spec.shape != e.shape:
                return (
                    f"payload {pid}: tensor {e.name} is {e.dtype}{list(e.shape)} in the payload, "
                    f"{spec.dtype}{list(spec.shape)} on this receiver"
                )
            if e.name in unsupported:
                return f"payload {pid}: tensor {e.name} has an unsupported loader path (prewarm)"
            if e.kind == Kind.XOR and e.name in no_xor:
                return f"payload {pid}: XOR item for {e.name}, whose loader path needs overwrites"
        return None

    def take(self, attempt: int) -> list[StagedPayload]:
        """The staged payloads of `attempt` in (owner, sequence) order (still held)."""
        per = self.staged.get(attempt, {})
        return sorted(per.values(), key=lambda p: (p.header.meta.owner, p.header.meta.sequence))

    def _drop(self, sp: StagedPayload | None) -> None:
        if sp is not None and sp.decoded is not None:
            self.decoded_bytes -= sp.header.body_raw_len

    def mark_applied(self, attempt: int, payload_id: bytes) -> None:
        self.applied_ids.add(payload_id)
        self._drop(self.staged.get(attempt, {}).pop(payload_id, None))

    def fence(self, attempt: int) -> int:
        """Abort `attempt`: drop its staged payloads and refuse its late ones. Returns dropped."""
        self.fenced.add(attempt)
        dropped = self.staged.pop(attempt, {})
        for sp in dropped.values():
            self._drop(sp)
        return len(dropped)

    def new_transition(self) -> None:
        """Forget everything of the finished transition (after commit or dense load)."""
        self.staged.clear()
        self.applied_ids.clear()
        self.fenced.clear()
        self.decoded_bytes = 0
