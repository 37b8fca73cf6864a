"""The GPU lane's wheel table and offline install (scripts/gpu_wheels.py), here without network:
the table's rows, wheel-tag matching, and `install` on a wheelhouse of one wheel built here
(a FAKE package, ``dcr_fake_lane_mod``), through pip and through the no-pip unpacking."""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_wheels.py"


@pytest.fixture(scope="module")
def gw() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dcr_gpu_wheels", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_are_pinned_and_cover_both_pythons(gw: ModuleType) -> None:
    assert gw.versions() == ["3.12", "3.11"]
    for python in gw.versions():
        rows = gw.rows_for(python)
        modules = [m for m, _, _ in rows]
        assert len(modules) == len(set(modules)), f"a module twice for {python}"
        assert {"megatron.core", "megatron.bridge", "zstandard", "torch"} <= set(modules)
        for module, req, source in rows:
            assert source in ("carry", "carry-exact", "image"), module
            assert ("==" in req) == (source != "image"), req  # carried rows are pinned
    core = dict((m, r) for m, r, _ in gw.rows_for("3.12"))["megatron.core"]
    assert core == "megatron-core==0.19.2"
    assert dict((m, r) for m, r, _ in gw.rows_for("3.11"))["megatron.core"].endswith("0.16.1")


@pytest.mark.parametrize(
    ("wheel", "python", "ok"),
    [
        ("zstandard-0.25.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", "3.12", 1),
        ("zstandard-0.25.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", "3.11", 0),
        ("tokenizers-0.22.2-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "3.11", 1),
        ("safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.whl", "3.9", 0),  # abi3 from 3.10
        ("rich-15.0.0-py3-none-any.whl", "3.13", 1),
        ("numpy-2.5.5-cp312-cp312-macosx_14_0_arm64.whl", "3.12", 0),
        ("numpy-2.5.5-cp312-cp312-manylinux_2_28_aarch64.whl", "3.12", 0),
    ],
)
def test_wheel_tags(gw: ModuleType, wheel: str, python: str, ok: int) -> None:
    assert gw._compatible(wheel, python) is bool(ok)


def _fake_wheel(folder: Path) -> Path:
    """A minimal valid wheel of the FAKE distribution dcr-fake-lane-mod 1.0."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "dcr_fake_lane_mod-1.0-py3-none-any.whl"
    info = "dcr_fake_lane_mod-1.0.dist-info"
    files = {
        "dcr_fake_lane_mod/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: dcr-fake-lane-mod\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", record)
    return path


@pytest.mark.parametrize("pip", [True, False], ids=["pip", "unpacked"])
def test_install_provides_a_missing_module_offline(
    gw: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pip: bool
) -> None:
    if pip and importlib.util.find_spec("pip") is None:
        pytest.skip(f"no pip for {sys.executable}")
    house, target = tmp_path / "house", tmp_path / "site"
    _fake_wheel(house)
    rows = (("any", "dcr_fake_lane_mod", "dcr-fake-lane-mod==1.0", "carry"),)
    monkeypatch.setattr(gw, "PACKAGES", rows)
    if not pip:  # as on a machine whose Python has no pip: the wheel is unpacked
        real_call = gw.subprocess.call

        def no_pip(cmd: list[str], **kw: object) -> int:
            return 1 if cmd[1:3] == ["-m", "pip"] else real_call(cmd, **kw)

        monkeypatch.setattr(gw.subprocess, "call", no_pip)
    monkeypatch.setattr(sys, "path", list(sys.path))  # install() prepends the target
    assert gw.install(house, target) == 0
    assert (target / "dcr_fake_lane_mod" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (target / "dcr_fake_lane_mod-1.0.dist-info" / "METADATA").is_file()
    assert gw.install(house, target) == 0  # a rerun finds it present


def test_install_names_what_it_cannot_provide(
    gw: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    rows = (
        ("any", "dcr_fake_absent_a", "dcr-fake-absent-a==2.0", "carry"),
        ("any", "dcr_fake_absent_b", "dcr-fake-absent-b", "image"),
    )
    monkeypatch.setattr(gw, "PACKAGES", rows)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gw.install(tmp_path / "empty", tmp_path / "site") == 1
    out = capsys.readouterr().out
    assert "no wheel of dcr-fake-absent-a==2.0" in out
    assert "dcr_fake_absent_b (dcr-fake-absent-b: expected on the image" in out
