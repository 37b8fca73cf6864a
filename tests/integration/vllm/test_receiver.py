"""Receiver RPCs against real vLLM CPU engines: a delta refit is bit-exact with a dense load
(every parameter and buffer, every rank) and gives identical greedy tokens; duplicates are
applied once; a partial apply is repaired by an overwrite retry; bad payloads change nothing; an
attempt applies exactly its sealed set (a re-sequenced duplicate, an extra or a missing payload
fails with a clear error and changes nothing); no apply moves a parameter's or buffer's storage
(the addresses CUDA graphs captured).
The engine program is receiver_program.py; see its docstring for the scenario."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcr_tools.fixtures import perturb_checkpoint, write_tiny_model
from dcr_tools.procs import PYTHON, REPO, TP2_ENV, base_env, run_program

CASES = [
    ("qwen3-tp1", "qwen3", 1, {}),
    ("qwen3-tp2", "qwen3", 2, {}),
    ("tied-padded-vocab", "qwen3-tied", 1, {}),
    ("moe", "qwen3-moe", 1, {}),
    ("moe-tp2-ep", "qwen3-moe", 2, {"enable_expert_parallel": True}),
    # DeepSeek-V3 style MLA (kv_b_proj split over the heads, W_UK_T / W_UV views of each rank's
    # shard), shared + routed experts, fp32 router bias; slow lane in both modes
    ("mla-tp2", "deepseek-v3", 2, {}),
]
SLOW_CASES = {"mla-tp2"}
# every case runs in both placement modes: the replayed plan (default) and the native loader
# for every item; the loader-mode runs are the slow lane except one (the path is main's and
# the plan-mode runs cover every loader layout by default)
MODED = [
    pytest.param(
        (*case, mode),
        id=f"{case[0]}-{mode}",
        marks=[pytest.mark.slow]
        if (mode == "loader" and case[0] != "qwen3-tp1") or case[0] in SLOW_CASES
        else [],
    )
    for case in CASES
    for mode in ("plan", "loader")
]


# the RPC error contract on a real engine: label -> (rpc, args, kwargs, what the error names);
# receiver_program.py replaces the <...> placeholders with paths it writes
BAD_CALLS = {
    "prewarm bad dtype": ("dcr_prewarm", ([["x", "bfloat17", [2]]], 0), {}, "tensors[0]"),
    "stage not a list": ("dcr_stage", ("not a list",), {}, "payloads must be a list"),
    "fetch unknown kind": ("dcr_fetch", ({"kind": "ftp", "root": "/x"}, 1, 0), {}, "store:"),
    "fetch stale version": (
        "dcr_fetch", ({"kind": "dir", "root": "/x"}, 0, 0), {}, "version 0 is not after",
    ),
    "apply negative attempt": ("dcr_apply", (-1,), {}, "attempt must be >= 0"),
    "commit text version": ("dcr_commit", ("one",), {}, "version must be an integer"),
    "abort two attempts": ("dcr_abort", (0, 1), {}, "dcr_abort takes (attempt)"),
    "digest keyword": ("dcr_digest", (), {"tensor": "x"}, "'tensor'"),
    "dense load not a checkpoint": (
        "dcr_dense_load", ("<not-a-checkpoint>", 1), {}, "path: no *.safetensors",
    ),
    "dense load another model": ("dcr_dense_load", ("<other-model>", 1), {}, "path: tensor "),
    "memory reset_peak": ("dcr_memory", ("sometimes",), {}, "reset_peak must be a boolean"),
    "metrics argument": ("dcr_metrics", (1,), {}, "dcr_metrics takes ()"),
    "status keyword": ("dcr_status", (), {"verbose": True}, "'verbose'"),
    "info argument": ("dcr_info", (0,), {}, "dcr_info takes ()"),
}  # fmt: skip


def _versions(kind: str, root: Path) -> list[str]:
    paths = [write_tiny_model(kind, root / "v0", seed=0)]
    for v in range(1, 4):
        perturb_checkpoint(paths[-1], root / f"v{v}", seed=v)
        paths.append(root / f"v{v}")
    return [str(p) for p in paths]


def _run(kind: str, tp: int, extra: dict, tmp: Path, mode: str) -> tuple[dict, list[str]]:
    versions = _versions(kind, tmp / kind)
    out = tmp / "report.json"
    run_program(
        [
            PYTHON,
            str(REPO / "tests/integration/vllm/receiver_program.py"),
            "--versions",
            json.dumps(versions),
            "--tp",
            str(tp),
            "--out",
            str(out),
            "--extra",
            json.dumps(extra),
            "--placement",
            mode,
        ],
        timeout=600,
        env=base_env(**(TP2_ENV if tp > 1 else {})),
        log=tmp / "engine.log",
    )
    return json.loads(out.read_text()), versions


def _ok(acks: list) -> None:
    for ack in acks:
        assert ack["ok"], ack
        assert ack["error"] is None and ack["partial_item"] is None
        if ack["verified"]:
            assert ack["post_apply_mismatches"] == 0


def _placed(acks: list, mode: str) -> None:
    """Every item took the mode's path: replayed from the plan with no fall back (tensors
    behind a transformed loader path, if any, still go through the loader by design), or
    through the loader with each direct-path item counted as a ``loader_mode`` fall back."""
    for ack in acks:
        assert ack["items"] > 0 and ack["plan_items"] + ack["loader_items"] == ack["items"], ack
        if mode == "plan":
            assert ack["fallbacks"] == {} and ack["plan_items"] > 0, ack
        else:
            assert ack["plan_items"] == 0 and set(ack["fallbacks"]) == {"loader_mode"}, ack
            assert 0 < ack["fallbacks"]["loader_mode"] <= ack["items"], ack


@pytest.mark.vllm
@pytest.mark.parametrize("case", MODED)
def test_delta_refit_is_bit_exact(case, tmp_path: Path) -> None:
    _, kind, tp, extra, mode = case
    r, versions = _run(kind, tp, extra, tmp_path, mode)
    ranks = tp
    assert all(x["placement"] == mode for x in r["set_placement"])
    # the plan holds every direct tensor this rank loads; re-verified against a fresh trace
    # after dense loads, it still matches (and the re-trace changed nothing)
    for rep, ver in zip(r["prewarm"], r["verify_plan"], strict=True):
        assert rep["placement"] == mode and rep["plan_excluded"] == {}, rep
        loads = rep["tensors"] - len(rep["skipped"]) - len(rep["unsupported"])
        assert rep["planned"] == loads - len(rep["overwrite_only"]) > 0, rep
        assert ver["matches"] and ver["differences"] == {} and not ver["classes_changed"], ver
    assert r["d0_after_verify_plan"] == r["d0"]
    # apply before prewarm: a clear error
    assert "dcr_prewarm has not been called" in r["apply_before_prewarm"]
    # prewarm is side-effect free and reports every rank
    assert len(r["prewarm"]) == ranks
    assert r["d0"] == r["d0_after_prewarm"] == r["d0_after_dense_reload"]
    # bad arguments: ok:false + ProtocolError naming the argument on every rank, weights
    # unchanged, and the next calls get their own replies (nothing left queued in vLLM)
    for label, (rpc, _, _, named) in BAD_CALLS.items():
        replies = r["bad_args"][label]
        assert sorted(x["rank"] for x in replies) == list(range(ranks)), (label, replies)
        for x in replies:
            assert x["ok"] is False, (label, x)
            assert x["error"].startswith(f"ProtocolError: {rpc}: bad arguments: "), (label, x)
            assert named in x["error"], (label, named, x["error"])
    assert r["d0_after_bad_args"] == r["d0"]
    status = r["status_after_bad_args"]
    assert sorted(s["rank"] for s in status) == list(range(ranks))
    assert all(s["ok"] and s["state"] == "clean" and s["prewarmed"] for s in status), status
    info = sorted(r["info_after_bad_args"], key=lambda i: i["rank"])
    assert [(i["ok"], i["rank"]) for i in info] == [(True, k) for k in range(ranks)], info
    for rep in r["prewarm"]:
        assert rep["unsupported"] == {}, rep["unsupported"]
        assert rep["format_version"] == 2 and rep["tensors"] > 0
        # the post-load step was traced and derives nothing from these families' weights
        # (tests/integration/vllm/test_derived.py: an MLA model where it does)
        assert rep["derived"]["traced"] and rep["derived"]["tensors"] == [], rep["derived"]
    if kind == "qwen3-tied":
        assert r["prewarm"][0]["skipped"] == []  # lm_head is not canonical when tied
    if extra.get("enable_expert_parallel"):
        # each rank skips the experts that live on the other rank
        skipped = [set(rep["skipped"]) for rep in r["prewarm"]]
        assert all(any(".experts." in n for n in s) for s in skipped)
        assert not (skipped[0] & skipped[1])
    # the versions really differ (the oracle is not trivial)
    assert len({json.dumps(x["digest"]) for x in r["ref"]} | {json.dumps(r["d0"])}) == 4
    # rejected payloads change nothing
    for what, per_rank in r["rejections"].items():
        for res in per_rank:
            assert res["staged"] == [] and len(res["rejected"]) >= 1, (what, res)
    assert "base version 5" in r["rejections"]["wrong_base"][0]["rejected"][0]["reason"]
    assert "field digest" in r["rejections"]["corrupt"][0]["rejected"][0]["reason"]
    assert "unknown tensor" in r["rejections"]["unknown"][0]["rejected"][0]["reason"]
    assert "on this receiver" in r["rejections"]["wrong_shape"][0]["rejected"][0]["reason"]
    assert r["d0_after_rejections"] == r["d0"] == r["d0_after_empty_apply"]
    # exactly once: a re-sequenced duplicate (its XOR payloads refused at staging, the manifest
    # that names it refused at apply), an extra and a missing payload: clear errors naming the
    # ids, weights unchanged on every rank
    eo = r["exactly_once"]
    for res in eo["resequenced_stage"]:
        assert set(eo["first"]) <= set(res["staged"]) and res["rejected"], res
        assert all("already XORs" in x["reason"] for x in res["rejected"]), res
        assert {x["payload_id"] for x in res["rejected"]} <= set(eo["again"])
    refused = [x["payload_id"] for x in eo["resequenced_stage"][0]["rejected"]]
    for what, ids in (("resequenced", refused), ("extra", eo["extra"]), ("missing", eo["missing"])):
        for ack in eo[f"{what}_apply"]:
            assert ack["ok"] is False and ack["error"].startswith("ProtocolError: "), ack
            assert "nothing was applied" in ack["error"], ack
            assert all(i in ack["error"] for i in sorted(ids)[:8]), (what, ack)  # 8 named
    assert all(f"missing {len(refused)}: " in a["error"] for a in eo["resequenced_apply"])
    assert all(f"extra 1: {eo['extra'][0]}" in a["error"] for a in eo["extra_apply"])
    assert all(f"missing 1: {eo['missing'][0]}" in a["error"] for a in eo["missing_apply"])
    assert all(s["state"] == "clean" for s in eo["status"])
    assert r["d0_after_exactly_once"] == r["d0"]
    # v0 -> v1 (mixed XOR/overwrite), delivered reordered, staged twice, applied once:
    # bit-exact with the dense load
    assert r["n_payloads_v1"] > 1
    assert all(len(s["staged"]) == r["n_payloads_v1"] for s in r["stage1"])
    assert all(len(s["duplicates"]) == r["n_payloads_v1"] for s in r["stage1_again"])
    _ok(r["ack1"])
    _placed(r["ack1"], mode)
    assert r["d1"] == r["ref"][0]["digest"]
    assert r["tokens1"] == r["ref"][0]["tokens"]
    # v1 -> v2: a partial XOR apply leaves a mixture; XOR retries are refused; an overwrite
    # retry of the complete changed set repairs it
    assert all(not a["ok"] and a["items"] == 5 for a in r["ack2_partial"])
    assert r["d2_partial"] != r["ref"][1]["digest"] and r["d2_partial"] != r["ref"][0]["digest"]
    assert all(s["state"] == "dirty" for s in r["status_after_partial"])
    assert "retry with overwrites" in r["apply2_xor_retry_error"]
    _ok(r["ack2_retry"])
    _placed(r["ack2_retry"], mode)
    assert r["d2"] == r["ref"][1]["digest"] and r["tokens2"] == r["ref"][1]["tokens"]
    # v2 -> v3: overwrite-only from a clean receiver
    _ok(r["ack3"])
    _placed(r["ack3"], mode)
    for text in r["metrics"]:  # every fall back is counted; in plan mode there is none
        assert ('dcr_placement_fallbacks_total{reason="loader_mode"}' in text) == (mode == "loader")
        assert "dcr_placement_fallbacks_total{" not in text or mode == "loader"
    assert r["d3"] == r["ref"][2]["digest"] and r["tokens3"] == r["ref"][2]["tokens"]
    # every write was in place: each rank's parameters and buffers kept their data_ptr (the
    # addresses CUDA graphs capture) from before the dense loads and the first apply to after
    # the applies (XOR and overwrite, a partial apply and its overwrite retry)
    storage = r["storage"]
    assert len(storage["before_apply"]) == ranks and all(storage["before_apply"]), storage
    assert storage["end"] == storage["before_apply"]
    # vLLM's own weight_versions of every generation (the engine core stamps them from the
    # dcr_* replies, versions.py): the initial checkpoint is version 0, each dense load its
    # version; after an apply the weights are no committed version until the commit
    # version, each with the number of applies the ranks ran (every write its own label)
    labels = ["0", "1", "2", "3", "1-uncommitted", "2-uncommitted", "3-uncommitted"]
    outputs = [r["tokens0"], *(x["tokens"] for x in r["ref"]), r["tokens1"], r["tokens2"]]
    applies = []
    for spans, label, tokens in zip(r["spans"], labels, [*outputs, r["tokens3"]], strict=True):
        got = spans[0][0][0]
        if label.endswith("-uncommitted"):
            assert got.startswith(label + "."), (label, spans)
            applies.append(int(got.rsplit(".", 1)[1]))
        else:
            assert got == label, (label, spans)
        assert spans == [[[got, 0, len(t)]] for t in tokens], (label, spans)
    assert applies == sorted(set(applies))  # a new label for every apply
    assert [s[0][0] for s in r["spans_after_commit3"]] == ["3", "3"]
    if case[0] == "qwen3-tp1" and mode == "plan":
        # the dense-load reference itself equals a fresh engine started on v3
        fresh = tmp_path / "fresh.json"
        run_program(
            [
                PYTHON,
                str(REPO / "tests/integration/vllm/engine_program.py"),
                "--model",
                versions[3],
                "--tp",
                "1",
                "--prompts",
                json.dumps(["hello world the policy", "a refit sends only the bits"]),
                "--out",
                str(fresh),
            ],
            timeout=480,
            env=base_env(),
            log=tmp_path / "fresh.log",
        )
        f = json.loads(fresh.read_text())
        assert f["digests"] == r["d3"]
        assert f["tokens"] == r["tokens3"]


@pytest.mark.vllm
@pytest.mark.zmq
def test_relay_tree_stages_into_a_real_engine(tmp_path: Path) -> None:
    """Payloads streamed through a relay root are staged on the engine as they arrive; after
    the tree's completion acknowledgement, apply is bit-exact with a dense load."""
    from dcr_tools.procs import free_port

    versions = _versions("qwen3", tmp_path / "m")
    out = tmp_path / "relay.json"
    run_program(
        [
            PYTHON,
            str(REPO / "tests/integration/vllm/relay_program.py"),
            "--v0",
            versions[0],
            "--v1",
            versions[1],
            "--bind",
            f"tcp://127.0.0.1:{free_port()}",
            "--out",
            str(out),
        ],
        timeout=480,
        env=base_env(),
        log=tmp_path / "engine.log",
    )
    r = json.loads(out.read_text())
    assert r["tree_ack"]["complete"] and r["relay_duplicates"] == 1
    assert r["staged_before_apply"][0]["staged_payloads"] == r["n_payloads"] > 1
    ack = r["acks"][0]
    assert ack["ok"] and ack["payloads"] == r["n_payloads"] and ack["post_apply_mismatches"] == 0
    assert r["digest_delta"] == r["digest_dense"]
