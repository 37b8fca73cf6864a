"""DCR as vLLM's weight-transfer backend ``dcr`` against a real ``vllm serve`` (CPU, TP=1) that has
no DCR worker extension: the trainer side is vLLM's own ``WeightTransferTrainerFactory`` with
``HTTPVLLMWeightSyncClient``; the oracle is vLLM's own ``/weight_checker`` checksums after a
dense load of the same version.

Owners here are `CheckpointOwners` (test-only, labelled: they publish the real encoded delta
between two canonical checkpoints through a real directory transport instead of running a
Megatron job; tests/integration/test_native_megatron.py runs the same engine against the real trainer job).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from dcr_tools import faults
from dcr_tools.fixtures import perturb_checkpoint, write_tiny_model
from shared_codec.checkpoint import tensor_table
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.errors import RefitFailed
from tests.integration.vllm._native import NativeServer, native_trainer
from vllm_dcr_plugin.transfer import reports

pytestmark = pytest.mark.vllm

VERSIONS = 8  # v0 and up to 7 refits (the async RL test retries up to 5 rounds, then one more)
POSITIONS = 16384
GATE_TOKENS = POSITIONS - 16  # the request-gate case's requests: as long as the engine allows
LONG = 3000  # the async-RL request: long enough for a pause to land while it runs


class Server(NativeServer):
    """The module's engine: tiny Qwen3 v0..v7, one sequence at a time."""

    def __init__(self, root: Path) -> None:
        # 16384 positions: a long completion holds state in the engine for seconds (the async
        # RL test needs requests still running when the update or the pause arrives)
        versions = [
            write_tiny_model("qwen3", root / "v0", seed=0, max_position_embeddings=POSITIONS)
        ]
        for v in range(1, VERSIONS):
            perturb_checkpoint(versions[-1], root / f"v{v}", seed=v)
            versions.append(root / f"v{v}")
        super().__init__(
            root,
            versions,
            [
                "--enable-scale-out", "--max-model-len", str(POSITIONS),
                # one sequence at a time: requests queue behind the running one, so the engine
                # holds request state for as long as the queue lasts (the gate case below)
                "--max-num-seqs", "1",
            ],
        )  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp("native"))
    try:
        yield s
    finally:
        s.proc.stop()


def trainer(server: Server, tmp: Path, **config: Any) -> Any:
    """vLLM's trainer API with DCR's init info: what an orchestrator writes."""
    return native_trainer(server, tmp, **config)


def dense_checksums(server: Server, engine: Any, version: int) -> dict[str, str]:
    """The oracle: vLLM's checksums after a dense load of `version` (leaves it loaded)."""
    native = engine.coordinator.engines[0]
    native.initialize(version, str(server.versions[version]))
    return server.checksums()


