"""Adapter-only refits from a Megatron-Bridge LoRA model (issue 34 item 4): 2 real megatron-core
ranks (TP=2, gloo) train megatron-bridge's LoRA adapters on the tiny Llama; after each step the
named-tensor owner publishes the adapter's delta in PEFT coordinates (rank program:
worker_lora.py). Receivers: DCR's own `AdapterReceiver` over a FAKE LoRA manager (labelled: it
records ``add_lora`` / ``remove_lora``), then the same payloads into a real vLLM engine with
LoRA enabled (tests/integration/vllm/adapter_program.py ``--published``): every version built
from the payloads equals, bit for bit, the trainer's adapter of that version, and vLLM's dense
load of it (its LoRA manager's weights and the greedy tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcr_tools.procs import PYTHON, REPO, base_env, run_program, run_torchrun
from shared_codec.peft import read_adapter

WORKER = Path(__file__).with_name("worker_lora.py")
STEPS = 3


class FakeLoRAWorker:
    """FAKE vLLM worker: the LoRA manager calls the adapter receiver makes, recorded."""

    rank = 0

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def add_lora(self, request) -> bool:  # noqa: ANN001
        self.loaded.append(request.lora_int_id)
        return True

    def remove_lora(self, ident: int) -> bool:
        self.loaded.remove(ident)
        return True


@pytest.mark.megatron
@pytest.mark.vllm
def test_megatron_bridge_lora_adapter_refits_are_bit_exact(tiny_models, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    store = {"kind": "dir", "root": str(tmp_path / "store")}
    out = tmp_path / "adapters"
    run_torchrun(
        WORKER,
        ["--ckpt", str(tiny_models["llama"]), "--store", store["root"], "--out", str(out),
         "--steps", str(STEPS), "--report", str(report)],
        tmp=tmp_path,
    )  # fmt: skip
    r = json.loads(report.read_text())
    if "unsupported" in r:
        pytest.skip(f"this trainer lane's megatron-bridge has no usable LoRA: {r['unsupported']}")
    assert r["world"] == 2
    shapes = r["tensors"]
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert shapes[q + ".lora_A.weight"] == [8, 64] and shapes[q + ".lora_B.weight"] == [128, 8]
    for proj in ("k_proj", "v_proj", "o_proj"):
        assert f"base_model.model.model.layers.1.self_attn.{proj}.lora_A.weight" in shapes
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert f"base_model.model.model.layers.1.mlp.{proj}.lora_B.weight" in shapes

    from vllm_dcr_plugin.adapters import AdapterReceiver

    worker = FakeLoRAWorker()
    receiver = AdapterReceiver(worker, tmp_path / "receiver")
    receiver.load("policy", str(out / "v0"), 0)
    previous = read_adapter(out / "v0")[1]
    for v in range(1, STEPS + 1):
        got = receiver.fetch("policy", store, v, 0, 30.0)
        assert got["items"] > 0, got
        receiver.commit("policy", v)
        config, trainer = read_adapter(out / f"v{v}")
        held = receiver.adapters["policy"].tensors
        assert held.keys() == trainer.keys()
        for name, t in trainer.items():
            assert torch.equal(held[name].view(torch.int16), t.view(torch.int16)), (v, name)
        _, written = read_adapter(got["lora_path"])  # what vLLM's LoRA manager would load
        assert all(torch.equal(written[n], trainer[n]) for n in trainer)
        assert any(not torch.equal(previous[n], trainer[n]) for n in trainer), v  # it trained
        assert config["r"] == 8 and config["lora_alpha"] == 16
        previous = trainer
    assert receiver.adapters["policy"].version == STEPS
    assert sorted(receiver.adapters["policy"].live) == [STEPS - 1, STEPS]

    # the same payloads into a real vLLM engine with LoRA enabled (its base: the tiny Llama the
    # trainer's config describes): every version, loaded by vLLM's LoRA manager from DCR's
    # candidate, equals vLLM's dense load of the trainer's adapter, bit for bit and in tokens
    served = tmp_path / "served.json"
    run_program(
        [
            PYTHON, str(REPO / "tests/integration/vllm/adapter_program.py"),
            "--base", str(tiny_models["llama"]), "--store", store["root"], "--out", str(served),
            "--adapters", json.dumps([str(out / f"v{v}") for v in range(STEPS + 1)]),
            "--published",
        ],
        timeout=600,
        env=base_env(),
        log=tmp_path / "engine.log",
    )  # fmt: skip
    e = json.loads(served.read_text())
    for v in range(STEPS + 1):
        s = e["steps"][f"v{v}"]
        digest = s["status"]["loaded"][str(e["ids"][str(v)])]
        assert isinstance(digest, str) and digest == s["status"]["loaded"][str(1000 + v)], v
        assert s["alias"] == s["dense"], v
    assert e["steps"]["v0"]["alias"] != e["base"]
