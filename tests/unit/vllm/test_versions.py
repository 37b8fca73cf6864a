"""vLLM's ``weight_version`` on the dcr_* RPC path (vllm_dcr_plugin.versions): the label the
ranks' replies give, and the engine core stamping it inside its own ``collective_rpc``. The
engine core here is a FAKE (the three methods the wrapper calls); the real stamping on real
engines is tests/integration/vllm/test_receiver.py (``weight_versions`` of generated outputs).
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_dcr_plugin import patches
from vllm_dcr_plugin.versions import label_of, stamping_collective_rpc


def reply(
    state: str, committed: int, target: int | None = None, applies: int = 1, **extra: Any
) -> dict:
    weights = {
        "state": state,
        "committed_version": committed,
        "target_version": target,
        "apply_calls": applies,
    }
    return {"ok": True, "weights": weights, **extra}


@pytest.mark.parametrize(
    ("replies", "label"),
    [
        ([reply("clean", 3), reply("clean", 3)], "3"),  # a commit / dense load / prewarm
        ([reply("applied", 3, 4), reply("applied", 3, 4)], "4-uncommitted.1"),  # no commit yet
        ([reply("applied", 3, 4, 2), reply("dirty", 3, 4, 3)], "4-uncommitted.3"),  # part-way
        ([reply("dirty", 3), reply("clean", 3)], "4-uncommitted.1"),  # dirty, target unknown
        ([reply("clean", 3), reply("clean", 4)], None),  # ranks disagree: leave it
        ([reply("clean", 3), {"ok": False, "error": "x"}], None),  # a rank without a receiver
        ([], None),
        (["not a dict"], None),
    ],
)
def test_the_label_of_the_ranks_replies(replies: list, label: str | None) -> None:
    assert label_of(replies) == label


class FakeEngineCore:  # FAKE: what the wrapper calls on vLLM's EngineCore
    def __init__(self, replies: list) -> None:
        self.replies, self.version, self.calls = replies, "default", []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        return self.replies

    def get_weight_version(self) -> str:
        return self.version

    def set_weight_version(self, v: str) -> None:
        self.version = v


def test_each_write_of_uncommitted_weights_has_its_own_label() -> None:
    """A failed part-way apply, then the overwrite retry that repairs it: different weights,
    different labels (the prefix cache is salted by the label: prefix_salt.py)."""
    partial = label_of([reply("dirty", 1, 2, applies=4)])
    retried = label_of([reply("applied", 1, 2, applies=5)])
    assert partial == "2-uncommitted.4" != retried == "2-uncommitted.5"


def test_the_engine_core_stamps_after_dcr_methods_only() -> None:
    rpc = stamping_collective_rpc(FakeEngineCore.collective_rpc)
    core = FakeEngineCore([reply("applied", 0, 1)])
    assert rpc(core, "dcr_apply", None, (0,)) == core.replies and core.version == "1-uncommitted.1"
    core.replies = [reply("clean", 1)]
    rpc(core, "dcr_commit", None, (1,))
    assert core.version == "1"
    core.replies = [reply("clean", 9)]
    rpc(core, "other_method")  # not DCR's: whatever it answers, the version stays
    rpc(core, lambda worker: None)
    assert core.version == "1" and len(core.calls) == 4


def test_the_patch_is_in_the_table() -> None:
    p = next(p for p in patches.PATCHES if p.name == "engine_core.collective_rpc")
    assert p.target == "vllm.v1.engine.core:EngineCore.collective_rpc"
    assert p.make is stamping_collective_rpc
