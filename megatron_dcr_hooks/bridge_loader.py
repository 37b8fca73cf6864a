"""Import megatron-bridge's conversion modules without running the package ``__init__`` files.

megatron-bridge (0.3.1 on Python 3.11, 0.6.2 on Python 3.12) cannot be imported as a package on
these machines (``import megatron.bridge`` fails on an unguarded ``transformer_engine`` import in
its peft package, and its declared dependencies are CUDA-only, so it is installed with
``--no-deps``). Its conversion layer
works on CPU: ``param_mapping`` (mapping classes), ``mapping_registry`` (name resolution) and
``utils``. This loader registers the parent packages as empty namespace modules pointing at the
installed directories, so submodules import without their ``__init__`` files, and applies two
fixes:

1. ``scatter_to_tp_ranks``: gloo ``scatter`` misreads non-contiguous inputs, and
   ``RowParallelMapping.hf_to_megatron`` scatters ``torch.chunk(w, tp, dim=1)`` views, which
   silently corrupts row-parallel shards. Splits are made contiguous before the scatter.
2. ``gather_from_ep_ranks``: parses the expert number only from grouped-GEMM names
   (``experts.linear_fc1.weight7``); SequentialMLP names (``experts.local_experts.7.linear_fc1
   .weight``, the local spec) crash it. The local-experts form is parsed too.

Model registries: `megatron_dcr_hooks.bridge_registry` resolves the bridge class (and its
mapping registry) from the HF config's architectures, the way megatron-bridge's AutoBridge does.

Limitations:
1. Checked on megatron-bridge 0.3.1 and 0.6.2; other versions raise CompatibilityError. Both fixes
   are still needed on 0.6.2 (its ``scatter_to_tp_ranks`` and ``gather_from_ep_ranks`` are
   unchanged in these respects).
2. The package ``__init__`` files never run (namespace stand-ins, see ``_register_namespace``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Any

from shared_codec.errors import CompatibilityError

#: megatron-bridge versions this loader was checked on (0.3.1: Python 3.11, 0.6.2: Python 3.12)
CHECKED_BRIDGE: tuple[str, ...] = ("0.3.1", "0.6.2")

_NAMESPACES = (
    "megatron.bridge",
    "megatron.bridge.models",
    "megatron.bridge.models.conversion",
)

_loaded: dict[str, Any] = {}


def _bridge_root() -> Path:
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise CompatibilityError("megatron is not installed (pip install megatron-core)")
    for loc in spec.submodule_search_locations:
        root = Path(loc) / "bridge"
        if (root / "models" / "conversion" / "param_mapping.py").is_file():
            return root
    raise CompatibilityError(
        "megatron-bridge is not installed; run `make setup` (it installs megatron-bridge with "
        "--no-deps: 0.3.1 in .venv, 0.6.2 in .venv-trainer)"
    )


def _register_namespace(name: str, path: Path) -> None:
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__dcr_namespace__", False):
        return
    if existing is not None and name != "megatron.bridge":
        return
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]  # type: ignore[attr-defined]
    mod.__dcr_namespace__ = True  # type: ignore[attr-defined]
    mod.__package__ = name
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)


def check_version() -> str:
    """Return the installed megatron-bridge version or raise CompatibilityError."""
    try:
        version = importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError as e:
        raise CompatibilityError(
            "megatron-bridge is not installed; run `make setup` (megatron-bridge --no-deps)"
        ) from e
    if version not in CHECKED_BRIDGE:
        raise CompatibilityError(
            f"megatron_dcr_hooks.bridge_loader was checked on megatron-bridge "
            f"{' and '.join(CHECKED_BRIDGE)}, found {version}"
        )
    return version


def load_conversion() -> types.SimpleNamespace:
    """Import (once) and return ``param_mapping``, ``mapping_registry`` and ``utils``, fixed."""
    if "conversion" in _loaded:
        return _loaded["conversion"]
    check_version()
    root = _bridge_root()
    import megatron  # noqa: F401  (parent namespace package of megatron.core)

    _register_namespace("megatron.bridge", root)
    _register_namespace("megatron.bridge.models", root / "models")
    _register_namespace("megatron.bridge.models.conversion", root / "models" / "conversion")
    utils = importlib.import_module("megatron.bridge.models.conversion.utils")
    param_mapping = importlib.import_module("megatron.bridge.models.conversion.param_mapping")
    mapping_registry = importlib.import_module("megatron.bridge.models.conversion.mapping_registry")
    _apply_fixes(param_mapping)
    ns = types.SimpleNamespace(
        param_mapping=param_mapping, mapping_registry=mapping_registry, utils=utils
    )
    _loaded["conversion"] = ns
    return ns


def _apply_fixes(pm: Any) -> None:
    base = pm.MegatronParamMapping
    if getattr(base, "__dcr_fixed__", False):
        return
    original_scatter = base.scatter_to_tp_ranks

    def scatter_to_tp_ranks(self, splits, output_shape, dtype, device, src_rank=0):  # noqa: ANN001
        if splits:
            splits = [s.contiguous() for s in splits]
        return original_scatter(self, splits, output_shape, dtype, device, src_rank)

    original_gather_ep = base.gather_from_ep_ranks

    def gather_from_ep_ranks(self, megatron_weights, megatron_module, hf_param_name):  # noqa: ANN001
        m = re.search(r"\.local_experts\.(\d+)\.", self.megatron_param)
        if m is None:
            return original_gather_ep(self, megatron_weights, megatron_module, hf_param_name)
        # SequentialMLP name: rewrite to the grouped form the original parses, same expert id.
        grouped = re.sub(
            r"\.local_experts\.(\d+)\.(linear_fc\d)\.(weight|bias)$",
            r".\2.\3\1",
            self.megatron_param,
        )
        saved = self.megatron_param
        try:
            self.megatron_param = grouped
            return original_gather_ep(self, megatron_weights, megatron_module, hf_param_name)
        finally:
            self.megatron_param = saved

    base.scatter_to_tp_ranks = scatter_to_tp_ranks
    base.gather_from_ep_ranks = gather_from_ep_ranks
    base.__dcr_fixed__ = True


def import_bridge_module(name: str) -> types.ModuleType:
    """Import one module of the installed megatron-bridge (e.g.
    ``megatron.bridge.training.callbacks``) with its parent packages registered as namespace
    stand-ins, so no package ``__init__`` runs. Version-checked like `load_conversion`; the
    module's own imports must be installed (callbacks needs nothing beyond the standard
    library)."""
    if not name.startswith("megatron.bridge."):
        raise ValueError(f"{name!r} is not a megatron-bridge module")
    load_conversion()
    root = _bridge_root()
    parts = name.split(".")[2:-1]  # packages below megatron.bridge
    for i in range(1, len(parts) + 1):
        pkg = root.joinpath(*parts[:i])
        _register_namespace("megatron.bridge." + ".".join(parts[:i]), pkg)
    return importlib.import_module(name)
