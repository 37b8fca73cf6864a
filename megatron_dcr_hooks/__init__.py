"""megatron_dcr_hooks: the owner side of DCR, running inside Megatron trainer processes.

    from megatron_dcr_hooks import DCRConfig, enable_dcr
    from megatron_dcr_hooks import DCRCallback  # Megatron-Bridge: pretrain(..., callbacks=[...])

Modules:
- ``callback``: `DCRCallback` (a Megatron-Bridge training callback and post-optimizer-step hook)
  and `ServiceSpec`.
- ``hook``: `enable_dcr` and `DCRHook`, the orchestrator of one rank's owner
  (build/commit/abort/retry) over the modules of the paper's steps:
  ``detection`` (trackers and the changed-bits scan against the host baseline),
  ``projection`` (affine tasks -> canonical records), ``residual`` (residual conversion and
  the residual baseline), ``quantized`` (quantized deltas from each quantized weight's group
  owner), ``guard`` (the candidate guard), ``sink`` (payload encoding and the one
  bounded queue in front of the payload sink).
- ``config``: `DCRConfig` and `ConstructionMode`.
- ``candidate``: the `Candidate` record of a build and the owner's `OwnerState`.
- ``groups``: `ParallelGroups`, the process groups the hook is given (default: megatron-core's).
- ``service``: the owner service a remote coordinator drives (ZeroMQ, JSON).
- ``tasks`` / ``ownership``: conversion tasks (`TaskKind`) measured from the bridge, and who owns
  what.
- ``cpu_compat``: the CPU layer that lets real megatron-core run on gloo/CPU (trainer processes
  only; never imported by a vLLM process).
- ``bridge_loader``: imports megatron-bridge's conversion modules without its package
  ``__init__`` files, with two fixes; returns the bridge's own mapping registry for a model type.
- ``bridge_registry``: which megatron-bridge bridge converts a model, resolved from the HF
  config's architectures, and its mapping registry.
- ``conversion``: dense HF <-> Megatron conversion through the bridge registry.

Importing this package imports neither megatron-core nor transformers: the public names are
resolved lazily (module ``__getattr__``).
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "DCRCallback": "callback",
    "ServiceSpec": "callback",
    "Candidate": "candidate",
    "ConstructionMode": "config",
    "DCRConfig": "config",
    "DCRHook": "hook",
    "enable_dcr": "hook",
    "OwnerState": "candidate",
    "ParallelGroups": "groups",
    "RankGroup": "groups",
    "TaskKind": "tasks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"megatron_dcr_hooks.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'megatron_dcr_hooks' has no attribute {name!r}")


__all__ = sorted(_LAZY)
