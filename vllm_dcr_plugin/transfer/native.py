"""The native weight-transfer channel: the receiver contract over vLLM's own trainer-side
client (`VLLMWeightSyncClient`: HTTP or Ray) and the ``dcr`` backend's four phases, and
`NativeEngine`, the coordinator's handle over it (shared_codec.coordination.handle).

DCR's joint commit maps onto vLLM's phases (docs/protocol.md, "Native weight transfer"):

- `load`: ``init_weight_transfer_engine``: a dense load of a committed checkpoint when given,
  then prewarm, then ``weight_version`` stamped through an empty session;
- `deliver`: ``start_weight_update`` + ``update_weights``: one attempt, fetched and applied; the
  ACK is the per-rank `RankReport` the workers write into the control store;
- `send_commit`: ``finish_weight_update(weight_version)``: the workers read the commit record,
  commit when it names their attempt (vLLM then stamps ``weight_version``), fence it otherwise;
- `send_abort`: ``finish_weight_update()`` without a commit record for the attempt: fenced;
- `read_digest`: the digest the ranks reported with their last successful init or update.

An engine that runs a speculative draft (its init reports say ``draft``) gets each attempt in
two sessions: the base part (``start_weight_update`` + ``update_weights`` +
``finish_weight_update()``, which holds it), then the draft part (``start_draft_weight_update``
+ ``update_weights``), whose session the commit or abort closes; the ACK merges both parts'
reports, and the engine's digest covers both models. vLLM 0.32's clients have no
``start_draft_weight_update``: `start_draft_session` posts vLLM's own route (HTTP) or calls the
actors' method (Ray) itself.

The channel keeps vLLM's session state (``start_weight_update`` opens it,
``finish_weight_update`` closes it) so that it never calls one out of order (the worker would
raise and, with TP > 1, leave stale replies in vLLM's executor).

Limitations:
1. vLLM's clients return nothing and raise on HTTP errors only; results come back as reports
   in the control store (vllm_dcr_plugin.transfer.reports), so the control store must be
   reachable from trainer and workers alike.
2. The channel cannot probe the engine's health (`down` says nothing): a restore loads first
   and restarts the engine (its launcher) only when the load finds it unreachable.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

from shared_codec.coordination.handle import EngineHandle
from shared_codec.coordination.protocol import EngineAck, RankReport, engine_digest
from shared_codec.errors import DCRError, EngineUnreachable
from shared_codec.transport.base import ObjectStore
from shared_codec.transport.spec import TransportSpec
from vllm_dcr_plugin.transfer import reports


class NativeChannel:
    """The receiver contract over one engine's `VLLMWeightSyncClient` (module docstring).
    `control`: the control store (reports, commit records) and its spec; `source`: the spec
    the workers fetch attempts from; `launcher(name)`: a client of a restarted engine;
    `digests`: the ranks report their digest with every init and update."""

    name: str = "engine0"

    def __init__(
        self,
        client: VLLMWeightSyncClient,
        *,
        control: ObjectStore,
        control_spec: TransportSpec,
        source: TransportSpec,
        launcher: Callable[[str], VLLMWeightSyncClient] | None = None,
        digests: bool = True,
    ) -> None:
        self.client = client
        self.control, self.control_spec, self.source = control, control_spec, source
        self.launcher, self.digests = launcher, digests
        self.world_size = 1
        self.session_open = False
        self.draft = False  # the engine runs a speculative draft (its init reports say so)
        self.applied: tuple[int, int] | None = None  # (version, attempt) applied, not finished
        self.reports: list[RankReport] = []  # of the last update
        self.last_digest = ""

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # requests / ray errors: the engine did not answer
            raise EngineUnreachable(f"engine {self.name}: {type(e).__name__}: {e}") from None

    def _collect(self, step: str) -> list[RankReport]:
        got = reports.collect(self.control, self.name, step, world_size=self.world_size)
        return [RankReport.parse(r, what=f"engine {self.name} {step} report") for r in got]

    def _raise_failed(self, what: str, got: list[RankReport]) -> None:
        bad = [f"rank {r.rank}: {r.error}" for r in got if not r.ok]
        if bad:
            raise DCRError(f"engine {self.name}: {what} failed: " + "; ".join(bad))

    def _combined(self, got: list[RankReport]) -> str:
        """One digest over the ranks' reported digests ("" when a rank reported none)."""
        digests = [(r.rank, r.extra.get("digest")) for r in got]
        if not all(d for _, d in digests):
            return ""
        return engine_digest((rank, str(d)) for rank, d in digests)

    def _finish(self, weight_version: str | None) -> None:
        if not self.session_open:
            self._call(self.client.start_weight_update)
            self.session_open = True
        self._call(self.client.finish_weight_update, weight_version)
        self.session_open = False

    # -- the receiver contract (handle.Channel) ------------------------------------------------
    def load(self, version: int, path: str | None, tensors: list) -> list[Any]:
        """``init_weight_transfer_engine``: prewarm at committed `version` (after a dense load
        of `path`), then stamp `version` as the engine's weight version (an empty session).
        Raises `DCRError` with the workers' errors when a rank failed."""
        if self.session_open:  # a session a failed attempt left open: close it (fenced)
            try:
                self._finish(None)
            except EngineUnreachable:
                self.session_open = False
        session = uuid.uuid4().hex
        init = {
            "engine": self.name,
            "session": session,
            "control": self.control_spec.to_dict(),
            "source": self.source.to_dict(),
            "tensors": tensors,
            "committed_version": int(version),
            "dense_path": path,
            "digest": self.digests,
        }
        self._call(self.client.init_weight_transfer_engine, init)
        self.session_open, self.applied = False, None
        step = reports.init_step(session)
        first = reports.collect(self.control, self.name, step, world_size=1)[0]
        self.world_size = RankReport.parse(first, what=f"engine {self.name} init report").world_size
        got = self._collect(step)
        self._raise_failed("init", got)
        self.draft = any("draft" in r.extra for r in got)
        if self.draft and not draft_sessions(self.client):
            raise DCRError(
                f"engine {self.name} runs a speculative draft, and its client "
                f"{type(self.client).__name__} cannot start a draft weight-update session (no "
                "start_draft_weight_update, base_url or Ray handles)"
            )
        self.last_digest = self._combined(got)
        self._finish(str(version))
        return got

    def deliver(
        self, version: int, attempt: int, timeout_s: float, *, pipelined: bool, verify: bool
    ) -> EngineAck:
        if not self.session_open:
            self._call(self.client.start_weight_update)
            self.session_open = True
        update = {
            "version": int(version),
            "base_version": int(version) - 1,
            "attempt": int(attempt),
            "pipelined": pipelined,
            "overwrite_only": attempt > 0,
            "verify": verify,
            "digest": self.digests,
            "timeout_s": float(timeout_s),
            "draft": self.draft,
        }
        self.applied = (int(version), int(attempt))
        self._call(self.client.update_weights, update)
        if self.draft:  # the base part's finish holds it for the draft part
            self._call(self.client.finish_weight_update, None)
            self.session_open = False
        try:
            got = self._collect(reports.update_step(version, attempt))
        except DCRError as e:
            return EngineAck.failed(str(e))
        if self.draft and all(r.ok for r in got):
            self._call(start_draft_session, self.client)
            self.session_open = True
            self._call(self.client.update_weights, update)
            try:
                got = got + self._collect(reports.draft_update_step(version, attempt))
            except DCRError as e:
                return EngineAck.failed(str(e))
        self.reports = got
        ack = EngineAck.merge(got, pipelined=pipelined)
        if ack.ok:  # with a draft: the draft part's reports (their digest covers both models)
            self.last_digest = self._combined(got[len(got) - self.world_size :])
        return ack

    def send_commit(self, version: int) -> None:
        """``finish_weight_update(str(version))``: the workers find the commit record naming
        their attempt and commit; vLLM stamps the weight version. When this channel applied
        the attempt, every rank's finish report must say committed."""
        applied, self.applied = self.applied, None
        self._finish(str(version))
        if applied is None or applied[0] != version:
            return  # a resuming coordinator: a receiver that did not commit refuses the next
        got = self._collect(reports.finish_step(*applied))
        self._raise_failed("finish (commit)", got)
        missed = [r.rank for r in got if not r.extra.get("committed")]
        if missed:
            raise DCRError(f"engine {self.name}: rank(s) {missed} did not commit {version}")

    def send_abort(self, attempt: int) -> None:
        self.applied = None
        self._finish(None)

    def read_digest(self) -> str:
        return self.last_digest

    def down(self) -> str:
        return ""

    def can_relaunch(self) -> bool:
        return self.launcher is not None

    def relaunch(self) -> None:
        assert self.launcher is not None
        self.client = self.launcher(self.name)
        self.session_open = False


