"""One engine handle over many channels: `EngineHandle` is the coordinator's `Engine` for one
rollout engine (all its ranks), whatever reaches it; a `Channel` is how it is reached.

The handle holds what every engine shares: the canonical tensor table it prewarms, where
committed checkpoints are (`checkpoint_for`, dense loads on restore), whether attempts are
applied pipelined and verified, the last ACK, and the restore sequence (restart when the
channel says the engine is down or out of step, then dense-load and prewarm, restarting once
more if the engine dies during the load). The channel carries the receiver contract (stage,
apply, ACK, commit, abort, digest, dense load + prewarm) to the engine's ranks and merges their
answers into one `EngineAck` by `EngineAck.merge`. Channels:

- over vLLM's ``collective_rpc`` and DCR's ``dcr_*`` RPCs (`rpc_channel.RpcChannel`): HTTP
  (``POST /collective_rpc`` of a ``vllm serve``), a Ray actor, an in-process ``LLM``
  (engines.py);
- over vLLM's native weight-transfer API with the ``dcr`` backend
  (`vllm_dcr_plugin.transfer.native.NativeChannel`).

A new kind of receiver is one more channel. Channel methods are named apart from the handle's
(``send_commit`` / ``commit``), so a class may be a handle over itself: `HttpEngine`,
`RayEngine` and `InProcessEngine` (engines.py) are the handle and its channel in one object,
built from the constructor arguments users already write.

Limitations:
1. A channel that cannot tell whether its engine is alive (the native one) reports nothing
   from `Channel.down`; its restore starts with the load, and restarts only when that fails.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from shared_codec.coordination.protocol import EngineAck, RankReply
from shared_codec.errors import DCRError, EngineUnreachable, ProtocolError


class Channel(Protocol):
    """How an `EngineHandle` reaches one engine's ranks. Every call raises `EngineUnreachable`
    when the engine does not answer; a failure the engine answered is a `DCRError` (naming
    the failed ranks) or, for `deliver`, a failed `EngineAck`."""

    def load(self, version: int, path: str | None, tensors: list) -> list[Any]:
        """Dense-load the checkpoint directory `path` (when given) as committed `version`,
        then prewarm `tensors` at `version`: every rank's answer."""
        ...

    def deliver(
        self, version: int, attempt: int, timeout_s: float, *, pipelined: bool, verify: bool
    ) -> EngineAck:
        """Fetch (or receive) and apply the attempt on every rank: the merged ACK."""
        ...

    def send_commit(self, version: int) -> None:
        """Tell every rank that `version` is committed."""
        ...

    def send_abort(self, attempt: int) -> None:
        """Fence `attempt` on every rank (its staged and late payloads are refused)."""
        ...

    def read_digest(self) -> str:
        """One digest of the engine's weights on every rank (`protocol.engine_digest`)."""
        ...

    def down(self) -> str:
        """Why the engine must be restarted before use ("" when it need not be)."""
        ...

    def can_relaunch(self) -> bool:
        """Whether `relaunch` can restart the engine (a launcher was given)."""
        ...

    def relaunch(self) -> None:
        """Restart the engine (a new process, actor or client), forgetting why it was down."""
        ...


class EngineHandle:
    """The coordinator's handle of one engine over a `Channel` (module docstring).

    `tensors`: the canonical tensor table for prewarm (``[[name, dtype, shape], ...]``);
    `checkpoint_for(version)`: a canonical checkpoint directory of a committed version, or a
    context manager giving one and holding it while the engine loads it (the replica's lease,
    shared_codec/replica); dense loads on restore; None: this handle cannot restore;
    `pipelined` (default): an attempt is
    applied payload by payload as it arrives, so the coordinator can start it while the owners
    build; `verify`: every apply checks its writes."""

    def __init__(
        self,
        name: str,
        channel: Channel,
        *,
        tensors: list,
        checkpoint_for: Callable[[int], Any] | None = None,
        verify: bool = False,
        pipelined: bool = True,
    ) -> None:
        self.name = name
        self.channel = channel
        self.tensors = tensors
        self.checkpoint_for = checkpoint_for
        self.verify = verify
        self.pipelined = pipelined
        self.last: EngineAck | None = None

    # -- coordinator Engine protocol -----------------------------------------------------------
    def prewarm(self, version: int) -> list[Any]:
        """Prewarm every rank at committed `version`: the ranks' capability reports."""
        return self.channel.load(version, None, self.tensors)

    def apply(self, version: int, attempt: int, timeout_s: float) -> EngineAck:
        """Deliver and apply the attempt on every rank: the merged ACK (failed when a rank
        failed or the engine answered with an error; `EngineUnreachable` when it did not)."""
        ack = self.channel.deliver(
            version, attempt, timeout_s, pipelined=self.pipelined, verify=self.verify
        )
        self.last = ack
        return ack

    def commit(self, version: int) -> None:
        self.channel.send_commit(version)

    def abort(self, attempt: int) -> None:
        self.channel.send_abort(attempt)

    def digest(self) -> str:
        return self.channel.read_digest()

    def restore(self, version: int) -> None:
        """Bring the engine to committed `version` by a dense load and prewarm it, restarting
        it first when the channel says it is down or out of step, and once more when it dies
        during the load; the engine is then clean at `version`."""
        if self.checkpoint_for is None:
            raise DCRError(f"engine {self.name}: no checkpoint_for, cannot restore")
        relaunched = False
        why = self.channel.down()
        if why:
            if not self.channel.can_relaunch():
                raise DCRError(f"receiver {self.name} is {why} and has no launcher to restart it")
            self.channel.relaunch()
            relaunched = True
        got = self.checkpoint_for(version)
        held = got if isinstance(got, AbstractContextManager) else nullcontext(got)
        with held as path:  # a replica's lease holds the version's files while they load
            try:
                self.channel.load(version, str(path), self.tensors)
            except EngineUnreachable:
                # a worker that died can leave the API server answering /health for a moment
                # while its executor is already shut down: restart it once, then load
                if relaunched or not self.channel.can_relaunch():
                    raise
                self.channel.relaunch()
                self.channel.load(version, str(path), self.tensors)

    # -- the dcr_* RPCs, where the channel has them --------------------------------------------
    def rpc(self, method: str, *args: Any, timeout: float = 600.0) -> list[RankReply]:
        """Call a ``dcr_*`` RPC on every rank (channels over ``collective_rpc``); raise
        `DCRError` naming the engine and the failing ranks."""
        call = getattr(self.channel, "call_ok", None)
        if call is None:
            raise ProtocolError(f"engine {self.name}: its channel has no dcr_* RPCs")
        try:
            return call(method, list(args), timeout)  # type: ignore[no-any-return]
        except DCRError as e:
            if isinstance(e, EngineUnreachable):
                raise
            raise type(e)(f"receiver {self.name}: {e}") from None
