"""The installed ``dcr-refit-skyrl.pth`` (issue 33: SkyRL switches to DCR by configuration alone):
the wheel ships it at the top of site-packages, and it arms DCR's SkyRL patches only in
interpreters where ``SKYRL_DCR_CONFIG`` is set. The patching itself, on SkyRL's real modules, is
tests/integration/frameworks/test_skyrl.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vllm_dcr_plugin.frameworks import skyrl

REPO = Path(__file__).resolve().parents[2]
PTH = REPO / "vllm_dcr_plugin/frameworks" / skyrl.PTH
PROBE = (
    "import sys; print(any(type(f).__name__ == '_PatchOnImport' for f in sys.meta_path),"
    " 'vllm_dcr_plugin.frameworks.skyrl' in sys.modules)"
)


def run_probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != skyrl.ENV}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_the_wheel_ships_the_pth_at_the_top_of_site_packages(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / f, src / f)
    for pkg in ("shared_codec", "vllm_dcr_plugin", "megatron_dcr_hooks", "dcr_tools"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setuptools import build_meta as b; b.build_wheel({str(dist)!r})",
        ],
        cwd=src,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("dcr_refit-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read(skyrl.PTH) == PTH.read_bytes()


def test_the_pth_line_arms_only_where_the_variable_is_set() -> None:
    """Runs this environment's interpreter (``make setup`` copies the .pth into it, as the
    wheel installs it): without the variable nothing of DCR is imported at start."""
    lines = PTH.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import ")  # site runs `import` lines only
    purelib = Path(__import__("sysconfig").get_paths()["purelib"])
    if not (purelib / skyrl.PTH).exists():
        pytest.skip(f"{skyrl.PTH} is not in {purelib}: `make setup` copies it there")
    assert (purelib / skyrl.PTH).read_bytes() == PTH.read_bytes()
    assert run_probe() == "False False"
    assert run_probe(**{skyrl.ENV: '{"control": {}}'}) == "True True"


def test_arm_without_the_variable_changes_nothing() -> None:
    before = list(sys.meta_path)
    saved = os.environ.pop(skyrl.ENV, None)
    try:
        skyrl.arm()
        assert sys.meta_path == before
    finally:
        if saved is not None:
            os.environ[skyrl.ENV] = saved
