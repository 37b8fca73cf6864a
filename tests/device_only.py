"""TEST DOUBLE: a device-only process group, standing in for NCCL on a machine without a GPU.

A default Megatron job initializes ``torch.distributed`` with NCCL, whose groups take CUDA
tensors only. This double is a real ``ProcessGroup`` whose only backend (a gloo one) is
registered for the ``cuda`` device type, so torch's own dispatch refuses a CPU tensor with the
error NCCL gives ("No backend type associated with device type cpu"), and there is no CUDA
here to give it anything else. DCR handed it as its world group must therefore never issue a
collective on it (megatron_dcr_hooks/collectives.py: its CPU reductions run on a gloo group
over the same ranks).

- `device_only_group()`: a one-rank double, not registered with torch (in-process units);
- `device_only_world()`: the double over every rank of an initialized job (collective), made
  through torch's own backend registry (``Backend.register_backend``) and ``new_group``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

#: the backend name the double registers under
BACKEND = "dcr_device_only"


def device_only_group() -> Any:
    """A one-rank process group that rejects CPU tensors (its backend serves ``cuda`` only)."""
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    gloo = dist.ProcessGroupGloo(store, 0, 1)
    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return pg


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def device_only_world() -> Any:
    """The double over every rank of the initialized job (collective: every rank calls)."""
    if BACKEND.upper() not in dist.Backend.__dict__:
        dist.Backend.register_backend(BACKEND, _create, devices=["cuda"])
    return dist.new_group(backend=BACKEND)


__all__ = ["BACKEND", "device_only_group", "device_only_world"]
