"""The ``dcr`` backend's speculative-draft protocol, with FAKES (pure unit test, labelled as such:
a FAKE vLLM worker whose target and draft are the fake loader models of test_receiver_units.py,
the draft sharing one parameter's storage with the target as vLLM shares an MTP or EAGLE draft's
embedding; FAKE configs). The same protocol against a real ``vllm serve`` with an MTP draft is
tests/integration/vllm/test_draft_transfer.py.

Checked: the draft's receiver skips the shared tensor (so an XOR is applied to that storage once,
by the target's receiver), both parts commit under one commit record, and every way the two
parts can fail to match (a base-only update, a draft part without its base part, a transition
whose draft part never came) changes nothing or fences both."""

from __future__ import annotations

import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shared_codec.coordination.commit import CommitLog, CommitRecord
from shared_codec.transport.spec import open_store
from tests.unit.vllm.test_exactly_once import _encode, _items, _publish, _versions
from tests.unit.vllm.test_native_contract import _UPDATE, TABLE, _init, _report
from tests.unit.vllm.test_receiver_units import FakeLoaderModel, _dense
from vllm_dcr_plugin import worker as dcr_worker
from vllm_dcr_plugin.receiver import Receiver
from vllm_dcr_plugin.transfer import reports
from vllm_dcr_plugin.transfer.worker_engine import DCRWeightTransferEngine

TABLE_NAMES = [n for n, _, _ in TABLE]


class FakeDraftWorker:
    """FAKE vLLM worker running a draft: its ``d`` parameter is the target's (shared storage)."""

    def __init__(self) -> None:
        self.rank = 0
        self.target, self.draft = FakeLoaderModel(), FakeLoaderModel()
        self.draft.d = self.target.d  # vLLM shares an MTP/EAGLE draft's embedding like this
        for model in (self.target, self.draft):
            _dense(model, _versions()[0])
        self.model_runner = SimpleNamespace(model=self.target, requests={})
        self._weight_update_active = False
        self._dcr_state = Receiver(self.target, rank={"rank": 0})

    def get_draft_model(self) -> torch.nn.Module:
        return self.draft


@pytest.fixture
def engine():
    """A real `DCRWeightTransferEngine` over the FAKE worker (FAKE vLLM configs)."""
    worker = FakeDraftWorker()
    saved = dcr_worker._state["worker"]
    dcr_worker._state["worker"] = weakref.ref(worker)
    config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=1), model_config=None)
    eng = DCRWeightTransferEngine(SimpleNamespace(backend="dcr"), config, None, worker.target)
    eng._fake_worker = worker  # keep it alive
    try:
        yield eng
    finally:
        dcr_worker._state["worker"] = saved


def _models(eng: DCRWeightTransferEngine) -> dict[str, torch.Tensor]:
    w = eng._fake_worker  # type: ignore[attr-defined]
    out = {f"target.{n}": p.clone() for n, p in w.target.named_parameters()}
    out.update({f"draft.{n}": p.clone() for n, p in w.draft.named_parameters()})
    return out


def _holds(eng: DCRWeightTransferEngine, version: int) -> bool:
    """Both models hold `version` of the refit tensors (d shared, t and c each model's own)."""
    expect = FakeLoaderModel()
    _dense(expect, _versions()[version])
    w = eng._fake_worker  # type: ignore[attr-defined]
    return all(
        torch.equal(getattr(m, n), getattr(expect, n)) for m in (w.target, w.draft) for n in "dtc"
    )


def _in_draft_session(eng: DCRWeightTransferEngine, call: Any) -> None:
    eng.set_weight_update_target(eng._fake_worker.draft, None)  # type: ignore[attr-defined]
    try:
        call()
    finally:
        eng.reset_weight_update_target()


