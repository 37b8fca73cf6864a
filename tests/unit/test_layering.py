"""Layering is a test: an AST scan of every import (module level and inside functions, plus
``importlib.import_module("...")`` with a literal name) in the product packages.

Rules (README "Architecture"):
1. ``shared_codec`` imports neither vLLM nor Megatron (megatron-core, megatron-bridge) nor the two
   side packages.
2. ``vllm_dcr_plugin`` and ``megatron_dcr_hooks`` do not import each other, and neither imports
   the other side's framework (no Megatron in the vLLM plugin, no vLLM in the Megatron hooks).
3. No product package imports ``dcr_tools``.

`test_scan_catches_planted_imports` plants each kind of violation in a temporary tree and checks
the scan reports it, so the rules cannot pass vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("shared_codec", "vllm_dcr_plugin", "megatron_dcr_hooks")

#: package -> top-level modules it must never import
BANNED: dict[str, frozenset[str]] = {
    "shared_codec": frozenset(
        {"vllm", "megatron", "vllm_dcr_plugin", "megatron_dcr_hooks", "dcr_tools"}
    ),
    "vllm_dcr_plugin": frozenset({"megatron", "megatron_dcr_hooks", "dcr_tools"}),
    "megatron_dcr_hooks": frozenset({"vllm", "vllm_dcr_plugin", "dcr_tools"}),
}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, dotted module) for every import statement and literal ``import_module`` call."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def violations(root: Path) -> list[str]:
    """Every banned import under `root`, as ``path:line: package imports module``."""
    found = []
    for package, banned in BANNED.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imported_modules(path.read_text()):
                if module.split(".")[0] in banned:
                    rel = path.relative_to(root)
                    found.append(f"{rel}:{line}: {package} imports {module}")
    return found


def test_product_packages_respect_layering() -> None:
    for package in PRODUCT:
        assert (REPO / package).is_dir(), package
    assert violations(REPO) == []


def test_scan_catches_planted_imports(tmp_path: Path) -> None:
    plants = {
        "shared_codec/a.py": "import vllm\n",
        "shared_codec/b.py": "def f():\n    from megatron.core import parallel_state\n",
        "shared_codec/c.py": "from vllm_dcr_plugin.extension import DCRWorkerExtension\n",
        "shared_codec/d.py": "import importlib\nimportlib.import_module('megatron_dcr_hooks.hook')\n",
        "vllm_dcr_plugin/e.py": "from megatron_dcr_hooks import enable_dcr\n",
        "megatron_dcr_hooks/f.py": "from vllm_dcr_plugin import register\n",
        "megatron_dcr_hooks/g.py": "import dcr_tools.procs\n",
        "vllm_dcr_plugin/ok.py": "import vllm\nfrom shared_codec.format import decode_payload\n",
    }
    for rel, text in plants.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert violations(tmp_path) == [
        "shared_codec/a.py:1: shared_codec imports vllm",
        "shared_codec/b.py:2: shared_codec imports megatron.core",
        "shared_codec/c.py:1: shared_codec imports vllm_dcr_plugin.extension",
        "shared_codec/d.py:2: shared_codec imports megatron_dcr_hooks.hook",
        "vllm_dcr_plugin/e.py:1: vllm_dcr_plugin imports megatron_dcr_hooks",
        "megatron_dcr_hooks/f.py:1: megatron_dcr_hooks imports vllm_dcr_plugin",
        "megatron_dcr_hooks/g.py:1: megatron_dcr_hooks imports dcr_tools.procs",
    ]


# -- no import circle ----------------------------------------------------------------------------
def module_graph(root: Path) -> dict[str, set[str]]:
    """Product module -> the product modules it imports (module level and inside functions,
    ``from pkg import sub`` as the submodule; imports under ``if TYPE_CHECKING:`` are not run
    and do not count)."""
    modules: dict[str, Path] = {}
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in modules:
                        deps.add(sub)
                    elif node.module in modules:
                        deps.add(node.module)
        deps.discard(name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circle_between_product_modules() -> None:
    graph = module_graph(REPO)
    assert len(graph) > 50, sorted(graph)  # the scan sees the packages
    assert circles(graph) == []


def test_circle_scan_catches_planted_circles(tmp_path: Path) -> None:
    plants = {
        "shared_codec/__init__.py": "",
        "shared_codec/a.py": "from shared_codec import b\n",
        "shared_codec/b.py": "def f():\n    from shared_codec.a import g\n",  # inside a function
        "shared_codec/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from shared_codec.d import x\n",
        "shared_codec/d.py": "from shared_codec.c import y\n",  # c -> d only for the type checker
        "vllm_dcr_plugin/__init__.py": "def __getattr__(n):\n    from vllm_dcr_plugin import e\n",
        "vllm_dcr_plugin/e.py": "from vllm_dcr_plugin import VERSION\n",  # -> the package
        "megatron_dcr_hooks/__init__.py": "",
    }
    for rel, text in plants.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert circles(module_graph(tmp_path)) == [
        ["shared_codec.a", "shared_codec.b"],
        ["vllm_dcr_plugin", "vllm_dcr_plugin.e"],
    ]
