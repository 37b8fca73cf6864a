"""The receiver state machine of one rank: prewarm, stage, apply, commit, abort, dense load.

Works on any ``torch.nn.Module`` with a vLLM-style ``load_weights(iterable of (name, tensor))``;
`DCRWorkerExtension` holds one per vLLM worker. States:

- ``clean``: weights are exactly the committed version. XOR and overwrite items accepted.
- ``applying``: a pipelined attempt (`fetch` with ``apply``) has applied the payloads that
  arrived so far, consistently; more of the same attempt may follow (XOR still accepted for it).
  Aborting it or applying another attempt makes the receiver ``dirty``.
- ``applied``: an attempt for (committed -> target) applied completely; awaiting ``commit``.
- ``dirty``: an attempt failed part-way; weights are a mixture. Only overwrite items (a retry of
  the complete changed set) are accepted until an attempt succeeds.

``commit(target)`` moves applied -> clean at the new version; ``dense_load(path, version)``
restores clean at any version. Every payload must have ``base_version == committed_version``.

Limitations:
1. One transition at a time; payloads for the next version are rejected until commit.
2. Request gating is the caller's job (`gate` callable): apply refuses while requests run.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from shared_codec import FORMAT_VERSION
from shared_codec.checkpoint import combined_digest, iter_checkpoint, tensor_digest
from shared_codec.dtypes import dtype_of
from shared_codec.errors import LoaderConditionError, PayloadError, ProtocolError
from shared_codec.format import decode_payload
from shared_codec.kernels import warm_up
from shared_codec.records import Kind
from vllm_dcr_plugin.apply import apply_batch, plan_batches
from vllm_dcr_plugin.intercept import (
    TraceHandler,
    ViewGeom,
    WriteInterceptMode,
    storage_key,
)
from vllm_dcr_plugin.metrics import ReceiverMetrics
from vllm_dcr_plugin.staging import StagingArea, TensorSpec

KEY_ENV = "DCR_PAYLOAD_KEY"


def key_from_env() -> bytes | None:
    """The shared payload secret from ``DCR_PAYLOAD_KEY`` (hex), if set."""
    raw = os.environ.get(KEY_ENV, "").strip()
    if not raw:
        return None
    try:
        return bytes.fromhex(raw)
    except ValueError:
        raise ProtocolError(f"{KEY_ENV} must be hex-encoded") from None


class _InjectedFailure(LoaderConditionError):
    """Fault injection (`fail_after_items`): raised before the loader pulls the next item."""


class Receiver:
    """Receiver state for one rank (see module docstring). Methods return plain values."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        rank: dict[str, int],
        gate: Callable[[], str | None] | None = None,
        loader_condition: Callable[[], str | None] | None = None,
    ) -> None:
        self.model = model
        self.rank = rank
        self.gate = gate or (lambda: None)
        self.loader_condition = loader_condition or (lambda: None)
        self.tensors: dict[str, TensorSpec] = {}
        self.skipped: set[str] = set()
        self.overwrite_only: dict[str, str] = {}
        self.unsupported: dict[str, str] = {}
        self.scratch: torch.Tensor | None = None
        self.staging = StagingArea(key=key_from_env())
        self.committed_version = 0
        self.state = "clean"
        self.applying_attempt: int | None = None  # the attempt of state "applying"
        self.target_version: int | None = None
        self.last_ack: dict[str, Any] | None = None
        self.metrics = ReceiverMetrics(int(rank.get("rank", 0)))

    # -- model storage -------------------------------------------------------------------
    def _named_storages(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for name, t in list(self.model.named_parameters()) + list(self.model.named_buffers()):
            if t.numel():
                out.setdefault(storage_key(t), name)
        return out

    def _param_snapshot(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        return {
            n: (storage_key(p), tuple(p.shape))
            for n, p in list(self.model.named_parameters()) + list(self.model.named_buffers())
        }

    # -- prewarm ---------------------------------------------------------------------------
    def prewarm(self, tensors: list, committed_version: int = 0) -> dict[str, Any]:
        """Register canonical tensors, reserve scratch, and trace the loader once per tensor
        with every write into model storage suppressed. Returns the capability report."""
        if self.state != "clean" and self.tensors:
            raise ProtocolError("prewarm during a transition; commit or dense-load first")
        specs: dict[str, TensorSpec] = {}
        for entry in tensors:
            name, dtype, shape = entry[0], entry[1], entry[2]
            specs[str(name)] = TensorSpec(dtype_of(str(dtype)).name, tuple(int(s) for s in shape))
        largest = max(
            (dtype_of(s.dtype).itemsize * _numel(s.shape) for s in specs.values()), default=0
        )
        self.scratch = torch.zeros(largest, dtype=torch.uint8)
        # compile the scatter kernels now, not inside the first timed apply
        warm_up(tuple(dtype_of(s.dtype).itemsize for s in specs.values()))
        storages = self._named_storages()
        before = self._param_snapshot()
        saved = {n: p.data for n, p in self.model.named_parameters()}
        condition = self.loader_condition()
        skipped: set[str] = set()
        overwrite_only: dict[str, str] = {}
        unsupported: dict[str, str] = {}
        coverage: dict[str, list[tuple[str, ViewGeom]]] = {}
        for name, spec in specs.items():
            if condition:
                unsupported[name] = condition
                continue
            d = dtype_of(spec.dtype)
            view = self.scratch[: d.itemsize * _numel(spec.shape)].view(d.torch_dtype)
            view = view.view(spec.shape)
            handler = TraceHandler(storages, storage_key(self.scratch))
            try:
                with WriteInterceptMode(storages, handler):
                    loaded = self.model.load_weights([(name, view)])  # type: ignore[operator]
            except Exception as e:  # the loader refused this tensor: cannot refit it in place
                unsupported[name] = f"loader raised {type(e).__name__}: {e}"
                continue
            finally:
                after = self._param_snapshot()
                if after != before:
                    self._restore_rebinding(saved)
            if after != before:
                unsupported[name] = "loader rebinds parameters (param.data = ...)"
                continue
            reason = _classify(handler.records, set(loaded) if loaded is not None else None)
            if reason == "skip":
                skipped.add(name)
            elif reason.startswith("unsupported:"):
                unsupported[name] = reason.removeprefix("unsupported: ")
            else:
                if reason:
                    overwrite_only[name] = reason
                for r in handler.records:
                    if r.op.startswith("copy_"):
                        coverage.setdefault(r.param, []).append((name, r.dest))
        for name, why in _overlaps(coverage).items():
            overwrite_only.setdefault(name, why)
        if self.scratch.numel() and int(self.scratch.count_nonzero()):
            raise AssertionError("prewarm left non-zero scratch")
        self.tensors = specs
        self.skipped = skipped
        self.overwrite_only = overwrite_only
        self.unsupported = unsupported
        self.committed_version = int(committed_version)
        self.state = "clean"
        self.staging.new_transition()
        return {
            "format_version": FORMAT_VERSION,
            **self.rank,
            "tensors": len(specs),
            "skipped": sorted(skipped),
            "overwrite_only": dict(sorted(overwrite_only.items())),
            "unsupported": dict(sorted(unsupported.items())),
            "scratch_bytes": int(self.scratch.numel()),
            "committed_version": self.committed_version,
        }

    def _restore_rebinding(self, saved: dict[str, torch.Tensor]) -> None:
        """Undo ``param.data = ...`` done by a traced loader (keeps prewarm side-effect free)."""
        params = dict(self.model.named_parameters())
        for name, data in saved.items():
            p = params.get(name)
            if (
                p is None
                or p.data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()
            ):
                if p is None:
                    raise LoaderConditionError(
                        f"the loader replaced parameter {name} during a trace; restart the engine"
                    )
                p.data = data

    def _require_prewarm(self) -> None:
        if self.scratch is None:
            raise ProtocolError(
                "dcr_prewarm has not been called on this rank: call "
                "collective_rpc('dcr_prewarm', args=(tensors,)) before staging or applying"
            )

    # -- stage / apply / commit ------------------------------------------------------------
    def stage(self, payloads: list) -> dict[str, Any]:
        """Validate, deduplicate and keep payloads (see staging.py). Returns lists of ids."""
        self._require_prewarm()
        res = self.staging.stage(
            list(payloads),
            committed_version=self.committed_version,
            tensors=self.tensors,
            no_xor=set(self.overwrite_only),
            unsupported=set(self.unsupported),
        )
        res["rank"] = self.rank.get("rank", 0)
        self.metrics.staged(res, sum(len(p) for p in payloads))
        return res

    def fetch(
        self,
        store_spec: str | dict[str, Any],
        version: int,
        attempt: int,
        timeout_s: float = 60.0,
        kill_after_payloads: int | None = None,
        apply: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Fetch every payload of the attempt's manifest from an object store (see
        `shared_codec.transport.store.open_store` for the spec), or read them from a relay node's
        spool directory (``{"kind": "spool", "root": DIR}``, after the tree acknowledged the
        attempt complete), and stage them. Returns counts and the staging results; a rejected
        payload fails the fetch (nothing of it is applied). `kill_after_payloads` SIGKILLs this
        process after staging that many (recovery tests).

        Pipelined (``apply`` given: ``{"verify": bool, "fail_after_items": n,
        "kill_after_items": n}``, the last two for recovery tests): payloads are taken from the
        store as their objects appear (before the manifest, `ObjectFetcher.stream`), or from the
        spool as the relay node writes them (`stream_spool`, until its manifest notice) and each is
        applied as soon as it is staged, so payload l is applied while l + 1 is still built or in
        flight; the result then carries the attempt's merged ACK under ``"ack"``, exactly as
        `apply` would return it, and the receiver is ``applied`` (or ``dirty`` after a failure).
        A fetch error after part of the attempt was applied leaves the receiver ``dirty``."""
        from shared_codec.transport.objects import ObjectFetcher
        from shared_codec.transport.relay import read_spool, stream_spool
        from shared_codec.transport.store import open_store

        self._require_prewarm()
        t0 = time.perf_counter()
        spec = json.loads(store_spec) if isinstance(store_spec, str) else dict(store_spec)
        source: Iterable[bytes]
        if spec.get("kind") == "spool":  # payloads a relay-tree node wrote to local disk
            if apply is not None:  # as they arrive, until the node's manifest notice
                source = stream_spool(
                    str(spec["root"]), int(version), int(attempt), float(timeout_s)
                )
            else:
                source = read_spool(str(spec["root"]), int(version), int(attempt))
        else:
            fetcher = ObjectFetcher(open_store(spec), key=self.staging.key)
            if apply is not None:  # fetched in a thread: the link's wait overlaps applies
                source = _prefetched(
                    lambda stop: fetcher.stream(
                        int(version), int(attempt), float(timeout_s), cancelled=stop.is_set
                    )
                )
            else:
                source = fetcher.fetch(int(version), int(attempt), float(timeout_s))
        out: dict[str, Any] = {"payloads": 0, "bytes": 0, "staged": 0, "duplicates": 0}
        acks: list[dict[str, Any]] = []
        opts = dict(apply or {})
        verify = bool(opts.get("verify", False))

        def remaining(key: str) -> int | None:
            n = opts.get(key)
            return None if n is None else max(0, int(n) - sum(a["items"] for a in acks))

        try:
            for payload in source:
                if kill_after_payloads is not None and out["payloads"] >= kill_after_payloads:
                    os.kill(os.getpid(), signal.SIGKILL)
                res = self.stage([payload])
                if res["rejected"]:
                    raise PayloadError(f"fetched payload rejected: {res['rejected'][0]['reason']}")
                out["payloads"] += 1
                out["bytes"] += len(payload)
                out["staged"] += len(res["staged"])
                out["duplicates"] += len(res["duplicates"])
                if apply is not None and res["staged"]:
                    acks.append(
                        self.apply(
                            attempt,
                            verify,
                            remaining("fail_after_items"),
                            remaining("kill_after_items"),
                            final=False,
                        )
                    )
                    if not acks[-1]["ok"]:
                        break
        except BaseException:
            if self.state == "applying":
                self.state = "dirty"  # part of the attempt is in the weights
            raise
        out["fetch_seconds"] = time.perf_counter() - t0
        if apply is not None and (not acks or acks[-1]["ok"]):
            acks.append(self.apply(attempt, verify, remaining("fail_after_items"), None))
        out["seconds"] = time.perf_counter() - t0
        out["rank"] = self.rank.get("rank", 0)
        self.metrics.fetch_seconds.observe(out["seconds"])
        if apply is not None:
            out["ack"] = merge_acks(acks)
        return out

    def apply(
        self,
        attempt: int,
        verify: bool = False,
        fail_after_items: int | None = None,
        kill_after_items: int | None = None,
        final: bool = True,
    ) -> dict[str, Any]:
        """See `_apply`; also counts the apply in the metrics."""
        t0 = time.perf_counter()
        ack = self._apply(attempt, verify, fail_after_items, kill_after_items, final)
        self.metrics.applied(ack, time.perf_counter() - t0)
        return ack

    def _apply(
        self,
        attempt: int,
        verify: bool = False,
        fail_after_items: int | None = None,
        kill_after_items: int | None = None,
        final: bool = True,
    ) -> dict[str, Any]:
        """Apply every staged payload of `attempt` in place; returns the ACK (plain dict).
        ``final=False`` (pipelined fetch): more payloads of the attempt may follow; the receiver
        is then ``applying`` instead of ``applied``.

        Fault injection for recovery tests: `fail_after_items` fails the attempt (as a loader
        error would) after that many items were applied, leaving a partial apply behind;
        `kill_after_items` SIGKILLs this process at that point (a receiver dying mid-apply).
        """
        self._require_prewarm()
        assert self.scratch is not None
        gate = self.gate()
        if gate:
            raise ProtocolError(f"request gate closed for apply: {gate}")
        attempt = int(attempt)
        if attempt in self.staging.fenced:
            raise ProtocolError(f"attempt {attempt} was aborted; start a new attempt")
        staged = self.staging.take(attempt)
        targets = {p.header.meta.version for p in staged}
        if len(targets) > 1:
            raise ProtocolError(f"attempt {attempt} mixes target versions {sorted(targets)}")
        target = targets.pop() if targets else None
        if self.state == "applying" and self.applying_attempt != attempt:
            self.state = "dirty"  # another attempt's payloads are partly in the weights
        if (
            self.state in ("applied", "applying")
            and target is not None
            and target != self.target_version
        ):
            raise ProtocolError(
                f"receiver holds an applied, uncommitted version {self.target_version}; commit it "
                f"before applying version {target}"
            )
        has_xor = any(e.kind == Kind.XOR for p in staged for e in p.header.items)
        if has_xor and not (
            self.state == "clean" or (self.state == "applying" and self.applying_attempt == attempt)
        ):
            raise ProtocolError(
                f"attempt {attempt} has XOR items but this receiver is {self.state} (weights are "
                "not exactly the committed version); retry with overwrites of the complete set"
            )
        ack: dict[str, Any] = {
            "ok": False,
            "attempt": attempt,
            "rank": self.rank.get("rank", 0),
            "target_version": target,
            "payloads": 0,
            "items": 0,
            "skipped_items": 0,
            "batches": 0,
            "elements_written": 0,
            "bytes": 0,
            "compressed_bytes": 0,
            "post_apply_mismatches": 0 if verify else None,
            "verified": bool(verify),
            "timings": {"decode_s": 0.0, "apply_s": 0.0},
            "error": None,
            "partial_item": None,
        }
        storages = self._named_storages()
        before = self._param_snapshot()
        touched = False
        pulled = [0]  # items the loader pulled so far (fault injection counts these)

        def before_item(item: Any) -> None:
            if kill_after_items is not None and pulled[0] >= kill_after_items:
                os.kill(os.getpid(), signal.SIGKILL)
            if fail_after_items is not None and pulled[0] >= fail_after_items:
                raise _InjectedFailure(
                    f"injected failure after {fail_after_items} items (fault injection)"
                )
            pulled[0] += 1

        t_start = time.perf_counter()
        try:
            for sp in staged:
                t0 = time.perf_counter()
                payload = sp.decoded or decode_payload(
                    sp.data, key=self.staging.key, max_body=self.staging.max_body
                )
                ack["timings"]["decode_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                items = [it for it in payload.items if it.name not in self.skipped]
                ack["skipped_items"] += len(payload.items) - len(items)
                for batch in plan_batches(items, self.scratch.numel(), set(self.overwrite_only)):
                    touched = True
                    done = pulled[0]
                    try:
                        results = apply_batch(
                            self.model,
                            batch,
                            scratch=self.scratch,
                            model_storages=storages,
                            masked=set(self.overwrite_only),
                            verify=verify,
                            before_item=before_item,
                        )
                    except _InjectedFailure:
                        ack["items"] += pulled[0] - done  # the loader finished what it pulled
                        raise
                    except Exception:
                        # the loader streams: items pulled before the last one are complete,
                        # the last one it pulled may be partial
                        ack["items"] += max(0, pulled[0] - done - 1)
                        ack["partial_item"] = batch[max(0, pulled[0] - done - 1)].name
                        raise
                    ack["items"] += len(batch)
                    ack["batches"] += 1
                    for item, res in zip(batch, results, strict=True):
                        ack["elements_written"] += res.elements_written
                        ack["bytes"] += item.raw_bytes
                        if verify:
                            ack["post_apply_mismatches"] += res.mismatches
                if self._param_snapshot() != before:
                    raise LoaderConditionError("the loader rebound parameters during apply")
                ack["timings"]["apply_s"] += time.perf_counter() - t0
                ack["payloads"] += 1
                ack["compressed_bytes"] += len(sp.data)
                self.staging.mark_applied(attempt, sp.header.payload_id)
        except (LoaderConditionError, PayloadError, RuntimeError, ValueError) as e:
            ack["error"] = f"{type(e).__name__}: {e}"
            if touched or self.state == "applying":
                self.state = "dirty"
                self.target_version = target or self.target_version
            self.last_ack = ack
            return ack
        ack["timings"]["total_s"] = time.perf_counter() - t_start
        if verify and ack["post_apply_mismatches"]:
            ack["error"] = f"post-apply check found {ack['post_apply_mismatches']} mismatches"
            self.state = "dirty"
            self.target_version = target or self.target_version
            self.last_ack = ack
            return ack
        ack["ok"] = True
        if target is not None or self.state == "applying":
            self.state = "applied" if final else "applying"
            self.applying_attempt = None if final else attempt
            self.target_version = target or self.target_version
        self.last_ack = ack
        return ack

    def commit(self, version: int) -> dict[str, Any]:
        """The coordinator committed `version`: make it this receiver's committed version."""
        version = int(version)
        if version == self.committed_version:  # a repeated commit (e.g. a resuming coordinator)
            return {"committed_version": version, "changed": False, "state": self.state}
        if self.state != "applied" or self.target_version != version:
            raise ProtocolError(
                f"cannot commit version {version}: receiver is {self.state} with target "
                f"{self.target_version} and committed {self.committed_version}"
            )
        self.committed_version = version
        self.state = "clean"
        self.target_version = None
        self.staging.new_transition()
        self.metrics.committed.set(version)
        return {"committed_version": version, "changed": True}

    def abort(self, attempt: int) -> dict[str, Any]:
        """Fence `attempt`: drop its staged payloads and refuse its late payloads."""
        dropped = self.staging.fence(int(attempt))
        if self.state == "applying" and self.applying_attempt == int(attempt):
            self.state = "dirty"  # the fenced attempt is partly in the weights
        return {"attempt": int(attempt), "dropped": dropped, "state": self.state}

    # -- digests and dense load -------------------------------------------------------------
    def digest(self) -> dict[str, Any]:
        """Per-name digests of every parameter and buffer of this rank, and a combined one."""
        per = {n: tensor_digest(t) for n, t in self.model.named_parameters()}
        per.update({f"buffer:{n}": tensor_digest(t) for n, t in self.model.named_buffers()})
        return {**self.rank, "digest": combined_digest(per), "tensors": per}

    def dense_load(self, path: str, version: int) -> dict[str, Any]:
        """Dense refit from a canonical checkpoint directory through ``load_weights``; the
        receiver is then clean at `version` (how new or restarted receivers join)."""
        gate = self.gate()
        if gate:
            raise ProtocolError(f"request gate closed for dense load: {gate}")
        t0 = time.perf_counter()
        loaded = self.model.load_weights(iter_checkpoint(path))  # type: ignore[operator]
        self.metrics.dense_loads.inc()
        self.metrics.committed.set(int(version))
        self.committed_version = int(version)
        self.state = "clean"
        self.target_version = None
        self.staging.new_transition()
        return {
            **self.rank,
            "loaded": len(loaded) if loaded is not None else None,
            "seconds": time.perf_counter() - t0,
            "committed_version": int(version),
        }

    def memory(self, reset_peak: bool = False) -> dict[str, Any]:
        """Resident and peak resident set size of this process (Linux /proc); with
        `reset_peak` the peak is reset to the current RSS first (for peak-delta measurements)."""
        if reset_peak:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
        fields: dict[str, int] = {}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in ("VmRSS", "VmHWM"):
                        fields[key] = int(rest.split()[0]) * 1024
        except OSError:
            pass
        scratch = 0 if self.scratch is None else int(self.scratch.numel())
        return {
            **self.rank,
            "rss_bytes": fields.get("VmRSS"),
            "peak_rss_bytes": fields.get("VmHWM"),
            "scratch_bytes": scratch,
            "staged_bytes": self.staging.staged_bytes,
        }

    def status(self) -> dict[str, Any]:
        return {
            **self.rank,
            "state": self.state,
            "committed_version": self.committed_version,
            "target_version": self.target_version,
            "prewarmed": self.scratch is not None,
            "staged_payloads": sum(len(v) for v in self.staging.staged.values()),
            "staged_bytes": self.staging.staged_bytes,
        }


def _prefetched(
    make_source: Callable[[threading.Event], Iterable[bytes]], depth: int = 4
) -> Iterator[bytes]:
    """Iterate ``make_source(stop)`` in a background thread, at most `depth` items ahead (I/O
    waits of the transport overlap the caller's work); its exception is re-raised in the caller.
    Closing the generator early (a failed apply) sets `stop`, which the source polls, so the
    thread ends instead of waiting out the attempt."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def run() -> None:
        try:
            for item in make_source(stop):
                while not stop.is_set():
                    try:
                        q.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            if not stop.is_set():  # nobody reads the queue once the consumer has left
                q.put(("end", None))
        except BaseException as e:  # handed to the consumer
            if not stop.is_set():
                q.put(("error", e))

    threading.Thread(target=run, name="dcr-prefetch", daemon=True).start()
    try:
        while True:
            kind, value = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()


def merge_acks(acks: list[dict[str, Any]]) -> dict[str, Any]:
    """One ACK for an attempt applied in several `apply` calls (pipelined fetch): counts and
    timings summed, the first error, ``ok`` only if every part was."""
    if not acks:
        raise ValueError("no ACK to merge")
    out = dict(acks[-1])
    out["timings"] = dict(acks[-1]["timings"])
    for k in (
        "payloads",
        "items",
        "skipped_items",
        "batches",
        "elements_written",
        "bytes",
        "compressed_bytes",
    ):
        out[k] = sum(int(a.get(k) or 0) for a in acks)
    if out.get("verified"):
        out["post_apply_mismatches"] = sum(int(a.get("post_apply_mismatches") or 0) for a in acks)
    for k in ("decode_s", "apply_s", "total_s"):
        out["timings"][k] = sum(float(a["timings"].get(k, 0.0)) for a in acks)
    out["ok"] = all(a["ok"] for a in acks)
    bad = next((a for a in acks if not a["ok"]), None)
    if bad is not None:
        out["error"], out["partial_item"] = bad["error"], bad["partial_item"]
    out["target_version"] = next(
        (a["target_version"] for a in acks if a["target_version"] is not None), None
    )
    out["pipelined_parts"] = len(acks)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _classify(records: list, loaded: set[str] | None) -> str:
    """'' (direct, XOR ok), 'skip', an overwrite-only reason, or 'unsupported: reason'."""
    copies = [r for r in records if r.op.startswith("copy_")]
    others = [r for r in records if not r.op.startswith("copy_")]
    if not records:
        if loaded:
            return "unsupported: loader reports tensors loaded but no write was intercepted"
        return "skip"
    for r in others:
        if r.from_scratch:
            return f"unsupported: {r.op} from the item into {r.param}"
        if r.changes_resident:
            return f"unsupported: {r.op} into {r.param} would change resident bits"
    if not copies:
        return "unsupported: only non-copy writes intercepted"
    if loaded is not None and {r.param for r in copies} - loaded:
        return "unsupported: loader wrote parameters it did not report as loaded"
    reasons = []
    for r in copies:
        if r.src is None:
            reasons.append(f"transformed copy into {r.param}")
        elif r.src_dtype != r.dest_dtype:
            reasons.append(f"cast {r.src_dtype}->{r.dest_dtype} into {r.param}")
        elif r.src.shape != r.dest.shape or not (r.src.nested() and r.dest.nested()):
            reasons.append(f"non-nested or broadcast view copy into {r.param}")
    seen: dict[str, list[ViewGeom]] = {}
    for r in copies:
        seen.setdefault(r.param, []).append(r.dest)
    for param, views in seen.items():
        if len(views) > 1 and _views_overlap(views):
            reasons.append(f"overlapping writes into {param}")
    return "; ".join(reasons)


def _views_overlap(views: list[ViewGeom]) -> bool:
    return bool(_overlapping_views([("", v) for v in views]))


def _overlapping_views(entries: list[tuple[str, ViewGeom]]) -> set[int]:
    """Indices of entries whose view overlaps an earlier entry's view (one bitmap per param,
    one view's offsets at a time)."""
    import numpy as np

    end = max((int(v.offsets().max()) + 1 for _, v in entries if v.numel), default=0)
    seen = np.zeros(end, dtype=bool)
    out: set[int] = set()
    for i, (_, v) in enumerate(entries):
        offs = v.offsets()
        if offs.size and (seen[offs].any() or np.unique(offs).size != offs.size):
            out.add(i)
        seen[offs] = True
    return out


def _overlaps(coverage: dict[str, list[tuple[str, ViewGeom]]]) -> dict[str, str]:
    """Canonical tensors whose copies overlap another copy into the same parameter."""
    out: dict[str, str] = {}
    for param, entries in coverage.items():
        if len(entries) < 2:
            continue
        hits = _overlapping_views(entries)
        if not hits:
            continue
        names = {entries[i][0] for i in hits}
        # the earlier writer of an overlapped region is affected too
        for i in hits:
            offs = set(entries[i][1].offsets().tolist())
            for name, v in entries[:i]:
                if offs.intersection(v.offsets().tolist()):
                    names.add(name)
        for name in names:
            out[name] = f"overlapping writes into {param}"
    return out
