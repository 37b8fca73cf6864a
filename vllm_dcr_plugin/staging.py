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

Exactly once: dedupe by payload id does not catch the same changes re-encoded under another
sequence number (another id), so staging also keeps a per-attempt XOR ledger (`XorLedger`: the
sorted canonical destination indices of every XOR item staged or applied in the attempt, 8
bytes per XOR element) and rejects, at stage time and before any write, a payload whose XOR
items address an element that another payload of the attempt (or another item of the same
payload) already XORs. And `take(attempt, expect=...)` refuses (`ProtocolError`, nothing
written) unless the attempt's staged and applied payloads are exactly the sealed set the
attempt's manifest names (`SealedSet`: ids and count, bound to version, attempt and base
version): a missing or an extra payload is named. The set a fetch read from the seal is
remembered per attempt (`seal`) so a later `dcr_apply` is held to it too.

Decoded records are kept next to the compressed bytes while their total raw size stays within
`keep_decoded_bytes` (default 256 MiB), so apply does not decode twice; beyond that budget only
the compressed bytes are kept and apply decodes again (staging memory = compressed size).

Also here: `tensor_specs` (the prewarm table, validated: `ProtocolError` for a malformed one).
The payload secret comes from the receiver's config (config.py, ``DCR_PAYLOAD_KEY``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared_codec.decode import decode_body
from shared_codec.dtypes import dtype_of
from shared_codec.errors import PayloadError, ProtocolError
from shared_codec.format import DEFAULT_MAX_BODY, ID_SIZE, Payload, PayloadHeader, peek_header
from shared_codec.records import Kind


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A canonical tensor as prewarm registered it."""

    dtype: str
    shape: tuple[int, ...]


def tensor_specs(table: object) -> dict[str, TensorSpec]:
    """The prewarm table ``[[name, dtype, shape], ...]`` as specs by name; `ProtocolError` (with
    the offending entry) for anything else: a non-list, a bad entry, a dtype the codec does not
    carry, a negative or non-integer dimension, a name listed twice."""
    if not isinstance(table, list | tuple):
        raise ProtocolError(f"tensors must be a list of [name, dtype, shape], got {table!r:.80}")
    specs: dict[str, TensorSpec] = {}
    for i, entry in enumerate(table):
        try:
            name, dtype, shape = entry
            if not isinstance(name, str) or not name or not isinstance(shape, list | tuple):
                raise TypeError("name must be a non-empty string and shape a list")
            if name in specs:
                raise ValueError(f"{name!r} is listed twice")
            dims = tuple(_dim(s) for s in shape)
            specs[name] = TensorSpec(dtype_of(str(dtype)).name, dims)
        except (TypeError, ValueError, KeyError) as e:
            raise ProtocolError(f"tensors[{i}]: bad tensor entry {entry!r:.120}: {e}") from None
    return specs


def _dim(s: Any) -> int:
    n = operator.index(s) if not isinstance(s, bool) else -1  # ints, numpy ints; not "3", 3.0
    if n < 0:
        raise ValueError(f"dimension {s!r} is not a non-negative integer")
    return int(n)


@dataclass(frozen=True, slots=True, kw_only=True)
class SealedSet:
    """The payload set an attempt's seal (manifest) names: exactly these payloads, and no
    others, may be applied for (`version`, `attempt`). `base_version` is None where the seal
    does not carry it (a relay spool's manifest notice); every staged payload is still checked
    against the committed version. Build it with `SealedSet.of` (validates the listing)."""

    version: int
    attempt: int
    base_version: int | None
    payload_ids: frozenset[bytes]

    @classmethod
    def of(
        cls,
        *,
        version: int,
        attempt: int,
        base_version: int | None,
        payload_ids: Iterable[str | bytes],
    ) -> SealedSet:
        """`ProtocolError` for a listing that names an id twice (the count would disagree
        with the set) or an id that is not 32 hex digits."""
        ids: list[bytes] = []
        for pid in payload_ids:
            try:
                raw = bytes.fromhex(pid) if isinstance(pid, str) else bytes(pid)
            except (TypeError, ValueError):
                raise ProtocolError(f"sealed payload id {pid!r:.80} is not hex") from None
            if len(raw) != ID_SIZE:
                raise ProtocolError(f"sealed payload id {pid!r:.80} is not {ID_SIZE} bytes")
            ids.append(raw)
        if len(set(ids)) != len(ids):
            twice = sorted({i.hex() for i in ids if ids.count(i) > 1})
            raise ProtocolError(
                f"version {version} attempt {attempt}: the seal lists {len(ids)} payloads but "
                f"only {len(set(ids))} distinct ids (listed twice: {', '.join(twice[:4])})"
            )
        return cls(
            version=int(version),
            attempt=int(attempt),
            base_version=None if base_version is None else int(base_version),
            payload_ids=frozenset(ids),
        )

    @property
    def count(self) -> int:
        return len(self.payload_ids)


@dataclass
class _TensorChunks:
    """One tensor's XOR chunks in a ledger: (payload id, sorted indices) with each chunk's
    first and last index in growing arrays, so a new chunk is compared only with the chunks
    whose index range meets its own (a tensor split over many payloads in index order costs one
    vectorised range test, not a loop over every earlier payload)."""

    pids: list[bytes] = field(default_factory=list)
    indices: list[np.ndarray] = field(default_factory=list)
    lo: np.ndarray = field(default_factory=lambda: np.empty(8, np.int64))
    hi: np.ndarray = field(default_factory=lambda: np.empty(8, np.int64))

    def append(self, pid: bytes, idx: np.ndarray) -> None:
        n = len(self.pids)
        if n == self.lo.size:
            self.lo, self.hi = np.resize(self.lo, 2 * n), np.resize(self.hi, 2 * n)
        self.lo[n], self.hi[n] = idx[0], idx[-1]
        self.pids.append(pid)
        self.indices.append(idx)

    def overlap(self, idx: np.ndarray) -> tuple[bytes, int] | None:
        """(payload id, element) of a chunk sharing an element with `idx`, or None."""
        n = len(self.pids)
        near = np.flatnonzero((self.hi[:n] >= idx[0]) & (self.lo[:n] <= idx[-1]))
        for k in near.tolist():
            hit = _overlap(self.indices[k], idx)
            if hit is not None:
                return self.pids[k], hit
        return None


@dataclass
class XorLedger:
    """The destination elements one attempt XORs, per canonical tensor: (payload id, sorted
    int64 indices) chunks, one per XOR item. XOR is its own inverse, so an element XORed by two
    payloads of one attempt would end up with old bits; `conflict` finds that before a payload
    is kept. Memory: the indices (8 bytes per XOR element) plus 16 bytes per chunk."""

    chunks: dict[str, _TensorChunks] = field(default_factory=dict)

    def conflict(self, payload: Payload) -> str | None:
        """Why `payload`'s XOR items cannot join this attempt (naming the tensor, the element
        and both payload ids), or None. Checks against every chunk of the attempt and among
        the payload's own items."""
        pid = payload.header.payload_id
        mine: dict[str, _TensorChunks] = {}
        for item in payload.items:
            if item.kind != Kind.XOR or not item.count:
                continue
            for chunks in (self.chunks.get(item.name), mine.get(item.name)):
                found = chunks.overlap(item.indices) if chunks is not None else None
                if found is not None:
                    other, element = found
                    who = "another of its own items" if other == pid else f"payload {other.hex()}"
                    return (
                        f"payload {pid.hex()}: XOR item for {item.name} addresses element "
                        f"{element} that {who} already XORs in attempt "
                        f"{payload.header.meta.attempt} (the same change under another id: "
                        "applying both would restore the old bits)"
                    )
            mine.setdefault(item.name, _TensorChunks()).append(pid, item.indices)
        return None

    def add(self, payload: Payload) -> None:
        pid = payload.header.payload_id
        for item in payload.items:
            if item.kind == Kind.XOR and item.count:
                self.chunks.setdefault(item.name, _TensorChunks()).append(pid, item.indices)

    @property
    def elements(self) -> int:
        return sum(int(a.size) for c in self.chunks.values() for a in c.indices)


