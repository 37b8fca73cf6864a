"""SkyRL drives DCR: its own weight sync (``SkyrlWeightSyncClient``, ``MegatronWeightSource`` /
``FsdpWeightSource``) refits vLLM servers started with backend ``dcr``, through DCR's trainer
engine (trainer_engine.py) and the named-tensor owner (shared_codec.named).

What a SkyRL user writes (docs/skyrl.md)::

    # every SkyRL process that builds a trainer engine (the policy workers), before training:
    from vllm_dcr_plugin.frameworks import skyrl
    skyrl.install({"control": {...}, "transport": {...}, "checkpoint_for": ".../v{version}"})
    # config: generator.inference_engine.weight_sync_backend=dcr
    # servers: vllm serve MODEL --weight-transfer-config '{"backend": "dcr"}' (VLLM_SERVER_DEV_MODE=1)

or the same configuration as JSON in ``DCR_SKYRL_CONFIG`` and ``install()`` without arguments
(a Ray ``runtime_env`` hook can call it in every worker).

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

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

SKYRL_VERSION = "0.4.0"
BACKEND = "dcr"
ENV = "DCR_SKYRL_CONFIG"

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
    0) and ``owner`` (`NamedOwnerConfig` fields). None: JSON from ``DCR_SKYRL_CONFIG``.
    Idempotent (a second call replaces the configuration)."""
    import importlib.metadata

    got = importlib.metadata.version("skyrl")
    if got != SKYRL_VERSION:
        raise RuntimeError(
            f"vllm_dcr_plugin.frameworks.skyrl patches SkyRL {SKYRL_VERSION}, found {got}: "
            "check the patched functions (PATCHES) against it before pinning it"
        )
    if config is None:
        raw = os.environ.get(ENV)
        if not raw:
            raise ValueError(f"install(): no configuration given and {ENV} is not set")
        config = json.loads(raw)
    _config.clear()
    _config.update(config)
    if _originals:
        return
    import skyrl.backends.skyrl_train.weight_sync as ws
    import skyrl.backends.skyrl_train.weight_sync.weight_senders as senders
    import skyrl.train.utils.utils as utils

    _patch(ws, "get_transfer_strategy", _strategy(ws.get_transfer_strategy))
    ws._VLLM_RECEIVE_BACKENDS[BACKEND] = BACKEND
    _patch(senders, "build_trainer_engine", _builder(senders.build_trainer_engine))
    _patch(utils, "validate_megatron_cfg", _megatron_check(utils.validate_megatron_cfg))


def remove() -> None:
    """Undo `install`."""
    import importlib

    for (module, attr), original in _originals.items():
        setattr(importlib.import_module(module), attr, original)
    if _originals:
        import skyrl.backends.skyrl_train.weight_sync as ws

        ws._VLLM_RECEIVE_BACKENDS.pop(BACKEND, None)
    _originals.clear()
    _config.clear()


def _patch(module: Any, attr: str, replacement: Any) -> None:
    _originals[(module.__name__, attr)] = getattr(module, attr)
    setattr(module, attr, replacement)


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
    clients = {f"engine{i}": SkyrlWeightSyncClient([url], 1) for i, url in enumerate(server_urls)}
    engine = WeightTransferTrainerFactory.trainer_init(info, client=clients, source=source)
    # SkyRL's Worker reads these capability attributes of every trainer engine
    engine.skyrl_handles_prefix_cache_reset = False
    engine.skyrl_force_disable_expandable_segments = False
    engine.skyrl_empty_cache_after_send = True
    engine.skyrl_draft_source = None
    return engine


__all__ = ["PATCHES", "build_dcr_engine", "install", "installed", "remove"]
