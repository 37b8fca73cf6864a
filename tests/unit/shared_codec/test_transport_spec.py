"""`TransportSpec` (shared_codec/transport/spec.py): one typed spec with a kind registry,
parsed where it arrives. Pure unit test (a local directory store; no network)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared_codec.transport.spec import KINDS, Kind, Role, TransportSpec, register_kind
from shared_codec.transport.store import DirectoryStore, ThrottledStore

SPECS = [
    {"kind": "dir", "root": "/data/x"},
    {"kind": "dir", "root": "/data/x", "bandwidth_bytes_per_s": 4e6},
    {"kind": "s3", "bucket": "b", "endpoint_url": "http://127.0.0.1:9000", "prefix": "p"},
    {"kind": "relay", "root": "tcp://127.0.0.1:5555", "timeout_s": 20.0, "window": 4},
    {"kind": "spool", "root": "/spool"},
]


@pytest.mark.parametrize("raw", SPECS, ids=[s["kind"] for s in SPECS])
def test_round_trip_plain_and_json(raw: dict) -> None:
    spec = TransportSpec.parse(raw)
    assert spec.to_dict() == raw
    assert TransportSpec.parse(spec.to_json()) == spec == TransportSpec.parse(spec)
    assert json.loads(spec.to_json()) == raw


def test_roles_of_the_kinds() -> None:
    roles = {name: set(kind.roles) for name, kind in KINDS.items()}
    assert roles == {
        "dir": {Role.STORE, Role.SINK, Role.SOURCE},
        "s3": {Role.STORE, Role.SINK, Role.SOURCE},
        "relay": {Role.SINK},
        "spool": {Role.SOURCE},
    }
    relay = TransportSpec.parse(SPECS[3])
    assert relay.plays(Role.SINK) and not relay.plays(Role.SOURCE)
    with pytest.raises(ValueError, match="cannot be used as a source"):
        relay.open_source()
    with pytest.raises(ValueError, match="has no retention"):
        TransportSpec.parse(SPECS[4]).forget(3)


@pytest.mark.parametrize(
    "raw,role,says",
    [
        ({"kind": "spool", "root": "/s"}, Role.SINK, "control: transport spec kind must be one of"),
        ({"kind": "relay", "root": "x"}, Role.STORE, "control: store spec kind must be one of"),
        ({"kind": "dir"}, Role.STORE, "control: a 'dir' store spec needs 'root'"),
        ({"kind": "dir", "root": ""}, Role.STORE, "needs 'root' (a non-empty string)"),
        ({"kind": "s3"}, Role.SOURCE, "control: a 's3' store spec needs 'bucket'"),
        ({"kind": "dir", "root": "/x", "rot": 1}, None, "unknown key(s) ['rot'] in a 'dir' spec"),
        ({"kind": "s3", "bucket": "b", "prefix": 3}, None, "control.prefix must be a string"),
        ({"kind": "relay", "root": "x", "window": 0}, None, "control.window must be an integer"),
        ({"kind": "relay", "root": "x", "timeout_s": -1}, None, "control.timeout_s must be > 0"),
        ({"kind": "relay", "root": "x", "timeout_s": True}, None, "must be a number"),
        ("{", None, "control is not valid JSON"),
        ("[1]", None, "control must be a"),
        (None, None, "control must be a"),
    ],
)
def test_bad_specs_are_refused_naming_the_argument(raw, role, says) -> None:
    with pytest.raises((ValueError, TypeError)) as e:
        TransportSpec.parse(raw, role=role, what="control")
    assert says in str(e.value), str(e.value)


def test_null_fields_count_as_absent_and_zero_bandwidth_is_unthrottled() -> None:
    spec = TransportSpec.parse({"kind": "dir", "root": "/x", "bucket": None})
    assert spec.to_dict() == {"kind": "dir", "root": "/x"}
    assert TransportSpec.parse({"kind": "dir", "root": "/x", "bandwidth_bytes_per_s": 0}) == spec


def test_opening_through_the_registry(tmp_path: Path) -> None:
    plain = TransportSpec.parse({"kind": "dir", "root": str(tmp_path / "s")}).open_store()
    assert isinstance(plain, DirectoryStore)
    slow = TransportSpec.parse(
        {"kind": "dir", "root": str(tmp_path / "s"), "bandwidth_bytes_per_s": 1e9}
    ).open_store()
    assert isinstance(slow, ThrottledStore)
    spec = TransportSpec.parse({"kind": "dir", "root": str(tmp_path / "p")})
    with spec.open_sink(version=1, attempt=0) as sink:
        sink.abandon("test")
    with pytest.raises(Exception, match="abandoned by the coordinator: test"):
        spec.open_source().sealed(1, 0, timeout_s=2)


def test_register_kind_takes_only_spec_fields() -> None:
    with pytest.raises(ValueError, match=r"not TransportSpec fields: \['host'\]"):
        register_kind(Kind(name="ftp", required=("host",)))
    assert "ftp" not in KINDS