def _overlap(a: np.ndarray, b: np.ndarray) -> int | None:
    """An element of both strictly increasing index arrays, or None (O(min log max))."""
    if not a.size or not b.size or a[-1] < b[0] or b[-1] < a[0]:
        return None
    small, big = (a, b) if a.size <= b.size else (b, a)
    pos = np.searchsorted(big, small)
    pos[pos == big.size] = big.size - 1
    hit = np.flatnonzero(big[pos] == small)
    return int(small[hit[0]]) if hit.size else None


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
    applied: dict[int, set[bytes]] = field(default_factory=dict)  # per attempt
    ledgers: dict[int, XorLedger] = field(default_factory=dict)  # per attempt
    sealed: dict[int, SealedSet] = field(default_factory=dict)  # per attempt, from a fetch

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
            ledger = self.ledgers.setdefault(h.meta.attempt, XorLedger())
            reason = ledger.conflict(payload)
            if reason:
                out["rejected"].append({"index": i, "payload_id": pid, "reason": reason})
                continue
            ledger.add(payload)
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

    def seal(self, sealed: SealedSet) -> None:
        """Remember the set the attempt's seal names (a fetch read it): `take` then holds the
        attempt to it. `ProtocolError` when a different set was recorded for the attempt."""
        known = self.sealed.get(sealed.attempt)
        if known is not None and known != sealed:
            raise ProtocolError(
                f"attempt {sealed.attempt}: the seal now names {sealed.count} payloads "
                f"(version {sealed.version}), {known.count} were recorded (version "
                f"{known.version}): two different manifests for one attempt"
            )
        self.sealed[sealed.attempt] = sealed

    def take(
        self, attempt: int, expect: SealedSet | None = None, *, complete: bool = True
    ) -> list[StagedPayload]:
        """The staged payloads of `attempt` in (owner, sequence) order (still held).

        With `expect` (or a set recorded by `seal`; both must agree), the attempt's staged and
        already applied payloads must be exactly the sealed set, every one for its version and
        base version: otherwise `ProtocolError` naming the missing and extra ids, nothing taken
        or changed. ``complete=False`` (a part of a pipelined attempt, more may follow): only
        payloads beyond the sealed set are refused."""
        per = self.staged.get(attempt, {})
        out = sorted(per.values(), key=lambda p: (p.header.meta.owner, p.header.meta.sequence))
        known = self.sealed.get(attempt)
        if expect is not None and known is not None and expect != known:
            raise ProtocolError(
                f"attempt {attempt}: the expected set ({expect.count} payloads, version "
                f"{expect.version}, base {expect.base_version}) differs from the seal the fetch "
                f"read ({known.count} payloads, version {known.version}, base "
                f"{known.base_version})"
            )
        expect = expect or known
        if expect is None:
            return out
        if expect.attempt != attempt:
            raise ProtocolError(f"expected set is for attempt {expect.attempt}, not {attempt}")
        have = set(per) | self.applied.get(attempt, set())
        missing = sorted(i.hex() for i in expect.payload_ids - have) if complete else []
        extra = sorted(i.hex() for i in have - expect.payload_ids)
        if missing or extra:
            raise ProtocolError(
                f"attempt {attempt} does not hold exactly its sealed set of {expect.count} "
                f"payloads (version {expect.version}): "
                + "; ".join(
                    f"{what} {len(ids)}: {', '.join(ids[:8])}{' ...' if len(ids) > 8 else ''}"
                    for what, ids in (("missing", missing), ("extra", extra))
                    if ids
                )
                + "; nothing was applied"
            )
        for p in out:
            m = p.header.meta
            if m.version != expect.version or (
                expect.base_version is not None and m.base_version != expect.base_version
            ):
                raise ProtocolError(
                    f"payload {p.header.payload_id_hex} is version {m.version} on base "
                    f"{m.base_version}; the sealed set is version {expect.version} on base "
                    f"{expect.base_version}"
                )
        return out

    def _drop(self, sp: StagedPayload | None) -> None:
        if sp is not None and sp.decoded is not None:
            self.decoded_bytes -= sp.header.body_raw_len

    def mark_applied(self, attempt: int, payload_id: bytes) -> None:
        self.applied_ids.add(payload_id)
        self.applied.setdefault(attempt, set()).add(payload_id)
        self._drop(self.staged.get(attempt, {}).pop(payload_id, None))

    def fence(self, attempt: int) -> int:
        """Abort `attempt`: drop its staged payloads and refuse its late ones. Returns dropped."""
        self.fenced.add(attempt)
        self.ledgers.pop(attempt, None)
        self.sealed.pop(attempt, None)
        dropped = self.staged.pop(attempt, {})
        for sp in dropped.values():
            self._drop(sp)
        return len(dropped)

    def new_transition(self) -> None:
        """Forget everything of the finished transition (after commit or dense load)."""
        self.staged.clear()
        self.applied_ids.clear()
        self.fenced.clear()
        self.applied.clear()
        self.ledgers.clear()
        self.sealed.clear()
        self.decoded_bytes = 0
