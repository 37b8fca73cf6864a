"""HF <-> Megatron weight conversion through megatron-bridge's mapping registry.

This is the dense path: load canonical (HF) tensors into Megatron shards, and export Megatron
shards back to canonical tensors. Every placement rule comes from megatron-bridge's mapping
classes resolved by its registry (``bridge_registry.mapping_registry_for``); nothing here knows a
model's layout. DCR uses it to restore checkpoints, for mode F (full conversion), for residual
tasks, and as the test oracle.

Call order: every rank of the job calls ``load_hf_weights`` / ``export_hf_weights`` with the same
model structure; the mappings run TP/EP collectives in parameter order.

Pipeline parallelism (PP, and virtual stages: any number of model chunks per rank) follows
megatron-bridge's own export: the task list of a rank is the job-global parameter list of its
pipeline group (every stage's names, gathered once, in pipeline-rank then chunk order), so all
ranks of a pipeline group walk the same list. A parameter held on another stage is a *remote*
task (no parameter, no module): the rank still calls its mapping with ``None`` and the bridge
broadcasts the owning stage's shard (``broadcast_from_pp_rank``) before its TP/EP gathers.
Local layer indices become global ones through each layer's ``layer_number`` (megatron's
per-chunk layer offset), as the bridge does.

Limitations:
1. Local expert names (SequentialMLP) are converted to the EP-global expert index
   ``ep_rank * E/EP + i`` before the registry lookup.
2. Under PP every conversion broadcasts the whole (TP-local) shard across the pipeline group;
   DCR converts only probes (once), residual tasks and mode F that way.
3. Grouped exports (megatron-bridge mappings with ``is_grouped_export``, e.g. GPT-OSS's
   ``mlp.experts.gate_up_proj``: one HF tensor stacks every expert's converted tensor along a
   new leading dimension) are stacked by `GroupedExports` as megatron-bridge 0.6.2's
   ``_accumulate_grouped_export`` does, with expert parallelism 1 only (under EP > 1 the
   bridge's gathered layout was not checked here: ValueError) and without
   ``transpose_on_export`` (ValueError). Expert ``e``'s converted tensor is the slice ``[e]``
   of the stacked one, so its flat canonical index is ``e * slice size + index in the slice``.
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
    """One Megatron parameter of the pipeline group and the resolved bridge mapping that
    converts it. `param`, `module`, `local_name` and `chunk` are None for a *remote* task (the
    parameter lives on another pipeline stage; module docstring)."""

    local_name: str | None
    global_name: str
    param: torch.Tensor | None  # a parameter, or a persistent buffer the bridge maps
    module: torch.nn.Module | None
    mapping: Any
    chunk: int | None = None

    @property
    def local(self) -> bool:
        return self.param is not None

    @property
    def mapping_grouped(self) -> bool:
        """Whether the mapping is a grouped export (module docstring, limitation 3)."""
        return bool(getattr(self.mapping, "is_grouped_export", False))

    @property
    def hf_names(self) -> list[str]:
        hf = self.mapping.hf_param
        return [hf] if isinstance(hf, str) else list(hf.values())


def _clear_pp_caches(mapping: Any, depth: int = 0) -> None:
    """Reset the bridge's per-mapping pipeline state of `mapping` and its nested mappings, so
    every pipeline rank runs the same broadcasts in every conversion: the cached broadcast specs
    (shape, dtype: DCR converts the same mapping with int64 probes and BF16 shards) and
    AutoMapping's detected layout (the registry shares direct-name mappings between lookups, so
    a rank that used one locally, e.g. to load, would skip the broadcast its peers wait in)."""
    clear = getattr(mapping, "clear_tensor_spec_output_cache", None)
    if clear is None or depth > 3:
        return
    clear()
    mapping.clear_broadcast_cache()
    if hasattr(mapping, "_detected_type"):  # AutoMapping: detect (and broadcast) again
        mapping._mapping = None
    for value in vars(mapping).values():
        _clear_pp_caches(value, depth + 1)


def megatron_to_hf(task: ParamTask, tensor: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Convert `tensor` (this rank's shard of `task`, or None for a remote task) to canonical
    tensors with the task's bridge mapping. Collective over the task's TP/EP groups and, with
    PP > 1, over the pipeline group."""
    if getattr(task.mapping, "pp_size", 1) > 1:
        _clear_pp_caches(task.mapping)
    return task.mapping.megatron_to_hf(tensor, task.module)


_EXPERT = re.compile(r"\.local_experts\.(\d+)\.|\.(?:weight|bias)(\d+)$")


