"""The trainer side of vLLM's weight-transfer backend ``dcr``: `DCRTrainerWeightTransferEngine`.

An orchestrator written against vLLM's trainer API switches to DCR by name::

    engine = WeightTransferTrainerFactory.trainer_init(
        DCRTrainerInitInfo(rank=0, control=..., transport=..., owners=..., tensors=...),
        client=HTTPVLLMWeightSyncClient(url, timeout=900),   # or RayVLLMWeightSyncClient
    )
    ...after every optimizer step...
    engine.send_weights()        # one DCR transition, committed or RefitFailed

``send_weights`` runs DCR's coordinator (shared_codec.coordination): owners (the trainer job's
owner service) build and publish the attempt, every engine fetches and applies it, the commit
record is compare-and-set, owners advance their baselines; a failed attempt is fenced and retried
with overwrites. The engines are reached only through vLLM's client (`native.NativeEngine`),
mapping DCR's joint commit onto vLLM's four phases (docs/protocol.md, "Native weight transfer"):

- ``init_weight_transfer_engine``: prewarm (and a dense load of the committed version when the
  engine joins or is restored);
- ``start_weight_update`` + ``update_weights``: one attempt, fetched and applied; the ACK is the
  per-rank report the workers write into the control store;
- commit record: written by the coordinator after every engine ACKed ok;
- ``finish_weight_update(weight_version)``: the workers read the commit record: they commit when
  it names their attempt (vLLM then stamps ``weight_version``), and fence the attempt otherwise.

Membership (between transitions, rank 0): ``add_engine(name, client)`` builds the engine's
handle as `trainer_init` builds its clients' and joins it through the coordinator
(`Coordinator.join`): a dense load of the committed version from `checkpoint_for` (needed: an
engine joining without it is refused before it is called), a prewarm, the next version's reserved
attempts fenced; it receives every transition from the next one on. ``remove_engine(name)``
takes one out (`Coordinator.leave`: it keeps the weights it holds, nothing more is sent to it).
Each commit record's ``receivers`` lists that version's members. An engine the coordinator
evicted during a transition (dead: its restore failed, the version committed without it) is
tried again before each later `send_weights` and joins at the committed version (a dense load
from ``checkpoint_for``) once it answers: a framework that restarts a dead server needs no call.

Multi-rank trainers: `trainer_init`, `send_weights`, `add_engine` and `remove_engine` may run on
every rank; rank 0 drives everything and the other ranks return at once (the owners' collective
work runs in the owner service, which every trainer rank serves).

Limitations:
1. vLLM's clients return nothing and raise on HTTP errors only; results come back as reports in
   the control store (vllm_dcr_plugin.transfer.reports), so the control store must be reachable
   from trainer and workers alike.
2. `HTTPVLLMWeightSyncClient`'s timeout (300 s by default) bounds one apply; give the client a
   timeout above `ack_timeout_s`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from shared_codec.coordination.commit import CommitRecord
from shared_codec.coordination.coordinator import (
    Coordinator,
    CoordinatorConfig,
    Engine,
    Owners,
    RefitResult,
)
from shared_codec.coordination.owners import RemoteOwners
from shared_codec.transport.base import ObjectStore
from shared_codec.transport.spec import Role, TransportSpec
from vllm_dcr_plugin.arguments import arguments, integer, seconds
from vllm_dcr_plugin.arguments import name as _name
from vllm_dcr_plugin.staging import tensor_specs
from vllm_dcr_plugin.transfer import register_backends
from vllm_dcr_plugin.transfer.native import NativeEngine

log = logging.getLogger("dcr.trainer")


@dataclass
class DCRTrainerInitInfo(TrainerInitInfo):
    """Trainer init info of backend ``dcr``.

    `control`: control store spec (``dir``/``s3``: commit and attempt records, worker reports);
    `transport`: where owners publish payloads (sink spec: ``dir``, ``s3`` or ``relay``);
    `source`: where the workers fetch them (default: `transport` when it is a store; a relay
    node's ``{"kind": "spool", ...}`` for a relay tree); `owners`: the owner service's ZeroMQ
    endpoint (or any `Owners` object); `tensors`: the canonical tensor table
    ``[[name, dtype, shape], ...]``; `checkpoint_for`: a canonical checkpoint of each committed
    version, for dense loads when an engine joins (`add_engine`) or is restored (without it a
    failed engine cannot be restored and none can join): a path template with ``{version}``,
    or a callable version -> path, or version -> context manager yielding the path and holding
    it while the engines load it (the rollout cluster's replica:
    `ReplicaReceiver.checkpoints()`); `dense_load_at_init`: dense-load the committed version at
    init. The rest configures the coordinator (`CoordinatorConfig`) and the updates
    (`pipelined`, `verify`)."""

    backend: ClassVar[str] = "dcr"

    control: dict[str, Any] = field(default_factory=dict)
    transport: dict[str, Any] = field(default_factory=dict)
    owners: str | Owners = ""
    tensors: list = field(default_factory=list)
    source: dict[str, Any] | None = None
    checkpoint_for: str | Callable[[int], Any] | None = None
    dense_load_at_init: bool = False
    engine_names: list[str] | None = None
    max_attempts: int = 3
    ack_timeout_s: float = 600.0
    record_digests: bool = True
    pipelined: bool = True
    verify: bool = False
    launcher: Callable[[str], VLLMWeightSyncClient] | None = None


def _checked(
    info: DCRTrainerInitInfo, client: Any
) -> tuple[TransportSpec, TransportSpec, TransportSpec, dict[str, Any]]:
    """`trainer_init`'s arguments, checked before any engine is called or any record written:
    (control spec, transport spec, source spec, engine name -> client). `ProtocolError`
    naming the field otherwise."""
    with arguments("trainer_init"):
        control = TransportSpec.parse(info.control, role=Role.STORE, what="control")
        transport = TransportSpec.parse(info.transport, role=Role.SINK, what="transport")
        if info.source is None and not transport.plays(Role.SOURCE):
            raise ValueError("source: give the relay node's spool spec for a relay transport")
        source = TransportSpec.parse(
            transport if info.source is None else info.source, role=Role.SOURCE, what="source"
        )
        if not isinstance(info.owners, str):
            if info.owners is None or not callable(getattr(info.owners, "build", None)):
                raise TypeError("owners must be the owner service's endpoint or an Owners object")
        elif not info.owners:
            raise ValueError("owners must name the owner service's endpoint")
        if not tensor_specs(info.tensors):
            raise ValueError("tensors must list the canonical tensors, got an empty table")
        if info.checkpoint_for is not None and not callable(info.checkpoint_for):
            if not isinstance(info.checkpoint_for, str) or "{version}" not in info.checkpoint_for:
                raise ValueError(
                    "checkpoint_for must be a path template with '{version}' or a callable "
                    "(version -> path, or -> a context manager yielding the path)"
                )
            try:
                info.checkpoint_for.format(version=0)
            except (IndexError, KeyError, ValueError) as e:
                raise ValueError(
                    f"checkpoint_for: only {{version}} may be filled in: {e}"
                ) from None
        if isinstance(client, Mapping):
            if not client:
                raise ValueError("client: an empty mapping of engine name -> client")
            clients = dict(client)
        else:
            clients = {"engine0": client}
        if info.engine_names is not None:
            names = info.engine_names
            if isinstance(client, Mapping) or not isinstance(names, list) or len(names) != 1:
                raise ValueError("engine_names names the one client; use a mapping for several")
            clients = {names[0]: client}
        for name in clients:
            _name(name, "engine name")
        if integer(info.max_attempts, "max_attempts") < 1:
            raise ValueError(f"max_attempts must be >= 1, got {info.max_attempts}")
        seconds(info.ack_timeout_s, "ack_timeout_s")
        for flag in ("dense_load_at_init", "record_digests", "pipelined", "verify"):
            if not isinstance(getattr(info, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(info, flag)!r:.40}")
        if info.dense_load_at_init and info.checkpoint_for is None:
            raise ValueError("dense_load_at_init needs checkpoint_for")
        if info.launcher is not None and not callable(info.launcher):
            raise TypeError("launcher must be callable (engine name -> client) or None")
    return control, transport, source, clients


def _named_owners(info: DCRTrainerInitInfo, source: WeightSource | None) -> Any:
    """The owners that take `source`'s named tensors at every `send_weights` (None without a
    source). `ProtocolError` when a source comes with owners that cannot take it."""
    if source is None:
        return None
    with arguments("trainer_init"):
        take = getattr(info.owners, "take_weights", None)
        if not callable(take):
            raise TypeError(
                "source: a WeightSource needs owners that take named tensors (owners="
                "shared_codec.named.NamedTensorOwner on every rank), not "
                f"{type(info.owners).__name__}"
            )
    return info.owners


def _checkpoints(given: str | Callable[[int], Any] | None) -> Callable[[int], Any] | None:
    """`DCRTrainerInitInfo.checkpoint_for` (checked) as the handles take it: version -> path,
    or -> a context manager yielding the path (`EngineHandle.restore` holds it while loading)."""
    if given is None or callable(given):
        return given
    template = given

    def checkpoint_for(version: int) -> str:
        return template.format(version=version)

    return checkpoint_for


@dataclass(frozen=True, slots=True, kw_only=True)
class _EngineBuilder:
    """How `trainer_init` builds each engine's handle, kept for `add_engine`: every engine of
    one trainer engine shares the control store, the payload source, the tensor table, the
    checkpoints and the update settings."""

    control: ObjectStore
    control_spec: TransportSpec
    source: TransportSpec
    tensors: list
    checkpoint_for: Callable[[int], Any] | None
    launcher: Callable[[str], VLLMWeightSyncClient] | None
    pipelined: bool
    verify: bool
    digests: bool

    def __call__(self, name: str, client: VLLMWeightSyncClient) -> NativeEngine:
        return NativeEngine(
            name,
            client,
            control=self.control,
            control_spec=self.control_spec,
            source=self.source,
            tensors=self.tensors,
            checkpoint_for=self.checkpoint_for,
            launcher=self.launcher,
            pipelined=self.pipelined,
            verify=self.verify,
            digests=self.digests,
        )


class DCRTrainerWeightTransferEngine(TrainerWeightTransferEngine[DCRTrainerInitInfo]):
    """Trainer engine of backend ``dcr`` (see the module docstring)."""

    init_info_cls = DCRTrainerInitInfo

    def __init__(
        self,
        *,
        client: Any,
        source: WeightSource | None = None,
        is_sender: bool = True,
        coordinator: Coordinator | None = None,
        builder: _EngineBuilder | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.coordinator = coordinator
        self.builder = builder  # trainer_init's, for add_engine
        self.named: Any = None  # owners taking the source's named tensors (trainer_init)
        self.evicted: dict[str, Any] = {}  # engine name -> its client (rejoin, `_rejoin`)
        self.last_result: RefitResult | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: DCRTrainerInitInfo,
        *,
        client: Any,
        source: WeightSource | None = None,
    ) -> Self:
        """Rank 0: initialize every engine (prewarm, or dense load + prewarm) at the committed
        version and resume the coordinator (version 0 is committed on first use). `client`:
        one `VLLMWeightSyncClient`, or a mapping of engine name -> client for several
        engines. Other ranks: nothing."""
        named = _named_owners(init_info, source)
        if not init_info.is_sender:
            engine = cls(client=client, source=source, is_sender=False)
            engine.named = named
            return engine
        info = init_info
        control_spec, transport, fetch_from, clients = _checked(info, client)
        control = control_spec.open_store()
        build = _EngineBuilder(
            control=control,
            control_spec=control_spec,
            source=fetch_from,
            tensors=info.tensors,
            checkpoint_for=_checkpoints(info.checkpoint_for),
            launcher=info.launcher,
            pipelined=info.pipelined,
            verify=info.verify,
            digests=info.record_digests,
        )
        engines = [build(name, c) for name, c in clients.items()]
        owners = RemoteOwners(info.owners) if isinstance(info.owners, str) else info.owners
        coordinator = Coordinator(
            control,
            owners,
            engines,  # type: ignore[arg-type]
            CoordinatorConfig(
                max_attempts=info.max_attempts,
                ack_timeout_s=info.ack_timeout_s,
                record_digests=info.record_digests,
                pipeline=info.pipelined,
            ),
            transport=transport,
        )
        current = coordinator.commits.current()
        version = 0 if current is None else current.version
        got = None
        if info.dense_load_at_init and build.checkpoint_for is not None:
            got = build.checkpoint_for(version)
        held = got if isinstance(got, AbstractContextManager) else nullcontext(got)
        with held as dense:  # a replica's lease holds the version's files while they load
            for e in engines:
                e.initialize(version, None if dense is None else str(dense))
        if current is None:
            coordinator.initialize()
        else:
            coordinator.resume()
        engine = cls(
            client=client, source=source, is_sender=True, coordinator=coordinator, builder=build
        )
        engine.named = named
        return engine

    # vLLM's base returns None; returning the result as well is harmless to its callers
    def send_weights(self, version: int | None = None) -> RefitResult | None:  # type: ignore[override]
        """Run one DCR transition to `version` (default: committed + 1) and return its result
        (rank 0; other ranks return None). Raises `RefitFailed` after the last attempt; the
        committed version then stays in force on every engine (see docs/protocol.md).

        With a `source` (a `WeightSource` given to `trainer_init`), every rank first hands its
        stream to the owners (``owners.take_weights(source)``, a collective: the named-tensor
        owner, shared_codec.named); a refused stream raises its `ArgumentError` on every
        rank before any engine is called."""
        if self.named is not None:
            assert self.source is not None
            self.named.take_weights(self.source)
        if not self.is_sender:
            return None
        assert self.coordinator is not None
        if version is not None:
            committed = self.coordinator.committed_version()
            with arguments("send_weights"):
                if integer(version, "version") <= committed:
                    raise ValueError(
                        f"version must be newer than the committed version {committed}, "
                        f"got {version}"
                    )
                if version != committed + 1:
                    raise ValueError(
                        f"version must be the committed version + 1 ({committed + 1}), got "
                        f"{version}: versions are consecutive"
                    )
        self._rejoin()  # after the argument checks: a refused call changes nothing
        before = {e.name: e for e in self.coordinator.engines}
        try:
            self.last_result = self.coordinator.refit(version)
        finally:  # engines the coordinator evicted (their restore failed) may come back
            for name, e in before.items():
                if name not in self.coordinator.members:
                    self.evicted[name] = e.client  # type: ignore[attr-defined]
        return self.last_result

    def _rejoin(self) -> None:
        """Rank 0, before a transition: each engine the coordinator evicted (dead, its
        restore failed) joins again (`Coordinator.join`: a dense load of the committed
        version from ``checkpoint_for``, a prewarm) once it answers; one that still does not
        stays out, logged, and is tried again at the next `send_weights`."""
        if self.builder is None or self.builder.checkpoint_for is None:
            return
        assert self.coordinator is not None
        for name, client in list(self.evicted.items()):
            if name in self.coordinator.members:
                del self.evicted[name]
                continue
            try:
                self.coordinator.join(self.builder(name, client))
            except Exception as e:  # still down: the transition goes on without it
                log.warning("dcr: evicted engine %s did not rejoin: %s", name, e)
                continue
            del self.evicted[name]
            log.info("dcr: evicted engine %s rejoined at the committed version", name)

    # -- membership (between transitions) ------------------------------------------------------
    @property
    def members(self) -> tuple[str, ...]:
        """The engines the next `send_weights` refits (rank 0; other ranks: ())."""
        return () if self.coordinator is None else self.coordinator.members

    def add_engine(self, name: str, client: VLLMWeightSyncClient) -> CommitRecord | None:
        """Rank 0, between transitions: build engine `name`'s handle over `client` as
        `trainer_init` builds its clients' and join it (`Coordinator.join`): a dense load of
        the committed version from ``checkpoint_for`` and a prewarm (vLLM's
        ``init_weight_transfer_engine``), then the next version's reserved attempts fenced; the
        next `send_weights` includes it. Returns the commit record of the version it holds.
        Raises `ProtocolError` (``add_engine: bad arguments: ...``) before the engine is called
        for a bad name, a name already a member, or a trainer engine without
        ``checkpoint_for``; a failed restore raises the engine's error and changes nothing.
        Other ranks: nothing, None."""
        if not self.is_sender:
            return None
        assert self.coordinator is not None
        with arguments("add_engine"):
            _name(name, "engine name")
            if client is None or isinstance(client, Mapping):
                raise TypeError("client must be one VLLMWeightSyncClient (one engine per call)")
            if self.builder is None:
                raise ValueError("engine: only a trainer engine made by trainer_init adds engines")
            if self.builder.checkpoint_for is None:
                raise ValueError(
                    "checkpoint_for: a joining engine is restored by a dense load of the "
                    "committed version; give DCRTrainerInitInfo.checkpoint_for"
                )
            if name in self.coordinator.members:
                raise ValueError(
                    f"engine name {name!r} is already a member "
                    f"(members: {list(self.coordinator.members)})"
                )
        return self.coordinator.join(self.builder(name, client))

    def remove_engine(self, name: str) -> Engine | None:
        """Rank 0, between transitions: take engine `name` out of the membership
        (`Coordinator.leave`: it keeps the weights it holds and is sent nothing more; the next
        commit record does not list it). Returns its handle. Raises `ProtocolError`
        (``remove_engine: bad arguments: ...``) for a name that is not a member. Other ranks:
        nothing, None."""
        if not self.is_sender:
            return None
        assert self.coordinator is not None
        self.evicted.pop(name, None)
        with arguments("remove_engine"):
            _name(name, "engine name")
            if name not in self.coordinator.members:
                raise ValueError(
                    f"engine name {name!r} is not a member "
                    f"(members: {list(self.coordinator.members)})"
                )
        return self.coordinator.leave(name)

    def shutdown(self) -> None:
        owners = getattr(self.coordinator, "owners", None)
        if isinstance(owners, RemoteOwners):
            owners.close()


register_backends()
