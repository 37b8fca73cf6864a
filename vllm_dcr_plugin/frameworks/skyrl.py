"""SkyRL drives DCR: its own weight sync (``SkyrlWeightSyncClient``, ``MegatronWeightSource`` /
``FsdpWeightSource``) refits vLLM servers started with backend ``dcr``, through DCR's trainer
engine (trainer_engine.py) and the named-tensor owner (shared_codec.named).

What a SkyRL user writes (docs/skyrl.md), configuration only::

    export SKYRL_DCR_CONFIG='{"control": {...}, "transport": {...}, "checkpoint_for": ".../v{version}"}'
    # SkyRL config: generator.inference_engine.weight_sync_backend=dcr
    # servers: vllm serve MODEL --weight-transfer-config '{"backend": "dcr"}' (VLLM_SERVER_DEV_MODE=1)

dcr-refit installs ``dcr-refit-skyrl.pth`` into site-packages: in every interpreter where
``SKYRL_DCR_CONFIG`` is set it calls `arm`, which patches SkyRL's modules as they are imported.
SkyRL's own ``prepare_runtime_environment`` forwards ``SKYRL_*`` variables to its Ray workers,
so the policy workers are patched with no code. `install` does the same by hand (a dict, or
the variable), for programs that cannot rely on the ``.pth`` (an editable install without it).

SkyRL 0.4.0 then calls, on every policy rank, its ``build_trainer_engine``; for ``dcr`` this
module builds the engine instead: every rank a `NamedTensorOwner` over a gloo group of the
trainer's world (baseline: the committed canonical checkpoint, the policy model at version 0),
and `WeightTransferTrainerFactory.trainer_init(DCRTrainerInitInfo(...), client={one
SkyrlWeightSyncClient per server URL}, source=<SkyRL's own source>)`. Each training step SkyRL
calls ``engine.send_weights()`` on every rank: the owner diffs SkyRL's stream, rank 0 runs one
DCR transition (committed, or `RefitFailed` with the committed version in force), and SkyRL's
own error path sees any failure.

Patches (`PATCHES`; SkyRL 0.4.0, checked by `install`): only the closed backend switch.
1. ``skyrl.backends.skyrl_train.weight_sync.get_transfer_strategy`` and
   ``_VLLM_RECEIVE_BACKENDS``: SkyRL maps every name it does not know to ``nccl`` (silently:
   ``dcr`` would run as NCCL); ``dcr`` now resolves to ``dcr`` on both sides.
2. ``...weight_sync.weight_senders.build_trainer_engine``: for ``dcr``, DCR's engine (above);
   every other backend goes to SkyRL's own function.
3. ``skyrl.train.utils.utils.validate_megatron_cfg``: its assert lists the Megatron backends
   it knows; ``dcr`` passes (the rest of the validation runs unchanged).
`remove()` restores all three; `installed()` names the running set.

The upstream change that removes the patches: ``get_transfer_strategy`` ending in ``return
weight_sync_backend`` instead of ``return "nccl"``, with ``_VLLM_RECEIVE_BACKENDS.get(s, s)``
and ``build_trainer_engine`` asking the registered backend's init info for backends it does
not build itself (docs/skyrl.md).

Limitations:
1. One DCR engine per server URL (SkyRL's fan-out client would make N servers one engine
   whose per-rank reports collide).
2. SkyRL resets the prefix cache around the sync itself (``skyrl_handles_prefix_cache_reset``
   is False here).
3. LoRA, FP8 wire formats and speculative drafters through ``dcr`` are refused (their
   sources are other streams).
"""

from __future__ import annotations

import importlib.abc
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

SKYRL_VERSION = "0.4.0"
BACKEND = "dcr"
#: the configuration (JSON) `install()` and `arm` read; SkyRL's ``prepare_runtime_environment``
#: forwards every ``SKYRL_*`` variable of the launching shell to its Ray workers
ENV = "SKYRL_DCR_CONFIG"
#: installed at the top of site-packages (setup.py); calls `arm` where `ENV` is set
PTH = "dcr-refit-skyrl.pth"

#: what `install` patches: (module, attribute) -> why
PATCHES: dict[tuple[str, str], str] = {
    ("skyrl.backends.skyrl_train.weight_sync", "get_transfer_strategy"): (
        "unknown weight_sync_backend names become 'nccl'; 'dcr' resolves to 'dcr'"
    ),
    ("skyrl.backends.skyrl_train.weight_sync.weight_senders", "build_trainer_engine"): (
        "builds DCR's trainer engine (named-tensor owner, one client per server) for 'dcr'"
    ),
    ("skyrl.train.utils.utils", "validate_megatron_cfg"): (
        "its closed set of Megatron weight-sync backends lets 'dcr' through"
    ),
}