def test_native_refits_commit_retry_and_refuse_bad_updates(server: Server, tmp_path: Path):
    engine, owners, control = trainer(server, tmp_path, verify=True)
    native = engine.coordinator.engines[0]
    assert engine.coordinator.committed_version() == 0

    # v1: a clean delta refit through the four phases; vLLM stamps the weight version
    res = engine.send_weights()
    assert res.version == 1 and res.retries == 0 and res.record.receivers == ("engine0",)
    (rank0,) = res.attempts[0].acks["engine0"]["ranks"]
    assert rank0["ack"]["pipelined_parts"] > 1  # applied payload by payload as they arrived
    assert server.weight_version() == "1"
    after_v1 = server.checksums()

    # v2: the engine fails part-way through attempt 0 (dirty); the overwrite retry repairs it
    faults.arm(server.fault_plan, fail_after_items=2)
    res = engine.send_weights()
    assert res.version == 2 and res.retries == 1
    failed = res.attempts[0]
    assert not failed.ok and "engine0" in failed.failed
    assert "InjectedFailure" in failed.failed["engine0"]
    assert owners.builds[-2:] == [(2, 0, False), (2, 1, True)]
    finish0 = json.loads(control.get(reports.key("engine0", reports.finish_step(2, 0), 0)))
    assert finish0["committed"] is False  # attempt 0 was fenced, not committed
    assert server.weight_version() == "2"
    after_v2 = server.checksums()

    # a stale update (base version 1, committed is 2) and bad arguments change nothing
    client = native.client
    client.start_weight_update()
    client.update_weights({"version": 2, "base_version": 1, "attempt": 7})
    client.update_weights({"version": "three", "base_version": 2, "attempt": 0})
    client.update_weights({"version": 3, "base_version": 2, "attempt": 0, "colour": "red"})
    client.update_weights({"version": 3, "base_version": 2, "attempt": 5, "timeout_s": 0})
    client.update_weights({"version": 3, "base_version": 3, "attempt": 6})
    client.finish_weight_update()
    stale = json.loads(control.get(reports.key("engine0", reports.update_step(2, 7), 0)))
    assert not stale["ok"] and "stale or foreign" in stale["error"]
    bad = json.loads(control.get(reports.key("engine0", "invalid/update", 0)))
    assert not bad["ok"] and "ProtocolError" in bad["error"] and "version" in bad["error"]
    unknown = json.loads(control.get(reports.key("engine0", reports.update_step(3, 0), 0)))
    assert not unknown["ok"] and "colour" in unknown["error"]
    for attempt, reason in ((5, "timeout_s must be > 0"), (6, "version 3 must be > base_version")):
        rep = json.loads(control.get(reports.key("engine0", reports.update_step(3, attempt), 0)))
        assert not rep["ok"] and "ProtocolError: update_weights: bad" in rep["error"], rep
        assert reason in rep["error"], rep
    # bad init_info: answered in the report, the engine keeps its prewarm and version
    good = {
        "engine": "engine0",
        "control": {"kind": "dir", "root": str(tmp_path / "store")},
        "source": {"kind": "dir", "root": str(tmp_path / "store")},
        "tensors": tensor_table(server.versions[0]),
        "committed_version": 2,
    }
    from shared_codec.checkpoint import load_checkpoint, save_checkpoint

    embed = "model.embed_tokens.weight"
    other = save_checkpoint(  # another model's shapes: refused before anything is loaded
        {embed: load_checkpoint(server.versions[0])[embed][:, :8].clone()}, tmp_path / "other"
    )
    bad_inits = {
        "bad-version": ({"committed_version": -1}, "committed_version must be >= 0"),
        "bad-kind": ({"source": {"kind": "ftp", "root": "/x"}}, "source: store spec kind"),
        "bad-spec-key": ({"source": {**good["source"], "bucket": "b"}}, "source: unknown key"),
        "bad-table": ({"tensors": [["w", "bfloat17", [2]]]}, "bfloat17"),
        "bad-field": ({"colour": "red"}, "colour"),
        "bad-key": ({"key": "not hex"}, "key must be hex"),
        "bad-dense": ({"dense_path": str(tmp_path)}, "dense_path: no *.safetensors"),
        "other-model": ({"dense_path": str(other)}, f"dense-load path: tensor {embed}"),
    }
    for session, (change, reason) in bad_inits.items():
        client.init_weight_transfer_engine({**good, "session": session, **change})
        rep = json.loads(control.get(reports.key("engine0", reports.init_step(session), 0)))
        assert not rep["ok"] and "ProtocolError" in rep["error"] and reason in rep["error"], rep
    assert server.checksums() == after_v2
    assert server.weight_version() == "2"
    native.pipelined = False  # staged first, then applied (fetch waits for the seal)
    res = engine.send_weights()  # still prewarmed at v2, still the same control store
    assert res.version == 3 and res.retries == 0
    (rank0,) = res.attempts[0].acks["engine0"]["ranks"]
    assert "pipelined_parts" not in rank0["ack"] and rank0["fetch"]["staged"] > 1, rank0
    after_v3 = server.checksums()

    # the oracle: dense loads of v1 and v2 give vLLM's checksums of the delta refits
    assert dense_checksums(server, engine, 1) == after_v1
    assert dense_checksums(server, engine, 2) == after_v2
    assert dense_checksums(server, engine, 3) == after_v3

    # membership: engine0 leaves; v4 commits without it (sent nothing, it keeps v3)
    client = native.client
    assert engine.remove_engine("engine0") is native and engine.members == ()
    res = engine.send_weights()
    assert res.version == 4 and res.record.receivers == () and res.record.digests == {}
    assert server.weight_version() == "3" and server.checksums() == after_v3
    # it joins again: a dense load of committed v4 from checkpoint_for, stamped as its version
    record = engine.add_engine("engine0", client)
    assert record.version == 4 and engine.members == ("engine0",)
    assert server.weight_version() == "4"
    joined_v4, joined_digest = server.checksums(), engine.coordinator.engines[0].digest()
    res = engine.send_weights()  # the next version lists it again and refits it by a delta
    assert res.version == 5 and res.retries == 0 and res.record.receivers == ("engine0",)
    assert server.weight_version() == "5"
    after_v5 = server.checksums()
    assert dense_checksums(server, engine, 4) == joined_v4
    assert engine.coordinator.engines[0].digest() == joined_digest
    assert dense_checksums(server, engine, 5) == after_v5
    assert engine.coordinator.engines[0].digest() == res.record.digests["engine0"]


