"""The ``init_info`` and ``update_info`` of vLLM's weight-transfer backend ``dcr`` (worker side:
`DCRInitInfo`, `DCRUpdateInfo`) and their validation (`parse_init`, `parse_update`): a bad field
is a `ProtocolError` naming it (arguments.py), before anything is called."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from shared_codec.replica.client import is_checkpoint_url
from shared_codec.transport.spec import Role, TransportSpec
from vllm_dcr_plugin.arguments import (
    arguments,
    boolean,
    checkpoint,
    integer,
    name,
    payload_key,
    seconds,
    transport_spec,
)
from vllm_dcr_plugin.staging import tensor_specs


@dataclass
class DCRInitInfo(WeightTransferInitInfo):
    """``init_info`` of backend ``dcr`` (plain JSON values).

    `engine`: this engine's name in reports and commit records; `session`: a fresh token per
    init (reports of an earlier init are never mistaken for this one); `control`: the control
    store spec (``{"kind": "dir"|"s3", ...}``: commit records and reports); `source`: the payload
    source spec (``dir``/``s3`` store or a relay node's ``spool``) - both JSON objects on the
    wire, `TransportSpec` once `parse_init` checked them; `tensors`: the canonical
    tensor table ``[[name, dtype, shape], ...]``; `committed_version`: the version the weights
    hold now; `dense_path`: a canonical checkpoint of that version to dense-load first (a
    directory, or a replica's checkpoint URL, downloaded first: shared_codec/replica); `key`:
    hex of the payload authentication key (else the receiver's, ``DCR_PAYLOAD_KEY``: config.py);
    `digest`: report the weights' digest after init."""

    engine: str = ""
    session: str = ""
    control: TransportSpec | dict[str, Any] = field(default_factory=dict)
    source: TransportSpec | dict[str, Any] = field(default_factory=dict)
    tensors: list = field(default_factory=list)
    committed_version: int = 0
    dense_path: str | None = None
    key: str | None = None
    digest: bool = False


@dataclass
class DCRUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of backend ``dcr``: one attempt. `pipelined`: apply each payload as it
    arrives (else fetch all, then apply); `overwrite_only`: reject XOR items (retries);
    `verify`: post-apply comparison of the touched elements; `digest`: report the weights'
    digest after apply (and check it again at finish); `timeout_s`: the fetch deadline;
    `draft`: the engine's speculative draft is refit from this attempt too (needed exactly when
    the engine runs one: the base part's finish then waits for the draft part)."""

    version: int = 0
    base_version: int = 0
    attempt: int = 0
    pipelined: bool = True
    overwrite_only: bool = False
    verify: bool = False
    digest: bool = False
    timeout_s: float = 600.0
    draft: bool = False


@dataclass
class _Invalid:
    """Info that did not parse: carried to the call so that it can report the error."""

    error: str
    raw: Any


_INIT_FIELDS = set(DCRInitInfo.__dataclass_fields__)
_UPDATE_FIELDS = set(DCRUpdateInfo.__dataclass_fields__)


def _known_fields(d: Any, what: str, fields: set[str]) -> dict[str, Any]:
    """`d` when it is a JSON object with only `fields` as keys."""
    if not isinstance(d, dict):
        raise TypeError(f"{what} must be a JSON object, got {type(d).__name__}")
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"unknown {what} field(s) {sorted(unknown)}")
    return d


def parse_init(d: Any) -> DCRInitInfo:
    """Validated `DCRInitInfo` from a plain dict; `ProtocolError` naming the bad field."""
    with arguments("init_weight_transfer_engine"):
        info = DCRInitInfo(**_known_fields(d, "init_info", _INIT_FIELDS))
        info.engine = name(info.engine, "engine")
        info.session = name(info.session, "session")
        info.control = transport_spec(info.control, "control", Role.STORE)
        info.source = transport_spec(info.source, "source", Role.SOURCE)
        tensor_specs(info.tensors)
        info.committed_version = integer(info.committed_version, "committed_version")
        if info.dense_path is not None and not is_checkpoint_url(info.dense_path):
            info.dense_path = checkpoint(info.dense_path, "dense_path")
        if info.key is not None:
            payload_key(info.key, "key")
        info.digest = boolean(info.digest, "digest")
    return info


def parse_update(d: Any) -> DCRUpdateInfo:
    """Validated `DCRUpdateInfo` from a plain dict; `ProtocolError` naming the bad field."""
    with arguments("update_weights"):
        info = DCRUpdateInfo(**_known_fields(d, "update_info", _UPDATE_FIELDS))
        info.version = integer(info.version, "version")
        info.base_version = integer(info.base_version, "base_version")
        info.attempt = integer(info.attempt, "attempt")
        for flag in ("pipelined", "overwrite_only", "verify", "digest", "draft"):
            setattr(info, flag, boolean(getattr(info, flag), flag))
        info.timeout_s = seconds(info.timeout_s, "timeout_s")
        if info.version <= info.base_version:
            raise ValueError(f"version {info.version} must be > base_version {info.base_version}")
        if info.version != info.base_version + 1:
            raise ValueError(
                f"version {info.version} must be base_version + 1 ({info.base_version + 1}): "
                "versions are consecutive, and a later one would never be published"
            )
    return info
