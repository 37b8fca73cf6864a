"""Which megatron-bridge bridge converts a model: resolved from the HF config's architectures.

There is no DCR-written model table. megatron-bridge registers each bridge class with a decorator,
``@MegatronModelBridge.register_bridge(source=<HF architecture class or its name>, target=...,
provider=..., model_type=...)``, and its ``AutoBridge`` picks the bridge from the first entry of
the HF config's ``architectures`` that ends with one of ``SUPPORTED_HF_ARCHITECTURES``. This
module does the same with the installed package:

1. Discovery: every ``megatron/bridge/models/**/*_bridge.py`` of the installed bridge is imported
   with ``MegatronModelBridge`` replaced by `_StubBridgeBase` (the real base class drags in
   training and PEFT code that needs Transformer Engine). The stub's ``register_bridge`` records
   each registration, keyed by the HF architecture class name. Modules that fail to import are
   kept with their concrete error (``discover().unavailable``); `resolve` names that error when
   the requested architecture is registered only there (found by reading the module's source).
2. Resolution: `architecture_of(hf_config)` is AutoBridge's choice of architecture (suffixes read
   from the installed ``auto_bridge.py``); `resolve(key)` accepts an architecture name, an HF
   config dict, or a ``model_type`` that exactly one bridge registers (``register_bridge(...,
   model_type=...)``, megatron-bridge's own data).
3. Providers: `provider_record(hf_config)` runs the bridge's own ``provider_bridge`` against the
   stub base, whose ``provider_bridge`` maps the HF config through the bridge's own
   ``CONFIG_MAPPING`` and ``ACTIVATION_MAPPING`` (read from the installed ``model_bridge.py``) into
   a plain attribute record instead of a ``GPTModelProvider`` (which needs omegaconf, not
   installed here). The bridge's family settings (QK-norm, QKV bias, MoE options...) land on that
   record; `dcr_tools.trainers.model` builds a CPU model from it.

Limitations:
1. Checked on megatron-bridge 0.3.1 (``bridge_loader.check_version``).
2. While bridge modules import, a placeholder ``omegaconf`` module stands in when omegaconf is not
   installed (only provider serialization uses it); any use raises CompatibilityError.
3. ``provider_record`` covers bridges whose ``provider_bridge`` only calls the base
   ``provider_bridge`` and sets attributes; others raise with the bridge's own error.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_dcr_hooks import bridge_loader
from shared_codec.errors import CompatibilityError

_MODEL_BRIDGE = "megatron.bridge.models.conversion.model_bridge"


@dataclass(frozen=True, kw_only=True)
class BridgeRegistration:
    """One ``register_bridge`` call of the installed megatron-bridge."""

    architecture: str  # HF architecture class name, e.g. "LlamaForCausalLM"
    module: str  # e.g. "megatron.bridge.models.llama.llama_bridge"
    bridge_class: Any  # the bridge class (defined over the stub base)
    target: str  # Megatron model class name, e.g. "GPTModel"
    provider: str | None = None  # provider class name when the bridge names one
    model_type: str | None = None

    def mapping_registry(self, hf_config: Mapping[str, Any] | None = None) -> Any:
        """The bridge's own ``MegatronMappingRegistry``. Some megatron-bridge 0.6 bridges
        (DeepSeek, GLM-4.5/5, Nemotron-H, ...) build it from the HF config, which AutoBridge
        sets on the bridge first: `hf_config` is set the same way when given; without it such
        a bridge raises `CompatibilityError` naming it."""
        cls: Any = self.bridge_class
        bridge = cls.__new__(cls)
        if hf_config is not None:
            view = _ConfigView(hf_config)
            bridge.hf_config = view
            bridge.hf_pretrained = types.SimpleNamespace(config=view)
        try:
            return cls.mapping_registry(bridge)
        except AttributeError as e:
            if hf_config is None and getattr(e, "name", None) in ("hf_config", "hf_pretrained"):
                raise CompatibilityError(
                    f"{self.module}.{cls.__name__} builds its mapping registry from the HF "
                    f"config ({e.name}); DCR resolves it from the architecture name only, so "
                    f"{self.architecture} is not supported by the owner hook yet"
                ) from e
            raise


@dataclass(frozen=True, kw_only=True)
class Discovery:
    """Everything the installed bridge registers, and the modules that do not import here."""

    registrations: dict[str, BridgeRegistration]  # by architecture
    unavailable: dict[str, str]  # module -> "ExcType: message"
    declared: dict[str, list[str]] = field(default_factory=dict)  # module -> sources in its code


_cache: dict[str, Any] = {}


def _source_of(source: Any) -> str:
    return source if isinstance(source, str) else getattr(source, "__name__", repr(source))


class _Recorder:
    registrations: list[dict[str, Any]] = []


class _OmegaConfPlaceholder:
    """Stands in for ``omegaconf.OmegaConf`` during bridge imports when omegaconf is absent."""

    def __getattr__(self, name: str) -> Any:
        raise CompatibilityError(
            f"omegaconf is not installed; megatron-bridge's provider serialization "
            f"(OmegaConf.{name}) is unavailable in DCR's import of the bridge"
        )


def _placeholder_modules() -> dict[str, types.ModuleType]:
    if importlib.util.find_spec("omegaconf") is not None:
        return {}
    oc = types.ModuleType("omegaconf")
    oc.OmegaConf = _OmegaConfPlaceholder()  # type: ignore[attr-defined]
    oc.DictConfig = type("DictConfig", (), {})  # type: ignore[attr-defined]
    oc.ListConfig = type("ListConfig", (), {})  # type: ignore[attr-defined]
    utils = types.ModuleType("omegaconf._utils")

    def is_structured_config(obj: Any) -> bool:
        raise CompatibilityError("omegaconf is not installed (is_structured_config)")

    utils.is_structured_config = is_structured_config  # type: ignore[attr-defined]
    oc._utils = utils  # type: ignore[attr-defined]
    return {"omegaconf": oc, "omegaconf._utils": utils}


def _literal(path: Path, class_name: str | None, name: str) -> Any:
    """The AST node assigned to `name` (inside `class_name` if given) in the file at `path`."""
    tree = ast.parse(path.read_text())
    body: list[ast.stmt] = tree.body
    if class_name is not None:
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
        body = cls.body
    for node in body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node.value  # type: ignore[attr-defined]
    raise CompatibilityError(f"{path} has no {name} (megatron-bridge layout changed?)")


def _bridge_base_tables(root: Path) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """``CONFIG_MAPPING`` and ``ACTIVATION_MAPPING`` of the installed ``MegatronModelBridge``."""
    from megatron.core.activations import fast_gelu, squared_relu

    path = root / "models" / "conversion" / "model_bridge.py"
    config_mapping = ast.literal_eval(_literal(path, "MegatronModelBridge", "CONFIG_MAPPING"))
    shared = root / "utils" / "activation_map.py"
    if shared.is_file():
        # megatron-bridge >= 0.4: the table moved out of the class into a module of its own
        # that imports only torch and megatron-core (our namespace stand-ins skip the
        # ``megatron.bridge.utils`` package __init__)
        mod = importlib.import_module("megatron.bridge.utils.activation_map")
        return [tuple(x) for x in config_mapping], dict(mod.ACTIVATION_FUNC_MAP)
    node = _literal(path, "MegatronModelBridge", "ACTIVATION_MAPPING")
    scope = {
        "F": torch.nn.functional,
        "torch": torch,
        "squared_relu": squared_relu,
        "fast_gelu": fast_gelu,
    }
    activations = eval(  # noqa: S307 - the installed bridge's own literal, names bound above
        compile(ast.Expression(node), str(path), "eval"), {"__builtins__": {}}, scope
    )
    return [tuple(x) for x in config_mapping], activations


def supported_suffixes() -> tuple[str, ...]:
    """AutoBridge's ``SUPPORTED_HF_ARCHITECTURES`` (architecture-name suffixes it accepts)."""
    if "suffixes" not in _cache:
        path = bridge_loader._bridge_root() / "models" / "conversion" / "auto_bridge.py"
        _cache["suffixes"] = tuple(
            ast.literal_eval(_literal(path, None, "SUPPORTED_HF_ARCHITECTURES"))
        )
    return _cache["suffixes"]


