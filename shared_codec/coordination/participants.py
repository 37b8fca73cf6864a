"""The coordinator's participants: the owner group and the receivers (engines, and the rollout
cluster's replica), as the protocols the coordinator calls (coordinator.py has the order).

A receiver whose ``required`` attribute is true (`required`) takes part in every transition:
the coordinator never evicts it (`CoordinatorConfig.evict`), and restores it before the others,
which may dense-load from it (the replica, shared_codec/replica/receiver.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from shared_codec.coordination.protocol import BuildReply, EngineAck, VerifyReply


class Owners(Protocol):
    """The owner group (every trainer rank). Implementations: `megatron_dcr_hooks.service`."""

    def build(self, version: int, attempt: int, retry: bool) -> BuildReply | Mapping[str, Any]:
        """Construct and publish attempt `attempt` of `version` (payloads, then manifest):
        the `BuildReply` (or its plain object, checked by the coordinator)."""
        ...

    def verify(self, version: int) -> VerifyReply | Mapping[str, Any] | None:
        """The candidate guard: raise `CandidateChanged` if the trainer's weights moved since
        `version` was built (called before the compare-and-set). May return the `VerifyReply`
        (the owner service: its ``guard``, kept as the attempt's `AttemptResult.guard`)."""
        ...

    def commit(self, version: int) -> None: ...

    def abort(self, version: int, attempt: int) -> None: ...


class Engine(Protocol):
    """One rollout engine (all its ranks). Implementation: `handle.EngineHandle` over a channel
    (`engines.HttpEngine`, `RayEngine`, `InProcessEngine`, the native backend's `NativeEngine`)."""

    name: str

    def apply(self, version: int, attempt: int, timeout_s: float) -> EngineAck | Mapping[str, Any]:
        """Deliver (fetch or receive, then stage) and apply the attempt: the `EngineAck` (or
        its plain object, checked by the coordinator)."""
        ...

    def commit(self, version: int) -> None: ...

    def abort(self, attempt: int) -> None: ...

    def digest(self) -> str: ...

    def restore(self, version: int) -> None:
        """Bring this engine (restarting it if it died) to committed `version` by a dense
        load, ready to take the next attempt."""
        ...


def required(engine: Engine) -> bool:
    """A receiver every transition needs (the replica: ``required = True``)."""
    return bool(getattr(engine, "required", False))


__all__ = ["Engine", "Owners", "required"]