def test_draft_part_commits_with_the_base_part_and_mismatches_fence_both(
    engine: DCRWeightTransferEngine, tmp_path: Path
) -> None:
    engine.init_transfer_engine(engine.parse_init_info(_init(tmp_path, "s1", digest=True)))
    init = _report(tmp_path, reports.init_step("s1"))
    assert init["ok"] and init["draft"]["prewarm"]["role"] == "draft", init
    assert init["draft"]["prewarm"]["shared"] == ["d.weight"]  # the target's receiver writes d
    assert "d.weight" not in init["prewarm"]["skipped"]
    base = engine._receivers()[0]
    payloads = _encode(_items(*_versions(), {"overwrite_only": base.found.overwrite_only}))
    _publish(tmp_path / "source", payloads)
    before = _models(engine)

    def unchanged() -> bool:
        now = _models(engine)
        return all(torch.equal(now[n], before[n]) for n in before)

    # refused, nothing changed: a base-only update, a draft part without its base part
    engine.update_weights({**_UPDATE, "attempt": 5})
    rep = _report(tmp_path, reports.update_step(1, 5))
    assert not rep["ok"] and "runs a speculative draft model" in rep["error"], rep
    _in_draft_session(engine, lambda: engine.update_weights({**_UPDATE, "draft": True}))
    rep = _report(tmp_path, reports.draft_update_step(1, 0))
    assert not rep["ok"] and "its base part was not applied" in rep["error"], rep
    assert unchanged() and engine.pending is None and engine.held is None

    # a transition whose draft part never came: the next finish fences both parts
    engine.update_weights({**_UPDATE, "draft": True})
    assert _report(tmp_path, reports.update_step(1, 0))["ok"]
    engine.finish_weight_update()  # the base session's finish holds the attempt
    assert engine.held == (1, 0)
    control = open_store({"kind": "dir", "root": str(tmp_path / "control")})
    with pytest.raises((KeyError, FileNotFoundError)):  # nothing decided, nothing reported
        control.get(reports.key("engine0", reports.finish_step(1, 0), 0))
    engine.finish_weight_update()  # closing a session without the draft part
    rep = _report(tmp_path, reports.finish_step(1, 0))
    assert rep["committed"] is False and rep["why"] == "its draft part was not applied", rep
    assert all(r.state.value == "applied" for r in engine._receivers()[:1])
    assert 0 in engine._receivers()[1].staging.fenced

    # both parts of attempt 1 (overwrites), one commit record: both models hold v1, and the
    # shared tensor was written once (an XOR applied twice would restore v0)
    items = _items(*_versions(), {"overwrite_only": set(TABLE_NAMES)})
    _publish(tmp_path / "source", _encode(items, attempt=1), attempt=1)
    update = {**_UPDATE, "attempt": 1, "overwrite_only": True, "draft": True, "digest": True}
    engine.update_weights(update)
    engine.finish_weight_update()
    _in_draft_session(engine, lambda: engine.update_weights(update))
    rep = _report(tmp_path, reports.draft_update_step(1, 1))
    assert rep["ok"] and rep["role"] == "draft" and rep["ack"]["elements_written"] > 0, rep
    log = CommitLog(control)
    log.commit(None, CommitRecord(version=0, base_version=0, baseline_id="b", attempt=0))
    log.commit(0, CommitRecord(version=1, base_version=0, baseline_id="b", attempt=1))
    _in_draft_session(engine, engine.finish_weight_update)
    rep = _report(tmp_path, reports.finish_step(1, 1))
    assert rep["committed"] and rep["draft_commit"]["committed_version"] == 1, rep
    assert [r.committed_version for r in engine._receivers()] == [1, 1]
    assert _holds(engine, 1)


def test_xor_delta_reaches_shared_storage_once(
    engine: DCRWeightTransferEngine, tmp_path: Path
) -> None:
    engine.init_transfer_engine(engine.parse_init_info(_init(tmp_path, "s1")))
    base = engine._receivers()[0]
    payloads = _encode(_items(*_versions(), {"overwrite_only": base.found.overwrite_only}))
    assert any(it.kind.name == "XOR" and it.name == "d.weight" for it in _items(
        *_versions(), {"overwrite_only": base.found.overwrite_only}
    ))  # fmt: skip
    _publish(tmp_path / "source", payloads)
    engine.update_weights({**_UPDATE, "draft": True})
    engine.finish_weight_update()
    _in_draft_session(engine, lambda: engine.update_weights({**_UPDATE, "draft": True}))
    assert _report(tmp_path, reports.draft_update_step(1, 0))["ok"]
    control = open_store({"kind": "dir", "root": str(tmp_path / "control")})
    log = CommitLog(control)
    log.commit(None, CommitRecord(version=0, base_version=0, baseline_id="b", attempt=0))
    log.commit(0, CommitRecord(version=1, base_version=0, baseline_id="b", attempt=0))
    _in_draft_session(engine, engine.finish_weight_update)
    assert _report(tmp_path, reports.finish_step(1, 0))["committed"]
    assert _holds(engine, 1)


def test_draft_sessions_through_vllms_clients_or_refused() -> None:
    """vLLM 0.32's trainer clients have no ``start_draft_weight_update``: the channel uses the
    HTTP client's ``base_url`` or the Ray client's ``handles`` (vLLM's own classes here), a
    client's own method where it has one, and refuses any other client by name."""
    from vllm.distributed.weight_transfer.clients import (
        HTTPVLLMWeightSyncClient,
        RayVLLMWeightSyncClient,
    )

    from shared_codec.errors import DCRError
    from vllm_dcr_plugin.transfer.native import draft_sessions, start_draft_session

    calls: list[str] = []
    own = SimpleNamespace(start_draft_weight_update=lambda: calls.append("own"))
    assert draft_sessions(HTTPVLLMWeightSyncClient("http://127.0.0.1:1"))
    assert draft_sessions(RayVLLMWeightSyncClient([]))
    assert draft_sessions(own) and not draft_sessions(object())
    start_draft_session(own)
    assert calls == ["own"]
    with pytest.raises(DCRError, match="object cannot start a draft weight-update session"):
        start_draft_session(object())