def draft_sessions(client: Any) -> bool:
    """Whether `start_draft_session` can start a draft session through `client`."""
    return (
        callable(getattr(client, "start_draft_weight_update", None))
        or isinstance(getattr(client, "base_url", None), str)
        or isinstance(getattr(client, "handles", None), list)
    )


def start_draft_session(client: Any) -> None:
    """``start_draft_weight_update`` through `client`: its own method where it has one, else
    vLLM's route ``/start_draft_weight_update`` (an `HTTPVLLMWeightSyncClient`: its
    ``base_url`` and ``timeout``) or the actors' method (a `RayVLLMWeightSyncClient`: its
    ``handles``). `DCRError` for a client that offers none of these."""
    own = getattr(client, "start_draft_weight_update", None)
    if callable(own):
        own()
        return
    base_url = getattr(client, "base_url", None)
    if isinstance(base_url, str):
        import requests

        timeout = float(getattr(client, "timeout", 300))
        requests.post(f"{base_url}/start_draft_weight_update", timeout=timeout).raise_for_status()
        return
    handles = getattr(client, "handles", None)
    if isinstance(handles, list):
        import ray

        ray.get([h.start_draft_weight_update.remote() for h in handles])
        return
    raise DCRError(
        f"{type(client).__name__} cannot start a draft weight-update session (no "
        "start_draft_weight_update, base_url or Ray handles); the engine runs a speculative draft"
    )


class NativeEngine(EngineHandle, NativeChannel):
    """The coordinator's handle of one vLLM engine reached only through a
    `VLLMWeightSyncClient`, over its own `NativeChannel`."""

    def __init__(
        self,
        name: str,
        client: VLLMWeightSyncClient,
        *,
        control: ObjectStore,
        control_spec: TransportSpec,
        source: TransportSpec,
        tensors: list,
        checkpoint_for: Callable[[int], str] | None = None,
        launcher: Callable[[str], VLLMWeightSyncClient] | None = None,
        pipelined: bool = True,
        verify: bool = False,
        digests: bool = True,
    ) -> None:
        NativeChannel.__init__(
            self,
            client,
            control=control,
            control_spec=control_spec,
            source=source,
            launcher=launcher,
            digests=digests,
        )
        EngineHandle.__init__(
            self,
            name,
            self,
            tensors=tensors,
            checkpoint_for=checkpoint_for,
            verify=verify,
            pipelined=pipelined,
        )

    def initialize(self, version: int, dense_path: str | None = None) -> list[Any]:
        """Init at committed `version` (after a dense load of `dense_path`): `load`."""
        return self.load(version, dense_path, self.tensors)
