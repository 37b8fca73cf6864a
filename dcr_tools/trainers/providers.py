"""Provider records: a bridge's own ``provider_bridge`` run on an HF config, for the CPU builder.

`provider_record(hf_config)` resolves the bridge (`megatron_dcr_hooks.bridge_registry.resolve`)
and runs its own ``provider_bridge`` on the config. The bridge classes the registry imported
are defined over the registry's stub base (the real ``MegatronModelBridge`` drags in training
and PEFT code that needs Transformer Engine); the stub carries the real base's class tables
(``CONFIG_MAPPING``, ``ACTIVATION_MAPPING``, which bridge class bodies extend at import), and
`ProviderBase` here supplies the base methods a ``provider_bridge`` calls. The record is built
on a subclass of the bridge class with `ProviderBase` after the stub in its method order
(``bridge -> ... -> stub base -> ProviderBase``), so a family's ``super().provider_bridge()``
reaches `ProviderBase.provider_bridge`, which maps the HF config through the stub's tables
into a plain attribute record (`ProviderRecord`) instead of a ``GPTModelProvider`` (which
needs omegaconf, not installed here). The family's own settings (QK-norm, QKV bias, MoE
options...) land on that record; `dcr_tools.trainers.model` builds a CPU model from it.

Only the tools use this (the reference trainers, fixtures, benchmarks); the owner hook needs
the bridge's mapping registry alone (`bridge_registry.mapping_registry_for`).

Limitations:
1. Covers bridges whose ``provider_bridge`` only calls the base ``provider_bridge`` (or the
   other base helpers below) and sets attributes; others raise with the bridge's own error.
2. Mirrors megatron-bridge 0.6.2's base (``model_bridge.py``) for YaRN and MLA settings;
   YaRN on an ``MLAModelProvider`` is refused (`CompatibilityError`), not translated.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch

from megatron_dcr_hooks.bridge_registry import ConfigView, resolve, source_name
from shared_codec.errors import CompatibilityError


class ProviderRecord(types.SimpleNamespace):
    """What a bridge's ``provider_bridge`` produced: provider field name -> value. Carries
    ``provider_class`` (the class the real bridge would instantiate) and ``architecture``."""


def _yarn_scaling(hf_config: Any) -> tuple[str, Mapping[str, Any]] | None:
    """(config key, scaling dict) when `hf_config` asks for YaRN RoPE scaling. transformers 5
    keeps the scaling in ``rope_parameters``, older configs in ``rope_scaling`` (megatron-bridge
    0.6.2's base reads ``rope_scaling`` only; a transformers-5 config object serves the same
    dict under both names)."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = getattr(hf_config, key, None)
        if isinstance(rope, dict) and (rope.get("type") or rope.get("rope_type")) == "yarn":
            return key, rope
    return None


