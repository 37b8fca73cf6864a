"""The receiver's configuration (vllm_dcr_plugin/config.py) and its optional observer
(vllm_dcr_plugin/observer.py), pure unit tests with a FAKE loader model: the environment is read
in one place into a frozen config, malformed values are refused naming their variable, and a
receiver takes its settings from the config it is given (placement, payload key, observer)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shared_codec.buckets import encode_items
from shared_codec.errors import ProtocolError
from shared_codec.format import PayloadMeta
from shared_codec.records import Kind, diff_tensors
from tests.unit.vllm.test_receiver_units import CANON, FakeLoaderModel, _canonical, _dense
from vllm_dcr_plugin.config import ReceiverConfig
from vllm_dcr_plugin.observer import Call, load_observer
from vllm_dcr_plugin.placement import PlacementMode
from vllm_dcr_plugin.receiver import Receiver

TABLE = [[n, "bfloat16", list(s)] for n, (s, _) in CANON.items()]


def test_from_env_reads_every_variable() -> None:
    assert ReceiverConfig.from_env({}) == ReceiverConfig()
    config = ReceiverConfig.from_env(
        {
            "DCR_PLACEMENT": "loader",
            "DCR_PAYLOAD_KEY": "ab" * 4,
            "DCR_METRICS_PORT": "9100",
            "DCR_METRICS_ADDR": "0.0.0.0",
            "DCR_RECEIVER_OBSERVER": "tests.unit.vllm.test_config:Recorder",
        }
    )
    assert config == ReceiverConfig(
        placement=PlacementMode.LOADER,
        payload_key=b"\xab" * 4,
        metrics_port=9100,
        metrics_addr="0.0.0.0",
        observer="tests.unit.vllm.test_config:Recorder",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.placement = PlacementMode.PLAN  # type: ignore[misc]


@pytest.mark.parametrize(
    "env, error, says",
    [
        ({"DCR_PLACEMENT": "fast"}, ValueError, "placement mode 'fast' (DCR_PLACEMENT)"),
        ({"DCR_PAYLOAD_KEY": "xyz"}, ProtocolError, "DCR_PAYLOAD_KEY must be hex"),
        ({"DCR_PAYLOAD_KEY": "ab" * 65}, ProtocolError, "at most 64"),
        ({"DCR_METRICS_PORT": "http"}, ValueError, "invalid literal"),
        ({"DCR_METRICS_PORT": "70000"}, ValueError, "metrics_port must be a TCP port"),
        ({"DCR_RECEIVER_OBSERVER": "no colon"}, ValueError, "package.module:attr"),
    ],
)
def test_malformed_values_are_refused(env, error, says) -> None:
    with pytest.raises(error) as e:
        ReceiverConfig.from_env(env)
    assert says in str(e.value)


def test_receiver_takes_its_settings_from_the_config(monkeypatch) -> None:
    monkeypatch.setenv("DCR_PLACEMENT", "plan")  # the given config wins over the environment
    config = ReceiverConfig(placement=PlacementMode.LOADER, payload_key=b"k" * 16)
    rx = Receiver(FakeLoaderModel(), rank={"rank": 0}, config=config)
    assert rx.placement == "loader" and rx.placement is PlacementMode.LOADER
    assert rx.staging.key == b"k" * 16 and rx.config is config
    assert (
        Receiver(FakeLoaderModel(), rank={"rank": 0}, placement="plan", config=config).placement
        == "plan"
    )
    assert rx.set_placement("plan") == {"rank": 0, "previous": "loader", "placement": "plan"}


class Recorder:
    """FAKE observer (a factory by path): records every call it is told about."""

    seen: list[tuple] = []

    def begin(self, rank: int, call: Call, role: str = "base") -> Recorder:
        self.seen.append(("begin", rank, str(call)))
        return self

    def before_payload(self, index: int, data: bytes) -> None:
        self.seen.append(("payload", index))

    def before_item(self, item) -> None:
        self.seen.append(("item", item.name))
        if item.name == "c.weight":
            raise RuntimeError("refused by the observer")


def test_observer_named_by_the_config_sees_each_item_and_can_fail_the_apply() -> None:
    Recorder.seen = []
    model = FakeLoaderModel()
    v0, v1 = _canonical(0), _canonical(1)
    _dense(model, v0)
    config = ReceiverConfig(observer="tests.unit.vllm.test_config:Recorder")
    rx = Receiver(model, rank={"rank": 3}, config=config)
    assert isinstance(rx.observer, Recorder)
    rx.prewarm(TABLE)
    items = [
        diff_tensors(n, v0[n], v1[n], owner=0, kind=Kind.OVERWRITE)
        for n in ("d.weight", "t.weight", "c.weight")
    ]
    meta = PayloadMeta(version=1, base_version=0, attempt=0, owner=0, sequence=0)
    assert rx.stage(encode_items(items, meta))["staged"]
    ack = rx.apply(0)
    assert Recorder.seen == [
        ("begin", 3, "apply"),
        ("item", "d.weight"),
        ("item", "t.weight"),
        ("item", "c.weight"),
    ]
    # raised before c.weight was pulled: the two items before it are complete, none partial
    assert not ack["ok"] and ack["error"] == "RuntimeError: refused by the observer"
    assert ack["items"] == 2 and ack["partial_item"] is None
    assert rx.status()["state"] == "dirty"


def test_load_observer_refuses_what_it_cannot_make(tmp_path: Path) -> None:
    assert load_observer(None) is None
    with pytest.raises(ValueError, match="No module named"):
        load_observer("tests.vllm.no_such_module:Observer")
    with pytest.raises(ValueError, match="has no attribute"):
        load_observer("tests.unit.vllm.test_config:Nothing")
    with pytest.raises(ValueError, match="not callable"):
        load_observer("tests.unit.vllm.test_config:TABLE.__doc__")
    with pytest.raises(ValueError, match="has no begin"):
        load_observer("tests.unit.vllm.test_config:_no_begin")


def _no_begin() -> object:
    return object()
