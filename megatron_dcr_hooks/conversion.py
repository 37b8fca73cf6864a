"""HF <-> Megatron weight conversion through megatron-bridge's mapping registry.

This is the dense path: load canonical (HF) tensors into Megatron shards, and export Megatron
shards back to canonical tensors. Every placement rule comes from megatron-bridge's mapping
classes resolved by its registry (``bridge_registry.mapping_registry_for``); nothing here knows a
model's layout. DCR uses it to restore checkpoints, for mode F (full conversion), for residual
tasks, and as the test oracle.

Call order: every rank of the job calls ``load_hf_weights`` / ``export_hf_weights`` with the same
model structure; the mappings run TP/EP collectives in parameter order.

Limitations:
1. PP=1 and one model chunk (no virtual pipeline stages).
2. Local expert names (SequentialMLP) are converted to the EP-global expert index
   ``ep_rank * E/EP + i`` before the registry lookup.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dcr_hooks import bridge_registry
from megatron_dcr_hooks.groups import ParallelGroups


@dataclass(frozen=True, kw_only=True)
class ParamTask:
    """One Megatron parameter of this rank and the resolved bridge mapping that converts it."""

    local_name: str
    global_name: str
    param: torch.nn.Parameter
    module: torch.nn.Module
    mapping: Any

    @property
    def hf_names(self) -> list[str]:
        hf = self.mapping.hf_param
        return [hf] if isinstance(hf, str) else list(hf.values())


def unwrap(model: Any) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (``.module`` chains)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def global_param_name(local_name: str, config: Any, ep_rank: int, ep_size: int) -> str:
    """The job-global name of a local parameter (EP-global expert index for local experts,
    ``ep_rank * E/EP + i``). Pure: the expert-parallel position is passed in."""
    m = re.search(r"\.local_experts\.(\d+)\.", local_name)
    if m is None or not config.num_moe_experts:
        return local_name
    per_rank = config.num_moe_experts // ep_size
    global_idx = ep_rank * per_rank + int(m.group(1))
    return local_name[: m.start(1)] + str(global_idx) + local_name[m.end(1) :]


def _module_of(root: torch.nn.Module, name: str) -> torch.nn.Module:
    module_name = name.rpartition(".")[0]
    return root.get_submodule(module_name) if module_name else root


def conversion_tasks(
    model: Any, architecture: str, groups: ParallelGroups | None = None
) -> list[ParamTask]:
    """Resolve every parameter of `model` on this rank against the bridge registry.

    `groups`: the job's process groups (the expert-parallel position names local experts by
    their EP-global index); default `ParallelGroups.from_megatron()`.
    Raises ValueError naming any parameter the registry cannot map (never skips silently);
    the tied output layer (``share_embeddings_and_output_weights``) is not a separate task.
    """
    groups = groups or ParallelGroups.from_megatron()
    root = unwrap(model)
    config = root.config
    registry = bridge_registry.mapping_registry_for(architecture)
    tasks: list[ParamTask] = []
    for local_name, param in root.named_parameters():
        if "_extra_state" in local_name:
            continue
        if local_name.startswith("output_layer.") and getattr(
            root, "share_embeddings_and_output_weights", False
        ):
            continue
        gname = global_param_name(local_name, config, groups.ep.rank, groups.ep.size)
        mapping = registry.megatron_to_hf_lookup(gname)
        if mapping is None:
            raise ValueError(
                f"megatron-bridge registry for {architecture!r} has no mapping for parameter "
                f"{gname!r}; extend the bridge registry, not DCR"
            )
        module = _module_of(root, local_name)
        if not hasattr(module, "config"):
            module.config = config
        tasks.append(
            ParamTask(
                local_name=local_name,
                global_name=gname,
                param=param,
                module=module,
                mapping=mapping,
            )
        )
    return tasks


def load_hf_weights(
    model: Any, architecture: str, hf_tensor: Callable[[str], torch.Tensor]
) -> list[ParamTask]:
    """Load canonical tensors into this rank's shards (every rank calls; collectives inside).

    `hf_tensor(name)` returns the canonical tensor `name` (CPU). Returns the tasks used.
    """
    tasks = conversion_tasks(model, architecture)
    with torch.no_grad():
        for task in tasks:
            hf = task.mapping.hf_param
            weights: Any = (
                hf_tensor(hf) if isinstance(hf, str) else {k: hf_tensor(v) for k, v in hf.items()}
            )
            shard = task.mapping.hf_to_megatron(weights, task.module)
            if shard is None:
                continue
            if tuple(shard.shape) != tuple(task.param.shape):
                raise ValueError(
                    f"bridge produced shape {tuple(shard.shape)} for {task.global_name}, "
                    f"parameter has {tuple(task.param.shape)}"
                )
            task.param.data.copy_(shard.to(task.param.dtype))
    return tasks


def iter_hf_export(model: Any, architecture: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield canonical (name, tensor) pairs converted from the Megatron shards.

    Every rank must iterate to the end (collectives). Each rank yields every canonical tensor
    (TP and EP gathers are all-gathers); duplicates of replicated tensors are not yielded twice.
    """
    seen: set[str] = set()
    with torch.no_grad():
        for task in conversion_tasks(model, architecture):
            out = task.mapping.megatron_to_hf(task.param.detach(), task.module)
            for name, tensor in out.items():
                if name in seen:
                    continue
                seen.add(name)
                yield name, tensor.detach().clone().contiguous()


def export_hf_weights(model: Any, architecture: str) -> dict[str, torch.Tensor]:
    """All canonical tensors of `model` as a dict (every rank calls; see `iter_hf_export`)."""
    return dict(iter_hf_export(model, architecture))


def hf_getter(tensors: Mapping[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """`hf_tensor` callable over an in-memory canonical state dict with a clear missing error."""

    def get(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise KeyError(f"canonical tensor {name!r} is missing from the checkpoint") from None

    return get