class _ConfigView:
    """Attribute access over an HF config dict (missing keys raise AttributeError, so
    ``getattr(cfg, name, None)`` works as on a ``PretrainedConfig``). transformers 5 moves
    ``rope_theta`` into ``rope_parameters``; it is exposed at top level too (without it the
    bridge's CONFIG_MAPPING would silently fall back to its default RoPE base)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        data = dict(cfg)
        params = data.get("rope_parameters")
        if "rope_theta" not in data and isinstance(params, dict) and "rope_theta" in params:
            data["rope_theta"] = params["rope_theta"]
        if "torch_dtype" not in data and "dtype" in data:
            data["torch_dtype"] = data["dtype"]
        self.__dict__["_data"] = data

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_data"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__["_data"])


class ProviderRecord(types.SimpleNamespace):
    """What a bridge's ``provider_bridge`` produced: provider field name -> value. Carries
    ``provider_class`` (the class the real bridge would instantiate)."""


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


class _StubBridgeBase:
    """Minimal stand-in for ``model_bridge.MegatronModelBridge`` while bridge modules import."""

    SOURCE_NAME: str | None = None
    MODEL_TYPE: str | None = None
    PROVIDER_CLASS: Any = None
    CONFIG_MAPPING: list[tuple[str, str]] = []
    ACTIVATION_MAPPING: dict[str, Any] = {}

    @classmethod
    def register_bridge(
        cls, *, source: Any, target: Any, provider: Any = None, model_type: str | None = None
    ) -> Any:
        def deco(bridge_cls: type) -> type:
            bridge_cls.SOURCE_NAME = _source_of(source)  # type: ignore[attr-defined]
            if model_type is not None:
                bridge_cls.MODEL_TYPE = model_type  # type: ignore[attr-defined]
            if provider is not None:
                bridge_cls.PROVIDER_CLASS = provider  # type: ignore[attr-defined]
            _Recorder.registrations.append(
                {
                    "architecture": _source_of(source),
                    "bridge_class": bridge_cls,
                    "target": _source_of(target),
                    "provider": None if provider is None else _source_of(provider),
                    "model_type": model_type,
                }
            )
            return bridge_cls

        return deco

    # -- the parts of the base class a provider_bridge calls -------------------------------
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
        record.provider_class = None if pc is None else _source_of(pc)
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


def _register_implementation(*, source: Any, target: Any, bridge_class: Any) -> None:
    """Stand-in for megatron-bridge >= 0.6's module-level ``register_bridge_implementation``
    (an extra architecture name for an already decorated bridge class, e.g. an upstream
    spelling): recorded like a ``register_bridge`` call, without a ``model_type``."""
    pc = getattr(bridge_class, "PROVIDER_CLASS", None)
    _Recorder.registrations.append(
        {
            "architecture": _source_of(source),
            "bridge_class": bridge_class,
            "target": _source_of(target),
            "provider": None if pc is None else _source_of(pc),
            "model_type": None,
        }
    )


def _module_names(root: Path) -> list[tuple[str, Path]]:
    out = []
    for f in sorted((root / "models").rglob("*_bridge.py")):
        rel = f.relative_to(root)
        if rel.parts[1] == "conversion":
            continue  # model_bridge / auto_bridge / peft_bridge: the machinery itself
        out.append(("megatron.bridge." + ".".join(rel.with_suffix("").parts), f))
    return out


def _declared_sources(path: Path) -> list[str]:
    """``source=`` arguments of ``register_bridge(...)`` / ``register_bridge_implementation(...)``
    calls in a module's source (read only to name the architectures of a module that cannot be
    imported). A name bound to a string at module level (megatron-bridge 0.6 writes
    ``source=_QWEN3_5_MOE_HF_CLASS_NAME``) is resolved to that string."""
    tree = ast.parse(path.read_text())
    constants = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    names = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "register_bridge"
        ) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "register_bridge_implementation"
        ):
            for kw in node.keywords:
                if kw.arg == "source":
                    if isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                        names.append(kw.value.value)
                    elif isinstance(kw.value, ast.Name):
                        names.append(constants.get(kw.value.id, kw.value.id))
    return names


def _reexport_getattr(package: str, init: Path) -> Any:
    """PEP 562 ``__getattr__`` for a namespace stand-in of `package`: a name its skipped
    ``__init__.py`` re-exports (``from .sub import Name``) is imported from that submodule."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for node in ast.walk(ast.parse(init.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if not any((a.asname or a.name) == name for a in node.names):
                continue
            source = next(a.name for a in node.names if (a.asname or a.name) == name)
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = base + ("." + node.module if node.module else "")
            else:
                target = node.module or ""
            return getattr(importlib.import_module(target), source)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def _register_all_namespaces(root: Path) -> None:
    for d in sorted(root.rglob("*")):
        init = d / "__init__.py"
        if d.is_dir() and init.is_file() and "__pycache__" not in d.parts:
            rel = d.relative_to(root)
            name = "megatron.bridge" + "".join("." + p for p in rel.parts)
            bridge_loader._register_namespace(name, d)
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.bridge") and getattr(mod, "__dcr_namespace__", False):
            init = Path(mod.__path__[0]) / "__init__.py"
            if init.is_file() and not hasattr(mod, "__getattr__"):
                setattr(mod, "__getattr__", _reexport_getattr(name, init))  # noqa: B010


