"""The owner-side optimizer-step hook: detect, project, convert, encode, hand to a sink.

``hook = enable_dcr(model_chunks, optimizer, DCRConfig(...))`` builds conversion tasks from the
bridge registry (tasks.py), picks owners (ownership.py) and snapshots the committed baseline:
host-memory trackers of every owned affine shard's stored bits (detection.py), and the
residual baseline of canonical tensors owned by a canonical-name hash (residual.py). With
``wrap_step`` (default) the Megatron optimizer's ``step`` is wrapped so `after_step` runs after
every successful step; training loops may call ``hook.after_step()`` themselves instead.

`DCRHook` orchestrates the paper's steps; each lives in its own module:
- detection.py: trackers and the changed-bits scan against them (step 1);
- projection.py: affine tasks -> canonical records (step 2, affine path);
- residual.py: residual conversion and the residual baseline (step 2, residual path);
- quantized.py: with ``DCRConfig.quantization``, the quantized deltas of the quantized weights
  from their group owners (issue 32; the canonical records of those weights go there, not to
  the payloads);
- sink.py: encoding into bounded payloads (step 3, `shared_codec.buckets`) and the one
  bounded queue between the build and the transport;
- guard.py: the candidate guard; candidate.py: the `Candidate` record and `OwnerState`.

One transition (every rank calls, in the same order; collectives inside):
``build(version, attempt)`` -> payloads handed to the sink -> coordinator commits ->
``commit()`` advances trackers and residual baseline in place; ``abort()`` keeps them;
``build(version, attempt + 1, retry=True)`` re-emits the complete changed set from the same
candidate weights as overwrites. The coordinator asks the owners to verify the candidate
(guard.py) before its compare-and-set; after it, its owner service commits with
``verify=False`` (the record is durable: owners advance to the built candidate, which is what
the engines hold). Async trainers must not step between ``build`` and the commit (or build
again afterwards).

Modes (paper Table 3, `ConstructionMode`): X = projection + mixed XOR/overwrite (default),
P = projection + overwrites, F = full conversion of every tensor through the bridge + overwrites.

Process groups: the hook takes a `ParallelGroups` (``groups=``; default
`ParallelGroups.from_megatron()`, read once in the constructor). Ownership, the residual owner,
the payload owner id and every reduction use it; nothing below the constructor asks
megatron-core's ``parallel_state`` or the default process group. Its CPU reductions run on
``groups.host`` (the world on gloo or ``cpu:gloo,cuda:nccl``; on an NCCL world a gloo group the
constructor creates over the same ranks: collectives.py), so a default NCCL job runs it unchanged.

Parallel layouts: TP, DP (with or without the distributed optimizer), EP/ETP, SP, and PP with
any number of model chunks per rank (virtual stages); CP ranks count as data-parallel replicas
(groups.py; run here with CP=2 in the process groups only, the CPU attention not split:
docs/parallel-layouts.md). Each rank owns shards of its own pipeline stage only
(conversion.py: other stages' parameters are remote tasks it converts collectively but never
owns), so owned elements add up to the canonical element count.

Limitations:
1. Detection reads every owned shard per build and per guard scan: in place on the host, or
   on the GPU against the host baseline streamed in chunks (detection.py, limitation 1);
   `commit` reads no shard: it scatters the build's recorded change into the trackers.
2. Parameters lazily gathered by the next forward (``overlap_param_gather``) are synced
   before every build, on DDP-wrapped chunks only (detection.py, limitation 2).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_dcr_hooks.candidate import Candidate, OwnerLedger, OwnerState
from megatron_dcr_hooks.collectives import all_reduce, with_host
from megatron_dcr_hooks.config import ConstructionMode, DCRConfig
from megatron_dcr_hooks.detection import (
    DeviceScan,
    advance_trackers,
    changed_bits,
    host_trackers,
    shard_state,
    sync_params,
)
from megatron_dcr_hooks.groups import ParallelGroups
from megatron_dcr_hooks.guard import CandidateGuard
from megatron_dcr_hooks.ownership import owns
from megatron_dcr_hooks.projection import project
from megatron_dcr_hooks.quantized import QuantizedOwner
from megatron_dcr_hooks.residual import ResidualBaseline
from megatron_dcr_hooks.tasks import Task, TaskKind, affine_share, build_tasks
from shared_codec.errors import ProtocolError
from shared_codec.format import PayloadMeta
from shared_codec.kernels import warm_up
from shared_codec.quantized import format_of
from shared_codec.stream import PayloadStream, Sink

__all__ = [
    "BuildReport",
    "Candidate",
    "ConstructionMode",
    "DCRConfig",
    "DCRHook",
    "OwnerState",
    "Sink",
    "enable_dcr",
]

log = logging.getLogger("dcr.owner")


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
    quantized_weights: int = 0  # this rank's group-owned weights with BF16 changes
    quantized_groups: int = 0  # their quantization groups requantized
    quantized_entries: int = 0  # quantized delta entries emitted
    seconds: float = 0.0
    detect_seconds: float = 0.0


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
        # DCR's CPU reductions run on a group that takes CPU tensors: the world itself, or a
        # gloo group over its ranks created here on an NCCL world (collectives.py)
        self.groups = with_host(groups if groups is not None else ParallelGroups.from_megatron())
        self.chunks = list(model_chunks)
        self.model = self.chunks[0]
        self.config = config
        sync_params(self.chunks)
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
        # trackers: committed stored bits of owned shards (affine tasks are projected from
        # them; owned residual tasks only use them for the changed flag)
        self.trackers: dict[int, torch.Tensor] = {} if full else host_trackers(self.owned)
        # parameters on a device are compared there, the baseline streamed in chunks
        self.scan = DeviceScan(config.detect_chunk_bytes)
        self.ledger = OwnerLedger()
        self.guard = CandidateGuard(
            self.owned,
            self.trackers,
            enabled=config.candidate_guard,
            rank=self.rank,
            device_scan=self.scan,
        )
        self.step_thread: int | None = None  # the thread of the last optimizer step seen
        self.last_report: BuildReport | None = None
        residual_tasks = [t for t in self.tasks if t.kind is TaskKind.RESIDUAL or full]
        self.residual = ResidualBaseline(residual_tasks, self.chunks, self.groups)
        self.quant: QuantizedOwner | None = None
        if config.quantization is not None:
            fmt = format_of(config.quantization)
            self.quant = QuantizedOwner(fmt, self.tasks, self.chunks, self.groups)
        warm_up()  # compile the detection scan now, not inside the first optimizer step

    # -- state ---------------------------------------------------------------------------
    @property
    def state(self) -> OwnerState:
        """Where this owner stands between two commits (`OwnerState`)."""
        return self.ledger.state

    @property
    def candidate(self) -> Candidate | None:
        """The last successful build's record until it is committed (None when IDLE)."""
        return self.ledger.candidate

    @property
    def committed_version(self) -> int:
        """The last version this owner committed (0: the weights at construction)."""
        return self.ledger.committed_version

    @property
    def residual_baseline(self) -> dict[str, torch.Tensor]:
        """Canonical name -> this rank's host copy of that residual tensor (residual.py)."""
        return self.residual.tensors

    @property
    def residual_tasks(self) -> list[Task]:
        return self.residual.tasks

    @property
    def guard_scans(self) -> int:
        """Candidate guards that scanned the shards."""
        return self.guard.scans

    @property
    def guard_held(self) -> int:
        """Guards answered without a scan (`verify_candidate` ``scan=False``)."""
        return self.guard.held

    @property
    def _built(self) -> tuple[int, dict[int, bytes]] | None:
        """(version, guard records) the guard can verify, else None (read by unit tests)."""
        version, c = self.ledger.last_built(), self.ledger.candidate
        return None if version is None or c is None else (version, dict(c.checks))

    @property
    def _delta(self) -> Mapping[int, tuple[np.ndarray, np.ndarray]]:
        """The candidate's recorded change per tracked shard (read by unit tests)."""
        c = self.ledger.candidate
        return {} if c is None else c.delta

    def baseline_bytes(self) -> dict[str, int]:
        """Host memory of this rank's baseline: trackers and residual baseline."""
        tr = sum(t.numel() * t.element_size() for t in self.trackers.values())
        rb = self.residual.nbytes()
        qb = {} if self.quant is None else self.quant.nbytes()
        return {
            "tracker_bytes": tr,
            "residual_bytes": rb,
            **qb,
            "baseline_bytes": tr + rb + sum(qb.values()),
        }

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

        `retry`: every record is an overwrite (repairs partial writes of a failed attempt);
        a retry of the candidate's version first runs the candidate guard (it must re-emit the
        same candidate). Payloads go to `sink` (or the config's sink, or ``self.payloads``)
        through a bounded queue while construction continues. Collective: every rank calls.
        A failed build records nothing (the state and candidate stay as they were).
        """
        if version <= self.committed_version:
            raise ProtocolError(f"version {version} <= committed {self.committed_version}")
        sync_params(self.chunks)
        if retry and self.ledger.holds(version):
            self.verify_candidate(version)  # the retry must re-emit the same candidate
        t0 = time.perf_counter()
        checks: dict[int, bytes] = {}
        delta: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        rep = BuildReport(version=version, attempt=attempt, retry=retry)
        meta = PayloadMeta(
            version=version,
            base_version=self.committed_version,
            attempt=attempt,
            owner=self.rank,
            sequence=0,
        )
        out = sink or self.config.sink or self.payloads.append
        with PayloadStream(meta, self.config.buckets(), out, self.config.queue_depth) as stream:
            self._affine(stream, rep, checks, delta, xor_ok=not retry)
            converted = self._residual(stream, rep, checks, delta)
            if self.quant is not None:  # collective: the quantized weights' group owners
                overwrite = retry or self.config.mode is not ConstructionMode.X
                q = self.quant.emit(
                    stream.add, overwrite=overwrite, overwrite_only=self.config.overwrite_only
                )
                rep.quantized_weights, rep.quantized_groups = q.weights, q.groups
                rep.quantized_entries = q.entries
            stream.finish()
        rep.items, rep.entries, rep.xor_entries = stream.items, stream.entries, stream.xor_entries
        rep.payloads, rep.payload_bytes = stream.payload_count, stream.stored_bytes
        counts = torch.tensor([rep.changed_elements, rep.owned_elements], dtype=torch.float64)
        counts = all_reduce(counts, self.groups.cpu_world.group)
        rep.element_change_rate = float(counts[0] / counts[1]) if counts[1] else 0.0
        rep.seconds = time.perf_counter() - t0
        self.ledger.built(
            Candidate(
                version=version,
                attempt=attempt,
                base_version=meta.base_version,
                retry=retry,
                checks=checks,
                delta=delta,
                residual=converted,
            )
        )
        self.last_report = rep
        log.info(
            "dcr build v%d attempt %d%s: %d payloads, %d bytes, %d entries (%d XOR), change rate "
            "%.4f, %.3fs (detect %.3fs)",
            version, attempt, " retry" if retry else "", rep.payloads, rep.payload_bytes,
            rep.entries, rep.xor_entries, rep.element_change_rate, rep.seconds,
            rep.detect_seconds,
        )  # fmt: skip
        return rep

    def _affine(
        self,
        stream: PayloadStream,
        rep: BuildReport,
        checks: dict[int, bytes],
        delta: dict[int, tuple[np.ndarray, np.ndarray]],
        *,
        xor_ok: bool,
    ) -> None:
        """Detection and projection of the tracked shards, largest first: record each changed
        shard's change in `delta` and emit its canonical records (`xor_ok`: not a retry)."""
        xor_ok = xor_ok and self.config.mode is ConstructionMode.X
        # taper estimate: the records still to come, extrapolated from those so far; unknown
        # (no taper) when residual conversion follows
        taper = not self.residual.tasks
        for t in self.scan_order:
            rep.owned_elements += t.param.numel()  # scanned so far (residual tasks after)
            td = time.perf_counter()
            local, new, base = changed_bits(t.param, self.trackers[t.index], self.scan)
            rep.detect_seconds += time.perf_counter() - td
            if self.guard.enabled:
                checks[t.index] = b""  # checked against `delta`
            if not local.size:
                continue
            delta[t.index] = (local, new)
            rep.changed_elements += int(local.size)
            items = project(
                t,
                local,
                new,
                base,
                xor_ok=xor_ok,
                overwrite_only=self.config.overwrite_only,
                owner=self.rank,
            )
            rest = sum(item.raw_bytes for item in items)
            later = (
                (stream.buffered_bytes + rest)
                * (self._scan_elements - rep.owned_elements)
                // max(rep.owned_elements, 1)
            )
            for item in items:
                rest -= item.raw_bytes
                if self.quant is not None and self.quant.take(item):
                    continue  # to its group owner (quantized.py)
                stream.add(item, after=rest + later if taper else None)

    def _residual(
        self,
        stream: PayloadStream,
        rep: BuildReport,
        checks: dict[int, bytes],
        delta: dict[int, tuple[np.ndarray, np.ndarray]],
    ) -> dict[str, torch.Tensor]:
        """Residual conversion: flag changed tasks (owned ones from the trackers; all-reduced),
        convert them with the bridge, compare with the residual baseline, emit overwrites.
        Returns the converted tensors this rank holds (the candidate's residual)."""
        tasks = self.residual.tasks
        if not tasks:
            return {}
        full = self.config.mode is ConstructionMode.F
        flags = torch.zeros(len(tasks), dtype=torch.int32)
        for i, t in enumerate(tasks):
            if t.index in self.owned_idx:
                rep.owned_elements += t.param.numel()
                record, changed = shard_state(
                    t.param, self.trackers.get(t.index), guard=self.guard.enabled, scan=self.scan
                )
                if self.guard.enabled:
                    checks[t.index] = record
                if changed is not None and changed[0].size:
                    delta[t.index] = changed
                if full or changed is None or changed[0].size:
                    flags[i] = 1
        if full:
            flags.fill_(1)
        selected = self.residual.select(flags)
        converted = self.residual.convert(selected)
        rep.residual_tasks_converted = len(selected)
        for name, new in converted.items():
            n, item = self.residual.overwrite(name, new, owner=self.rank)
            if full:
                rep.changed_elements += n
            if item is not None and not (self.quant is not None and self.quant.take(item)):
                stream.add(item)
        return converted

    def verify_candidate(self, version: int, *, scan: bool = True) -> None:
        """Raise `CandidateChanged` if this rank's owned parameters no longer hold what the build
        of `version` built from (one detection scan of the owned shards; changes nothing).
        With ``candidate_guard=False`` it checks nothing.

        ``scan=False``: the caller held the training thread from the build until now (the
        owner service, `OwnerService.serve`): only the protocol checks run (a build of
        `version` to verify; no second build of it, e.g. a wrapped optimizer step), not the
        shard scan. Counted in `guard_scans` / `guard_held` (guard.py)."""
        self.guard.verify(self.ledger, version, scan=scan)

    def commit(self, *, verify: bool = True) -> None:
        """The candidate version was committed: advance trackers and residual baseline in place
        to what the build emitted (its recorded changed indices and new bits scattered into the
        trackers: O(changed), no scan of the shards).

        `verify` (default): first the candidate guard (`verify_candidate`, one detection scan);
        refuses (`CandidateChanged`, nothing advanced) when the parameters moved since the
        build. The coordinator's owner service passes ``verify=False``: it verified before its
        compare-and-set, and once the commit record is durable the owners must advance to the
        candidate the engines hold; refusing then would split the owners from the record."""
        candidate = self.ledger.to_commit()
        if verify:
            self.verify_candidate(candidate.version)
        advance_trackers(self.trackers, candidate.delta)
        self.residual.advance(candidate.residual)
        if self.quant is not None:
            self.quant.advance()
        self.ledger.committed()

    def abort(self) -> None:
        """The attempt failed: keep the committed baseline (a retry rebuilds from it; the
        candidate's guard records stay for its guard)."""
        if self.quant is not None:
            self.quant.drop()
        self.ledger.aborted()

    def after_step(self) -> BuildReport | None:
        """Called after each optimizer step: builds the next version's delta (attempt 0)."""
        self.step_thread = threading.get_ident()
        return self.build(self.committed_version + 1, 0)


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
