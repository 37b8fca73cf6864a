"""The error contract of the native weight-transfer backend ``dcr`` (docs/protocol.md,
"Errors"), worker and trainer side, with FAKES (pure unit test, labelled as such: a FAKE vLLM
worker holding a receiver over the fake loader model, FAKE configs and a recording FAKE trainer
client; the same entry points against a real ``vllm serve`` are in test_native_transfer.py).

Worker side: every bad ``init_info`` / ``update_info`` field is a ``ProtocolError`` naming it,
answered as an ``ok: false`` report in the control store (the entry points never raise into
vLLM's executor); it changes nothing (weights' digest, receiver state, the engine's init and
pending attempt), and a valid call afterwards works. Trainer side: `trainer_init` refuses a bad
field with a ``ProtocolError`` naming it before any engine is called or any record written;
`send_weights` refuses a version that is not newer than the committed one."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shared_codec.checkpoint import save_checkpoint
from shared_codec.coordination.commit import CommitLog, CommitRecord
from shared_codec.errors import ProtocolError
from shared_codec.transport.spec import open_store
from tests.unit.vllm.test_exactly_once import REFIT, _encode, _items, _publish, _versions
from tests.unit.vllm.test_receiver_units import CANON, FakeLoaderModel, _assert_holds, _dense
from vllm_dcr_plugin import worker as dcr_worker
from vllm_dcr_plugin.receiver import Receiver
from vllm_dcr_plugin.transfer import reports
from vllm_dcr_plugin.transfer.worker_engine import (
    DCRInitInfo,
    DCRUpdateInfo,
    DCRWeightTransferEngine,
    parse_init,
    parse_update,
)

TABLE = [[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()]


def _init(tmp: Path, session: str = "s0", **change: Any) -> dict[str, Any]:
    store = {"kind": "dir", "root": str(tmp / "control")}
    return {
        "engine": "engine0",
        "session": session,
        "control": store,
        "source": {"kind": "dir", "root": str(tmp / "source")},
        "tensors": TABLE,
        "committed_version": 0,
        **change,
    }


def _bad_inits(tmp: Path) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (change to a good init_info, what the error must say)."""
    empty = tmp / "empty"
    empty.mkdir(exist_ok=True)
    return {
        "unknown-field": ({"colour": "red"}, "unknown init_info field(s) ['colour']"),
        "engine-slash": ({"engine": "a/b"}, "engine must be"),
        "control-kind": ({"control": {"kind": "spool", "root": "/x"}}, "control: store spec kind"),
        "control-no-root": ({"control": {"kind": "dir"}}, "control: a 'dir' store spec needs"),
        "source-kind": ({"source": {"kind": "ftp", "root": "/x"}}, "source: store spec kind"),
        "source-key": ({"source": {"kind": "dir", "root": "/x", "rot": 1}}, "source: unknown key"),
        "source-json": ({"source": "{"}, "source is not valid JSON"),
        "tensors-dtype": ({"tensors": [["w", "bfloat17", [2]]]}, "tensors[0]"),
        "tensors-text": ({"tensors": "w"}, "tensors must be a list"),
        "version-negative": ({"committed_version": -1}, "committed_version must be >= 0"),
        "version-float": ({"committed_version": 1.5}, "committed_version must be an integer"),
        "dense-missing": ({"dense_path": str(tmp / "nope")}, "dense_path must name"),
        "dense-empty": ({"dense_path": str(empty)}, "dense_path: no *.safetensors"),
        "key-not-hex": ({"key": "xyz"}, "key must be hex"),
        "key-int": ({"key": 7}, "key must be hex text"),
        "key-too-long": ({"key": "ab" * 65}, "key must be 1 to 64 bytes"),
        "key-empty": ({"key": ""}, "key must be 1 to 64 bytes"),
        "digest-maybe": ({"digest": "maybe"}, "digest must be a boolean"),
    }


