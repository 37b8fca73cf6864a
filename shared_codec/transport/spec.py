"""`TransportSpec`: the one typed name of a transport, parsed and checked in one place.

A spec says where payloads go (a sink), where a rollout node reads them (a source), or which
object store holds records (a store). It crosses processes as a plain JSON object (RPC
arguments, CLI flags, config files) and is parsed back into a `TransportSpec` wherever it
arrives, with `TransportSpec.parse`; everything downstream takes the typed spec. The kind
registry (`KINDS`, `register_kind`) says, per ``"kind"``, which fields it takes, which roles it
can play and how it is opened:

- ``{"kind": "dir", "root": PATH}``: a local or shared directory (store, sink, source).
- ``{"kind": "s3", "bucket": B, "endpoint_url": URL, "prefix": P, "region": R}``: any
  S3-compatible store (store, sink, source); credentials come from the usual boto3 sources.
  ``dir`` and ``s3`` may add ``"bandwidth_bytes_per_s"`` (a `ThrottledStore`, benchmarks).
- ``{"kind": "relay", "root": ADDRESS, "timeout_s": 60, "window": 16}`` plus, for CURVE,
  ``"public"``, ``"secret"`` (this sender's key pair) and ``"root_public"`` (Z85 strings):
  owners and the coordinator send to a relay tree's root (sink only).
- ``{"kind": "spool", "root": DIR}``: a relay node's spool on the rollout node (source only).

Errors: `parse` raises ValueError (TypeError for a field of the wrong type) whose message
starts with the name the caller gave the argument (``what``), before any I/O; the RPC boundaries turn them into
`ProtocolError` (vllm_dcr_plugin.arguments).

Limitations:
1. A kind's fields are fields of `TransportSpec` itself (typed, defaulting to None); a new kind
   that needs a new field adds it here with a default.
2. Secrets in a relay spec travel wherever the spec does; keep specs with CURVE secret keys
   on the trusted control network.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared_codec.transport.base import ObjectStore, PayloadSink, PayloadSource


class Role(StrEnum):
    """What a spec is used as: an object store for records, a payload sink, a payload source."""

    STORE = "store"
    SINK = "sink"
    SOURCE = "source"


@dataclass(frozen=True, slots=True, kw_only=True)
class Kind:
    """One registered transport kind: the fields it requires and accepts, the roles it plays,
    and how each role opens (functions of the spec; None for a role it does not play)."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    store: Callable[[TransportSpec], ObjectStore] | None = None
    sink: Callable[[TransportSpec, int, int, int | None], PayloadSink] | None = None
    source: Callable[[TransportSpec, bytes | None], PayloadSource] | None = None
    forget: Callable[[TransportSpec, int, float], int] | None = None

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(r for r in Role if getattr(self, r.value) is not None)


