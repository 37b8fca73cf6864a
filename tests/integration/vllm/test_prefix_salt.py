"""The version-salted prefix cache on a real vLLM engine (issue 34 item 2; program:
prefix_salt_program.py): after a commit no request reuses KV computed under another version,
with no prefix-cache reset; requests of one version share the cache; a failed part-way apply
and its overwrite retry are each their own version. Oracle: vLLM's own ``num_cached_tokens``
and ``weight_versions``, and the greedy tokens of a dense load of v1 with a reset cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcr_tools.fixtures import perturb_checkpoint, write_tiny_model
from dcr_tools.procs import PYTHON, REPO, base_env, run_program

pytestmark = pytest.mark.vllm


def test_each_weight_version_has_its_own_prefix_cache(tmp_path: Path) -> None:
    v0 = write_tiny_model("qwen3", tmp_path / "v0", seed=0)
    v1 = tmp_path / "v1"
    perturb_checkpoint(v0, v1, seed=1)
    out = tmp_path / "report.json"
    run_program(
        [
            PYTHON,
            str(REPO / "tests/integration/vllm/prefix_salt_program.py"),
            "--versions", json.dumps([str(v0), str(v1)]),
            "--out", str(out),
        ],
        timeout=480,
        env=base_env(),
        log=tmp_path / "program.log",
    )  # fmt: skip
    r = json.loads(out.read_text())
    assert all(not a["ok"] for a in r["partial_ack"])  # the fault plan failed it part-way
    labels = {}
    for state in ("v0", "partial", "retried", "v1"):
        first, again = r[state]
        # a new version meets none of the blocks the engine cached under the others ...
        assert first["cached"] == 0, (state, first)
        # ... and requests of one version share them (128 = 4 full 32-token blocks of 150)
        assert again["cached"] == 128 and again["tokens"] == first["tokens"], (state, again)
        assert len(set(first["versions"])) == 1 and first["versions"] == again["versions"]
        labels[state] = first["versions"][0]
    assert labels["v0"] == "0" and labels["v1"] == "1"
    assert labels["partial"].startswith("1-uncommitted.")
    assert labels["retried"].startswith("1-uncommitted.")
    assert labels["partial"] != labels["retried"]
    # the tokens after the commit are v1's: a dense load of v1 with a reset cache
    assert r["v1"][0]["tokens"] == r["dense_v1"]["tokens"]