BAD_UPDATES: dict[str, tuple[dict[str, Any], str]] = {
    "unknown-field": ({"colour": "red"}, "unknown update_info field(s) ['colour']"),
    "version-text": ({"version": "three"}, "version must be an integer"),
    "version-negative": ({"version": -1}, "version must be >= 0"),
    "base-bool": ({"base_version": True}, "base_version must be an integer"),
    "attempt-negative": ({"attempt": -2}, "attempt must be >= 0"),
    "not-newer": ({"version": 1, "base_version": 1}, "version 1 must be > base_version 1"),
    "pipelined-maybe": ({"pipelined": "maybe"}, "pipelined must be a boolean"),
    "overwrite-2": ({"overwrite_only": 2}, "overwrite_only must be a boolean"),
    "verify-list": ({"verify": []}, "verify must be a boolean"),
    "timeout-zero": ({"timeout_s": 0}, "timeout_s must be > 0"),
    "timeout-text": ({"timeout_s": "soon"}, "timeout_s must be a number"),
}
_UPDATE = {"version": 1, "base_version": 0, "attempt": 0, "timeout_s": 10.0}


def test_parsers_name_the_bad_field(tmp_path: Path) -> None:
    assert parse_init(_init(tmp_path)).tensors == TABLE
    for name, (change, says) in _bad_inits(tmp_path).items():
        with pytest.raises(
            ProtocolError, match="init_weight_transfer_engine: bad arguments: "
        ) as e:
            parse_init(_init(tmp_path, **change))
        assert says in str(e.value), (name, str(e.value))
    with pytest.raises(ProtocolError, match="init_info must be a JSON object"):
        parse_init(["engine0"])
    assert parse_update(_UPDATE).version == 1
    for name, (change, says) in BAD_UPDATES.items():
        with pytest.raises(ProtocolError, match="update_weights: bad arguments: ") as e:
            parse_update({**_UPDATE, **change})
        assert says in str(e.value), (name, str(e.value))


class FakeWorker:
    """FAKE vLLM worker: the attributes the DCR engine reads (rank, model runner, session)."""

    def __init__(self) -> None:
        self.rank = 0
        model = FakeLoaderModel()
        _dense(model, _versions()[0])
        self.model_runner = SimpleNamespace(model=model, requests={})
        self._weight_update_active = False
        self._dcr_state = Receiver(model, rank={"rank": 0})


@pytest.fixture
def engine():
    """A real `DCRWeightTransferEngine` over the FAKE worker (FAKE vLLM configs)."""
    worker = FakeWorker()
    saved = dcr_worker._state["worker"]
    dcr_worker._state["worker"] = weakref.ref(worker)
    config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=1), model_config=None)
    model = worker.model_runner.model
    eng = DCRWeightTransferEngine(SimpleNamespace(backend="dcr"), config, None, model)
    eng._fake_worker = worker  # keep it alive
    try:
        yield eng
    finally:
        dcr_worker._state["worker"] = saved


def _state(eng: DCRWeightTransferEngine) -> tuple:
    rx = eng._receiver()
    return (
        rx.digest()["digest"],
        rx.status(),
        dict(rx.tensors),
        rx.staging.key,
        eng.init,
        eng.pending,
        {a: sorted(per) for a, per in rx.staging.staged.items()},
        set(rx.staging.fenced),
    )


def _report(tmp: Path, step: str) -> dict[str, Any]:
    control = open_store({"kind": "dir", "root": str(tmp / "control")})
    return json.loads(control.get(reports.key("engine0", step, 0)))


