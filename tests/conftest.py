"""Shared fixtures: deterministic tiny HF checkpoints, written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Receivers created in the test process, and the engines and Ray workers it starts (they inherit
# this environment), load the test-only fault plan observer; it stays inert unless a test names
# an armed plan (DCR_FAULT_PLAN, dcr_tools/faults.py).
os.environ.setdefault("DCR_RECEIVER_OBSERVER", "dcr_tools.faults:FaultPlan")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """kind -> checkpoint directory for the three tiny fixtures (seed 0)."""
    from dcr_tools.fixtures import KINDS, write_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: write_tiny_model(kind, root / kind, seed=0) for kind in KINDS}
