"""Change detection against the host baseline (paper step 1): trackers and the changed-bits scan.

The committed baseline of the affine path is one tracker per owned shard: a contiguous host
copy of the shard's stored bits at the last commit, keyed by the task's index. Detection
compares stored bits, never float values. Where it runs is chosen by where the parameter lives:

- a host parameter: the shard's bits are compared with the tracker by the compiled scan
  `shared_codec.kernels.changed_indices` (as before);
- a device parameter (a GPU): `DeviceScan` streams the tracker to the device in bounded chunks
  through two pinned staging buffers and compares there, as the paper does; only the changed
  indices and their bits come back to the host.

Both give the same (indices, bits), hence the same payload bytes (tests/unit/megatron: the
streamed scan run on host tensors against the compiled one; the GPU lane: both on CUDA).

- `host_trackers(owned)`: the trackers of the owned shards (taken at construction).
- `changed_bits(shard, tracker, scan=)`: the flat local indices whose stored bits differ from
  the tracker, their stored bits now, and the tracker's bits. Changes nothing.
- `shard_state(shard, tracker, guard=, scan=)`: what the candidate guard records for an owned
  shard: its change against the tracker, or without a tracker (mode F) a 20-byte
  `fingerprint` of the whole shard.
- `advance_trackers(trackers, delta)`: a commit: scatters a build's recorded changed indices
  and new bits into the trackers, O(changed), reading no shard.
- `sync_params(chunks)`: finishes a lazily deferred parameter all-gather before any read.

Lazily gathered parameters (distributed optimizer with ``overlap_param_gather``): the
optimizer's step leaves the updated BF16 parameters to be all-gathered by the next forward
pass. `sync_params` finishes that gather (every ``DistributedDataParallel`` chunk's
``start_param_sync(force_sync=True)``), so detection reads the updated values, as Megatron-LM
does before saving a checkpoint; the next forward then finds the parameters already in sync.

Limitations:
1. Trackers are host copies (pageable memory). On a device, each scan moves the tracker's
   bytes host -> device once, `DeviceScan.chunk_bytes` at a time (two pinned buffers of that
   size on the host, two chunks and a change mask on the device); on the host, the scan reads
   the shard in place. A build's recorded change (~10 bytes of host memory per changed
   element) is held from build to commit.
2. The lazy gather is finished only on chunks given DDP-wrapped (``start_param_sync``); pass
   the chunks as the training loop holds them, not the bare GPTModels.
3. Mode F's whole-shard fingerprint copies the shard to the host (the guard's fallback).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from megatron_dcr_hooks.tasks import Task
from shared_codec.dtypes import dtype_of, tensor_bits
from shared_codec.kernels import changed_indices, set_scatter

#: a shard's change against its tracker: (changed flat local indices, their new stored bits)
Change = tuple[np.ndarray, np.ndarray]

#: default bytes of one streamed chunk of the baseline (device detection)
DEVICE_CHUNK_BYTES = 64 << 20

#: signed integer dtype of each element size (torch compares and gathers these on any device)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sync_params(chunks: Iterable[Any]) -> None:
    """Finish any lazily deferred parameter all-gather (``overlap_param_gather``) so the stored
    bits read afterwards are the updated ones (module docstring). No-op otherwise."""
    for chunk in chunks:
        sync = getattr(chunk, "start_param_sync", None)
        ddp_config = getattr(chunk, "ddp_config", None)
        if sync is not None and getattr(ddp_config, "overlap_param_gather", False):
            sync(force_sync=True)


def host_trackers(owned: Iterable[Task]) -> dict[int, torch.Tensor]:
    """Task index -> a contiguous host copy of the owned shard's stored bits."""
    return {t.index: t.param.detach().to("cpu", copy=True).contiguous() for t in owned}