def test_worker_entry_points_report_bad_arguments_and_change_nothing(
    engine: DCRWeightTransferEngine, tmp_path: Path
) -> None:
    # before any init: an update has nowhere to report and changes nothing
    before = _state(engine)
    engine.update_weights(_UPDATE)
    engine.finish_weight_update()
    assert _state(engine) == before

    # init_transfer_engine: every bad field is an ok:false report naming it
    for name, (change, says) in _bad_inits(tmp_path).items():
        engine.init_transfer_engine(engine.parse_init_info(_init(tmp_path, name, **change)))
        if name.startswith("control") or name == "engine-slash":
            continue  # no usable control store or engine name: no report (the trainer
            # sees it missing); nothing changed either
        rep = _report(tmp_path, reports.init_step(name))
        assert rep["ok"] is False, (name, rep)
        assert rep["error"].startswith("ProtocolError: init_weight_transfer_engine: bad "), rep
        assert says in rep["error"], (name, says, rep["error"])
        assert _state(engine) == before, name
    # a valid init afterwards
    engine.init_transfer_engine(engine.parse_init_info(_init(tmp_path, "good", digest=True)))
    rep = _report(tmp_path, reports.init_step("good"))
    assert rep["ok"] and rep["prewarm"]["tensors"] == len(TABLE), rep
    assert rep["digest"] == before[0]

    # update_weights: every bad field is an ok:false report naming it, nothing changed
    rx = engine._receiver()
    payloads = _encode(_items(*_versions(), {"overwrite_only": rx.found.overwrite_only}))
    _publish(tmp_path / "source", payloads)
    before = _state(engine)
    invalid = tmp_path / "control" / reports.key("engine0", "invalid/update", 0)
    for i, (name, (change, says)) in enumerate(BAD_UPDATES.items()):
        update = {**_UPDATE, "attempt": 10 + i, **change}  # a report key per case
        invalid.unlink(missing_ok=True)
        engine.update_weights(update)
        if invalid.exists():  # the version or the attempt did not parse
            rep = json.loads(invalid.read_text())
        else:
            rep = _report(tmp_path, reports.update_step(update["version"], update["attempt"]))
        assert rep["ok"] is False, (name, rep)
        assert rep["error"].startswith("ProtocolError: update_weights: bad arguments: "), rep
        assert says in rep["error"], (name, says, rep["error"])
        assert _state(engine) == before, name
    # a caller's own typed info is held to the same contract (vLLM parses dicts first)
    engine.receive_weights(DCRUpdateInfo(version=1, base_version=0, attempt=30, timeout_s=-1))
    rep = _report(tmp_path, reports.update_step(1, 30))
    assert rep["ok"] is False and "timeout_s must be > 0" in rep["error"], rep
    engine.init_transfer_engine(
        DCRInitInfo(**{**_init(tmp_path, "typed"), "committed_version": -4})
    )
    rep = _report(tmp_path, reports.init_step("typed"))
    assert rep["ok"] is False and "committed_version must be >= 0" in rep["error"], rep
    assert _state(engine) == before
    # a stale or foreign update (base version 3, committed 0): refused before any fetch
    engine.update_weights({**_UPDATE, "version": 4, "base_version": 3})
    rep = _report(tmp_path, reports.update_step(4, 0))
    assert rep["ok"] is False and "stale or foreign" in rep["error"], rep
    assert _state(engine) == before
    # finish_weight_update with nothing pending: nothing to do, nothing changed
    engine.finish_weight_update()
    assert _state(engine) == before

    # valid: the attempt is fetched and applied, committed when the record names it (typed)
    engine.receive_weights(DCRUpdateInfo(**{**_UPDATE, "verify": True}))
    rep = _report(tmp_path, reports.update_step(1, 0))
    assert rep["ok"] and rep["ack"]["items"] == len(REFIT), rep
    control = open_store({"kind": "dir", "root": str(tmp_path / "control")})
    log = CommitLog(control)
    log.commit(None, CommitRecord(version=0, base_version=0, baseline_id="b", attempt=0))
    log.commit(0, CommitRecord(version=1, base_version=0, baseline_id="b", attempt=0))
    engine.finish_weight_update()
    assert _report(tmp_path, reports.finish_step(1, 0))["committed"] is True
    assert rx.status()["committed_version"] == 1
    _assert_holds(rx.model, _versions()[1])  # type: ignore[arg-type]


