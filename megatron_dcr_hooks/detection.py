"""Change detection against the host baseline (paper step 1): the trackers of the owned shards.

The committed baseline of the affine path is one tracker per owned shard: a contiguous host
copy of the shard's stored bits at the last commit, keyed by the task's index. Detection
compares stored bits, never float values, with `shared_codec.scan.changed_bits`: in place on
the host, or streamed to the device where the parameter lives (`DeviceScan`).

- `host_trackers(owned)`: the trackers of the owned shards (taken at construction).
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
1. Trackers are host copies (pageable memory); a device scan moves each tracker's bytes to
   the device once per scan (shared_codec.scan). A build's recorded change (~10 bytes of host
   memory per changed element) is held from build to commit.
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
from shared_codec.dtypes import tensor_bits
from shared_codec.kernels import set_scatter
from shared_codec.scan import DeviceScan, changed_bits

#: a shard's change against its tracker: (changed flat local indices, their new stored bits)
Change = tuple[np.ndarray, np.ndarray]


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