_originals: dict[tuple[str, str], Any] = {}
_config: dict[str, Any] = {}


def installed() -> list[str]:
    """The patched attributes, ``module.attribute`` (empty when not installed)."""
    return [f"{m}.{a}" for m, a in _originals]


def install(config: Mapping[str, Any] | None = None) -> None:
    """Route SkyRL's ``weight_sync_backend=dcr`` to DCR (module docstring). `config`: the
    `DCRTrainerInitInfo` fields besides ``rank``, ``owners``, ``tensors`` (``control``,
    ``transport``, ``checkpoint_for``, ``max_attempts``, ...), plus ``baseline`` (the committed
    canonical checkpoint the owners diff against; default: SkyRL's policy model path, version
    0) and ``owner`` (`NamedOwnerConfig` fields). None: JSON from ``SKYRL_DCR_CONFIG``.
    Idempotent (a second call replaces the configuration). Call it before SkyRL's worker
    modules import ``get_transfer_strategy`` by name, or let `arm` do it at import time."""
    import importlib

    _check_version()
    _configure(config)
    for name, patch in _BY_MODULE.items():
        patch(importlib.import_module(name))


def arm() -> None:
    """What the installed ``dcr-refit-skyrl.pth`` runs at every interpreter start where
    ``SKYRL_DCR_CONFIG`` is set (SkyRL forwards ``SKYRL_*`` variables to every Ray worker):
    each patched SkyRL module is patched the moment it finishes executing, before any other
    module can import a name from it, with the configuration from the variable. Nothing of
    SkyRL is imported here; modules already imported are patched now. Idempotent."""
    import sys

    if not os.environ.get(ENV):
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    for name in _BY_MODULE:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__spec__", None) is not None:
            if not getattr(module.__spec__, "_initializing", False):
                _after_import(name, module)


def remove() -> None:
    """Undo `install` (and `arm`)."""
    import importlib
    import sys

    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    for (module, attr), original in _originals.items():
        setattr(importlib.import_module(module), attr, original)
    if _originals:
        import skyrl.backends.skyrl_train.weight_sync as ws

        ws._VLLM_RECEIVE_BACKENDS.pop(BACKEND, None)
    _originals.clear()
    _config.clear()


def _check_version() -> None:
    import importlib.metadata

    got = importlib.metadata.version("skyrl")
    if got != SKYRL_VERSION:
        raise RuntimeError(
            f"vllm_dcr_plugin.frameworks.skyrl patches SkyRL {SKYRL_VERSION}, found {got}: "
            "check the patched functions (PATCHES) against it before pinning it"
        )


def _configure(config: Mapping[str, Any] | None) -> None:
    if config is None:
        raw = os.environ.get(ENV)
        if not raw:
            raise ValueError(f"no DCR configuration given and {ENV} is not set")
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV} is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{ENV} must be a JSON object, got {type(config).__name__}")
    _config.clear()
    _config.update(config)


def _after_import(name: str, module: Any) -> None:
    """Patch `module` (one of `_BY_MODULE`) right after it executed (`arm`)."""
    _check_version()
    if not _config:
        _configure(None)
    _BY_MODULE[name](module)