def grouped_expert(task: ParamTask) -> int | None:
    """The EP-global expert index of `task` if its mapping is a grouped export (module
    docstring, limitation 3), else None. ValueError for a grouped export DCR does not stack."""
    mapping = task.mapping
    if not task.mapping_grouped:
        return None
    if getattr(mapping, "transpose_on_export", False):
        raise ValueError(
            f"{task.global_name}: {type(mapping).__name__} transposes grouped exports by "
            "comparing with the HF checkpoint's shape; DCR does not stack such mappings"
        )
    if int(getattr(mapping, "ep_size", 1) or 1) > 1:
        raise ValueError(
            f"{task.global_name}: grouped export ({type(mapping).__name__}) under expert "
            "parallelism > 1 is not supported by DCR (the bridge's EP-gathered layout was not "
            "checked)"
        )
    m = _EXPERT.search(task.global_name)
    if m is None:
        raise ValueError(f"{task.global_name}: grouped export without an expert index")
    return int(m.group(1) or m.group(2))


class GroupedExports:
    """Stacks the per-expert outputs of grouped-export tasks into their HF tensors (module
    docstring, limitation 3). `add` returns a task's canonical tensors: other tasks' outputs
    unchanged, a grouped task's only once every expert of its group was added (then the
    stacked tensor), else nothing. `finish` raises if a group stayed incomplete."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._parts: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, task: ParamTask, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        expert = grouped_expert(task)
        if expert is None:
            return out
        done: dict[str, torch.Tensor] = {}
        for name, tensor in out.items():
            parts = self._parts.setdefault(name, {})
            parts[expert] = tensor
            if len(parts) == self.num_experts:
                done[name] = torch.stack([parts[e] for e in range(self.num_experts)])
                del self._parts[name]
        return done

    def finish(self) -> None:
        if self._parts:
            raise ValueError(
                f"grouped exports incomplete (experts missing): {sorted(self._parts)[:5]}"
            )


def num_experts_of(model: Any) -> int:
    """``num_moe_experts`` of `model` (one model or its chunks), 0 without experts."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    config = getattr(unwrap(chunks[0]), "config", None)
    return int(getattr(config, "num_moe_experts", None) or 0)


def unwrap(model: Any) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (``.module`` chains)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)\.")


def global_layer_name(root: torch.nn.Module, local_name: str) -> str:
    """`local_name` with its chunk-local layer index replaced by the global one (the layer's
    ``layer_number`` - 1, i.e. megatron's pipeline / virtual-stage layer offset applied)."""
    m = _LAYER.match(local_name)
    if m is None:
        return local_name
    layer = root.get_submodule(m.group(1) + m.group(2))
    number = getattr(layer, "layer_number", None)
    if number is None:
        return local_name
    return f"{m.group(1)}{int(number) - 1}.{local_name[m.end() :]}"


def _gather_names(names: list[str], group: Any, size: int) -> list[list[str]]:
    """All-gather one list of names per rank of `group` (UTF-8 in uint8 tensors, no pickle; on
    the group's device: collectives.py)."""
    from megatron_dcr_hooks.collectives import all_gather

    data = torch.frombuffer(bytearray("\n".join(names).encode() or b"\0"), dtype=torch.uint8)
    lengths = all_gather(torch.tensor([data.numel()], dtype=torch.int64), group, size)
    width = int(max(int(x) for x in lengths))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = all_gather(padded, group, size)
    out = []
    for part, length in zip(parts, lengths, strict=True):
        raw = bytes(part[: int(length)].tolist())
        out.append([] if raw == b"\0" else raw.decode().split("\n"))
    return out


def global_param_name(local_name: str, config: Any, ep_rank: int, ep_size: int) -> str:
    """The job-global name of a local parameter (EP-global expert index for local experts,
    ``ep_rank * E/EP + i``). Pure: the expert-parallel position is passed in."""
    m = re.search(r"\.local_experts\.(\d+)\.", local_name)
    if m is None or not config.num_moe_experts:
        return local_name
    per_rank = config.num_moe_experts // ep_size
    global_idx = ep_rank * per_rank + int(m.group(1))
    return local_name[: m.start(1)] + str(global_idx) + local_name[m.end(1) :]


