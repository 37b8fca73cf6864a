"""Quantized deltas on the owner side (issue 32): the trainer trains in BF16, the engines serve
a quantized checkpoint (``DCRConfig.quantization``, a `shared_codec.quantized.FORMATS` name).

Each quantized canonical weight (`shared_codec.quantized.quantizes`) has one *group owner*,
the rank its canonical-name hash picks (`ownership.residual_owner`). It keeps the weight's
committed BF16 canonical tensor and its committed quantized baseline (weight and scale, as the
library quantizer writes them). A build then runs like this:
1. Owners project their changed elements as usual (affine path), and residual conversion
   compares converted tensors as usual. The canonical records of quantized weights are not
   emitted: `take` keeps them.
2. `emit` (collective) sends every rank's kept records to the group owners (one
   ``all_gather_object`` over the host group). Each group owner applies them to its committed
   BF16 tensor and marks the touched quantization groups. A group may span several owners'
   shards (a TP, ETP or EP split that is not aligned to the block size). The group owner
   therefore holds the whole group, and only the touched groups are requantized, by the
   library (`shared_codec.quantized.quantized_delta`). The quantized bytes that changed go as
   XOR, or as overwrite on a retry, in mode P or F, or when the engines report the weight as
   overwrite-only. The scales that changed go by the same rule for the scale's name.
3. `advance` (on commit) moves the committed BF16 tensors and quantized baselines to the
   candidate. `drop` (on abort) keeps them, so a retry rebuilds from them.

The bits equal those of quantizing the bridge's export of the new weights with the library
(tests/integration/test_quantized_end_to_end.py). The trainer environment needs
compressed-tensors at the rollout environment's version (0.17.0).

Host memory (`nbytes`): one BF16 copy and one quantized copy of every quantized weight in the
job, split over the ranks by the name hash.

Limitations:
1. The records reach the group owners through an all-gather: every rank receives all of the
   quantized changes, so traffic grows with the world size (an all-to-all would not).
2. A group owner copies the whole committed BF16 tensor of each changed weight once per
   build, and the diff against the baseline reads the whole quantized tensor. Only the
   requantization is O(touched groups).
3. Only two-dimensional weights are quantized (`quantizes` names projections, experts
   included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_dcr_hooks.conversion import GroupedExports, megatron_to_hf, num_experts_of
from megatron_dcr_hooks.groups import ParallelGroups
from megatron_dcr_hooks.ownership import residual_owner
from megatron_dcr_hooks.tasks import Task
from shared_codec.dtypes import tensor_bits
from shared_codec.quantized import (
    QuantFormat,
    groups_of,
    quantize,
    quantized_delta,
    quantizes,
    scale_name,
)
from shared_codec.records import DeltaItem, Kind


@dataclass(slots=True)
class Pending:
    """One routed canonical record of a quantized weight: its kind, indices and values."""

    name: str
    kind: int
    indices: np.ndarray
    values: np.ndarray


@dataclass(slots=True)
class Changed:
    """A group owner's candidate for one weight: the BF16 elements that changed (flat indices
    and new stored bits) and the requantized weight and scale."""

    indices: np.ndarray
    bits: np.ndarray
    q: torch.Tensor
    scale: torch.Tensor


@dataclass(slots=True)
class EmitReport:
    """What one `emit` did on this rank (the group owner's side)."""

    weights: int = 0  # quantized weights with BF16 changes
    bf16_changed: int = 0  # their changed BF16 elements
    groups: int = 0  # quantization groups touched and requantized
    items: int = 0
    entries: int = 0


class QuantizedOwner:
    """The quantized weights of the job and the baselines this rank group-owns (module
    docstring). Constructed collectively (it converts the quantized weights through the
    bridge once, for the committed BF16 baseline)."""

    def __init__(
        self, fmt: QuantFormat, tasks: list[Task], chunks: list[Any], groups: ParallelGroups
    ) -> None:
        self.fmt = fmt
        self._world = groups.cpu_world
        self.rank = self._world.rank
        self.names = frozenset(n for t in tasks for n in t.hf_shapes if quantizes(n))
        self.bf16: dict[str, torch.Tensor] = {}
        self.q: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        grouped = GroupedExports(num_experts_of(chunks))
        with torch.no_grad():
            for t in tasks:
                if self.names.isdisjoint(t.hf_shapes):
                    continue
                shard = t.param.detach() if t.local else None
                for name, tensor in grouped.add(
                    t.param_task, megatron_to_hf(t.param_task, shard)
                ).items():
                    if name in self.names and self._owns(name):
                        w = tensor.detach().to("cpu").contiguous().clone()
                        self.bf16[name] = w
                        self.q[name] = quantize(w, fmt)
        grouped.finish()
        self.pending: list[Pending] = []
        self.candidate: dict[str, Changed] = {}

    def _owns(self, name: str) -> bool:
        return residual_owner(name, self._world.size) == self.rank

    def take(self, item: DeltaItem) -> bool:
        """Keep `item` for the group owner when it is a quantized weight's record (True);
        False: emit it as usual."""
        if item.name not in self.names:
            return False
        self.pending.append(Pending(item.name, int(item.kind), item.indices, item.values))
        return True

    def emit(
        self,
        emit: Any,
        *,
        overwrite: bool,
        overwrite_only: frozenset[str] | Any = frozenset(),
    ) -> EmitReport:
        """Route the kept records to the group owners and emit the quantized delta of every
        weight this rank group-owns through `emit` (``emit(item)``). `overwrite`: every record
        an overwrite (a retry, mode P or F). Collective over the host group: every rank calls,
        with or without records."""
        gathered: list[list[Pending] | None] = [None] * self._world.size
        dist.all_gather_object(gathered, self.pending, group=self._world.group)
        self.pending = []
        by_name: dict[str, list[Pending]] = {}
        for part in gathered:
            for p in part or ():
                if self._owns(p.name):
                    by_name.setdefault(p.name, []).append(p)
        rep = EmitReport()
        self.candidate = {}
        for name in sorted(by_name):
            changed = self._apply(name, by_name[name])
            if changed is None:
                continue
            new_w, idx, bits = changed
            q, s = self.q[name]
            wkind = Kind.OVERWRITE if overwrite or name in overwrite_only else Kind.XOR
            skind = Kind.OVERWRITE if overwrite or scale_name(name) in overwrite_only else Kind.XOR
            nq, ns, items = quantized_delta(
                name, new_w, idx, q, s, self.fmt, owner=self.rank, kind=wkind, scale_kind=skind
            )
            self.candidate[name] = Changed(indices=idx, bits=bits, q=nq, scale=ns)
            rep.weights += 1
            rep.bf16_changed += int(idx.size)
            rep.groups += int(
                groups_of(idx, (int(new_w.shape[0]), int(new_w.shape[1])), self.fmt).size
            )
            for item in items:
                rep.items += 1
                rep.entries += int(item.count)
                emit(item)
        return rep

    def _apply(
        self, name: str, parts: list[Pending]
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray] | None:
        """The new BF16 weight from the committed one and the routed records, with the flat
        indices whose stored bits changed and those bits (None: no bit changed)."""
        old = self.bf16[name]
        ob = tensor_bits(old)
        idx = np.concatenate([p.indices for p in parts])
        vals = np.concatenate(
            [p.values if p.kind == Kind.OVERWRITE else ob[p.indices] ^ p.values for p in parts]
        )
        if np.unique(idx).size != idx.size:
            raise AssertionError(f"{name}: an element has several owners' records")
        keep = vals != ob[idx]
        if not keep.any():
            return None
        order = np.argsort(idx[keep], kind="stable")
        idx, vals = idx[keep][order], vals[keep][order]
        new = old.clone()
        tensor_bits(new)[idx] = vals
        return new, idx, vals

    def advance(self) -> None:
        """The candidate was committed: the BF16 tensors and quantized baselines move to it."""
        for name, c in self.candidate.items():
            tensor_bits(self.bf16[name])[c.indices] = c.bits
            self.q[name] = (c.q, c.scale)
        self.candidate = {}

    def drop(self) -> None:
        """The attempt failed: keep the committed baselines."""
        self.candidate = {}
        self.pending = []

    def nbytes(self) -> dict[str, int]:
        """Host memory of this rank's BF16 and quantized baselines."""
        bf16 = sum(t.numel() * t.element_size() for t in self.bf16.values())
        quant = sum(
            q.numel() * q.element_size() + s.numel() * s.element_size() for q, s in self.q.values()
        )
        return {"quantized_bf16_bytes": bf16, "quantized_baseline_bytes": quant}


__all__ = ["Changed", "EmitReport", "QuantizedOwner"]