@dataclass
class _State:
    registrations: dict[str, BridgeRegistration] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    declared: dict[str, list[str]] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)
    imported: set[str] = field(default_factory=set)


def _state() -> _State:
    if "state" not in _cache:
        bridge_loader.load_conversion()
        root = bridge_loader._bridge_root()
        _register_all_namespaces(root)
        config_mapping, activations = _bridge_base_tables(root)
        _StubBridgeBase.CONFIG_MAPPING = config_mapping
        _StubBridgeBase.ACTIVATION_MAPPING = activations
        st = _State()
        for name, path in _module_names(root):
            st.paths[name] = path
            st.declared[name] = _declared_sources(path)
        _cache["state"] = st
    return _cache["state"]


def _import_bridges(modules: list[str]) -> None:
    """Import bridge `modules` (not yet tried) under the stub base and record registrations."""
    st = _state()
    todo = [m for m in modules if m not in st.imported]
    if not todo:
        return
    stub = types.ModuleType(_MODEL_BRIDGE)
    stub.MegatronModelBridge = _StubBridgeBase  # type: ignore[attr-defined]
    stub.WeightConversionTask = type("WeightConversionTask", (), {})  # type: ignore[attr-defined]
    stub.register_bridge_implementation = _register_implementation  # type: ignore[attr-defined]
    placeholders = _placeholder_modules()
    swapped = {name: sys.modules.get(name) for name in (_MODEL_BRIDGE, *placeholders)}
    sys.modules[_MODEL_BRIDGE] = stub
    sys.modules.update(placeholders)
    try:
        for name in todo:
            st.imported.add(name)
            _Recorder.registrations = []
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - reported per module, never hidden
                st.unavailable[name] = f"{type(e).__name__}: {e}"
                sys.modules.pop(name, None)
                continue
            for reg in _Recorder.registrations:
                arch = reg["architecture"]
                if arch in st.registrations:
                    raise CompatibilityError(
                        f"architecture {arch!r} is registered twice: by "
                        f"{st.registrations[arch].module} and {name}"
                    )
                st.registrations[arch] = BridgeRegistration(module=name, **reg)
    finally:
        for mod_name, previous in swapped.items():
            if previous is None:
                sys.modules.pop(mod_name, None)
            else:
                sys.modules[mod_name] = previous