class ProviderBase:
    """The parts of ``MegatronModelBridge`` a ``provider_bridge`` calls (module docstring).
    The tables are the stub base's (ahead of this class in the method order)."""

    CONFIG_MAPPING: list[tuple[str, str]]
    ACTIVATION_MAPPING: dict[str, Any]
    PROVIDER_CLASS: Any

    @classmethod
    def hf_to_megatron_activation(cls, hidden_act: str) -> Any:
        if hidden_act not in cls.ACTIVATION_MAPPING:
            raise ValueError(
                f"Unsupported activation function: {hidden_act}. "
                f"Supported: {list(cls.ACTIVATION_MAPPING)}"
            )
        return cls.ACTIVATION_MAPPING[hidden_act]

    def dtype_from_hf(self, config: Any, default: Any = None) -> torch.dtype:
        value = getattr(config, "torch_dtype", None)
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str):
            return {
                "float16": torch.float16,
                "fp16": torch.float16,
                "bfloat16": torch.bfloat16,
                "bf16-mixed": torch.bfloat16,
            }.get(value, torch.float32)
        if default is not None:
            return default
        raise ValueError("torch_dtype is not of type str/torch.dtype")

    def make_vocab_size_divisible_by(self, vocab_size: int) -> int:
        base = 128
        while vocab_size % base != 0:
            base //= 2
        return base

    def hf_config_to_provider_kwargs(self, hf_config: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for hf_name, megatron_name in self.CONFIG_MAPPING:
            value = getattr(hf_config, hf_name, None)
            if value is not None:
                kwargs[megatron_name] = value
        if kwargs.get("vocab_size") is not None:
            kwargs["make_vocab_size_divisible_by"] = self.make_vocab_size_divisible_by(
                kwargs["vocab_size"]
            )
        dtype = self.dtype_from_hf(hf_config, default=torch.float32)
        kwargs["fp16"] = dtype == torch.float16
        kwargs["bf16"] = dtype == torch.bfloat16
        kwargs["params_dtype"] = dtype
        act = str(
            getattr(hf_config, "hidden_act", None)
            or getattr(hf_config, "hidden_activation", "silu")
        )
        kwargs["activation_func"] = self.hf_to_megatron_activation(act)
        return kwargs

    def provider_bridge(self, hf_pretrained: Any) -> ProviderRecord:
        hf_config = hf_pretrained.config
        record = ProviderRecord(**self.hf_config_to_provider_kwargs(hf_config))
        pc = self.PROVIDER_CLASS
        record.provider_class = None if pc is None else source_name(pc)
        yarn = _yarn_scaling(hf_config)
        if record.provider_class == "MLAModelProvider":
            if yarn is not None:
                raise CompatibilityError(
                    f"DCR's provider record does not translate YaRN RoPE scaling ({yarn[0]}) "
                    "for an MLAModelProvider (MLA's rotary_scaling_factor / mscale fields)"
                )
            self._mla_provider_settings(hf_config, record)
        elif yarn is not None:
            self._yarn_provider_settings(yarn[1], record)
        return record

    #: (HF rope-scaling key, provider field): megatron-bridge 0.6.2's
    #: ``MegatronModelBridge.YARN_ROPE_SCALING_MAPPING`` (model_bridge.py)
    YARN_ROPE_SCALING_MAPPING: list[tuple[str, str]] = [
        ("factor", "yarn_rotary_scaling_factor"),
        ("original_max_position_embeddings", "yarn_original_max_position_embeddings"),
        ("beta_fast", "yarn_beta_fast"),
        ("beta_slow", "yarn_beta_slow"),
        ("mscale", "yarn_mscale"),
        ("mscale_all_dim", "yarn_mscale_all_dim"),
    ]

    def _yarn_provider_settings(self, rope: Mapping[str, Any], record: ProviderRecord) -> None:
        """What the real base ``hf_config_to_provider_kwargs`` / ``provider_bridge``
        (megatron-bridge 0.6.2, model_bridge.py) do for YaRN scaling on a GPT provider:
        ``position_embedding_type = "yarn"``, every ``YARN_ROPE_SCALING_MAPPING`` key the config
        has (not None) onto its ``yarn_*`` field, ``truncate`` onto
        ``yarn_correction_range_round_to_int``. A family's own ``provider_bridge`` may then set
        other values (GPT-OSS's sets all of them); the record keeps what it finally holds."""
        record.position_embedding_type = "yarn"
        for hf_key, field_name in self.YARN_ROPE_SCALING_MAPPING:
            if rope.get(hf_key) is not None:
                setattr(record, field_name, rope[hf_key])
        if "truncate" in rope:
            record.yarn_correction_range_round_to_int = rope["truncate"]

    def _mla_provider_settings(self, hf_config: Any, record: ProviderRecord) -> None:
        """What the real base ``provider_bridge`` (megatron-bridge 0.6.2,
        ``model_bridge.py`` ``hf_config_to_provider_kwargs`` / ``provider_bridge``) does for an
        ``MLAModelProvider`` beyond the plain mapping: (a) a field the config has with value
        ``None`` is mapped too (``hasattr``), so ``q_lora_rank: null`` (no query LoRA) reaches
        the provider instead of ``MLATransformerConfig``'s default 512 (megatron-bridge 0.3.1
        drops it, and would build query-LoRA layers the checkpoint does not have);
        (b) without YaRN scaling (refused above) RoPE is unscaled: ``rotary_scaling_factor``
        and ``mscale_all_dim`` 1.0 instead of MLATransformerConfig's DeepSeek-V3 YaRN
        defaults (40, 0.0), and ``position_embedding_type`` is ``"rope"``."""
        for hf_name, megatron_name in self.CONFIG_MAPPING:
            if "." in hf_name or hasattr(record, megatron_name):
                continue
            if hasattr(hf_config, hf_name) and getattr(hf_config, hf_name) is None:
                setattr(record, megatron_name, None)
        record.rotary_scaling_factor = 1.0
        record.mscale_all_dim = 1.0
        record.position_embedding_type = "rope"


_runners: dict[type, type] = {}


def _runner(bridge_class: type) -> type:
    """`bridge_class` with `ProviderBase` after the stub base in its method order (same name,
    module and qualified name; one per bridge class)."""
    if bridge_class not in _runners:
        _runners[bridge_class] = type(
            bridge_class.__name__,
            (bridge_class, ProviderBase),
            {"__module__": bridge_class.__module__, "__qualname__": bridge_class.__qualname__},
        )
    return _runners[bridge_class]


def provider_record(hf_config: Mapping[str, Any]) -> ProviderRecord:
    """Run the resolved bridge's own ``provider_bridge`` on `hf_config` (module docstring).
    ValueError when it cannot run on this config (the bridge's error named)."""
    reg = resolve(hf_config)
    cls: Any = reg.bridge_class
    runner: Any = _runner(cls)
    bridge = runner.__new__(runner)
    view = ConfigView(hf_config)
    bridge.hf_config = view
    try:
        record = bridge.provider_bridge(types.SimpleNamespace(config=view))
    except (AttributeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{reg.module}.{cls.__name__}.provider_bridge cannot run on this config: "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(record, ProviderRecord):
        raise CompatibilityError(
            f"{reg.module}.{cls.__name__}.provider_bridge returned {type(record).__name__}, "
            "not the provider base's record"
        )
    record.architecture = reg.architecture
    return record
