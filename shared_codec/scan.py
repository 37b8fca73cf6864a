"""What every owner runs on the tensors it owns: the changed-bits scan against a host baseline,
and the stable name hash that picks each tensor's owner.

- `changed_bits(tensor, baseline, scan=)`: the flat indices whose stored bits differ from the
  host baseline, their stored bits now, and the baseline's bits. Changes nothing. A host tensor
  is compared in place by the compiled scan (`shared_codec.kernels.changed_indices`); a device
  tensor (a GPU) by `DeviceScan`, which streams the baseline to the device in bounded chunks
  through two pinned staging buffers and compares there, as the paper does: only the changed
  indices and their bits come back to the host. Both give the same arrays, hence the same
  payload bytes (tests/unit/megatron/test_collectives.py runs the streamed scan on host
  tensors against the compiled one; the GPU lane both on CUDA).
- `stable_hash(name)`: a process-independent hash of a name; ownership must agree on every
  rank (the Megatron hook's shard owners, the named-tensor owner's tensor owners).

Users: the Megatron hook (megatron_dcr_hooks.detection) and the named-tensor owner
(shared_codec.named). Bit comparison only, never float equality.

Limitations:
1. On a device, each scan moves the baseline's bytes host -> device once,
   `DeviceScan.chunk_bytes` at a time (two pinned buffers of that size on the host, two
   chunks and a change mask on the device).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from shared_codec.dtypes import dtype_of, tensor_bits
from shared_codec.kernels import changed_indices

#: default bytes of one streamed chunk of the baseline (device detection)
DEVICE_CHUNK_BYTES = 64 << 20

#: signed integer dtype of each element size (torch compares and gathers these on any device)
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def stable_hash(name: str) -> int:
    """A process-independent hash of a name (ownership must agree on every rank)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


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


__all__ = ["DEVICE_CHUNK_BYTES", "DeviceScan", "changed_bits", "stable_hash"]