def discover() -> Discovery:
    """Import every bridge module of the installed megatron-bridge under the stub base and
    collect its registrations (once per process; seconds: transformers model classes load)."""
    st = _state()
    _import_bridges(sorted(st.paths))
    return Discovery(
        registrations=dict(st.registrations),
        unavailable=dict(st.unavailable),
        declared=dict(st.declared),
    )


def architecture_of(hf_config: Mapping[str, Any]) -> str:
    """AutoBridge's choice: the first of the config's ``architectures`` ending with a supported
    suffix (``ForCausalLM``, ``ForConditionalGeneration``...). ValueError if there is none."""
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ValueError("HF config has no 'architectures'; the bridge is resolved from it")
    suffixes = supported_suffixes()
    for arch in archs:
        if arch.endswith(suffixes):
            return arch
    raise ValueError(f"none of the HF config's architectures {archs} ends with {suffixes}")


def resolve(key: str | Mapping[str, Any]) -> BridgeRegistration:
    """The registration for an HF config dict (its architectures), an architecture name, or a
    ``model_type`` registered by exactly one bridge. ValueError names an unknown key, and the
    concrete import error when the key is registered by a module that does not import here."""
    arch = architecture_of(key) if isinstance(key, Mapping) else key
    st = _state()
    # import only the modules whose source declares `arch` first (a full discovery is seconds)
    _import_bridges(sorted(m for m, srcs in st.declared.items() if arch in srcs))
    if arch in st.registrations:
        return st.registrations[arch]
    found = discover()
    if arch in found.registrations:
        return found.registrations[arch]
    by_type = [r for r in found.registrations.values() if r.model_type == arch]
    if len(by_type) == 1:
        return by_type[0]
    for module, sources in found.declared.items():
        if arch in sources and module in found.unavailable:
            raise ValueError(
                f"architecture {arch!r} is registered by {module}, which cannot be imported "
                f"here: {found.unavailable[module]}"
            )
    raise ValueError(
        f"no megatron-bridge bridge registers architecture {arch!r} "
        f"(installed megatron-bridge registers {len(found.registrations)}: "
        f"{sorted(found.registrations)})"
    )


def mapping_registry_for(key: str | Mapping[str, Any]) -> Any:
    """megatron-bridge's own ``MegatronMappingRegistry`` for `key` (see `resolve`); an HF
    config dict is also handed to the bridge (`BridgeRegistration.mapping_registry`)."""
    reg = resolve(key)
    if isinstance(key, Mapping):
        return reg.mapping_registry(key)
    cache_key = f"registry:{reg.architecture}"
    if cache_key not in _cache:
        _cache[cache_key] = reg.mapping_registry()
    return _cache[cache_key]


def provider_record(hf_config: Mapping[str, Any]) -> ProviderRecord:
    """Run the resolved bridge's own ``provider_bridge`` on `hf_config` (module docstring, 3)."""
    reg = resolve(hf_config)
    cls: Any = reg.bridge_class
    bridge = cls.__new__(cls)
    view = _ConfigView(hf_config)
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
            "not the stub base's record"
        )
    record.architecture = reg.architecture
    return record
