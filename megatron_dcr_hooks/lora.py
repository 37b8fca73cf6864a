"""LoRA adapters of a Megatron model in Hugging Face PEFT coordinates: the owner side of
adapter-only refits (issue 34 item 4).

megatron-bridge's own PEFT (``megatron.bridge.peft.lora.LoRA``) wraps the model's linear layers
(``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) with trainable adapters; its
``MegatronPeftBridge.stream_adapter_weights_megatron_to_hf`` gathers them over TP/PP/EP and
yields PEFT names (``model.layers.0.self_attn.q_proj.lora_A.weight``, fused QKV and gate/up
split as the base weights are). `MegatronLoRA` runs both on CPU:

- `apply(model_chunks)`: the bridge's LoRA transform (the base frozen; build the optimizer
  after it);
- `adapter_tensors(model_chunks)`: a collective on every rank: the adapter's PEFT state dict
  (``base_model.model.`` + the bridge's names), cloned, identical on every rank;
- `peft_config(base)`: the ``adapter_config.json`` vLLM and PEFT read.

The tensors feed the named-tensor owner (shared_codec.named: ``take_weights``), whose payloads
the rollout engines apply to their adapter (vllm_dcr_plugin.adapters): the same commit
protocol as the base weights.

Two compatibility fixes (megatron-bridge 0.6.2 without Transformer Engine):
1. ``megatron.bridge.peft.lora_layers`` imports ``transformer_engine.pytorch`` at module level
   for its fused TE path only: a stand-in module is put in ``sys.modules`` for that import and
   taken out again;
2. megatron-core without Transformer Engine makes its TE classes ``MagicMock``s, which
   ``megatron.bridge.peft.utils`` then treats as present (``HAVE_TE``): it is set False, so the
   plain ``ColumnParallelLinear`` / ``RowParallelLinear`` of the local spec are matched.

Limitations:
1. megatron-bridge 0.6.2 (the trainer environment); 0.3.1 is refused with `CompatibilityError`.
2. Dense models of the bridges' standard mappings (checked: Llama); MLA and expert adapters are
   not checked here.
3. At TP=1 the bridge yields the live parameters: `adapter_tensors` clones them.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any
from unittest.mock import MagicMock

import torch

from megatron_dcr_hooks.bridge_loader import check_version, import_bridge_module
from megatron_dcr_hooks.bridge_registry import mapping_registry_for
from shared_codec.errors import CompatibilityError

PEFT_PREFIX = "base_model.model."
PEFT_BRIDGE = ("0.6.2",)  # megatron-bridge versions whose PEFT was checked here
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@contextlib.contextmanager
def _te_stand_in() -> Iterator[None]:
    """A ``transformer_engine`` stand-in in ``sys.modules`` while the block imports (fix 1)."""
    names = ("transformer_engine", "transformer_engine.pytorch")
    saved = {n: sys.modules.get(n) for n in names}
    te = types.ModuleType("transformer_engine")
    te.__path__ = []  # type: ignore[attr-defined]
    te.pytorch = MagicMock()  # type: ignore[attr-defined]
    sys.modules.update({names[0]: te, names[1]: te.pytorch})  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _bridge_peft() -> tuple[Any, Any]:
    """(the ``LoRA`` class, the ``peft_bridge`` module), with both fixes applied."""
    version = check_version()
    if version not in PEFT_BRIDGE:
        raise CompatibilityError(
            f"megatron-bridge {version}: its PEFT (LoRA) is not checked here; adapter refits "
            f"need megatron-bridge {' or '.join(PEFT_BRIDGE)}"
        )
    try:
        utils = import_bridge_module("megatron.bridge.peft.utils")
        utils.HAVE_TE = False  # type: ignore[attr-defined]  # fix 2
        import_bridge_module("megatron.bridge.peft.module_matcher")
        with _te_stand_in():
            lora = import_bridge_module("megatron.bridge.peft.lora")
            peft_bridge = import_bridge_module("megatron.bridge.models.conversion.peft_bridge")
    except (ImportError, AttributeError) as e:
        raise CompatibilityError(
            f"megatron-bridge's PEFT (LoRA) is not usable here ({type(e).__name__}: {e}); "
            "adapter refits need megatron-bridge 0.6.2"
        ) from None
    return lora.LoRA, peft_bridge


class MegatronLoRA:
    """LoRA of rank `dim` (scaling `alpha` / `dim`) on `targets` of a model built from the HF
    config `hf_config` (see the module docstring)."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        *,
        dim: int = 8,
        alpha: int = 16,
        targets: Sequence[str] = TARGETS,
    ) -> None:
        lora_cls, peft_bridge = _bridge_peft()
        self.hf_config, self.dim, self.alpha = hf_config, int(dim), int(alpha)
        self.lora = lora_cls(dim=self.dim, alpha=self.alpha, target_modules=list(targets))
        registry = mapping_registry_for(hf_config)

        class Exporter(peft_bridge.MegatronPeftBridge):  # type: ignore[misc, name-defined]
            """The bridge's adapter export over this model's mapping registry."""

            def mapping_registry(self) -> Any:
                return registry

            def _unwrap_name(self, name: str) -> str:
                while name.startswith("module."):
                    name = name[len("module.") :]
                return name

            def _with_progress_tracking(self, tasks: Any, *_: Any, **__: Any) -> Any:
                return iter(tasks)

        self.exporter = Exporter()

    def apply(self, model_chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """Wrap the target linears with adapters; the base weights are frozen."""
        return list(self.lora(model_chunks, training=True))

    def adapter_tensors(self, model_chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
        """The adapter's PEFT state dict (a collective: every rank calls it, every rank gets
        all of it), cloned from the model."""
        stream = self.exporter.stream_adapter_weights_megatron_to_hf(
            model_chunks, cpu=True, show_progress=False
        )
        return {PEFT_PREFIX + name: t.detach().clone().contiguous() for name, t in stream}

    def peft_config(self, base: str, names: Sequence[str]) -> dict[str, Any]:
        """``adapter_config.json`` for the adapter whose PEFT tensors are `names`."""
        modules = sorted({n.split(".")[-3] for n in names if ".lora_A." in n})
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.dim,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": modules,
            "base_model_name_or_path": base,
        }