def _generate(server: Server, max_tokens: int, started: threading.Event | None, out: list) -> None:
    """One greedy completion; appends (token ids, final choice) to `out`. Streamed, with
    `started` set once the first tokens arrived; without `started`, not streamed: the client
    sits in one blocking read (no per-token work in this process)."""
    body = {
        "token_ids": [1, 2, 3, 4],
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0},
        "stream": started is not None,
    }
    if started is None:
        r = requests.post(server.url + "/inference/v1/generate", json=body, timeout=600)
        r.raise_for_status()
        (choice,) = r.json()["choices"]
        out.append((choice["token_ids"], choice))
        return
    tokens: list[int] = []
    final = None
    with requests.post(
        server.url + "/inference/v1/generate", json=body, stream=True, timeout=600
    ) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            assert "choices" in event, f"the stream sent {event}"
            choice = event["choices"][0]
            tokens += choice["token_ids"]
            if len(tokens) >= 8:
                started.set()
            if choice["finish_reason"] is not None:
                final = choice
    out.append((tokens, final))


def _gauges(server: Server) -> dict[str, float]:
    """vLLM's own request gauges (``vllm:num_requests_running`` / ``_waiting``)."""
    text = requests.get(server.url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        for name in ("running", "waiting"):
            if line.startswith((f"vllm:num_requests_{name}{{", f"vllm:num_requests_{name} ")):
                out[name] = float(line.split()[-1])
    return out


def _wait_running(server: Server, started: threading.Event, timeout_s: float = 120.0) -> None:
    """Wait until vLLM's own ``vllm:num_requests_running`` gauge shows a request in the engine,
    or the stream's first tokens arrived (`started`), whichever is seen first.

    Neither alone is a sure signal on 2 cores: the API server can deliver a whole stream in one
    burst when the request ends, and its starved event loop can answer ``/metrics`` only then.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not started.is_set():
        if _gauges(server).get("running", 0) >= 1:
            return
        time.sleep(0.05)
    assert started.is_set(), f"no request running in the engine after {timeout_s} s"


def test_async_rl_pause_keep_apply_resume(server: Server, tmp_path: Path):
    engine, _, _ = trainer(server, tmp_path)
    assert server.weight_version() == "0"
    reference: list = []  # the old (v0) engine's greedy tokens for the request used below
    _generate(server, LONG, threading.Event(), reference)
    old = reference[0][0]
    assert len(old) == LONG

    # the gate: a request runs and generation is not paused -> the apply is refused before any
    # write (the request needs several seconds of engine time; the refusal names it)
    gate = Coordinator(
        engine.coordinator.control,
        engine.coordinator.owners,
        engine.coordinator.engines,
        CoordinatorConfig(max_attempts=1),
        transport=engine.coordinator.transport,
    )
    before = server.checksums()
    # eight clients send the longest requests the engine allows back to back, not streamed,
    # until the refit returns (--max-num-seqs 1: one runs, the others wait in vLLM's scheduler,
    # which hands the worker the next in the step that retires the last), so the worker holds
    # request state for as long as the refit takes. On 2 cores a starved API server was seen
    # to pass the refit's start / update calls, new requests and finished responses on up to
    # 85 s late; the refit starts once all eight are in the engine (seven queued: minutes of
    # engine time), and a fixed batch of four streamed 8000-token requests once ran dry first.
    done, stop = [], threading.Event()

    def client() -> None:
        while not stop.is_set():
            _generate(server, GATE_TOKENS, None, done)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while (g := _gauges(server)).get("running", 0) < 1 or g.get("waiting", 0) < len(threads) - 1:
        assert time.monotonic() < deadline, f"the requests did not all reach the engine: {g}"
        time.sleep(0.05)
    t_seen = time.monotonic()
    try:
        res = gate.refit()
    except RefitFailed as e:
        assert re.search(r"request gate closed .*\d request\(s\) still hold", str(e)), e
    else:  # say what the worker's gate saw and when
        (rank0,) = res.attempts[0].acks["engine0"]["ranks"]
        pytest.fail(
            f"applied {time.monotonic() - t_seen:.1f} s after requests were seen running and "
            f"queued; the gate saw {rank0.get('gate')}; requests done: {len(done)}; "
            f"phases: {res.attempts[0].seconds}"
        )
    finally:
        stop.set()
    # sync RL's other way out: pause(abort) ends the rollout, then resume (before the join: a
    # client that sent its last request just as the refit returned then finishes it normally)
    server.post("/pause", mode="abort")
    server.post("/resume")
    for t in threads:
        t.join(600)
    # the abort ended the running and the queued requests: each request ended either way
    finals = [(final["finish_reason"], len(tokens)) for tokens, final in done]
    assert any(r == "abort" and n < GATE_TOKENS for r, n in finals), finals
    assert all(r == "abort" or (r == "length" and n == GATE_TOKENS) for r, n in finals), finals
    assert server.checksums() == before  # refused before any write
    assert server.weight_version() == "0"

    # async RL: pause(keep) mid-generation, refit, resume: the frozen request continues on the
    # new weights and its weight_versions show the switch. The request needs seconds of engine
    # time, but vLLM's API server can deliver a stream in one burst after a lag (seen on 2
    # cores), so the pause could land after the request ended: such a round must show the old
    # version only (the refit still lands exactly) and the next version tries again (<= 5; a
    # clean-clone CI run once saw 3 such rounds in a row with 2000-token requests).
    version = 0
    for _ in range(5):
        started, done = threading.Event(), []
        t = threading.Thread(target=_generate, args=(server, LONG, started, done))
        t.start()
        _wait_running(server, started)
        server.post("/pause", mode="keep")
        assert requests.get(server.url + "/is_paused", timeout=30).json()["is_paused"] is True
        res = engine.send_weights()  # (first round: the retry of the refused attempt)
        version += 1
        assert res.version == version and res.attempts[-1].ok
        (seen,) = [r["gate"] for r in res.attempts[-1].acks["engine0"]["ranks"]]
        server.post("/resume")
        t.join(600)
        tokens, final = done[0]
        assert len(tokens) == LONG and final["finish_reason"] == "length"
        spans = final["weight_versions"]
        after_resume: list = []  # a request sent after the resume runs on the new weights
        _generate(server, LONG, threading.Event(), after_resume)
        if [s["version"] for s in spans] == [str(version - 1)]:  # ended before the pause
            assert tokens == old
            old = after_resume[0][0]
            continue
        assert [s["version"] for s in spans] == [str(version - 1), str(version)], spans
        assert seen == {"requests": 1, "paused": True}  # applied under the request, paused
        switch = spans[0]["end"]
        assert 0 < switch == spans[1]["start"] < LONG and spans[1]["end"] == LONG
        assert tokens[:switch] == old[:switch]  # before the pause: the old engine's tokens
        break
    else:
        pytest.fail("in 5 rounds the pause never landed while the request ran")
    after = server.checksums()
    # the oracle: a dense load of the new version gives the same checksums and greedy tokens
    assert dense_checksums(server, engine, version) == after
    dense: list = []
    _generate(server, LONG, threading.Event(), dense)
    assert after_resume[0][0] == dense[0][0] != old

    # sync RL: pause(wait) drains, refit, resume; new requests run on the next version
    server.post("/pause", mode="wait")
    res = engine.send_weights()
    version += 1
    assert res.version == version and res.retries == 0
    server.post("/resume")
    started, done = threading.Event(), []
    _generate(server, 16, started, done)
    assert [s["version"] for s in done[0][1]["weight_versions"]] == [str(version)]
    after = server.checksums()
    assert dense_checksums(server, engine, version) == after


def test_named_owner_takes_a_module_source(server: Server, tmp_path: Path):
    """A framework's hand-over: vLLM's own `ModuleSource` over a real HF model that a real
    optimizer steps, taken by the named-tensor owner at every ``send_weights`` (no Megatron,
    no test owners). After each step the engine's checksums equal a dense load of the model's
    state, and a refused stream leaves the engine at the committed version."""
    import torch
    import transformers
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from shared_codec.checkpoint import save_checkpoint
    from shared_codec.errors import ArgumentError
    from shared_codec.named import NamedTensorOwner
    from vllm_dcr_plugin.transfer.trainer_engine import DCRTrainerInitInfo

    v0 = server.versions[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(v0, dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=2e-3)
    store = {"kind": "dir", "root": str(tmp_path / "store")}
    owner = NamedTensorOwner(store, v0)
    info = DCRTrainerInitInfo(
        rank=0,
        control=store,
        transport=store,
        owners=owner,  # type: ignore[arg-type]
        tensors=tensor_table(v0),
        checkpoint_for=str(server.root / "v{version}"),
        dense_load_at_init=True,
        verify=True,
    )
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(server.url, timeout=600), source=ModuleSource(model)
    )
    native = engine.coordinator.engines[0]
    ids = torch.tensor([[1, 5, 9, 14, 3, 77, 21, 8]])
    for step in (1, 2, 3):
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        res = engine.send_weights()
        assert res.version == step and res.retries == 0
        assert 0 < owner.last_take.element_change_rate < 0.5, owner.last_take
        after = server.checksums()
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        dense = save_checkpoint(state, tmp_path / f"dense{step}", like=v0)
        native.initialize(step, str(dense))  # the oracle: a dense load of the same state
        assert server.checksums() == after, step

    class WrongDtype(ModuleSource):
        def __iter__(self):
            for name, t in super().__iter__():
                yield name, (t.float() if name == "model.norm.weight" else t)

    engine.source = WrongDtype(model)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # a change the refused stream must not deliver
    with pytest.raises(ArgumentError, match="model.norm.weight.*torch.float32"):
        engine.send_weights()
    assert engine.coordinator.committed_version() == 3
    assert server.checksums() == after and server.weight_version() == "3"
    engine.source = ModuleSource(model)  # the framework's next sync: delivered
    assert engine.send_weights().version == 4
    after = server.checksums()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    native.initialize(4, str(save_checkpoint(state, tmp_path / "dense4", like=v0)))
    assert server.checksums() == after
