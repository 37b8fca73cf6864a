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

Multi-rank trainers: `trainer_init` and `send_weights` may run on every rank; rank 0 drives
everything and the other ranks return at once (the owners' collective work runs in the owner
service, which every trainer rank serves).

Limitations:
1. vLLM's clients return nothing and raise on HTTP errors only; results come back as reports in
   the control store (vllm_dcr_plugin.transfer.reports), so the control store must be reachable
   from trainer and workers alike.
2. `HTTPVLLMWeightSyncClient`'s timeout (300 s by default) bounds one apply; give the client a
   timeout above `ack_timeout_s`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from shared_codec.coordination.coordinator import (
    Coordinator,
    CoordinatorConfig,
    Owners,
    RefitResult,
)
from shared_codec.coordination.owners import RemoteOwners
from shared_codec.transport.spec import Role, TransportSpec
from vllm_dcr_plugin.arguments import arguments, integer, seconds
from vllm_dcr_plugin.staging import tensor_specs
from vllm_dcr_plugin.transfer import register_backends
from vllm_dcr_plugin.transfer.native import NativeEngine
from vllm_dcr_plugin.transfer.worker_engine import _name


@dataclass
class DCRTrainerInitInfo(TrainerInitInfo):
    """Trainer init info of backend ``dcr``.

    `control`: control store spec (``dir``/``s3``: commit and attempt records, worker reports);
    `transport`: where owners publish payloads (sink spec: ``dir``, ``s3`` or ``relay``);
    `source`: where the workers fetch them (default: `transport` when it is a store; a relay
    node's ``{"kind": "spool", ...}`` for a relay tree); `owners`: the owner service's ZeroMQ
    endpoint (or any `Owners` object); `tensors`: the canonical tensor table
    ``[[name, dtype, shape], ...]``; `checkpoint_for`: a path template with ``{version}`` naming
    a canonical checkpoint of each committed version (dense loads when an engine joins or is
    restored; without it a failed engine cannot be restored); `dense_load_at_init`: dense-load
    the committed version at init. The rest configures the coordinator
    (`CoordinatorConfig`) and the updates (`pipelined`, `verify`)."""

    backend: ClassVar[str] = "dcr"

    control: dict[str, Any] = field(default_factory=dict)
    transport: dict[str, Any] = field(default_factory=dict)
    owners: str | Owners = ""
    tensors: list = field(default_factory=list)
    source: dict[str, Any] | None = None
    checkpoint_for: str | None = None
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
        if info.checkpoint_for is not None:
            if not isinstance(info.checkpoint_for, str) or "{version}" not in info.checkpoint_for:
                raise ValueError("checkpoint_for must be a path template with '{version}'")
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
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.coordinator = coordinator
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
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False)
        info = init_info
        control_spec, transport, fetch_from, clients = _checked(info, client)
        control = control_spec.open_store()
        template = info.checkpoint_for

        def checkpoint_for(version: int) -> str:
            assert template is not None
            return template.format(version=version)

        engines = [
            NativeEngine(
                name,
                c,
                control=control,
                control_spec=control_spec,
                source=fetch_from,
                tensors=info.tensors,
                checkpoint_for=checkpoint_for if template else None,
                launcher=info.launcher,
                pipelined=info.pipelined,
                verify=info.verify,
                digests=info.record_digests,
            )
            for name, c in clients.items()
        ]
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
        dense = checkpoint_for(version) if info.dense_load_at_init and template else None
        for e in engines:
            e.initialize(version, dense)
        if current is None:
            coordinator.initialize()
        else:
            coordinator.resume()
        return cls(client=client, source=source, is_sender=True, coordinator=coordinator)

    # vLLM's base returns None; returning the result as well is harmless to its callers
    def send_weights(self, version: int | None = None) -> RefitResult | None:  # type: ignore[override]
        """Run one DCR transition to `version` (default: committed + 1) and return its result
        (rank 0; other ranks return None). Raises `RefitFailed` after the last attempt; the
        committed version then stays in force on every engine (see docs/protocol.md)."""
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
        self.last_result = self.coordinator.refit(version)
        return self.last_result

    def shutdown(self) -> None:
        owners = getattr(self.coordinator, "owners", None)
        if isinstance(owners, RemoteOwners):
            owners.close()


register_backends()
