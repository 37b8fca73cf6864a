"""The per-rank receiver: prewarm, stage, fetch, apply, commit, abort, dense load.

Works on any ``torch.nn.Module`` with a vLLM-style ``load_weights(iterable of (name, tensor))``;
`DCRWorkerExtension` holds one per vLLM worker and validates RPC arguments before calling it.
Who does what: the settings config.py (`ReceiverConfig`, from the worker's environment), states
and their transitions state.py, the prewarm probe capability.py, each tensor's class and what
its writes feed prewarm.py, placement (mode and plan)
placement.py, derived tensors derived.py, validation and dedupe staging.py, payload sources and
the fetch loop sources.py, the in-place application apply.py, waiting for the device's writes
before any ACK device.py, the ACK ack.py, the optional observer observer.py. Every payload must
have ``base_version == committed_version``; ``commit(target)`` moves applied -> clean at the new
version; ``dense_load(path, version)`` restores clean at any version.

Limitations:
1. One transition at a time; payloads for the next version are rejected until commit.
2. Request gating is the caller's job (`gate` callable): apply refuses while requests run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shared_codec import FORMAT_VERSION
from shared_codec.checkpoint import check_shapes, combined_digest, iter_checkpoint, tensor_digest
from shared_codec.coordination.protocol import RankAck
from shared_codec.dtypes import dtype_of
from shared_codec.errors import LoaderConditionError, PayloadError, ProtocolError
from shared_codec.kernels import warm_up
from shared_codec.records import Kind
from vllm_dcr_plugin import derived, device, prewarm, quantized
from vllm_dcr_plugin.ack import Tally
from vllm_dcr_plugin.apply import ItemCounter, PlanChecks, apply_staged
from vllm_dcr_plugin.capability import Capabilities, numel, probe
from vllm_dcr_plugin.config import ReceiverConfig
from vllm_dcr_plugin.intercept import named_storages
from vllm_dcr_plugin.metrics import ReceiverMetrics, process_memory
from vllm_dcr_plugin.observer import Call, CallObserver, ReceiverObserver, load_observer
from vllm_dcr_plugin.placement import (
    MODES,
    Placement,
    PlacementMode,
    PlacementPlan,
    current_tensors,
)
from vllm_dcr_plugin.prewarm import Prewarmed
from vllm_dcr_plugin.sources import FetchSteps, fetch_attempt, payload_source
from vllm_dcr_plugin.staging import SealedSet, StagingArea, TensorSpec, tensor_specs
from vllm_dcr_plugin.state import Event, ReceiverState, advance, check_apply, check_next

_S = ReceiverState
log = logging.getLogger(__name__)


class Receiver:
    """Receiver of one rank (see the module docstring). Methods return plain values.

    `config`: the receiver's settings (default: `ReceiverConfig.from_env()`); `placement`
    overrides its start-up placement mode; `observer` overrides the observer its config names;
    `role`: ``"base"``, or ``"draft"`` for a speculative draft model's receiver, whose
    `shared_with` (the target model) owns storage the draft shares: tensors written only there
    are the target receiver's (capability.probe, ``shared``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        rank: dict[str, int],
        gate: Callable[[], str | None] | None = None,
        loader_condition: Callable[[], str | None] | None = None,
        placement: str | None = None,
        config: ReceiverConfig | None = None,
        observer: ReceiverObserver | None = None,
        role: str = "base",
        shared_with: torch.nn.Module | None = None,
    ) -> None:
        config = config if config is not None else ReceiverConfig.from_env()
        mode = (
            config.placement if placement is None else PlacementMode.parse(placement, "placement")
        )
        self.config = config
        self.placing = Placement(mode)
        self.model = model
        self.rank = rank
        self.role = role
        self.shared_with = shared_with
        self.gate = gate or (lambda: None)
        self.loader_condition = loader_condition or (lambda: None)
        self.observer = observer if observer is not None else load_observer(config.observer)
        self.tensors: dict[str, TensorSpec] = {}
        self.found = Prewarmed()  # each tensor's class, what its writes feed (prewarm.py)
        self.scratch: torch.Tensor | None = None
        self.staging = StagingArea(key=config.payload_key)
        self.committed_version = 0
        self.state = _S.CLEAN
        self.applying_attempt: int | None = None  # the attempt of state "applying"
        self.target_version: int | None = None
        self.last_ack: RankAck | None = None
        self.apply_calls = 0  # every apply (or pipelined part) so far: versions.weights_state
        self.metrics = ReceiverMetrics(
            self._rank, port=config.metrics_port, addr=config.metrics_addr
        )

    @property
    def placement(self) -> PlacementMode:
        """The current placement mode (equal to its string, ``"plan"`` or ``"loader"``)."""
        return self.placing.mode

    @property
    def plan(self) -> PlacementPlan | None:
        """The placement plan of the latest loader trace (None before prewarm)."""
        return self.placing.plan

    @property
    def _rank(self) -> int:
        return int(self.rank.get("rank", 0))

    @contextlib.contextmanager
    def _partial_loads(self) -> Iterator[None]:
        """The scope of ``load_weights`` calls that pass some tensors only (prewarm traces and
        applies): the checkpoint format of quantized layers (quantized.py), and vLLM's MTP
        completeness check off, as vLLM's own weight-transfer engines turn it off (an MTP
        draft's loader otherwise refuses any call without an MTP layer tensor)."""
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with quantized.checkpoint_format(self.model), disable_mtp_completeness_check():
            yield

    def _probe(self, specs: dict[str, TensorSpec], scratch: torch.Tensor) -> Capabilities:
        """The loader's trace of `specs` (capability.probe; every write suppressed). Storage of
        the model this one shares storage with (a draft's target) is another receiver's."""
        shared = () if self.shared_with is None else named_storages(self.shared_with)
        return probe(self.model, specs, scratch, self.loader_condition(), frozenset(shared))

    def prewarm(self, tensors: list, committed_version: int = 0) -> dict[str, Any]:
        """Register canonical tensors, reserve scratch, and trace the loader once per tensor
        with every write into model storage suppressed (capability.py). Returns the report."""
        after = advance(self.state, Event.PREWARM) if self.tensors else _S.CLEAN
        specs = tensor_specs(tensors)
        sizes = [dtype_of(s.dtype).itemsize * numel(s.shape) for s in specs.values()]
        try:
            scratch = torch.zeros(max(sizes, default=0), dtype=torch.uint8)
        except (RuntimeError, MemoryError) as e:  # a shape no model has: refuse, not raise
            raise ProtocolError(
                f"tensors: the largest tensor needs {max(sizes)} bytes of scratch, which "
                f"cannot be allocated ({type(e).__name__}); nothing changed"
            ) from None
        # compile the scatter kernels now, not inside the first timed apply
        warm_up(tuple(dtype_of(s.dtype).itemsize for s in specs.values()))

        def trace() -> Capabilities:
            with self._partial_loads():
                return self._probe(specs, scratch)

        self.found, caps = prewarm.find(self.model, specs, trace)
        self.scratch, self.tensors = scratch, specs
        self.placing.plan = caps.plan
        self.committed_version = int(committed_version)
        self.state = after
        self.staging.new_transition()
        return {
            "format_version": FORMAT_VERSION,
            **self.rank,
            "tensors": len(specs),
            **self.found.report(self.role),
            "scratch_bytes": int(scratch.numel()),
            "committed_version": self.committed_version,
            **self.placing.report(),
            "derived": dict(self.found.derived.report),
            "quantized": quantized.report(self.model),
        }

    def set_placement(self, mode: str) -> dict[str, Any]:
        """Choose how later applies place direct-path items: ``plan`` (replay the recorded
        placement) or ``loader`` (every item through ``load_weights``; each counted as a
        ``loader_mode`` fall back). Returns the previous and the new mode."""
        if mode not in MODES:
            raise ProtocolError(f"placement mode {mode!r}: expected one of {MODES}")
        previous = self.placing.set_mode(PlacementMode(mode))
        log.info("placement mode %s -> %s", previous.value, mode)
        return {**self.rank, "previous": previous.value, "placement": mode}

    def verify_plan(self) -> dict[str, Any]:
        """Re-trace the loader for every registered tensor (side-effect free, as prewarm) and
        compare the fresh placement plan with the kept one. The fresh plan replaces the kept
        one either way (placement always follows the loader's latest trace); differences and
        stale parameters are reported, counted (``dcr_plan_mismatches_total``) and logged."""
        scratch = self._require_prewarm()
        gate = self.gate()
        if gate:
            raise ProtocolError(f"request gate closed for verify_plan: {gate}")
        old = self.placing.plan or PlacementPlan()
        with self._partial_loads():
            stale = old.stale(current_tensors(self.model, old.params))
            caps = self._probe(self.tensors, scratch)
        diff = old.differences(caps.plan)
        found = self.found.retraced(caps)  # refusals of derived tensors and quantized layers stand
        classes_changed = not found.same_classes(self.found)
        self.placing.plan, self.found = caps.plan, found
        if diff:
            self.metrics.plan_mismatches.inc(len(diff))
            log.warning(
                "dcr_verify_plan: %d tensors' placement changed: %s",
                len(diff),
                dict(list(diff.items())[:4]),
            )
        return {
            **self.rank,
            "matches": not diff and not stale,
            "differences": diff,
            "stale_before": stale,
            "classes_changed": classes_changed,
            **self.placing.report(),
        }

    def _require_prewarm(self) -> torch.Tensor:
        if self.scratch is None:
            raise ProtocolError(
                "dcr_prewarm has not been called on this rank: call "
                "collective_rpc('dcr_prewarm', args=(tensors,)) before staging or applying"
            )
        return self.scratch

    def stage(self, payloads: list, overwrite_only: bool = False) -> dict[str, Any]:
        """Validate, deduplicate and keep payloads (see staging.py). Returns lists of ids.
        `overwrite_only` (a retry): XOR items are rejected for every tensor."""
        self._require_prewarm()
        res = self.staging.stage(
            list(payloads),
            committed_version=self.committed_version,
            tensors=self.tensors,
            no_xor=set(self.tensors) if overwrite_only else set(self.found.overwrite_only),
            unsupported=set(self.found.unsupported),
        )
        res["rank"] = self.rank.get("rank", 0)
        self.metrics.staged(res, sum(len(p) for p in payloads))
        return res

    def fetch(
        self,
        store_spec: Any,
        version: int,
        attempt: int,
        timeout_s: float = 60.0,
        apply: dict[str, Any] | None = None,
        overwrite_only: bool = False,
    ) -> dict[str, Any]:
        """Fetch and stage every payload of the attempt from a store or a relay node's spool
        (the loop: sources.fetch_attempt); returns counts. A rejected payload fails the fetch
        (with `overwrite_only` an XOR item is one); the attempt must hold exactly the set its
        seal names (`ProtocolError` otherwise, nothing applied), and a later `apply` of the
        attempt is held to it. Pipelined (``apply`` given: ``{"verify": bool}``): payloads are
        applied as they arrive; the result carries the attempt's merged ACK under ``"ack"``
        and the receiver is ``applied``, or ``dirty`` after a failure once part of the attempt
        was applied (also when the final set is not the sealed set)."""
        self._require_prewarm()
        t0 = time.perf_counter()
        version, attempt, pipelined = int(version), int(attempt), apply is not None
        source = payload_source(store_spec, key=self.staging.key)
        verify = bool((apply or {}).get("verify", False))
        checks = PlanChecks()  # each planned parameter resolved and checked once per fetch

        def part(final: bool, watch: CallObserver | None) -> RankAck:
            return self._metered(attempt, verify, watch, final=final, checks=checks)

        steps = FetchSteps(
            stage=lambda payload: self.stage([payload], overwrite_only),
            seal=self.staging.seal,
            check_sealed=lambda: self.staging.take(attempt),
            apply=part if pipelined else None,
        )
        try:
            out, acks = fetch_attempt(
                source,
                version,
                attempt,
                float(timeout_s),
                steps,
                rank=self._rank,
                observer=self.observer,
                role=self.role,
            )
        except BaseException:
            if self.state == _S.APPLYING:  # part of the attempt is in the weights
                self.state = advance(self.state, Event.FAILED)
            raise
        out["seconds"] = time.perf_counter() - t0
        out["rank"] = self.rank.get("rank", 0)
        self.metrics.fetch_seconds.observe(out["seconds"])
        if pipelined:
            out["ack"] = RankAck.merge(acks).to_wire()
        return out

    def apply(
        self, attempt: int, verify: bool = False, expect: SealedSet | None = None
    ) -> dict[str, Any]:
        """Apply every staged payload of `attempt` in place (apply.py); returns the ACK (a
        plain dict, ack.py). Refused with `ProtocolError` before any write when prewarm is
        missing, the gate is closed, the attempt was aborted, payloads mix target versions, an
        applied version awaits commit, XOR items arrive while the weights are not exactly
        the committed version, or the attempt does not hold exactly its sealed set (`expect`,
        and the seal a fetch recorded: ids, count, version and base version; staging.py). A
        failure part-way leaves the receiver ``dirty``. Writes are in place (every parameter
        and buffer keeps its storage address: device.storage_pointers) and finished on the
        device before the ACK is returned (device.synchronize); an error the device reports
        then fails the ACK."""
        watch = (
            None
            if self.observer is None
            else self.observer.begin(self._rank, Call.APPLY, self.role)
        )
        return self._metered(int(attempt), bool(verify), watch, final=True, expect=expect).to_wire()

    def _metered(
        self,
        attempt: int,
        verify: bool,
        watch: CallObserver | None,
        final: bool,
        expect: SealedSet | None = None,
        checks: PlanChecks | None = None,
    ) -> RankAck:
        t0 = time.perf_counter()
        ack = self._apply(attempt, verify, watch, final, expect, checks)
        self.metrics.applied(ack.to_wire(), time.perf_counter() - t0)
        self.last_ack = ack
        self.apply_calls += 1
        return ack

    def _apply(
        self,
        attempt: int,
        verify: bool,
        watch: CallObserver | None,
        final: bool,
        expect: SealedSet | None = None,
        checks: PlanChecks | None = None,
    ) -> RankAck:
        """See `apply`. ``final=False`` (pipelined fetch): more payloads of the attempt may
        follow; the receiver is then ``applying`` instead of ``applied`` (a recorded seal then
        refuses only payloads beyond it). `watch`: the call's observer (told before each item);
        `checks`: the plan state of the fetch's earlier parts (apply.PlanChecks), None for a
        fresh one."""
        scratch = self._require_prewarm()
        gate = self.gate()
        if gate:
            raise ProtocolError(f"request gate closed for apply: {gate}")
        if attempt in self.staging.fenced:
            raise ProtocolError(f"attempt {attempt} was aborted; start a new attempt")
        if expect is not None and expect.base_version not in (None, self.committed_version):
            raise ProtocolError(
                f"attempt {attempt} is sealed on base version {expect.base_version}; this "
                f"receiver's committed version is {self.committed_version}"
            )
        staged = self.staging.take(attempt, expect, complete=final)
        targets = {p.header.meta.version for p in staged}
        if len(targets) > 1:
            raise ProtocolError(f"attempt {attempt} mixes target versions {sorted(targets)}")
        target = targets.pop() if targets else None
        sealed = expect if expect is not None else self.staging.sealed.get(attempt)
        if target is None and final and sealed is not None and not sealed.payload_ids:
            target = sealed.version  # a sealed version with nothing to send (no bit changed)
        if self.state == _S.APPLYING and self.applying_attempt != attempt:
            # another attempt's payloads are partly in the weights
            self.state = advance(self.state, Event.INTERRUPTED)
        has_xor = any(e.kind == Kind.XOR for p in staged for e in p.header.items)
        check_apply(
            self.state,
            attempt=attempt,
            applying_attempt=self.applying_attempt,
            target=target,
            target_version=self.target_version,
            has_xor=has_xor,
        )
        tally = Tally(attempt=attempt, rank=self._rank, target_version=target, verify=verify)
        touched = {it.name for p in staged for it in p.header.items}
        t_start = time.perf_counter()
        try:
            with self._partial_loads():
                apply_staged(
                    self.model,
                    staged,
                    tally,
                    scratch=scratch,
                    staging=self.staging,
                    skipped=set(self.found.skipped),
                    masked=set(self.found.overwrite_only),
                    verify=verify,
                    counter=ItemCounter(watch),
                    plan=self.placing.replayed(),
                    checks=checks,
                )
        except (LoaderConditionError, PayloadError, RuntimeError, ValueError) as e:
            self.metrics.placed(tally)
            if tally.touched or self.state == _S.APPLYING:
                self._failed(target)
                self.found.rederive(self.model, touched)
            late = device.settle(self.model)  # a failed ACK too follows the writes made
            then = "" if late is None else f"; then the device reported: {late}"
            return tally.ack(ok=False, error=f"{type(e).__name__}: {e}{then}")
        self.found.rederive(self.model, touched)
        late = device.settle(self.model)
        tally.total_s = time.perf_counter() - t_start
        self.metrics.placed(tally)
        if late is not None:  # a write may have failed on the device: a mixture, maybe
            if tally.touched or self.state == _S.APPLYING:
                self._failed(target)
            return tally.ack(ok=False, error=f"device error after the writes: {late}")
        if verify and tally.mismatches:
            self._failed(target)
            return tally.ack(
                ok=False, error=f"post-apply check found {tally.mismatches} mismatches"
            )
        if target is not None or self.state == _S.APPLYING:
            self.state = advance(self.state, Event.APPLIED if final else Event.PART_APPLIED)
            self.applying_attempt = None if final else attempt
            self.target_version = target or self.target_version
        return tally.ack(ok=True)

    def _failed(self, target: int | None) -> None:
        self.state = advance(self.state, Event.FAILED)
        self.target_version = target or self.target_version

    def commit(self, version: int) -> dict[str, Any]:
        """The coordinator committed `version`: make it this receiver's committed version."""
        version = int(version)
        if version == self.committed_version:  # a repeated commit (e.g. a resuming coordinator)
            return {"committed_version": version, "changed": False, "state": self.state.value}
        if self.state != _S.APPLIED or self.target_version != version:
            raise ProtocolError(
                f"cannot commit version {version}: receiver is {self.state} with target "
                f"{self.target_version} and committed {self.committed_version}"
            )
        self.state = advance(self.state, Event.COMMIT)
        self.committed_version = version
        self.target_version = None
        self.staging.new_transition()
        self.metrics.committed.set(version)
        return {"committed_version": version, "changed": True}

    def abort(self, attempt: int) -> dict[str, Any]:
        """Fence `attempt`: drop its staged payloads and refuse its late payloads."""
        dropped = self.staging.fence(int(attempt))
        if self.state == _S.APPLYING and self.applying_attempt == int(attempt):
            self.state = advance(self.state, Event.INTERRUPTED)  # partly in the weights
        return {"attempt": int(attempt), "dropped": dropped, "state": self.state.value}

    def digest(self) -> dict[str, Any]:
        """Per-name digests of every parameter and buffer of this rank, and a combined one."""
        per = {n: tensor_digest(t) for n, t in self.model.named_parameters()}
        per.update({f"buffer:{n}": tensor_digest(t) for n, t in self.model.named_buffers()})
        named = set(per) | {n.removeprefix("buffer:") for n in per}
        per.update(derived.attribute_digests(self.model, named))  # derived plain attributes
        per.update(quantized.digests(self.model))  # what quantized kernels keep out of reach
        return {**self.rank, "digest": combined_digest(per), "tensors": per}

    def dense_load(self, path: str, version: int) -> dict[str, Any]:
        """Dense refit from a canonical checkpoint directory through ``load_weights``; the
        receiver is then clean at `version` (how new or restarted receivers join). Returns
        once the writes are finished on the device (device.synchronize)."""
        gate = self.gate()
        if gate:
            raise ProtocolError(f"request gate closed for dense load: {gate}")
        self.check_checkpoint(path, "dense-load path")
        t0 = time.perf_counter()
        try:
            with quantized.checkpoint_format(self.model):
                loaded = self.model.load_weights(iter_checkpoint(path))  # type: ignore[operator]
        except Exception as e:  # the loader stopped part-way: weights are a mixture
            self.state = advance(self.state, Event.FAILED)
            raise LoaderConditionError(
                f"dense load of {path} failed part-way ({type(e).__name__}: {e}); the receiver "
                f"is dirty at committed version {self.committed_version}: dense-load a good "
                "checkpoint or retry with overwrites"
            ) from None
        self.found.rederive(self.model, None)
        late = device.settle(self.model)
        if late is not None:
            self.state = advance(self.state, Event.FAILED)
            raise LoaderConditionError(
                f"dense load of {path}: the device reported an error after the writes ({late}); "
                f"the receiver is dirty at committed version {self.committed_version}"
            )
        self.metrics.dense_loads.inc()
        self.metrics.committed.set(int(version))
        self.committed_version = int(version)
        self.state = advance(self.state, Event.DENSE_LOAD)
        self.target_version = None
        self.staging.new_transition()
        return {
            **self.rank,
            "loaded": len(loaded) if loaded is not None else None,
            "seconds": time.perf_counter() - t0,
            "committed_version": int(version),
        }

    def check_version(self, version: int, what: str) -> None:
        """`ProtocolError` naming `what` when `version` is not the next one after this
        receiver's committed version (state.check_next)."""
        check_next(version, self.committed_version, what)

    def check_checkpoint(self, path: str, what: str) -> None:
        """`ProtocolError` naming `what` (nothing loaded) when a tensor of the checkpoint at
        `path` that the prewarm table names has another shape: a checkpoint of another model
        would stop the loader part-way. Reads the files' headers only."""
        if self.tensors:
            check_shapes(path, {n: spec.shape for n, spec in self.tensors.items()}, what)

    def memory(self, reset_peak: bool = False) -> dict[str, Any]:
        """RSS and peak RSS of this process (metrics.process_memory), scratch and staged bytes."""
        return {
            **self.rank,
            **process_memory(reset_peak),
            "scratch_bytes": 0 if self.scratch is None else int(self.scratch.numel()),
            "staged_bytes": self.staging.staged_bytes,
        }

    def status(self) -> dict[str, Any]:
        return {
            **self.rank,
            "state": self.state.value,
            "committed_version": self.committed_version,
            "target_version": self.target_version,
            "prewarmed": self.scratch is not None,
            "staged_payloads": sum(len(v) for v in self.staging.staged.values()),
            "staged_bytes": self.staging.staged_bytes,
        }
