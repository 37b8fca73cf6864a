"""What prewarm found: each canonical tensor's class on this rank, and what its writes feed.

`find` traces the loader once per tensor (capability.probe, every write suppressed), checks the
trainer's recipe against the engine's quantized format (quantized.check_recipe), plans the
re-derivation of what kernels derive from the written tensors (derived.plan_rederive) and
finds the quantized layers they write (quantized.written_layers). The result, `Prewarmed`,
classes each tensor: applied in place (the default), ``skipped`` (no model tensor), ``shared``
(a draft's tensor written only into the target's storage: the target receiver writes it),
``overwrite_only`` (XOR refused: e.g. several writes per element), or ``unsupported`` (refused,
with the reason; it includes every ``refused`` tensor, whose derived tensors or quantized layer
cannot be re-derived). `Prewarmed.retraced` is verify_plan's fresh trace: the classes and the
plan follow the loader, and the refusals stand.

Limitations: the trace runs on the model as it is (no weights change); a loader whose writes
depend on the values it loads is classified as it behaves on the traced values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vllm_dcr_plugin import derived, quantized
from vllm_dcr_plugin.capability import Capabilities
from vllm_dcr_plugin.staging import TensorSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Prewarmed:
    """One rank's classes of the prewarm table (see the module docstring)."""

    skipped: frozenset[str] = frozenset()
    shared: frozenset[str] = frozenset()
    overwrite_only: Mapping[str, str] = field(default_factory=dict)
    unsupported: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)  # cannot be re-derived -> why
    derived: derived.DerivedPlan = field(default_factory=derived.DerivedPlan)
    quantized: Mapping[str, frozenset[str]] = field(default_factory=dict)  # -> quantized layers

    @classmethod
    def of(
        cls,
        caps: Capabilities,
        refused: Mapping[str, str],
        **found: Any,
    ) -> Prewarmed:
        """The classes of a trace: every `refused` tensor is unsupported, not overwrite-only."""
        return cls(
            skipped=frozenset(caps.skipped),
            shared=frozenset(caps.shared),
            overwrite_only={n: w for n, w in caps.overwrite_only.items() if n not in refused},
            unsupported={**caps.unsupported, **refused},
            refused=dict(refused),
            **found,
        )

    def retraced(self, caps: Capabilities) -> Prewarmed:
        """verify_plan's classes: the fresh trace's, with this prewarm's refusals, derived plan
        and quantized layers kept."""
        fresh = Prewarmed.of(caps, self.refused)
        return replace(fresh, derived=self.derived, quantized=self.quantized)

    def same_classes(self, other: Prewarmed) -> bool:
        """Whether `other` classes every tensor as this does (verify_plan's ``classes_changed``)."""
        return (
            self.skipped == other.skipped
            and dict(self.overwrite_only) == dict(other.overwrite_only)
            and dict(self.unsupported) == dict(other.unsupported)
        )

    def rederive(self, model: torch.nn.Module, touched: Iterable[str] | None) -> None:
        """Re-run vLLM's post-load steps that the written tensors feed (None: all of them)."""
        names = None if touched is None else set(touched)
        derived.rederive_touched(model, self.derived, names)
        layers = None if names is None else {p for n in names for p in self.quantized.get(n, ())}
        quantized.rederive(model, layers)

    def report(self, role: str) -> dict[str, Any]:
        """The classes' part of the prewarm report."""
        return {
            "skipped": sorted(self.skipped),
            **({"role": role, "shared": sorted(self.shared)} if role != "base" else {}),
            "overwrite_only": dict(sorted(self.overwrite_only.items())),
            "unsupported": dict(sorted(self.unsupported.items())),
        }


def find(
    model: torch.nn.Module,
    specs: dict[str, TensorSpec],
    trace: Callable[[], Capabilities],
) -> tuple[Prewarmed, Capabilities]:
    """Prewarm's classes of `specs` on `model` (the module docstring) and the trace they come
    from (`trace`: capability.probe of `specs`, under the receiver's partial-load scope).
    Raises `ProtocolError` for a recipe that is not the engine's quantized format."""
    caps = trace()
    quantized.check_recipe(model, {n: s.dtype for n, s in specs.items()}, caps.writes)
    plan = derived.plan_rederive(model, caps.writes)
    layers = quantized.written_layers(model, caps.writes)
    refused = {
        **plan.refused,
        **quantized.refused_tensors(model, layers),
        **quantized.unsupported_tensors(model, caps.writes),
    }
    return Prewarmed.of(caps, refused, derived=plan, quantized=layers), caps