def test_worker_init_dense_path_of_another_model_changes_nothing(
    engine: DCRWeightTransferEngine, tmp_path: Path
) -> None:
    """A dense path whose tensors do not fit the prewarm table: an ok:false report naming it;
    nothing loaded."""
    engine.init_transfer_engine(engine.parse_init_info(_init(tmp_path, "s1")))
    assert _report(tmp_path, reports.init_step("s1"))["ok"]
    import torch

    other = tmp_path / "other"
    save_checkpoint({"t.weight": torch.zeros(4, 6, dtype=torch.bfloat16)}, other)
    before = _state(engine)
    init = _init(tmp_path, "s2", dense_path=str(other))
    engine.init_transfer_engine(engine.parse_init_info(init))
    rep = _report(tmp_path, reports.init_step("s2"))
    assert rep["ok"] is False and "dense-load path: tensor t.weight" in rep["error"], rep
    assert _state(engine) == before  # the engine keeps its previous init


class RecordingClient:
    """FAKE vLLM trainer client: records every call, answers nothing."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: self.calls.append(name)


class FakeOwners:
    """FAKE owners: records builds (a refused call must make none)."""

    def __init__(self) -> None:
        self.builds: list[tuple] = []

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        self.builds.append((version, attempt, retry))
        return {}


def test_trainer_init_refuses_bad_fields_before_calling_anything(tmp_path: Path) -> None:
    from vllm_dcr_plugin.transfer.trainer_engine import (
        DCRTrainerInitInfo,
        DCRTrainerWeightTransferEngine,
    )

    control = {"kind": "dir", "root": str(tmp_path / "control")}
    good = {
        "rank": 0,
        "control": control,
        "transport": control,
        "owners": FakeOwners(),
        "tensors": TABLE,
        "checkpoint_for": str(tmp_path / "v{version}"),
    }
    bad: dict[str, tuple[dict[str, Any], str]] = {
        "control kind": ({"control": {"kind": "spool", "root": "/x"}}, "control: store spec kind"),
        "control key": ({"control": {**control, "bucket": "b"}}, "control: unknown key"),
        "transport kind": ({"transport": {"kind": "ftp"}}, "transport: transport spec kind"),
        "relay without source": (
            {"transport": {"kind": "relay", "root": "tcp://127.0.0.1:1"}},
            "source: give the relay node's spool spec",
        ),
        "source kind": ({"source": {"kind": "relay", "root": "x"}}, "source: store spec kind"),
        "owners empty": ({"owners": ""}, "owners must name"),
        "owners not owners": ({"owners": 5}, "owners must be"),
        "tensors empty": ({"tensors": []}, "tensors must list"),
        "tensors dtype": ({"tensors": [["w", "float7", [1]]]}, "tensors[0]"),
        "checkpoint without {version}": ({"checkpoint_for": "/ckpt"}, "checkpoint_for must be"),
        "checkpoint other field": ({"checkpoint_for": "/c/{version}/{rank}"}, "checkpoint_for:"),
        "engine name": ({"engine_names": ["a/b"]}, "engine name must be"),
        "engine names two": ({"engine_names": ["a", "b"]}, "engine_names names the one"),
        "max_attempts 0": ({"max_attempts": 0}, "max_attempts must be >= 1"),
        "max_attempts text": ({"max_attempts": "x"}, "max_attempts must be an integer"),
        "ack timeout": ({"ack_timeout_s": -1}, "ack_timeout_s must be > 0"),
        "pipelined text": ({"pipelined": "yes"}, "pipelined must be a bool"),
        "dense without template": (
            {"dense_load_at_init": True, "checkpoint_for": None},
            "dense_load_at_init needs checkpoint_for",
        ),
        "launcher": ({"launcher": "relaunch"}, "launcher must be callable"),
    }
    for what, (change, says) in bad.items():
        client = RecordingClient()
        info = DCRTrainerInitInfo(**{**good, **change})
        with pytest.raises(ProtocolError, match="trainer_init: bad arguments: ") as e:
            DCRTrainerWeightTransferEngine.trainer_init(info, client=client)
        assert says in str(e.value), (what, says, str(e.value))
        assert client.calls == [], what
        assert not (tmp_path / "control").exists(), what  # no record written
    for clients, says in (({}, "client: an empty mapping"), ({"a/b": object()}, "engine name")):
        with pytest.raises(ProtocolError, match=says):
            DCRTrainerWeightTransferEngine.trainer_init(DCRTrainerInitInfo(**good), client=clients)


def test_send_weights_refuses_a_version_not_newer_than_committed(tmp_path: Path) -> None:
    from shared_codec.coordination.coordinator import Coordinator
    from vllm_dcr_plugin.transfer.trainer_engine import DCRTrainerWeightTransferEngine

    control = open_store({"kind": "dir", "root": str(tmp_path / "control")})
    log = CommitLog(control)
    log.commit(None, CommitRecord(version=0, base_version=0, baseline_id="b", attempt=0))
    for v in (1, 2, 3):
        log.commit(v - 1, CommitRecord(version=v, base_version=v - 1, baseline_id="b", attempt=0))
    owners = FakeOwners()
    coordinator = Coordinator(control, owners, [])  # type: ignore[arg-type]
    engine = DCRTrainerWeightTransferEngine(client=RecordingClient(), coordinator=coordinator)
    keys = sorted(control.list(""))
    for version, says in ((3, "newer than the committed version 3"), (-1, "version must be >=")):
        with pytest.raises(ProtocolError, match=f"send_weights: bad arguments: .*{says}"):
            engine.send_weights(version)
    with pytest.raises(ProtocolError, match="version must be an integer"):
        engine.send_weights(4.0)  # type: ignore[arg-type]
    assert owners.builds == [] and sorted(control.list("")) == keys


def test_an_update_beyond_the_next_version_is_refused_at_once(
    engine: DCRWeightTransferEngine, tmp_path: Path
) -> None:
    """An update whose version is not base_version + 1 (here 3 on base 0) is an ok:false report
    naming it, written at once (issue 29: nothing is ever published for it, and the fetch
    waited out its whole timeout); nothing changes."""
    import time

    engine.init_transfer_engine(engine.parse_init_info(_init(tmp_path, "gap")))
    assert _report(tmp_path, reports.init_step("gap"))["ok"]
    before = _state(engine)
    t0 = time.monotonic()
    engine.update_weights({**_UPDATE, "version": 3, "base_version": 0, "timeout_s": 60.0})
    assert time.monotonic() - t0 < 5.0  # not its 60 s timeout
    rep = _report(tmp_path, reports.update_step(3, 0))
    assert rep["ok"] is False and rep["error"].startswith("ProtocolError: update_weights: "), rep
    assert "version 3 must be base_version + 1 (1)" in rep["error"], rep
    assert _state(engine) == before


def test_send_weights_refuses_a_gap_naming_the_version(tmp_path: Path) -> None:
    """`send_weights(v)` with v beyond committed + 1 is a `ProtocolError` naming ``version``
    before any owner or engine is called (issue 29; it was a bare ValueError from the
    coordinator)."""
    from shared_codec.coordination.coordinator import Coordinator
    from vllm_dcr_plugin.transfer.trainer_engine import DCRTrainerWeightTransferEngine

    control = open_store({"kind": "dir", "root": str(tmp_path / "control")})
    CommitLog(control).commit(
        None, CommitRecord(version=0, base_version=0, baseline_id="b", attempt=0)
    )
    owners = FakeOwners()
    coordinator = Coordinator(control, owners, [])  # type: ignore[arg-type]
    engine = DCRTrainerWeightTransferEngine(client=RecordingClient(), coordinator=coordinator)
    keys = sorted(control.list(""))
    with pytest.raises(
        ProtocolError, match=r"send_weights: bad arguments: .*committed version \+ 1 \(1\), got 5"
    ):
        engine.send_weights(5)
    assert owners.builds == [] and sorted(control.list("")) == keys