def _params_and_persistent_buffers(root: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then persistent buffers (state-dict tensors that are no parameters, e.g. an
    MoE router's ``expert_bias``, updated outside the optimizer), as megatron-bridge's own
    conversion iterates them (``persistent_buffers`` in its conversion utils)."""
    yield from root.named_parameters()
    for prefix, module in root.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _global_name(root: torch.nn.Module, local_name: str, groups: ParallelGroups) -> str:
    return global_param_name(
        global_layer_name(root, local_name), root.config, groups.ep.rank, groups.ep.size
    )


def _module_of(root: torch.nn.Module, name: str) -> torch.nn.Module:
    module_name = name.rpartition(".")[0]
    return root.get_submodule(module_name) if module_name else root


def conversion_tasks(
    model: Any, architecture: str | Mapping[str, Any], groups: ParallelGroups | None = None
) -> list[ParamTask]:
    """Resolve every parameter of the pipeline group against the bridge registry.

    `architecture`: an HF architecture name or the HF config dict (required by bridges that
    build their registry from the config: ``bridge_registry.mapping_registry_for``).
    Persistent buffers the registry maps (an MoE router's ``expert_bias``) are tasks like
    parameters, as in megatron-bridge's own conversion; unmapped buffers are not checkpoint
    tensors and are skipped.

    `model`: one model or this rank's list of model chunks (virtual pipeline stages).
    `groups`: the job's process groups (the expert-parallel position names local experts by
    their EP-global index; the pipeline group gathers the other stages' names); default
    `ParallelGroups.from_megatron()`. Collective over the pipeline group when PP > 1.
    Returns local tasks and, with PP > 1, remote tasks (module docstring) in one order shared
    by the pipeline group. Raises ValueError naming any parameter the registry cannot map
    (never skips silently); the tied output layer (``share_embeddings_and_output_weights``)
    is not a separate task.
    """
    groups = groups or ParallelGroups.from_megatron()
    chunks = model if isinstance(model, (list, tuple)) else [model]
    registry = bridge_registry.mapping_registry_for(architecture)
    name = (
        architecture
        if isinstance(architecture, str)
        else bridge_registry.architecture_of(architecture)
    )

    def mapping_of(gname: str) -> Any:
        mapping = registry.megatron_to_hf_lookup(gname)
        if mapping is None:
            raise ValueError(
                f"megatron-bridge registry for {name!r} has no mapping for parameter "
                f"{gname!r}; extend the bridge registry, not DCR"
            )
        return mapping

    local: dict[str, ParamTask] = {}
    for chunk, wrapped in enumerate(chunks):
        root = unwrap(wrapped)
        config = root.config
        for local_name, param in _params_and_persistent_buffers(root):
            if "_extra_state" in local_name:
                continue
            if not isinstance(param, torch.nn.Parameter) and (
                registry.megatron_to_hf_lookup(_global_name(root, local_name, groups)) is None
            ):
                continue  # a buffer that is no checkpoint tensor (the bridge skips it too)
            if local_name.startswith("output_layer.") and getattr(
                root, "share_embeddings_and_output_weights", False
            ):
                continue
            gname = global_param_name(
                global_layer_name(root, local_name), config, groups.ep.rank, groups.ep.size
            )
            if gname in local:
                raise ValueError(f"parameter {gname!r} appears in two model chunks")
            module = _module_of(root, local_name)
            if not hasattr(module, "config"):
                module.config = config
            local[gname] = ParamTask(
                local_name=local_name,
                global_name=gname,
                param=param,
                module=module,
                mapping=mapping_of(gname),
                chunk=chunk,
            )
    if groups.pp.size == 1:
        return list(local.values())
    tasks: list[ParamTask] = []
    seen: set[str] = set()
    for names in _gather_names(list(local), groups.pp.group, groups.pp.size):
        for gname in names:
            if gname in seen:
                raise ValueError(f"parameter {gname!r} is held by two pipeline stages")
            seen.add(gname)
            tasks.append(
                local.get(gname)
                or ParamTask(
                    local_name=None,
                    global_name=gname,
                    param=None,
                    module=None,
                    mapping=mapping_of(gname),
                )  # fmt: skip
            )
    return tasks


def load_hf_weights(
    model: Any, architecture: str | Mapping[str, Any], hf_tensor: Callable[[str], torch.Tensor]
) -> list[ParamTask]:
    """Load canonical tensors into this rank's shards (every rank calls; collectives inside).

    `model`: one model or this rank's model chunks. `hf_tensor(name)` returns the canonical
    tensor `name` (CPU). Returns the tasks (remote ones included, not loaded here).
    """
    tasks = conversion_tasks(model, architecture)
    with torch.no_grad():
        for task in tasks:
            if task.param is None:
                continue  # held by another pipeline stage
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


def iter_hf_export(
    model: Any, architecture: str | Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield canonical (name, tensor) pairs converted from the Megatron shards.

    Every rank must iterate to the end (collectives). Each rank yields every canonical tensor
    (TP and EP gathers are all-gathers, other stages' tensors are broadcast across the pipeline
    group); duplicates of replicated tensors are not yielded twice. `model`: one model or this
    rank's model chunks.
    """
    seen: set[str] = set()
    grouped = GroupedExports(num_experts_of(model))
    with torch.no_grad():
        for task in conversion_tasks(model, architecture):
            shard = task.param.detach() if task.param is not None else None
            out = grouped.add(task, megatron_to_hf(task, shard))
            for name, tensor in out.items():
                if name in seen:
                    continue
                seen.add(name)
                yield name, tensor.detach().clone().contiguous()
    grouped.finish()


def export_hf_weights(model: Any, architecture: str | Mapping[str, Any]) -> dict[str, torch.Tensor]:
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
