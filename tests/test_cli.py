"""The `dcr` console script: help, versions, fixture writing, clear errors."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from shared_codec.checkpoint import load_checkpoint
from shared_codec.tiny_models import canonical_shapes, spec_for
from tests._procs import PYTHON

DCR = str(Path(PYTHON).with_name("dcr"))


def _dcr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DCR, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_commands() -> None:
    r = _dcr("--help")
    assert r.returncode == 0 and "version" in r.stdout and "fixture" in r.stdout
    assert _dcr().returncode == 2


def test_version_json() -> None:
    r = _dcr("version", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["format_version"] == 1 and info["megatron-core"] == "0.16.1"
    assert info["vllm"].startswith("0.32.0")


def test_fixture_writes_checkpoint(tmp_path: Path) -> None:
    r = _dcr("fixture", "qwen3-moe", str(tmp_path / "m"), "--seed", "5")
    assert r.returncode == 0, r.stderr
    weights = load_checkpoint(tmp_path / "m")
    assert {n: tuple(t.shape) for n, t in weights.items()} == canonical_shapes(
        spec_for("qwen3-moe")
    )


def test_fixture_unknown_kind_is_rejected(tmp_path: Path) -> None:
    r = _dcr("fixture", "gpt2", str(tmp_path / "x"))
    assert r.returncode == 2 and "invalid choice" in r.stderr
