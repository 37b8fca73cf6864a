"""The owner-side optimizer-step hook: detect, project, convert, encode, hand to a sink.

``hook = enable_dcr(model_chunks, optimizer, DCRConfig(...))`` builds conversion tasks from the
bridge registry (tasks.py), picks owners (ownership.py) and snapshots the committed baseline:
host-memory trackers of every owned affine shard's stored bits, and the residual baseline of
canonical tensors owned by a canonical-name hash. With ``wrap_step`` (default) the Megatron
optimizer's ``step`` is wrapped so `after_step` runs after every successful step; training loops
may call ``hook.after_step()`` themselves instead.

One transition (every rank calls, in the same order; collectives inside):
``build(version, attempt)`` -> payloads handed to the sink -> coordinator commits ->
``commit()`` advances trackers and residual baseline in place; ``abort()`` keeps them;
``build(version, attempt + 1, retry=True)`` re-emits the complete changed set from the same
candidate weights as overwrites.

Candidate guard (paper Proposition 1 assumes the candidate stays fixed until the commit): every
build records what it built from, per owned shard: its changed indices and their new stored
bits against the tracker (the delta `commit` scatters; in mode F, without trackers, a 20-byte
SHA-1 of the whole shard). `verify_candidate` scans the shards again and compares (the changed
indices, then their bits); `commit()` and an overwrite retry call it first and raise
`CandidateChanged` naming the moved parameters instead of committing a version the trainer no
longer holds or re-emitting a different candidate. The coordinator asks the owners to verify
before its compare-and-set, so a trainer that stepped between build and commit gets nothing
committed; after the compare-and-set its owner service commits with ``verify=False`` (the
record is durable: owners advance to the built candidate, which is what the engines hold).
Async trainers must not step between ``build`` and the commit (or build again afterwards).

Modes (paper Table 3, `ConstructionMode`): X = projection + mixed XOR/overwrite (default),
P = projection + overwrites, F = full conversion of every tensor through the bridge + overwrites.

Process groups: the hook takes a `ParallelGroups` (``groups=``; default
`ParallelGroups.from_megatron()`, read once in the constructor). Ownership, the residual owner,
the payload owner id and every reduction use it; nothing below the constructor asks
megatron-core's ``parallel_state`` or the default process group.

Parallel layouts: TP, DP (with or without the distributed optimizer), EP/ETP, SP, and PP with
any number of model chunks per rank (virtual stages); CP ranks count as data-parallel replicas
(groups.py; run here with CP=2 in the process groups only, the CPU attention not split:
docs/parallel-layouts.md). Each rank owns shards of its own pipeline stage only (conversion.py: other stages' parameters are remote tasks it converts
collectively but never owns), so owned elements add up to the canonical element count.

Lazily gathered parameters (distributed optimizer with ``overlap_param_gather``): the
optimizer's step leaves the updated BF16 parameters to be all-gathered by the next forward
pass. The hook finishes that gather itself before any detection (``_sync_params``: every
``DistributedDataParallel`` chunk's ``start_param_sync(force_sync=True)``), so it reads the
updated values, as Megatron-LM does before saving a checkpoint; the next forward then finds
the parameters already in sync.

Limitations:
1. Trackers are host copies, and so is detection: each build and candidate verify copies
   every owned shard to host memory (on a GPU: one device -> host copy of the owned shards)
   and the compiled scan (shared_codec.kernels) compares it there with the tracker. `commit`
   reads no shard: it scatters the build's recorded changed indices and new bits into the
   trackers (held from build to commit: ~10 bytes of host memory per changed element).
2. The lazy gather is finished only on chunks given DDP-wrapped (``start_param_sync``); pass
   the chunks as the training loop holds them, not the bare GPTModels.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_dcr_hooks.conversion import GroupedExports, megatron_to_hf, num_experts_of
from megatron_dcr_hooks.groups import ParallelGroups
from megatron_dcr_hooks.ownership import owns, residual_owner
from megatron_dcr_hooks.tasks import Task, TaskKind, affine_share, build_tasks
from shared_codec.buckets import DEFAULT_BUCKET_BYTES, BucketConfig, BucketEncoder
from shared_codec.dtypes import dtype_of, tensor_bits
from shared_codec.errors import CandidateChanged, OwnerBuildError, ProtocolError
from shared_codec.format import PayloadMeta
from shared_codec.kernels import changed_indices, set_scatter, warm_up
from shared_codec.records import DeltaItem, Kind, make_item

Sink = Callable[[bytes], None]
log = logging.getLogger("dcr.owner")


class ConstructionMode(StrEnum):
    """How a build constructs its delta (paper Table 3). String-valued, so ``mode="X"`` in a
    training config keeps working and the value prints as its letter."""

    X = "X"  # projection + mixed XOR/overwrite records
    P = "P"  # projection + overwrites only
    F = "F"  # full conversion of every tensor through the bridge + overwrites


@dataclass(frozen=True, kw_only=True)
class DCRConfig:
    """What a Megatron training config carries to enable DCR (frozen, keyword-only).

    `architecture`: the HF architecture whose megatron-bridge bridge converts the model
    (``bridge_registry.architecture_of(config.json)``, e.g. "LlamaForCausalLM"); a
    ``model_type`` that exactly one bridge registers ("qwen3") also resolves.
    `hf_config`: the model's HF config (config.json as a dict), handed to the bridge when it
    builds its mapping registry from the config (megatron-bridge 0.6: DeepSeek-V3 and others;
    without it such a bridge raises `CompatibilityError` naming it). When given, the tasks
    resolve the bridge from it (its ``architectures``, as `architecture` is derived), so the
    two must describe the same model.
    `mode`: `ConstructionMode` or its letter "X" (default), "P" or "F" (converted here; any
    other value raises ValueError). `bucket_bytes`: raw record bytes per payload.
    `min_bucket_bytes`: the buckets shrink towards the end of a build, halving down to this
    size, so a pipelined receiver has little left to move and apply once the build ends
    (`shared_codec.buckets`); set it to `bucket_bytes` for equal buckets throughout.
    `key`: shared secret for keyed payload digests. `paper_codec`: the paper's plain streams.
    `overwrite_only`: canonical tensors receivers cannot take XOR for (union of the receivers'
    prewarm reports; any iterable of names, stored as a frozenset). `force_residual`: mapping
    class names treated as residual.
    `queue_depth`: payloads buffered between construction and the sink (back-pressure).
    `wrap_step`: wrap ``optimizer.step``. `sink`: callable receiving each payload (bytes); the
    default keeps payloads in ``hook.payloads``. `candidate_guard` (default on): verify before
    commit and retry that the shards still hold what the build recorded (module docstring); it
    costs one detection scan per verify (a whole-shard hash per build in mode F), so a trainer
    that provably never steps between build and commit may turn it off.
    """

    architecture: str = "Qwen3ForCausalLM"
    mode: ConstructionMode | str = ConstructionMode.X  # a ConstructionMode after __post_init__
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    min_bucket_bytes: int = 256 << 10
    key: bytes | None = None
    paper_codec: bool = False
    overwrite_only: AbstractSet[str] = frozenset()  # a frozenset after __post_init__
    force_residual: tuple[str, ...] = ()
    queue_depth: int = 8
    wrap_step: bool = True
    encode_threads: int = 2
    sink: Sink | None = None
    candidate_guard: bool = True
    hf_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        try:
            mode = ConstructionMode(self.mode)
        except ValueError:
            valid = ", ".join(m.value for m in ConstructionMode)
            raise ValueError(f"DCRConfig.mode must be one of {valid}, not {self.mode!r}") from None
        if isinstance(self.overwrite_only, str):
            raise ValueError("DCRConfig.overwrite_only is a collection of tensor names, not a str")
        if isinstance(self.force_residual, str):
            raise ValueError("DCRConfig.force_residual is a tuple of class names, not a str")
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "overwrite_only", frozenset(self.overwrite_only))
        object.__setattr__(self, "force_residual", tuple(self.force_residual))


@dataclass
class BuildReport:
    """What one `build` did on this rank (plus the global element change rate)."""

    version: int
    attempt: int
    retry: bool
    items: int = 0
    entries: int = 0
    xor_entries: int = 0
    payloads: int = 0
    payload_bytes: int = 0
    owned_elements: int = 0
    changed_elements: int = 0
    element_change_rate: float = 0.0
    residual_tasks_converted: int = 0
    seconds: float = 0.0
    detect_seconds: float = 0.0


class _SinkThread:
    """Bounded queue between construction and the sink (the transport)."""

    def __init__(self, sink: Sink, depth: int) -> None:
        self.q: queue.Queue[bytes | None] = queue.Queue(maxsize=max(1, depth))
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, args=(sink,), daemon=True, name="dcr-sink")
        self.t.start()

    def _run(self, sink: Sink) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is None:
                try:
                    sink(item)
                except BaseException as e:  # surfaced by close()
                    self.error = e

    def put(self, payload: bytes) -> None:
        if self.error is not None:
            raise OwnerBuildError(f"DCR sink failed: {self.error}") from self.error
        self.q.put(payload)

    def close(self) -> None:
        self.q.put(None)
        self.t.join()
        if self.error is not None:
            raise OwnerBuildError(f"DCR sink failed: {self.error}") from self.error


class DCRHook:
    """Owner-side state of one trainer rank (see the module docstring).

    `groups`: the job's process groups (`ParallelGroups`); default
    `ParallelGroups.from_megatron()`. Construction is collective over them (every rank of
    ``groups.world`` constructs its hook with the same model structure and config).
    """

    def __init__(
        self,
        model_chunks: list[Any],
        config: DCRConfig,
        *,
        groups: ParallelGroups | None = None,
    ) -> None:
        if not model_chunks:
            raise ValueError("DCRHook needs this rank's model chunks (at least one)")
        self.groups = groups if groups is not None else ParallelGroups.from_megatron()
        self.chunks = list(model_chunks)
        self.model = self.chunks[0]
        self.config = config
        self._sync_params()
        self.rank = self.groups.world.rank
        self.world = self.groups.world.size
        self.payloads: list[bytes] = []
        self.tasks: list[Task] = build_tasks(
            self.chunks,
            config.architecture if config.hf_config is None else config.hf_config,
            self.groups,
            force_residual=config.force_residual,
        )
        self.owned = [t for t in self.tasks if t.local and owns(t, self.groups)]
        self.owned_idx = {t.index for t in self.owned}
        full = config.mode is ConstructionMode.F
        self.tracked = [t for t in self.owned if t.kind is TaskKind.AFFINE and not full]
        # build order: largest shards first, so the build ends on small shards and the buckets
        # taper (`BucketEncoder.add(after=)`): the last payload, what a pipelined receiver still
        # moves and applies after the build, is small (the order of items is free: every item
        # names its canonical tensor and indices)
        self.scan_order = sorted(self.tracked, key=lambda t: -t.param.numel())
        self._scan_elements = sum(t.param.numel() for t in self.tracked)
        self.residual_tasks = [t for t in self.tasks if t.kind is TaskKind.RESIDUAL or full]
        # trackers: committed stored bits of owned shards (affine tasks are projected from
        # them; owned residual tasks only use them for the changed flag)
        self.trackers: dict[int, torch.Tensor] = {
            t.index: t.param.detach().to("cpu", copy=True).contiguous()
            for t in self.owned
            if not full
        }
        # the last build's candidate per tracked shard that changed: (changed indices, their
        # new stored bits); `commit` scatters it into the tracker (O(changed), no scan)
        self._delta: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.residual_baseline: dict[str, torch.Tensor] = {}
        self._pending_residual: dict[str, torch.Tensor] = {}
        self.committed_version = 0
        self._candidate: int | None = None
        # candidate guard: (version, {task index: what to check}) of the last build: b"" for a
        # shard checked against its recorded delta, a whole-shard fingerprint without a tracker
        self._built: tuple[int, dict[int, bytes]] | None = None
        self._open = False  # a build since the last commit or abort
        self._rebuilt = False  # the open version was built again (engines may hold either)
        self.guard_scans = 0  # candidate guards that scanned the shards
        self.guard_held = 0  # guards answered without a scan (`verify_candidate` scan=False)
        self.step_thread: int | None = None  # the thread of the last optimizer step seen
        self.last_report: BuildReport | None = None
        self._init_residual_baseline()
        warm_up()  # compile the detection scan now, not inside the first optimizer step

    # -- baseline ------------------------------------------------------------------------
    def _sync_params(self) -> None:
        """Finish any lazily deferred parameter all-gather (``overlap_param_gather``) so the
        stored bits read below are the updated ones (module docstring). No-op otherwise."""
        for chunk in self.chunks:
            sync = getattr(chunk, "start_param_sync", None)
            ddp_config = getattr(chunk, "ddp_config", None)
            if sync is not None and getattr(ddp_config, "overlap_param_gather", False):
                sync(force_sync=True)

    def _convert(self, tasks: list[Task]) -> dict[str, torch.Tensor]:
        """Canonical tensors of `tasks` via the bridge (collective), kept if this rank owns them."""
        mine: dict[str, torch.Tensor] = {}
        grouped = GroupedExports(num_experts_of(self.chunks))
        with torch.no_grad():
            for t in tasks:
                shard = t.param.detach() if t.local else None
                out = grouped.add(t.param_task, megatron_to_hf(t.param_task, shard))
                for name, tensor in out.items():
                    if residual_owner(name, self.world) == self.rank:
                        mine[name] = tensor.detach().to("cpu").contiguous().clone()
        grouped.finish()
        return mine

    def _init_residual_baseline(self) -> None:
        self.residual_baseline = self._convert(self.residual_tasks)

    def baseline_bytes(self) -> dict[str, int]:
        """Host memory of this rank's baseline: trackers and residual baseline."""
        tr = sum(t.numel() * t.element_size() for t in self.trackers.values())
        rb = sum(t.numel() * t.element_size() for t in self.residual_baseline.values())
        return {"tracker_bytes": tr, "residual_bytes": rb, "baseline_bytes": tr + rb}

    def report(self) -> dict[str, Any]:
        """Classification and memory summary (affine share of canonical weight bytes)."""
        return {
            "rank": self.rank,
            "tasks": len(self.tasks),
            "affine_tasks": sum(t.kind is TaskKind.AFFINE for t in self.tasks),
            "residual_tasks": sum(t.kind is TaskKind.RESIDUAL for t in self.tasks),
            "owned_tasks": len(self.owned),
            **affine_share(self.tasks),
            **self.baseline_bytes(),
        }

    # -- one transition ------------------------------------------------------------------
    def build(
        self, version: int, attempt: int = 0, *, retry: bool = False, sink: Sink | None = None
    ) -> BuildReport:
        """Build and emit the delta committed -> `version` from the current weights.

        `retry`: every record is an overwrite (repairs partial writes of a failed attempt).
        Payloads go to `sink` (or the config's sink, or ``self.payloads``) through a bounded
        queue while construction continues. Collective: every rank calls.
        """
        if version <= self.committed_version:
            raise ProtocolError(f"version {version} <= committed {self.committed_version}")
        self._sync_params()
        if retry and self._built is not None and self._built[0] == version:
            self.verify_candidate(version)  # the retry must re-emit the same candidate
        t0 = time.perf_counter()
        fingerprints: dict[int, bytes] = {}
        delta: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        rep = BuildReport(version=version, attempt=attempt, retry=retry)
        out = sink or self.config.sink or self.payloads.append
        writer = _SinkThread(out, self.config.queue_depth)
        meta = PayloadMeta(
            version=version,
            base_version=self.committed_version,
            attempt=attempt,
            owner=self.rank,
            sequence=0,
        )
        enc = BucketEncoder(
            meta,
            BucketConfig(
                bucket_bytes=self.config.bucket_bytes,
                min_bucket_bytes=self.config.min_bucket_bytes,
                key=self.config.key,
                paper=self.config.paper_codec,
                threads=self.config.encode_threads,
            ),
        )
        xor_ok = self.config.mode is ConstructionMode.X and not retry
        # taper estimate: the records still to come, extrapolated from those so far; unknown
        # (no taper) when residual conversion follows
        taper = not self.residual_tasks
        try:
            for t in self.scan_order:
                cur = t.param.detach()
                rep.owned_elements += cur.numel()  # scanned so far (residual tasks come after)
                td = time.perf_counter()
                cur_bits = tensor_bits(cur.to("cpu"))
                base_bits = tensor_bits(self.trackers[t.index])
                local = changed_indices(cur_bits, base_bits)
                rep.detect_seconds += time.perf_counter() - td
                if self.config.candidate_guard:
                    fingerprints[t.index] = b""  # checked against `delta`
                if not local.size:
                    continue
                new = cur_bits[local]
                delta[t.index] = (local, new)
                rep.changed_elements += int(local.size)
                items = self._project(t, local, new, base_bits, xor_ok)
                rest = sum(item.raw_bytes for item in items)
                later = (
                    (enc.raw_bytes + enc.open_bytes + rest)
                    * (self._scan_elements - rep.owned_elements)
                    // max(rep.owned_elements, 1)
                )
                for item in items:
                    rest -= item.raw_bytes
                    self._emit(enc, writer, item, rep, after=rest + later if taper else None)
            self._residual(enc, writer, rep, fingerprints, delta)
            for payload in enc.finish():
                writer.put(payload)
        finally:
            writer.close()
        rep.payloads, rep.payload_bytes = enc.payload_count, enc.stored_bytes
        counts = torch.tensor([rep.changed_elements, rep.owned_elements], dtype=torch.float64)
        dist.all_reduce(counts, group=self.groups.world.group)
        rep.element_change_rate = float(counts[0] / counts[1]) if counts[1] else 0.0
        rep.seconds = time.perf_counter() - t0
        self._candidate = version
        if not retry:  # e.g. a wrapped optimizer step again before the coordinator committed
            self._rebuilt = self._open and self._built is not None and self._built[0] == version
        self._built, self._open = (version, fingerprints), True
        self._delta = delta
        self.last_report = rep
        log.info(
            "dcr build v%d attempt %d%s: %d payloads, %d bytes, %d entries (%d XOR), change rate "
            "%.4f, %.3fs (detect %.3fs)",
            version, attempt, " retry" if retry else "", rep.payloads, rep.payload_bytes,
            rep.entries, rep.xor_entries, rep.element_change_rate, rep.seconds,
            rep.detect_seconds,
        )  # fmt: skip
        return rep

    def _emit(
        self,
        enc: BucketEncoder,
        writer: _SinkThread,
        item: DeltaItem,
        rep: BuildReport,
        *,
        after: int | None = None,
    ) -> None:
        rep.items += 1
        rep.entries += item.count
        if item.kind == Kind.XOR:
            rep.xor_entries += item.count
        for payload in enc.add(item, after=after):
            writer.put(payload)

    def _project(
        self, t: Task, local: np.ndarray, new: np.ndarray, base: np.ndarray, xor_ok: bool
    ) -> list[DeltaItem]:
        """Changed local indices of an affine task (`new`: their stored bits now) -> one item
        per canonical tensor."""
        assert t.amap is not None
        name_idx, hf = t.amap.project(local)
        names = t.amap.names
        # one canonical tensor (most tasks): no grouping; a fused one (QKV, gate/up): per name
        parts: list[tuple[int, np.ndarray | None]] = (
            [(0, None)]
            if len(names) == 1
            else [(int(j), name_idx == j) for j in np.unique(name_idx)]
        )
        vals_xor: np.ndarray | None = None
        items = []
        for j, sel in parts:
            name = names[j]
            h = hf if sel is None else hf[sel]
            # canonical order; affine runs usually keep the local order, then no sort is needed
            order = None if bool((h[1:] > h[:-1]).all()) else np.argsort(h, kind="stable")
            kind = Kind.XOR if xor_ok and name not in self.config.overwrite_only else Kind.OVERWRITE
            if kind == Kind.XOR:
                if vals_xor is None:
                    vals_xor = new ^ base[local]
                vals = vals_xor
            else:
                vals = new
            if sel is not None:
                vals = vals[sel]
            if order is not None:
                h, vals = h[order], vals[order]
            if vals is new:  # `new` stays the build's recorded delta (commit scatters it)
                vals = new.copy()
            items.append(
                make_item(
                    name, dtype_of(t.param.dtype).name, t.hf_shapes[name], self.rank, kind, h, vals
                )
            )
        return items

    def _residual(
        self,
        enc: BucketEncoder,
        writer: _SinkThread,
        rep: BuildReport,
        fingerprints: dict[int, bytes],
        delta: dict[int, tuple[np.ndarray, np.ndarray]],
    ) -> None:
        """Residual conversion: flag changed tasks (all-reduced), convert them with the bridge,
        compare with the residual baseline owned by a canonical-name hash, emit overwrites."""
        if not self.residual_tasks:
            return
        full = self.config.mode is ConstructionMode.F
        flags = torch.zeros(len(self.residual_tasks), dtype=torch.int32)
        for i, t in enumerate(self.residual_tasks):
            if t.index in self.owned_idx:
                rep.owned_elements += t.param.numel()
                record, changed = self._shard_state(t)
                if self.config.candidate_guard:
                    fingerprints[t.index] = record
                if changed is not None and changed[0].size:
                    delta[t.index] = changed
                if full or changed is None or changed[0].size:
                    flags[i] = 1
        if full:
            flags.fill_(1)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.groups.world.group)
        # a grouped export (every expert stacked in one HF tensor) converts all its experts
        hit = {n for i, t in enumerate(self.residual_tasks) if flags[i] for n in t.hf_shapes}
        selected = [
            t
            for i, t in enumerate(self.residual_tasks)
            if flags[i] or (t.param_task.mapping_grouped and not hit.isdisjoint(t.hf_shapes))
        ]
        converted = self._convert(selected)
        rep.residual_tasks_converted = len(selected)
        for name, new in converted.items():
            old = self.residual_baseline[name]
            nb, ob = tensor_bits(new), tensor_bits(old)
            idx = changed_indices(nb, ob)
            self._pending_residual[name] = new
            if full:
                rep.changed_elements += int(idx.size)
            if idx.size:
                item = make_item(
                    name,
                    dtype_of(new.dtype).name,
                    tuple(new.shape),
                    self.rank,
                    Kind.OVERWRITE,
                    idx,
                    nb[idx],
                )
                self._emit(enc, writer, item, rep)

    def _shard_state(self, t: Task) -> tuple[bytes, tuple[np.ndarray, np.ndarray] | None]:
        """(guard record, (changed indices, their new stored bits) against the tracker) of an
        owned shard's current stored bits. Without a tracker (mode F: the whole shard is the
        candidate) the change is None and the guard record the shard's fingerprint."""
        base = self.trackers.get(t.index)
        if base is None:
            guard = self.config.candidate_guard
            return (_fingerprint(tensor_bits(t.param.detach().to("cpu"))) if guard else b""), None
        cur = tensor_bits(t.param.detach().to("cpu"))
        local = changed_indices(cur, tensor_bits(base))
        return b"", (local, cur[local])

    def _unmoved(self, t: Task, record: bytes) -> bool:
        """Does owned shard `t` still hold the candidate the last build recorded?"""
        state, change = self._shard_state(t)
        if change is None:
            return state == record
        built = self._delta.get(t.index)
        if built is None:  # unchanged at the build
            return not change[0].size
        return np.array_equal(change[0], built[0]) and np.array_equal(change[1], built[1])

    def verify_candidate(self, version: int, *, scan: bool = True) -> None:
        """Raise `CandidateChanged` if this rank's owned parameters no longer hold what the build
        of `version` built from (one detection scan of the owned shards; changes nothing).
        With ``candidate_guard=False`` it checks nothing.

        ``scan=False``: the caller held the training thread from the build until now (the
        owner service, `OwnerService.serve`): only the protocol checks run (a build of
        `version` to verify; no second build of it, e.g. a wrapped optimizer step), not the
        shard scan. Counted in `guard_scans` / `guard_held`."""
        if not self.config.candidate_guard:
            return
        if self._rebuilt and self._built is not None and self._built[0] == version:
            self._built, self._rebuilt = None, False
            raise CandidateChanged(
                f"rank {self.rank}: version {version} was built again (another optimizer step) "
                "before it was committed or aborted; the engines may hold either build. Nothing "
                "committed: build the version again from the current weights"
            )
        if self._built is None or self._built[0] != version:
            built = None if self._built is None else self._built[0]
            raise ProtocolError(
                f"rank {self.rank}: no build of version {version} to verify (last build: {built})"
            )
        if not scan:
            self.guard_held += 1
            return
        self.guard_scans += 1
        moved = [
            t.name
            for t in self.owned
            if t.index in self._built[1] and not self._unmoved(t, self._built[1][t.index])
        ]
        if moved:
            # the record is stale: a later retry builds from the current weights (the
            # coordinator restores the engines to the committed version first)
            self._built = None
            shown = ", ".join(moved[:5]) + (f" and {len(moved) - 5} more" if len(moved) > 5 else "")
            raise CandidateChanged(
                f"rank {self.rank}: parameters changed after version {version} was built "
                f"({shown}); an optimizer step between build and commit? Nothing committed: "
                "build the version again from the current weights"
            )

    def commit(self, *, verify: bool = True) -> None:
        """The candidate version was committed: advance trackers and residual baseline in place
        to what the build emitted (its recorded changed indices and new bits scattered into the
        trackers: O(changed), no scan of the shards).

        `verify` (default): first the candidate guard (`verify_candidate`, one detection scan);
        refuses (`CandidateChanged`, nothing advanced) when the parameters moved since the
        build. The coordinator's owner service passes ``verify=False``: it verified before its
        compare-and-set, and once the commit record is durable the owners must advance to the
        candidate the engines hold; refusing then would split the owners from the record."""
        if self._candidate is None:
            raise ProtocolError("commit without a built candidate")
        if verify:
            self.verify_candidate(self._candidate)
        with torch.no_grad():
            for idx, (local, new) in self._delta.items():
                set_scatter(_bits_view(self.trackers[idx]), local, new)
            for name, new_t in self._pending_residual.items():
                self.residual_baseline[name].copy_(new_t)
        self._delta, self._built = {}, None
        self._pending_residual.clear()
        self.committed_version = self._candidate
        self._candidate, self._open = None, False

    def abort(self) -> None:
        """The attempt failed: keep the committed baseline (a retry rebuilds from it; the
        candidate's record stays for its guard)."""
        self._pending_residual.clear()
        self._open = False

    def after_step(self) -> BuildReport | None:
        """Called after each optimizer step: builds the next version's delta (attempt 0)."""
        self.step_thread = threading.get_ident()
        return self.build(self.committed_version + 1, 0)


def _fingerprint(bits: np.ndarray) -> bytes:
    """20 bytes naming a whole shard's stored bits (the candidate of a shard without a
    tracker)."""
    h = hashlib.sha1(usedforsecurity=False)  # detects accidental change; ~3x BLAKE2b's speed
    h.update(np.ascontiguousarray(bits).data)
    return h.digest()


def _bits_view(t: torch.Tensor) -> np.ndarray:
    """The stored bits of the host tensor `t` as a writable numpy view of its memory."""
    bits = tensor_bits(t)
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tracker must be a contiguous host tensor")
    return bits


def enable_dcr(
    model_chunks: list[Any],
    optimizer: Any,
    config: DCRConfig,
    *,
    groups: ParallelGroups | None = None,
) -> DCRHook:
    """Create the owner-side hook for this trainer rank; with ``config.wrap_step`` the
    optimizer's ``step`` runs ``hook.after_step()`` after every successful step.

    `groups`: the job's process groups (default `ParallelGroups.from_megatron()`)."""
    hook = DCRHook(model_chunks, config, groups=groups)
    if config.wrap_step:
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            ok = result[0] if isinstance(result, tuple) else True
            if ok:
                hook.after_step()
            return result

        optimizer.step = step
    return hook
