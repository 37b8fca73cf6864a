"""Apply the staged payloads of an attempt in place: replayed placement, or through the native
loader.

`apply_staged` decodes each staged payload and applies its items in order, counting into the
ACK's `Tally` (ack.py) and reporting how far a failure got: runs of items the placement plan
holds go to `replay_batch` (placement.py: the loader's recorded copies, no ``load_weights``
call; the same `scatter.scatter_direct` as the loader path's direct writes), the others through
`loader_apply.plan_batches` and `loader_apply.apply_batch` (one ``load_weights`` call per batch
under the write-intercepting mode). Both paths pull items through one `ItemCounter`, which
tells the receiver's optional observer (observer.py) before each item.

Limitations:
1. A failure inside a batch fails the attempt with every item of the batch reported as possibly
   partial (the receiver is then dirty; an overwrite retry repairs it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared_codec.decode import decode_payload
from shared_codec.errors import LoaderConditionError
from shared_codec.records import DeltaItem
from vllm_dcr_plugin.ack import Tally
from vllm_dcr_plugin.intercept import ViewGeom, named_storages, param_snapshot
from vllm_dcr_plugin.loader_apply import apply_batch, plan_batches
from vllm_dcr_plugin.observer import CallObserver
from vllm_dcr_plugin.placement import PlacementPlan, current_tensors, replay_items
from vllm_dcr_plugin.scatter import Check, ItemResult, count_mismatches, scatter_direct
from vllm_dcr_plugin.staging import StagedPayload, StagingArea

log = logging.getLogger(__name__)


class ItemCounter:
    """The per-item hook of both apply paths: tells the call's observer (if any) before each
    item is pulled, then counts it (`pulled`). `refused`: the observer raised (before the item
    was pulled, so every item pulled before it is complete)."""

    def __init__(self, observer: CallObserver | None = None) -> None:
        self.observer = observer
        self.pulled = 0
        self.refused = False

    def __call__(self, item: DeltaItem) -> None:
        if self.observer is not None:
            try:
                self.observer.before_item(item)
            except BaseException:
                self.refused = True
                raise
        self.pulled += 1


@dataclass
class PlanChecks:
    """What the applies of one attempt have resolved about the placement plan: the planned
    parameters looked up so far (`current`), those found stale, and the integer views over their
    storages (`words`). `apply_staged` fills it; the receiver keeps one across the parts of one
    pipelined fetch, so each parameter is resolved and checked once per fetch instead of once per
    part (nothing else runs on the worker between the parts of a fetch, and a loader batch that
    rebinds a parameter fails the attempt), and a fresh one for every other apply."""

    current: dict[str, torch.Tensor | None] = field(default_factory=dict)
    stale: dict[str, str] = field(default_factory=dict)
    words: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)


def runs(
    items: list[DeltaItem], replayable: Callable[[str], bool]
) -> list[tuple[bool, list[DeltaItem]]]:
    """Split `items` (in order) into maximal runs of replayable / loader-path items."""
    out: list[tuple[bool, list[DeltaItem]]] = []
    for item in items:
        r = replayable(item.name)
        if out and out[-1][0] == r:
            out[-1][1].append(item)
        else:
            out.append((r, [item]))
    return out


def apply_staged(
    model: torch.nn.Module,
    staged: list[StagedPayload],
    tally: Tally,
    *,
    scratch: torch.Tensor,
    staging: StagingArea,
    skipped: set[str],
    masked: set[str],
    verify: bool,
    counter: ItemCounter,
    plan: PlacementPlan | None = None,
    checks: PlanChecks | None = None,
) -> None:
    """Apply `staged` payloads in order, counting into `tally` and marking each payload
    applied in `staging` once complete. Items `plan` holds (placement.py) are replayed through
    their recorded copies with no loader call; the others go through the loader batch by batch
    (`plan_batches`, `apply_batch`). `plan=None` (placement mode ``loader``) sends every item
    through the loader. Every direct-path item that does not replay is a fall back, counted by
    reason in ``tally.fallbacks`` (``loader_mode``, ``stale``: its parameters changed since the
    trace, ``not_planned``: excluded at prewarm) and logged; masked-path items are loader items
    by design, not fall backs.

    ``tally.touched`` says whether any batch reached the weights (they may have changed). On
    a failure the exception propagates with `tally` saying how far it got: items are applied in
    order, so items pulled before the failing one are complete and the last one pulled may be
    partial (``tally.partial_item``), except when the observer refused the next item (raised
    before it was pulled). `counter` is the per-item hook of both paths (it counts pulled items
    and tells the observer). `checks` (PlanChecks) carries the plan's resolved and
    checked parameters from earlier parts of the same attempt; None: a fresh one."""
    # model walks only when a loader batch runs; planned parameters are resolved by name
    storages: dict[int, str] | None = None
    before: dict[str, tuple[int, tuple[int, ...]]] | None = None
    checks = checks if checks is not None else PlanChecks()
    stale, current = checks.stale, checks.current

    def check_plan(items: list[DeltaItem]) -> None:
        assert plan is not None
        params = plan.params_of(it.name for it in items) - current.keys()
        if not params:
            return
        now = current_tensors(model, params)
        current.update(now)
        found = plan.stale(now)
        if found and not stale:
            first = next(iter(found.items()))
            log.warning(
                "placement plan stale for %d tensors (e.g. %s: %s); they go through "
                "load_weights until dcr_prewarm or dcr_verify_plan records a new plan",
                len(found),
                *first,
            )
        stale.update(found)

    def replayable(name: str) -> bool:
        return plan is not None and name in plan.tensors and name not in stale

    def fallback(name: str) -> str | None:
        if name in masked:
            return None
        if plan is None:
            return "loader_mode"
        return "stale" if name in stale else "not_planned"

    for sp in staged:
        t0 = time.perf_counter()
        payload = sp.decoded or decode_payload(sp.data, key=staging.key, max_body=staging.max_body)
        tally.decode_s += time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.thread_time()
        items = [it for it in payload.items if it.name not in skipped]
        tally.skipped_items += len(payload.items) - len(items)
        if plan is not None:
            check_plan(items)
        for replay, run in runs(items, replayable):
            batches = [run] if replay else plan_batches(run, scratch.numel(), masked)
            for batch in batches:
                tally.touched = True
                done = counter.pulled
                try:
                    if replay:
                        assert plan is not None
                        results = replay_batch(plan, batch, current, verify, counter, checks.words)
                    else:
                        if storages is None or before is None:
                            storages, before = named_storages(model), param_snapshot(model)
                        results = apply_batch(
                            model,
                            batch,
                            scratch=scratch,
                            model_storages=storages,
                            masked=masked,
                            verify=verify,
                            before_item=counter,
                        )
                except Exception:
                    if counter.refused:  # raised before the next item: nothing partial
                        tally.items += counter.pulled - done
                        raise
                    tally.items += max(0, counter.pulled - done - 1)
                    tally.partial_item = batch[max(0, counter.pulled - done - 1)].name
                    raise
                tally.items += len(batch)
                if replay:
                    tally.plan_items += len(batch)
                else:
                    tally.loader_items += len(batch)
                    tally.batches += 1
                    for item in batch:
                        why = fallback(item.name)
                        if why is not None:
                            tally.fallbacks[why] = tally.fallbacks.get(why, 0) + 1
                for item, res in zip(batch, results, strict=True):
                    tally.elements_written += res.elements_written
                    tally.bytes += item.raw_bytes
                    if verify:
                        tally.mismatches += res.mismatches
        if before is not None and param_snapshot(model) != before:
            raise LoaderConditionError("the loader rebound parameters during apply")
        tally.apply_s += time.perf_counter() - t0
        tally.apply_cpu_s += time.thread_time() - c0
        tally.payloads += 1
        tally.compressed_bytes += len(sp.data)
        staging.mark_applied(tally.attempt, sp.header.payload_id)
    if tally.fallbacks:
        log.info("apply attempt %d: loader-path fall backs %s", tally.attempt, tally.fallbacks)


def replay_batch(
    plan: PlacementPlan,
    batch: list[DeltaItem],
    current: dict[str, torch.Tensor | None],
    verify: bool,
    before_item: Callable[[DeltaItem], None],
    words: dict[tuple[str, int], torch.Tensor] | None = None,
) -> list[ItemResult]:
    """Apply `batch` (planned items) through the plan's recorded copies (placement.py);
    `words` keeps the parameters' storage views across batches (PlanChecks.words)."""
    checks: list[Check] = []

    def scatter(item: DeltaItem, src: ViewGeom, words: torch.Tensor, dest: ViewGeom) -> int:
        return scatter_direct(item, src, words, dest, checks, verify)

    done = replay_items(plan, batch, current, scatter, before_item, words)
    results = []
    for item, (n, params) in zip(batch, done, strict=True):
        r = ItemResult(name=item.name, entries=item.count, path="plan")
        r.elements_written, r.dest_params = n, params
        r.copies = len(plan.tensors[item.name])
        results.append(r)
    if verify and results:
        results[0].mismatches = count_mismatches(checks)
    return results
