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
3. Base tables: the stub carries the installed ``MegatronModelBridge``'s ``CONFIG_MAPPING``
   and ``ACTIVATION_MAPPING`` (read from ``model_bridge.py`` / ``utils/activation_map.py``)
   before any bridge module imports, since bridge class bodies extend them
   (``CONFIG_MAPPING = MegatronModelBridge.CONFIG_MAPPING + [...]``). Running a bridge's
   ``provider_bridge`` on those tables is the tools' business (`dcr_tools.trainers.providers`,
   for the CPU model builder); the owner hook needs only `mapping_registry_for`.

Limitations:
1. Checked on megatron-bridge 0.3.1 (``bridge_loader.check_version``).
2. While bridge modules import, a placeholder ``omegaconf`` module stands in when omegaconf is not
   installed (only provider serialization uses it); any use raises CompatibilityError.
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
            view = ConfigView(hf_config)
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


def source_name(source: Any) -> str:
    """The name a ``register_bridge`` argument stands for (a class, or already its name)."""
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


class ConfigView:
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


class _StubBridgeBase:
    """Minimal stand-in for ``model_bridge.MegatronModelBridge`` while bridge modules import:
    ``register_bridge`` records, and the class attributes bridge classes read or extend (the
    base tables are set from the installed bridge before any import, `_state`). Nothing a
    ``provider_bridge`` calls (module docstring, 3)."""

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
            bridge_cls.SOURCE_NAME = source_name(source)  # type: ignore[attr-defined]
            if model_type is not None:
                bridge_cls.MODEL_TYPE = model_type  # type: ignore[attr-defined]
            if provider is not None:
                bridge_cls.PROVIDER_CLASS = provider  # type: ignore[attr-defined]
            _Recorder.registrations.append(
                {
                    "architecture": source_name(source),
                    "bridge_class": bridge_cls,
                    "target": source_name(target),
                    "provider": None if provider is None else source_name(provider),
                    "model_type": model_type,
                }
            )
            return bridge_cls

        return deco


def _register_implementation(*, source: Any, target: Any, bridge_class: Any) -> None:
    """Stand-in for megatron-bridge >= 0.6's module-level ``register_bridge_implementation``
    (an extra architecture name for an already decorated bridge class, e.g. an upstream
    spelling): recorded like a ``register_bridge`` call, without a ``model_type``."""
    pc = getattr(bridge_class, "PROVIDER_CLASS", None)
    _Recorder.registrations.append(
        {
            "architecture": source_name(source),
            "bridge_class": bridge_class,
            "target": source_name(target),
            "provider": None if pc is None else source_name(pc),
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
