"""LoRA adapters as transactional refits on a real vLLM engine (issue 34 item 4; program:
adapter_program.py): versions of adapter alias ``policy`` refit by delta through vLLM's own LoRA
manager, each equal, bit for bit and in greedy tokens, to vLLM's dense load of the trainer's
adapter of that version; a fetched candidate is not used before its commit; a foreign attempt
is refused and aborted with the previous version still active; two versions stay live."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcr_tools.fixtures import perturb_lora, write_tiny_lora, write_tiny_model
from dcr_tools.procs import PYTHON, REPO, TP2_ENV, base_env, run_program

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    "tp", [1, pytest.param(2, marks=pytest.mark.slow, id="tp2")], ids=lambda t: f"tp{t}"
)
def test_adapter_versions_refit_by_delta_through_vllms_lora_manager(
    tmp_path: Path, tp: int
) -> None:
    base = write_tiny_model("qwen3", tmp_path / "base", seed=0)
    # v1 another draw (every element changes: the tokens differ from v0's), v2 and v3 small
    # changes of it (the low mantissa bits of 5% of the elements)
    adapters = [write_tiny_lora(base, tmp_path / "lora" / f"v{v}", seed=v + 1) for v in (0, 1)]
    for v in range(2, 4):
        adapters.append(perturb_lora(adapters[-1], tmp_path / "lora" / f"v{v}", seed=v))
    out = tmp_path / "report.json"
    run_program(
        [
            PYTHON, str(REPO / "tests/integration/vllm/adapter_program.py"),
            "--base", str(base), "--adapters", json.dumps([str(a) for a in adapters]),
            "--store", str(tmp_path / "store"), "--out", str(out), "--tp", str(tp),
        ],
        timeout=600,
        env=base_env(**(TP2_ENV if tp > 1 else {})),
        log=tmp_path / "program.log",
    )  # fmt: skip
    r = json.loads(out.read_text())
    steps, ids = r["steps"], r["ids"]
    assert set(r["ranks"].values()) == {tp}  # every rank answered every call alike

    def loaded(step: str, version: int) -> str:
        return steps[step]["status"]["loaded"][str(ids[str(version)])]

    # every committed version: the alias runs exactly vLLM's dense load of that version
    for v in range(4):
        s = steps[f"v{v}"]
        assert s["alias"] == s["dense"], f"v{v}"
        digest = loaded(f"v{v}", v)
        assert isinstance(digest, str) and digest == s["status"]["loaded"][str(1000 + v)], f"v{v}"
        assert s["status"]["adapters"]["policy"]["version"] == v
    assert steps["v0"]["alias"] != r["base"]  # the adapter changes the tokens
    assert len({loaded(f"v{v}", v) for v in range(4)}) == 4  # each version its own bits
    assert len({json.dumps(steps[f"v{v}"]["dense"]) for v in range(4)}) > 1  # versions differ
    # a fetched candidate is loaded but not used before its commit
    assert r["fetch1"]["ok"] and r["fetch1"]["active"] is False, r["fetch1"]
    assert steps["v1"]["alias"] != steps["v0"]["alias"]  # (so the next check can fail)
    assert steps["candidate1"]["alias"] == steps["v0"]["alias"]
    assert steps["candidate1"]["status"]["adapters"]["policy"]["candidate"] == [1, 0]
    # a foreign attempt: refused, aborted, the committed version stays active
    assert not r["fetch2_foreign"]["ok"] and "lm_head" in r["fetch2_foreign"]["error"]
    assert r["abort2"]["ok"] and r["abort2"]["version"] == 1, r["abort2"]
    assert steps["failed2"]["alias"] == steps["v1"]["alias"]
    held = steps["failed2"]["status"]["adapters"]["policy"]
    assert held["version"] == 1 and held["candidate"] is None, held
    assert ids["2"] not in {int(i) for i in steps["failed2"]["status"]["loaded"]}
    assert r["fetch2"]["ok"] and r["commit2"]["ok"], (r["fetch2"], r["commit2"])
    # two versions live (max_live_versions): v3 and v2; v0 and v1 left vLLM's LoRA manager
    assert steps["v3"]["status"]["adapters"]["policy"]["live"] == [2, 3]
    # the coordinator through the adapter channel (alias policy-b): v1 clean; v2's attempt 0
    # foreign, aborted, its overwrite retry committed; the record's digest is the engine's
    c = r["coordinated"]
    assert c["versions"] == [1, 2] and c["retries"] == [0, 1], c
    assert c["builds"] == [[1, 0, False], [2, 0, False], [2, 1, True]], c["builds"]
    assert "lm_head" in json.dumps(c["failed"]), c["failed"]
    assert c["status"]["adapters"]["policy-b"]["version"] == 2
    assert c["digests"][1] and c["digests"][0] != c["digests"][1]
    assert c["tokens"] == c["dense"]  # policy-b at v2 runs vLLM's dense load of v2
    live = {ids["2"], ids["3"]}
    assert live <= set(r["list_loras"]) and not {ids["0"], ids["1"]} & set(r["list_loras"])
