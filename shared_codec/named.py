"""The named-tensor owner: DCR's owners for trainers that hand over HF-named full tensors.

RL frameworks own their training loop and hand weights to a plug point as a stream of
Hugging Face named full tensors (a Megatron-Bridge export, an FSDP2 full state dict, an HF
model's ``named_parameters()``), never as Megatron shards. `NamedTensorOwner` takes such a
stream, diffs it by stored bits against a host baseline of the committed canonical checkpoint,
and is the coordinator's `Owners` (shared_codec.coordination.participants): the same payloads
under the same commit protocol as the owner-local Megatron hook (megatron_dcr_hooks.hook). Call order:

1. ``take_weights(source)`` on every rank that iterates the stream (collective over `group`):
   the candidate of the next version. `source` yields ``(name, tensor)`` pairs: any iterable,
   or a vLLM `WeightSource` (a rank that does not hold a name gets ``(name, None)``; pass its
   ``held_names()`` to the constructor: only holders own a name). Every canonical tensor must come exactly
   once, with the canonical dtype and shape.
2. the coordinator, on rank 0 (``group`` rank 0): ``build(version, attempt, retry)`` publishes
   one payload set per owner rank on the transport (mixed XOR/overwrite records in bounded
   buckets, through the pipelined sink, then the seal); ``verify``; ``commit`` or ``abort``.

Work split: each canonical tensor has one owner rank, ``stable_hash(name)`` over the ranks
that hold it, which keeps its baseline and scans it; every other rank drops the tensor at
once. With a `group` of several ranks, each rank's changed set goes to rank 0 within
``take_weights`` (DCR payload bytes over the host group, no pickle), where the builds encode
it. With no group, one rank does everything.

Guarantees:
1. Bad input changes nothing: a name not in the baseline, a tensor of another dtype or shape,
   a name twice, a canonical tensor missing from the stream (on any rank) raises
   `ArgumentError` naming it on every rank, after the stream is consumed (the iteration is a
   collective; stopping early would leave the other ranks waiting); the committed baseline
   is kept, no candidate is held (a transition then fails at its build, publishing nothing).
2. Records take the committed bits to the stream's bits exactly: XOR (mode X) where the
   receivers take XOR for that tensor (not in ``overwrite_only``) and not a retry; overwrites
   otherwise. A retry re-emits the complete changed set as overwrites.
3. The baseline advances only at ``commit`` (rank 0 at once, the other ranks at the next
   ``take_weights``, which learns the committed version from rank 0 before it reads anything);
   a failed transition leaves it at the committed version, and the next stream is diffed
   against that: a skipped or failed step needs nothing special.
4. The candidate is a copy of the changed bits, not of the trainer's tensors: nothing the
   trainer does after ``take_weights`` can change what the attempts send (``verify`` checks
   the protocol only).

Limitations:
1. Host memory: the owned share of the canonical checkpoint (the baseline), plus the changed
   set (indices and new bits, ~10-12 bytes per changed element) from ``take_weights`` to the
   commit; rank 0 holds every rank's changed set, twice (new bits and XOR masks).
2. Floating tensors are compared as stored: a stream in another dtype than the baseline is
   refused, never cast (a dense load would round it; DCR does not guess the rounding).
3. Rank 0 encodes every owner's payloads (the scan, the costly part, is split).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shared_codec.buckets import DEFAULT_BUCKET_BYTES, BucketConfig, encode_items
from shared_codec.checkpoint import iter_checkpoint
from shared_codec.coordination.protocol import BuildReply
from shared_codec.decode import decode_payload
from shared_codec.dtypes import tensor_bits
from shared_codec.errors import ArgumentError, ProtocolError
from shared_codec.format import PayloadMeta
from shared_codec.kernels import set_scatter
from shared_codec.records import DeltaItem, Kind, make_item
from shared_codec.scan import DeviceScan, changed_bits, stable_hash
from shared_codec.stream import PayloadStream
from shared_codec.transport.base import Seal
from shared_codec.transport.spec import Role, TransportSpec

log = logging.getLogger("dcr.named")

#: a changed set of one tensor: (flat indices, new stored bits, XOR of old and new bits)
Change = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True, kw_only=True)
class NamedOwnerConfig:
    """How a `NamedTensorOwner` encodes (the payload settings of
    megatron_dcr_hooks' `DCRConfig`).

    `xor`: mixed XOR/overwrite records (mode X); False: overwrites only (mode P).
    `overwrite_only`: canonical tensors the receivers cannot take XOR for (union of their
    prewarm reports). `bucket_bytes` / `min_bucket_bytes` / `key` / `paper_codec` /
    `encode_threads`: the payload buckets (`shared_codec.buckets`). `queue_depth`: payloads
    buffered between encoding and the sink."""

    xor: bool = True
    overwrite_only: AbstractSet[str] = frozenset()
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    min_bucket_bytes: int = 256 << 10
    key: bytes | None = None
    paper_codec: bool = False
    encode_threads: int = 2
    queue_depth: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.overwrite_only, str):
            raise ValueError("overwrite_only is a collection of tensor names, not a str")
        object.__setattr__(self, "overwrite_only", frozenset(self.overwrite_only))

    def buckets(self) -> BucketConfig:
        return BucketConfig(
            bucket_bytes=self.bucket_bytes,
            min_bucket_bytes=self.min_bucket_bytes,
            key=self.key,
            paper=self.paper_codec,
            threads=self.encode_threads,
        )


@dataclass
class TakeReport:
    """What one ``take_weights`` saw on this rank (and, on rank 0, the whole group's totals)."""

    version: int
    tensors: int = 0  # (name, tensor) pairs read on this rank
    owned: int = 0  # of them scanned here
    owned_elements: int = 0
    changed_elements: int = 0
    changed_tensors: int = 0
    element_change_rate: float = 0.0  # over the whole group
    seconds: float = 0.0
    scan_seconds: float = 0.0


@dataclass
class _Candidate:
    version: int
    base_version: int
    changes: dict[int, dict[str, Change]] = field(default_factory=dict)  # owner rank -> name ->
    elements: int = 0  # canonical elements of the whole checkpoint
    changed: int = 0


def _baseline_tensors(
    baseline: Mapping[str, torch.Tensor] | str | os.PathLike[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(baseline, str | os.PathLike):
        yield from iter_checkpoint(baseline)
    else:
        yield from baseline.items()


class NamedTensorOwner:
    """The owners of a framework that hands over named full tensors (module docstring).

    `transport`: where the payloads go (a sink spec: ``dir``, ``s3``, ``relay``).
    `baseline`: the committed canonical checkpoint (a safetensors file or directory, or a name
    -> tensor mapping) at `committed_version`: what the engines hold (the model they were
    started with at version 0, or the checkpoint of the committed version on a restart). Its
    names, dtypes and shapes are the canonical table. `group`: a process group taking CPU
    tensors (gloo) over the ranks that iterate the stream, or None for one rank.
    `held_names`: the names this rank's producer holds (a split `WeightSource`'s
    ``held_names()``; None: every name). Construction is collective over `group`."""

    def __init__(
        self,
        transport: str | Mapping[str, Any] | TransportSpec,
        baseline: Mapping[str, torch.Tensor] | str | os.PathLike[str],
        *,
        config: NamedOwnerConfig | None = None,
        group: Any = None,
        committed_version: int = 0,
        held_names: Iterable[str] | None = None,
    ) -> None:
        self.spec = TransportSpec.parse(transport, role=Role.SINK, what="transport")
        self.config = config or NamedOwnerConfig()
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world = 1 if group is None else dist.get_world_size(group)
        self.committed_version = int(committed_version)
        self.table: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for name, t in _baseline_tensors(baseline):
            self.table[name] = (t.dtype, tuple(t.shape))
        if not self.table:
            raise ValueError("the baseline checkpoint holds no tensor")
        self.held = None if held_names is None else frozenset(held_names)
        self.owner_of = self._owners(self.held)
        self.baseline: dict[str, torch.Tensor] = {}  # the names this rank owns
        for name, t in _baseline_tensors(baseline):
            if self.owner_of[name] == self.rank:
                self.baseline[name] = t.detach().to("cpu", copy=True).contiguous()
        unknown = self.config.overwrite_only - self.table.keys()
        if unknown:
            raise ValueError(f"overwrite_only names no canonical tensor: {sorted(unknown)[:5]}")
        self.elements = sum(int(np.prod(s, dtype=np.int64)) for _, s in self.table.values())
        self.scan = DeviceScan()
        self.candidate: _Candidate | None = None
        self._pending: tuple[int, dict[str, Change]] | None = None  # this rank's, to advance
        self.last_take: TakeReport | None = None

    # -- the stream --------------------------------------------------------------------------
    def take_weights(self, source: Iterable[tuple[str, torch.Tensor | None]]) -> TakeReport:
        """Diff the stream `source` against the committed baseline: the candidate of version
        committed + 1 (replacing any earlier candidate). Collective over the group; raises
        `ArgumentError` on every rank for bad input (guarantee 1)."""
        t0 = time.perf_counter()
        self._sync_committed()
        self._check_held(source)
        rep = TakeReport(version=self.committed_version + 1)
        errors: list[str] = []
        seen: set[str] = set()
        mine: dict[str, Change] = {}
        for name, tensor in source:
            rep.tensors += 1
            if errors:
                continue  # keep consuming: the iteration is a collective
            problem = self._check(name, tensor, seen)
            if problem:
                errors.append(problem)
                continue
            seen.add(name)
            if self.owner_of[name] != self.rank:
                continue
            assert tensor is not None  # `_check` refuses a missing tensor
            rep.owned += 1
            rep.owned_elements += tensor.numel()
            ts = time.perf_counter()
            idx, new, base = changed_bits(tensor, self.baseline[name], self.scan)
            rep.scan_seconds += time.perf_counter() - ts
            if idx.size:
                mine[name] = (idx, new, base[idx] ^ new)
                rep.changed_elements += int(idx.size)
        if not errors:
            missing = [n for n in self.baseline if n not in seen]
            if missing:
                errors.append(
                    f"the stream lacked {len(missing)} canonical tensor(s) this rank owns, "
                    f"e.g. {missing[:3]}"
                )
        refused = self._gather_json(errors[:1])
        if any(refused):
            self.candidate = None
            self._pending = None
            first = next((r, e[0]) for r, e in enumerate(refused) if e)
            raise ArgumentError(
                f"take_weights: the weights were refused (rank {first[0]}): {first[1]}; the "
                f"committed baseline (version {self.committed_version}) is kept"
            )
        self._pending = (rep.version, mine)
        changes = self._gather_changes(mine, rep.version)
        counts = self._gather_json([rep.changed_elements, rep.owned_elements])
        changed = sum(c[0] for c in counts)
        rep.element_change_rate = changed / self.elements if self.elements else 0.0
        rep.changed_tensors = len(mine)
        if self.rank == 0:
            self.candidate = _Candidate(
                version=rep.version,
                base_version=self.committed_version,
                changes=changes,
                elements=self.elements,
                changed=changed,
            )
        rep.seconds = time.perf_counter() - t0
        self.last_take = rep
        log.info(
            "dcr take v%d (rank %d): %d tensors, %d owned, %d changed elements (rate %.4f), "
            "%.3fs (scan %.3fs)",
            rep.version, self.rank, rep.tensors, rep.owned, rep.changed_elements,
            rep.element_change_rate, rep.seconds, rep.scan_seconds,
        )  # fmt: skip
        return rep

    def _check(self, name: Any, tensor: Any, seen: set[str]) -> str:
        """Why the pair (`name`, `tensor`) is refused, or ""."""
        if not isinstance(name, str):
            return f"a tensor name must be a str, got {type(name).__name__}"
        if name not in self.table:
            return f"{name!r} is no canonical tensor of the baseline checkpoint"
        if name in seen:
            return f"{name!r} came twice in one stream"
        if tensor is None:
            if self.owner_of[name] == self.rank:
                return f"{name!r}: this rank owns it but the source yielded None (held_names)"
            return ""
        if not isinstance(tensor, torch.Tensor):
            return f"{name!r}: a torch.Tensor was expected, got {type(tensor).__name__}"
        dtype, shape = self.table[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            return (
                f"{name!r}: got {tensor.dtype}{list(tensor.shape)}, the canonical tensor is "
                f"{dtype}{list(shape)}"
            )
        return ""

    def _owners(self, held: frozenset[str] | None) -> dict[str, int]:
        """Name -> its owner rank: ``stable_hash(name)`` over the ranks that hold it (every
        rank, unless `held_names` splits the producers). Collective; fixed for the owner's
        life (the baselines live there)."""
        every = self._gather_json(None if held is None else sorted(held))
        holders: dict[str, list[int]] = {}
        for r, names in enumerate(every):
            for n in self.table if names is None else names:
                holders.setdefault(n, []).append(r)
        orphans = [n for n in self.table if n not in holders]
        if orphans:
            raise ArgumentError(f"held_names: no rank holds {orphans[:3]}")
        return {n: holders[n][stable_hash(n) % len(holders[n])] for n in self.table}

    def _check_held(self, source: Any) -> None:
        """A `WeightSource` that declares ``held_names`` must declare the construction's."""
        held = getattr(source, "held_names", None)
        mine = held() if callable(held) else None
        if (None if mine is None else frozenset(mine)) != self.held:
            raise ArgumentError(
                "take_weights: the source's held_names differ from the ones the owner was "
                "constructed with (ownership is fixed: the baselines live on the owners)"
            )

    # -- rank 0 <-> the group ----------------------------------------------------------------
    def _gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able `obj` in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        return [json.loads(b) for b in self._all_bytes(json.dumps(obj).encode(), to_all=True)]

    def _all_bytes(self, data: bytes, *, to_all: bool) -> list[bytes]:
        """Every rank's `data` (variable length) in rank order: on every rank (`to_all`), or
        on rank 0 only (the others get [])."""
        g = self.group
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, n, group=g)
        width = max(int(s[0]) for s in sizes)
        buf = torch.zeros(max(width, 1), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if to_all:
            out = [torch.empty_like(buf) for _ in range(self.world)]
            dist.all_gather(out, buf, group=g)
        else:
            gathered: list[torch.Tensor] | None = (
                [torch.empty_like(buf) for _ in range(self.world)] if self.rank == 0 else None
            )
            dist.gather(buf, gathered, group=g, group_dst=0)
            if gathered is None:
                return []
            out = gathered
        return [bytes(t[: int(s[0])].numpy()) for t, s in zip(out, sizes)]

    def _gather_changes(
        self, mine: dict[str, Change], version: int
    ) -> dict[int, dict[str, Change]]:
        """Every rank's changed set on rank 0 (rank -> name -> change; the others get {}), sent
        as DCR payloads (overwrite records of the new bits, then of the XOR masks; each framed
        by its kind and length) and decoded, validated, on rank 0."""
        if self.world == 1:
            return {0: mine}
        frame = bytearray()
        for k in (1, 2):  # new bits, XOR masks
            items = [
                make_item(
                    n, self.table[n][0], self.table[n][1], self.rank, Kind.OVERWRITE, c[0], c[k]
                )
                for n, c in sorted(mine.items())
            ]
            meta = PayloadMeta(
                version=version, base_version=0, attempt=0, owner=self.rank, sequence=0
            )
            for p in encode_items(items, meta, BucketConfig(threads=0)):
                frame += bytes([k]) + len(p).to_bytes(8, "little") + p
        out: dict[int, dict[str, Change]] = {}
        numel = {n: int(np.prod(s, dtype=np.int64)) for n, (_, s) in self.table.items()}
        for r, data in enumerate(self._all_bytes(bytes(frame), to_all=False)):
            parts: dict[int, dict[str, list[DeltaItem]]] = {1: {}, 2: {}}
            pos = 0
            while pos < len(data):
                k, size = data[pos], int.from_bytes(data[pos + 1 : pos + 9], "little")
                payload = decode_payload(data[pos + 9 : pos + 9 + size], destinations=numel)
                for item in payload.items:
                    parts[k].setdefault(item.name, []).append(item)
                pos += 9 + size
            out[r] = {
                n: (
                    np.concatenate([i.indices for i in news]),
                    np.concatenate([i.values for i in news]),
                    np.concatenate([i.values for i in parts[2][n]]),
                )
                for n, news in parts[1].items()
            }
        return out

    def _sync_committed(self) -> None:
        """Learn rank 0's committed version; advance this rank's baseline to its pending
        candidate when that was committed, drop it otherwise (guarantee 3)."""
        if self.world > 1:
            committed = self._gather_json(self.committed_version)[0]
            self.committed_version = int(committed)
        if self._pending is not None:
            version, mine = self._pending
            if version <= self.committed_version and self.rank != 0:
                self._advance(mine)
            self._pending = None

    def _advance(self, mine: Mapping[str, Change]) -> None:
        for name, (idx, new, _) in mine.items():
            set_scatter(tensor_bits(self.baseline[name]), idx, new)

    # -- the coordinator's Owners (rank 0) ---------------------------------------------------
    def _held(self, version: int) -> _Candidate:
        if self.rank != 0:
            raise ProtocolError("the coordinator drives the named-tensor owner on rank 0 only")
        c = self.candidate
        if c is None or c.version != version:
            have = "none" if c is None else f"version {c.version}"
            raise ProtocolError(
                f"no weights were taken for version {version} (candidate: {have}; committed "
                f"{self.committed_version}): call take_weights before the transition"
            )
        return c

    def build(self, version: int, attempt: int, retry: bool) -> BuildReply:
        """Publish attempt `attempt` of `version`: each owner rank's changed set through its
        sink (XOR where allowed and not `retry`, overwrites otherwise), then the seal."""
        c = self._held(version)
        t0 = time.perf_counter()
        cfg = self.config
        ids: list[str] = []
        count = stored = 0
        for owner in sorted(c.changes):
            meta = PayloadMeta(
                version=version,
                base_version=c.base_version,
                attempt=attempt,
                owner=owner,
                sequence=0,
            )
            with self.spec.open_sink(version=version, attempt=attempt, owner=owner) as sink:
                with PayloadStream(meta, cfg.buckets(), sink.send, cfg.queue_depth) as stream:
                    # largest first: the buckets taper towards the end (shared_codec.buckets)
                    for name in sorted(
                        c.changes[owner], key=lambda n: -c.changes[owner][n][0].size
                    ):
                        idx, new, xor = c.changes[owner][name]
                        x = cfg.xor and not retry and name not in cfg.overwrite_only
                        dtype, shape = self.table[name]
                        stream.add(
                            make_item(
                                name, dtype, shape, owner, Kind.XOR if x else Kind.OVERWRITE,
                                idx, (xor if x else new).copy(),
                            )
                        )  # fmt: skip
                    stream.finish()
                count += stream.payload_count
                stored += stream.stored_bytes
                ids += sink.finish().payload_ids
        with self.spec.open_sink(version=version, attempt=attempt) as sink:
            sink.seal(
                Seal(
                    base_version=c.base_version,
                    owners=tuple(sorted(c.changes)),
                    payload_ids=tuple(ids),
                )
            )
        return BuildReply(
            baseline_id=f"named-v{c.base_version}",
            version=version,
            attempt=attempt,
            retry=retry,
            payload_bytes=stored,
            payloads=count,
            build_s=time.perf_counter() - t0,
            element_change_rate=c.changed / c.elements if c.elements else 0.0,
        )

    def verify(self, version: int) -> None:
        """The candidate is a copy of the changed bits (guarantee 4): only the protocol check."""
        self._held(version)

    def commit(self, version: int) -> None:
        """`version` was committed: rank 0's baselines advance now, the other ranks' at their
        next ``take_weights``. Idempotent for the committed version."""
        if version == self.committed_version and self.candidate is None:
            return
        c = self._held(version)
        self._advance(c.changes.get(0, {}))
        self.committed_version = version
        self.candidate = None
        self._pending = None

    def abort(self, version: int, attempt: int) -> None:
        """The attempt failed: keep the committed baseline and the candidate (a retry
        rebuilds from it)."""

    def baseline_bytes(self) -> int:
        """Host bytes of this rank's baseline."""
        return sum(t.numel() * t.element_size() for t in self.baseline.values())


__all__ = ["NamedOwnerConfig", "NamedTensorOwner", "TakeReport"]