class _PatchOnImport:
    """A ``sys.meta_path`` finder (`arm`): finds SkyRL's patched modules through the other
    finders and wraps their loaders so that the patch follows the module's execution."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        import sys

        if name not in _BY_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, name)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader; `exec_module` then patches (`_PatchOnImport`)."""

    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _after_import(self._name, module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_resource_reader, ...
        return getattr(self._inner, attr)


def _patch(module: Any, attr: str, replacement: Callable[[Any], Any]) -> None:
    """Replace ``module.attr`` by ``replacement(original)``, once."""
    key = (module.__name__, attr)
    if key in _originals:
        return
    _originals[key] = getattr(module, attr)
    setattr(module, attr, replacement(_originals[key]))


def _patch_weight_sync(ws: Any) -> None:
    _patch(ws, "get_transfer_strategy", _strategy)
    ws._VLLM_RECEIVE_BACKENDS[BACKEND] = BACKEND


def _patch_senders(senders: Any) -> None:
    _patch(senders, "build_trainer_engine", _builder)


def _patch_utils(utils: Any) -> None:
    _patch(utils, "validate_megatron_cfg", _megatron_check)


def _strategy(original: Callable[[str, bool], str]) -> Callable[[str, bool], str]:
    def get_transfer_strategy(weight_sync_backend: str, colocate_all: bool) -> str:
        if weight_sync_backend == BACKEND:
            return BACKEND
        return original(weight_sync_backend, colocate_all)

    return get_transfer_strategy


def _megatron_check(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def validate_megatron_cfg(cfg: Any) -> Any:
        ie = cfg.generator.inference_engine
        if ie.weight_sync_backend != BACKEND:
            return original(cfg)
        ie.weight_sync_backend = "nccl"  # the one assert that names backends sees a known one
        try:
            return original(cfg)
        finally:
            ie.weight_sync_backend = BACKEND

    return validate_megatron_cfg


def _builder(original: Callable[..., Any]) -> Callable[..., Any]:
    def build_trainer_engine(*, ie_cfg: Any, **kwargs: Any) -> Any:
        if ie_cfg.weight_sync_backend != BACKEND:
            return original(ie_cfg=ie_cfg, **kwargs)
        return build_dcr_engine(ie_cfg=ie_cfg, **kwargs)

    return build_trainer_engine


def build_dcr_engine(
    *,
    ie_cfg: Any,
    colocate_all: bool,
    rank: int,
    inference_world_size: int,
    source_factory: Callable[[Any, str], Any],
    server_urls: list,
    data_parallel_size: int,
    base_model_path: str | None = None,
    draft_source_factory: Callable[[Any], Any] | None = None,
) -> Any:
    """SkyRL's ``build_trainer_engine`` for ``dcr`` (every rank; module docstring)."""
    import torch.distributed as dist
    from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient
    from skyrl.train.utils.utils import str_to_torch_dtype
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shared_codec.checkpoint import tensor_table
    from shared_codec.errors import ArgumentError
    from shared_codec.named import NamedOwnerConfig, NamedTensorOwner
    from vllm_dcr_plugin.frameworks import committed_baseline
    from vllm_dcr_plugin.transfer.trainer_engine import DCRTrainerInitInfo

    if getattr(ie_cfg, "speculative_config", None) is not None:
        raise ArgumentError("weight_sync_backend=dcr: speculative drafters are not refit by DCR")
    if getattr(ie_cfg, "fp8_weight_sync_mode", None) is not None:
        raise ArgumentError("weight_sync_backend=dcr: FP8 weight-sync wires are not DCR's")
    if data_parallel_size != 1:
        raise ArgumentError(
            f"weight_sync_backend=dcr: one engine per server URL, got data_parallel_size "
            f"{data_parallel_size}"
        )
    config = dict(_config)
    baseline, committed = committed_baseline(config, base_model_path)
    config.pop("baseline", None)
    owner_config = NamedOwnerConfig(**config.pop("owner", {}))
    source = source_factory(str_to_torch_dtype(ie_cfg.model_dtype), BACKEND)
    group = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.new_group(backend="gloo")  # DCR's host collectives (every rank calls)
    owner = NamedTensorOwner(
        config["transport"],
        baseline,
        config=owner_config,
        group=group,
        committed_version=committed,
    )
    info = DCRTrainerInitInfo(rank=rank, owners=owner, tensors=tensor_table(baseline), **config)
    # DCR's trainer engine takes one client per engine name (trainer_engine.py)
    clients: Any = {
        f"engine{i}": SkyrlWeightSyncClient([url], 1) for i, url in enumerate(server_urls)
    }
    engine: Any = WeightTransferTrainerFactory.trainer_init(info, client=clients, source=source)
    # SkyRL's Worker reads these capability attributes of every trainer engine
    engine.skyrl_handles_prefix_cache_reset = False
    engine.skyrl_force_disable_expandable_segments = False
    engine.skyrl_empty_cache_after_send = True
    engine.skyrl_draft_source = None
    return engine


#: SkyRL module -> its patch (`PATCHES`); `install` imports them, `arm` waits for them
_BY_MODULE: dict[str, Callable[[Any], None]] = {
    "skyrl.backends.skyrl_train.weight_sync": _patch_weight_sync,
    "skyrl.backends.skyrl_train.weight_sync.weight_senders": _patch_senders,
    "skyrl.train.utils.utils": _patch_utils,
}

__all__ = ["ENV", "PATCHES", "PTH", "arm", "build_dcr_engine", "install", "installed", "remove"]