_STR_FIELDS = frozenset(
    ("root", "bucket", "endpoint_url", "prefix", "region", "public", "secret", "root_public")
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportSpec:
    """A parsed, checked transport spec (module docstring). Fields a kind does not take are
    None; `to_dict` gives back exactly the fields that were set."""

    kind: str
    root: str | None = None
    bucket: str | None = None
    endpoint_url: str | None = None
    prefix: str | None = None
    region: str | None = None
    bandwidth_bytes_per_s: float | None = None
    timeout_s: float | None = None
    window: int | None = None
    public: str | None = None
    secret: str | None = None
    root_public: str | None = None

    @classmethod
    def parse(
        cls,
        v: Any,
        *,
        role: Role | tuple[Role, ...] | None = None,
        what: str = "transport",
    ) -> TransportSpec:
        """`v` (a `TransportSpec`, a mapping, or its JSON text) as a checked spec whose kind
        plays `role` (one of several; None: any). Refuses an unknown kind or key, a missing
        required field and a field of the wrong type, naming `what`."""
        roles = (role,) if isinstance(role, Role) else tuple(role or Role)
        noun = "store" if Role.SINK not in roles else "transport"
        kinds = sorted(k.name for k in KINDS.values() if set(roles) & set(k.roles))
        if isinstance(v, TransportSpec):
            raw: Any = v.to_dict()
        elif isinstance(v, str):
            try:
                raw = json.loads(v)
            except ValueError as e:
                raise ValueError(
                    f"{what} is not valid JSON (a {noun} spec is a JSON object; not JSON: {e})"
                ) from None
        else:
            raw = v
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"{what} must be a {noun} spec (a JSON object), got {type(raw).__name__}"
            )
        name = raw.get("kind")
        if name not in kinds:
            raise ValueError(f"{what}: {noun} spec kind must be one of {kinds}, got {name!r}")
        kind = KINDS[name]
        for key in kind.required:
            if not isinstance(raw.get(key), str) or not raw[key]:
                raise ValueError(
                    f"{what}: a {name!r} {noun} spec needs {key!r} (a non-empty string)"
                )
        given = {k for k, value in raw.items() if value is not None}  # null: not given
        unknown = given - {"kind", *kind.required, *kind.optional}
        if unknown:
            raise ValueError(
                f"{what}: unknown key(s) {sorted(map(str, unknown))} in a {name!r} spec"
            )
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key == "kind" or value is None:
                continue
            values[key] = _field(key, value, what)
        return cls(kind=name, **values)

    def to_dict(self) -> dict[str, Any]:
        """The plain JSON object of this spec (the fields that are set)."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "kind" and value is not None:
                out[f.name] = value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def plays(self, role: Role) -> bool:
        return role in KINDS[self.kind].roles

    # -- opening ------------------------------------------------------------------------------
    def _opener(self, role: Role) -> Any:
        fn = getattr(KINDS[self.kind], role.value)
        if fn is None:
            raise ValueError(f"a {self.kind!r} spec cannot be used as a {role.value}")
        return fn

    def open_store(self) -> ObjectStore:
        """The object store this spec names (kinds dir, s3)."""
        return self._opener(Role.STORE)(self)  # type: ignore[no-any-return]

    def open_sink(self, *, version: int, attempt: int, owner: int | None = None) -> PayloadSink:
        """The sink of (`version`, `attempt`) for `owner` (None: the coordinator, which only
        seals or abandons)."""
        return self._opener(Role.SINK)(self, version, attempt, owner)  # type: ignore[no-any-return]

    def open_source(self, *, key: bytes | None = None) -> PayloadSource:
        """A rollout node's source. `key`: the payload authentication key, when configured
        (object stores verify digests on fetch; spooled payloads are verified when staged)."""
        return self._opener(Role.SOURCE)(self, key)  # type: ignore[no-any-return]

    def forget(self, before_version: int, timeout_s: float = 10.0) -> int:
        """Retention: remove every payload, manifest and abandon notice of versions below
        `before_version`. Returns the number removed (object store: objects; relay tree: the
        root's spool files - the root forwards the message to every node, best effort, and a
        node that missed one catches up with the next)."""
        fn = KINDS[self.kind].forget
        if fn is None:
            raise ValueError(f"a {self.kind!r} spec has no retention (it is not a sink)")
        return fn(self, int(before_version), float(timeout_s))


def _field(key: str, value: Any, what: str) -> Any:
    if key in _STR_FIELDS:
        if not isinstance(value, str):
            raise TypeError(f"{what}.{key} must be a string, got {type(value).__name__}")
        return value
    if key == "window":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}.window must be an integer >= 1, got {value!r:.40}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what}.{key} must be a number, got {type(value).__name__}")
    if key == "bandwidth_bytes_per_s" and value == 0:
        return None  # 0: unthrottled
    if not value > 0:  # also NaN
        raise ValueError(f"{what}.{key} must be > 0, got {value!r}")
    return float(value)


# -- the kinds ---------------------------------------------------------------------------------
def _object_store(spec: TransportSpec) -> ObjectStore:
    from shared_codec.transport.store import DirectoryStore, S3Store, ThrottledStore

    store: ObjectStore
    if spec.kind == "dir":
        assert spec.root is not None
        store = DirectoryStore(spec.root)
    else:
        assert spec.bucket is not None
        store = S3Store(
            spec.bucket,
            endpoint_url=spec.endpoint_url,
            prefix=spec.prefix or "",
            region=spec.region or "us-east-1",
        )
    if spec.bandwidth_bytes_per_s:
        store = ThrottledStore(store, spec.bandwidth_bytes_per_s)
    return store


def _object_sink(spec: TransportSpec, version: int, attempt: int, owner: int | None) -> Any:
    from shared_codec.transport.objects import ObjectSink

    return ObjectSink(_object_store(spec), version=version, attempt=attempt, owner=owner)


def _object_source(spec: TransportSpec, key: bytes | None) -> Any:
    from shared_codec.transport.objects import ObjectFetcher

    return ObjectFetcher(_object_store(spec), key=key)


def _object_forget(spec: TransportSpec, before_version: int, timeout_s: float) -> int:
    from shared_codec.transport.objects import forget

    return forget(_object_store(spec), before_version)


def _relay_sink(spec: TransportSpec, version: int, attempt: int, owner: int | None) -> Any:
    from shared_codec.transport.relay.sender import RelaySink

    return RelaySink(spec, version=version, attempt=attempt, owner=owner)


def _relay_forget(spec: TransportSpec, before_version: int, timeout_s: float) -> int:
    from shared_codec.transport.relay.sender import sender_for

    sender = sender_for(spec, timeout_s)
    try:
        return sender.forget(before_version, timeout_s).removed
    finally:
        sender.close()


def _spool_source(spec: TransportSpec, key: bytes | None) -> Any:
    from shared_codec.transport.relay.spool import SpoolSource

    assert spec.root is not None
    return SpoolSource(spec.root)


#: the registered kinds by name (`register_kind` adds one)
KINDS: dict[str, Kind] = {}


def register_kind(kind: Kind) -> None:
    """Add (or replace) a transport kind; its fields must be `TransportSpec` fields."""
    names = {f.name for f in fields(TransportSpec)} - {"kind"}
    extra = set(kind.required) | set(kind.optional)
    if not extra <= names:
        raise ValueError(f"kind {kind.name!r}: not TransportSpec fields: {sorted(extra - names)}")
    KINDS[kind.name] = kind


_THROTTLE = ("bandwidth_bytes_per_s",)
for _kind in (
    Kind(
        name="dir",
        required=("root",),
        optional=_THROTTLE,
        store=_object_store,
        sink=_object_sink,
        source=_object_source,
        forget=_object_forget,
    ),
    Kind(
        name="s3",
        required=("bucket",),
        optional=("endpoint_url", "prefix", "region", *_THROTTLE),
        store=_object_store,
        sink=_object_sink,
        source=_object_source,
        forget=_object_forget,
    ),
    Kind(
        name="relay",
        required=("root",),
        optional=("timeout_s", "window", "public", "secret", "root_public"),
        sink=_relay_sink,
        forget=_relay_forget,
    ),
    Kind(name="spool", required=("root",), source=_spool_source),
):
    register_kind(_kind)


# -- one-call helpers (parse, then open) -------------------------------------------------------
def open_store(spec: Any, what: str = "store") -> ObjectStore:
    """The object store `spec` names (a `TransportSpec`, a mapping or its JSON text)."""
    return TransportSpec.parse(spec, role=Role.STORE, what=what).open_store()


def open_sink(spec: Any, *, version: int, attempt: int, owner: int | None = None) -> PayloadSink:
    """The sink of (`version`, `attempt`) for `owner` on the transport `spec` names."""
    parsed = TransportSpec.parse(spec, role=Role.SINK)
    return parsed.open_sink(version=version, attempt=attempt, owner=owner)


def open_source(spec: Any, *, key: bytes | None = None) -> PayloadSource:
    """A rollout node's source on the transport `spec` names."""
    return TransportSpec.parse(spec, role=Role.SOURCE, what="source").open_source(key=key)


def forget(spec: Any, before_version: int, timeout_s: float = 10.0) -> int:
    """Retention on the transport `spec` names (`TransportSpec.forget`)."""
    return TransportSpec.parse(spec, role=Role.SINK).forget(before_version, timeout_s)