class DeviceScan:
    """The streamed scan of a device shard against its host tracker (module docstring).

    `chunk_bytes`: bytes of the tracker moved per chunk (rounded down to whole elements). The
    two pinned staging buffers are allocated at the first scan and reused. Runs on any device, the host included (without pinning there), which is
    how the default lane checks it against the compiled host scan."""

    def __init__(self, chunk_bytes: int = DEVICE_CHUNK_BYTES) -> None:
        if chunk_bytes < 8:
            raise ValueError(f"DeviceScan chunk_bytes must be >= 8, not {chunk_bytes}")
        self.chunk_bytes = int(chunk_bytes)
        self._staging: list[torch.Tensor] = []

    def _stage(self, device: torch.device) -> list[torch.Tensor]:
        if not self._staging:
            pin = device.type == "cuda" and torch.cuda.is_available()
            self._staging = [
                torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)
            ]
        return self._staging

    def __call__(
        self, shard: torch.Tensor, tracker: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(changed flat local indices, their stored bits now, the tracker's bits), compared on
        ``shard.device``; the same arrays `changed_bits` gives on the host."""
        d = dtype_of(shard.dtype)
        base = tensor_bits(tracker)
        if tracker.numel() != shard.numel() or tracker.dtype != shard.dtype:
            raise ValueError(
                f"tracker {tracker.dtype}[{tracker.numel()}] does not match the shard "
                f"{shard.dtype}[{shard.numel()}]"
            )
        n, size = shard.numel(), shard.element_size()
        as_int = _INT[size]
        cur = shard.detach().reshape(-1)
        if not cur.is_contiguous():
            cur = cur.contiguous()
        cur = cur.view(as_int)
        host = tracker.detach().reshape(-1).view(as_int)
        step = max(1, self.chunk_bytes // size)
        staging = [b[: step * size].view(as_int) for b in self._stage(shard.device)]
        idx_parts: list[torch.Tensor] = []
        bit_parts: list[torch.Tensor] = []
        starts = list(range(0, n, step))
        if starts:
            staging[0][: min(step, n)].copy_(host[: min(step, n)])
        for k, start in enumerate(starts):
            stop = min(n, start + step)
            buf = staging[k % 2][: stop - start]
            # host -> device from pinned memory, on the device's stream; the compare is queued
            # behind it
            chunk = buf.to(shard.device, non_blocking=True)
            mask = cur[start:stop] != chunk
            if k + 1 < len(starts):  # the next chunk's host copy overlaps the device compare
                nxt = min(n, stop + step)
                staging[(k + 1) % 2][: nxt - stop].copy_(host[stop:nxt])
            where = torch.nonzero(mask).reshape(-1)  # waits for the compare (and the copy)
            if where.numel():
                bit_parts.append(cur[start:stop][where].to("cpu"))
                idx_parts.append(where.to("cpu") + start)
        if not idx_parts:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=d.bits_np), base
        local = torch.cat(idx_parts).numpy().astype(np.int64, copy=False)
        new = torch.cat(bit_parts).numpy().view(d.bits_np)
        return local, new, base


def changed_bits(
    shard: torch.Tensor, tracker: torch.Tensor, scan: DeviceScan | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(changed flat local indices, their stored bits now, the tracker's bits) of `shard`: on
    the host with the compiled scan, on a device with `scan` (a default `DeviceScan` when
    None)."""
    if shard.device.type != "cpu":
        return (scan or DeviceScan())(shard, tracker)
    cur = tensor_bits(shard.detach())
    base = tensor_bits(tracker)
    local = changed_indices(cur, base)
    return local, cur[local], base


def shard_state(
    shard: torch.Tensor,
    tracker: torch.Tensor | None,
    *,
    guard: bool,
    scan: DeviceScan | None = None,
) -> tuple[bytes, Change | None]:
    """(guard record, change against the tracker) of an owned shard's current stored bits.
    Without a tracker (mode F: the whole shard is the candidate) the change is None and the
    guard record the shard's `fingerprint` (b"" when `guard` is off); with one the record is
    b"" (the guard compares the change itself)."""
    if tracker is None:
        return (fingerprint(tensor_bits(shard.detach().to("cpu"))) if guard else b""), None
    local, new, _ = changed_bits(shard, tracker, scan)
    return b"", (local, new)


def fingerprint(bits: np.ndarray) -> bytes:
    """20 bytes naming a whole shard's stored bits (the candidate of a shard without a
    tracker)."""
    h = hashlib.sha1(usedforsecurity=False)  # detects accidental change; ~3x BLAKE2b's speed
    h.update(np.ascontiguousarray(bits).data)
    return h.digest()


def advance_trackers(trackers: Mapping[int, torch.Tensor], delta: Mapping[int, Change]) -> None:
    """Scatter each recorded change (new stored bits at the changed indices) into its tracker."""
    with torch.no_grad():
        for idx, (local, new) in delta.items():
            set_scatter(_bits_view(trackers[idx]), local, new)


def _bits_view(t: torch.Tensor) -> np.ndarray:
    """The stored bits of the host tensor `t` as a writable numpy view of its memory."""
    bits = tensor_bits(t)
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tracker must be a contiguous host tensor")
    return bits
