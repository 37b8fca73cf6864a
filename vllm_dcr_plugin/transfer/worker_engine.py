"""The worker side of vLLM's weight-transfer backend ``dcr``: `DCRWeightTransferEngine`.

vLLM creates it in every worker when the engine runs with ``--weight-transfer-config
'{"backend": "dcr"}'`` (the general plugin registered the name) and calls it from its RL routes
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) or ``LLM``/``AsyncLLM`` methods of the same names. It drives the
worker's one `Receiver` (vllm_dcr_plugin.worker.receiver_of), the same one the ``dcr_*`` RPCs use.

Calls (the trainer engine `vllm_dcr_plugin.transfer.trainer_engine` makes them in this order):

1. ``init_weight_transfer_engine(DCRInitInfo)``: open the control store, optionally dense-load a
   committed checkpoint, prewarm the canonical tensor table at the committed version. This is
   also how a failed or restarted engine rejoins (a dense load of the committed version). A
   weight-update session a vanished trainer left open is closed (its attempt fenced). An init
   that fails keeps the previous init (control store, engine name, payload key).
2. ``start_weight_update()``: opens vLLM's session; nothing else.
3. ``update_weights(DCRUpdateInfo)``: one attempt (version, base version, attempt) is fetched
   from the payload source and applied in place, pipelined (each payload applied as it
   arrives) or staged first; ``overwrite_only`` rejects XOR items (retries). The writes are
   finished on the device before the report (what vLLM's base ``update_weights`` does on a
   GPU; `DCRWeightTransferEngine.update_weights` says how).
4. ``finish_weight_update()``: reads the commit record of the pending attempt's version from
   the control store: if it names this attempt, the post-apply check runs (the weights still
   have the digest the update reported) and the receiver commits; otherwise the attempt is
   fenced (its late payloads are refused) and the receiver stays dirty if part of it was
   written. vLLM stamps ``weight_version`` on the engine after this returns.

Speculative draft (MTP layers, EAGLE, a draft model; ``supports_draft_weight_update``): the
draft is refit in the same transition as the base weights, from the same attempt, by its own
receiver (worker.draft_receiver_of; storage the draft shares with the target model is the
target receiver's). On an engine with a draft, init prewarms (and dense-loads) both, and every
update says ``draft: true``; an attempt then runs in two sessions:

- ``start_weight_update`` + ``update_weights`` + ``finish_weight_update``: the base part. The
  finish holds the attempt: no decision yet, nothing reported;
- ``start_draft_weight_update`` + ``update_weights`` (the same version and attempt, reported
  under ``update/draft``) + ``finish_weight_update``: the draft part, and the decision for
  both: both receivers commit when the commit record names the attempt, and both fence it
  otherwise. A failure of either part, a draft part that never came, or one naming another
  attempt fences both, so the draft never holds another version than the base weights.

The infos and their validation are `vllm_dcr_plugin.transfer.infos` (re-exported here).

Never raises: a worker exception inside a multi-rank ``collective_rpc`` leaves stale replies in
vLLM's executor, and a raising ``finish_weight_update`` leaves the worker's session open. Every
call writes a per-rank report into the control store instead (vllm_dcr_plugin.transfer.reports):
``ok``, ``error``, the receiver state. A bad argument is an error report naming it, and changes
nothing; so is a stale or foreign update (base version != the committed version).

Limitations:
1. The draft part fetches the attempt's payloads again (the draft receiver stages its own copy).
2. Reports are how results travel; an engine whose control store is unreachable cannot report
   and the trainer sees missing reports (a failed attempt).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from shared_codec.checkpoint import combined_digest
from shared_codec.coordination.commit import CommitLog
from shared_codec.errors import DCRError, ProtocolError
from shared_codec.replica.client import local_checkpoint
from shared_codec.transport.base import ObjectStore
from shared_codec.transport.spec import Role, TransportSpec
from vllm_dcr_plugin import patches
from vllm_dcr_plugin import worker as dcr_worker
from vllm_dcr_plugin.arguments import integer, name, transport_spec
from vllm_dcr_plugin.transfer import reports
from vllm_dcr_plugin.transfer.infos import (  # the infos are part of this module's interface
    DCRInitInfo,
    DCRUpdateInfo,
    _Invalid,
    parse_init,
    parse_update,
)

__all__ = ["DCRInitInfo", "DCRUpdateInfo", "DCRWeightTransferEngine", "parse_init", "parse_update"]

logger = logging.getLogger(__name__)


class DCRWeightTransferEngine(WeightTransferEngine[DCRInitInfo, DCRUpdateInfo]):
    """Worker engine of backend ``dcr`` (see the module docstring)."""

    init_info_cls = DCRInitInfo
    update_info_cls = DCRUpdateInfo
    supports_draft_weight_update = True

    def __init__(
        self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.init: DCRInitInfo | None = None
        self.control: ObjectStore | None = None
        self.pending: tuple[int, int] | None = None  # (version, attempt) awaiting finish
        self.pending_draft = False  # the pending base part's draft part follows
        self.held: tuple[int, int] | None = None  # a base part awaiting its draft part
        self.reported_digest: str | None = None
        self.world_size = int(vllm_config.parallel_config.world_size)

    # -- helpers ------------------------------------------------------------------------------
    def _worker(self) -> Any:
        return dcr_worker.current_worker()

    def _draft_session(self) -> bool:
        """Whether vLLM aimed this session at the draft model (``start_draft_weight_update``:
        `set_weight_update_target`)."""
        return self.model is not self._default_model

    def _has_draft(self) -> bool:
        return dcr_worker.draft_model(self._worker()) is not None

    def _receiver(self) -> Any:
        """The receiver of the session's model (the draft's in a draft session)."""
        if self._draft_session():
            return dcr_worker.draft_receiver_of(self._worker())
        return dcr_worker.receiver_of(self._worker())

    def _receivers(self) -> list[Any]:
        """The base receiver, and the draft's when the engine runs a draft."""
        worker = self._worker()
        out = [dcr_worker.receiver_of(worker)]
        if self._has_draft():
            out.append(dcr_worker.draft_receiver_of(worker))
        return out

    def _digest(self) -> str:
        """The digest of the weights this engine refits: the base model's, combined with the
        draft's when the engine runs one."""
        digests = [r.digest()["digest"] for r in self._receivers()]
        if len(digests) == 1:
            return str(digests[0])
        return combined_digest({"base": digests[0], "draft": digests[1]})

    def _rank(self) -> int:
        try:
            return int(getattr(self._worker(), "rank", 0))
        except DCRError:
            return 0

    def _report(self, step: str, report: dict[str, Any]) -> None:
        if self.init is None or self.control is None:
            logger.error("DCR engine: cannot report %s (no valid init): %s", step, report)
            return
        base: dict[str, Any] = {"rank": self._rank(), "world_size": self.world_size}
        try:
            worker = self._worker()
            base["requests"] = dcr_worker.held_requests(worker)
            base["paused"] = dcr_worker.paused()
            status = self._receiver().status()
            base.update(
                role="draft" if self._draft_session() else "base",
                state=status["state"],
                committed_version=status["committed_version"],
                target_version=status["target_version"],
            )
        except Exception as e:  # the report must still go out
            base["status_error"] = f"{type(e).__name__}: {e}"
        base.update(report)
        try:
            reports.write(self.control, self.init.engine, step, base["rank"], base)
        except Exception:
            logger.exception("DCR engine: writing the %s report failed", step)

    @staticmethod
    def _error(e: BaseException) -> dict[str, Any]:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    # -- vLLM entry points --------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        try:
            return parse_init(init_dict)
        except DCRError as e:
            return _Invalid(f"{type(e).__name__}: {e}", init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        try:
            return parse_update(update_dict)
        except DCRError as e:
            return _Invalid(f"{type(e).__name__}: {e}", update_dict)

    def init_transfer_engine(self, init_info: Any) -> None:
        """See the module docstring; never raises. vLLM passes what `parse_init_info` made; a
        caller's own `DCRInitInfo` (or dict) is validated the same way."""
        if not isinstance(init_info, DCRInitInfo | _Invalid):
            init_info = self.parse_init_info(init_info)
        elif isinstance(init_info, DCRInitInfo):
            init_info = self.parse_init_info(dataclasses.asdict(init_info))
        if isinstance(init_info, _Invalid):
            self._report_invalid_init(init_info)
            return
        try:
            assert isinstance(init_info.control, TransportSpec)  # parse_init made it one
            control = init_info.control.open_store()
        except Exception as e:
            logger.error("DCR engine %s: control store: %s", init_info.engine, e)
            return
        stale = [a for a in (self.pending, self.held) if a is not None]
        previous = (self.init, self.control)
        self.init, self.control, self.pending, self.held = init_info, control, None, None
        step = reports.init_step(init_info.session)
        try:
            worker = self._worker()
            if patches.weight_update_active(worker):
                # a trainer that vanished mid-session: close it, refuse its attempt's payloads
                patches.close_weight_update(worker)
            for receiver in self._receivers():
                for _, attempt in stale:
                    receiver.abort(attempt)
            receivers = self._receivers()  # the base model's, then the draft's
            out: dict[str, Any] = {}
            if init_info.dense_path is not None:  # a replica's URL is downloaded first
                with local_checkpoint(init_info.dense_path) as local:
                    loads = [r.dense_load(local, init_info.committed_version) for r in receivers]
                out["dense_load"] = loads[0]
                if len(loads) > 1:
                    out["draft_dense_load"] = loads[1]
            prewarms = [
                r.prewarm(init_info.tensors, init_info.committed_version) for r in receivers
            ]
            out["prewarm"] = prewarms[0]
            if len(prewarms) > 1:
                out["draft"] = {"prewarm": prewarms[1]}
            if init_info.key is not None:  # only an init that succeeded changes the key
                for receiver in receivers:
                    receiver.staging.key = bytes.fromhex(init_info.key)
            if init_info.digest:
                out["digest"] = self._digest()
            self._report(step, {"ok": True, "error": None, **out})
        except Exception as e:
            self._report(step, self._error(e))
            # a failed init is not this engine's configuration: reports and finishes keep
            # going where the previous init said (a stale session stays closed)
            self.init, self.control = previous

    def _report_invalid_init(self, bad: _Invalid) -> None:
        """An init that did not parse can still report when its engine, session and control
        store are usable; otherwise the trainer sees the report missing."""
        raw = bad.raw if isinstance(bad.raw, dict) else {}
        try:
            engine = name(raw.get("engine"), "engine")
            session = name(raw.get("session"), "session")
            control = transport_spec(raw.get("control"), "control", Role.STORE).open_store()
        except Exception:
            logger.error("DCR engine: invalid init_info, cannot report: %s", bad.error)
            return
        rank = self._rank()
        report = {"ok": False, "error": bad.error, "rank": rank, "world_size": self.world_size}
        try:
            reports.write(control, engine, reports.init_step(session), rank, report)
        except Exception:
            logger.exception("DCR engine: writing the init report failed")

    def start_weight_update(self) -> None:
        """Opens vLLM's session (a draft session: vLLM aimed `model` at the draft first); DCR
        checks everything in `update_weights`."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One attempt (see the module docstring); never raises, always reports.

        Does what vLLM 0.32's base method does on a GPU (vllm/distributed/weight_transfer/
        base.py, ``WeightTransferEngine.update_weights``: ``parse_update_info``, then
        ``receive_weights``, then ``torch.accelerator.synchronize()``), in the order an engine
        that reports from ``receive_weights`` needs:

        1. parse: in `receive_weights` (`parse_update_info` never raises: info that does not
           parse is an error report and changes nothing, where the base's ``ValueError`` would
           end the worker's session);
        2. receive: fetch and apply through the worker's `Receiver`;
        3. synchronize: inside the receiver, after the writes and their re-derivation and
           before the ACK that this call reports (vllm_dcr_plugin.device.synchronize: the
           model's accelerator devices, a no-op on CPU). The base synchronizes after
           ``receive_weights`` returns, which here would follow the report, and an error the
           device raised then could not fail it.

        What the base leaves to start and finish does not apply: vLLM's checkpoint-format
        engines (``NCCLWeightTransferEngine``, ``IPCWeightTransferEngine``) run layerwise reload
        there (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``, which re-runs
        ``process_weights_after_loading`` per layer and copies the results into the kernel
        tensors' storage). DCR writes the resident weights in place, as vLLM's in-place engine
        ``SparseNCCLWeightTransferEngine`` does (its start and finish are no-ops), keeping every
        parameter's and buffer's storage (the addresses CUDA graphs captured); the post-load
        work that in-place writes would leave stale (derived tensors) is re-run by the receiver
        for the touched layers (vllm_dcr_plugin.derived). ``defers_processing`` stays False:
        when this returns, the weights are on the device. The worker's own
        ``finish_weight_update`` (vllm/v1/worker/gpu_worker.py) resets LoRA state itself."""
        self.receive_weights(update_info)

    @staticmethod
    def _invalid_step(raw: Any) -> str:
        """Where a report of an unparseable update goes: its own attempt when the numbers
        parse (so the trainer finds it), else a catch-all step."""
        try:
            v, a = integer(raw.get("version"), "v"), integer(raw.get("attempt"), "a")
            return reports.update_step(v, a)
        except Exception:
            return "invalid/update"

    def receive_weights(self, update_info: DCRUpdateInfo | dict[str, Any]) -> None:
        """One attempt; never raises, always reports. `update_info` (a `DCRUpdateInfo` or its
        dict) is validated here, so a direct call is held to the same contract."""
        raw = (
            dataclasses.asdict(update_info)
            if isinstance(update_info, DCRUpdateInfo)
            else update_info
        )
        info = self.parse_update_info(raw)
        if isinstance(info, _Invalid):
            self._report(self._invalid_step(raw), {"ok": False, "error": info.error})
            return
        draft_session = self._draft_session()
        step = (reports.draft_update_step if draft_session else reports.update_step)(
            info.version, info.attempt
        )
        if self.init is None:
            self._report(step, {"ok": False, "error": "ProtocolError: init not done"})
            return
        t0 = time.perf_counter()
        try:
            self._check_parts(info, draft_session)
            receiver = self._receiver()
            if info.base_version != receiver.committed_version:
                raise ProtocolError(
                    f"update for {info.base_version} -> {info.version} does not apply to "
                    f"committed version {receiver.committed_version} (stale or foreign); "
                    "nothing changed"
                )
            closed = dcr_worker.gate(self._worker())
            if closed:  # refuse before fetching: nothing of this attempt could be applied
                raise ProtocolError(f"request gate closed for apply: {closed}")
            gate_seen = dcr_worker.gate_state(self._worker())
            self.pending, self.reported_digest = (info.version, info.attempt), None
            self.pending_draft = info.draft and not draft_session
            opts = {"verify": info.verify} if info.pipelined else None
            fetched = receiver.fetch(
                self.init.source,
                info.version,
                info.attempt,
                info.timeout_s,
                opts,
                overwrite_only=info.overwrite_only,
            )
            ack = (
                fetched.pop("ack") if info.pipelined else receiver.apply(info.attempt, info.verify)
            )
            out: dict[str, Any] = {"ok": bool(ack.get("ok")), "error": ack.get("error")}
            out.update(ack=ack, fetch=fetched, gate=gate_seen, seconds=time.perf_counter() - t0)
            if out["ok"] and info.digest:
                out["digest"] = self._digest()
                if not self.pending_draft:  # the draft part's digest is the one finish checks
                    self.reported_digest = out["digest"]
            self._report(step, out)
        except Exception as e:
            self._report(step, {**self._error(e), "seconds": time.perf_counter() - t0})

    def _check_parts(self, info: DCRUpdateInfo, draft_session: bool) -> None:
        """`ProtocolError` (nothing changed) for an update that does not fit the engine's draft:
        ``draft`` must say whether the engine runs one, and a draft part must follow its base
        part (the same version and attempt, held by the base session's finish). A base part
        while another attempt's base part is still held fences that one first."""
        has_draft = self._has_draft()
        if info.draft != has_draft:
            raise ProtocolError(
                "update_info draft=true, but this engine runs no speculative draft model"
                if info.draft
                else "this engine runs a speculative draft model: refit it in the same "
                "transition (update_info draft=true, then the same attempt in a draft session: "
                "start_draft_weight_update); a base-only update would leave the draft stale"
            )
        if not draft_session:
            if self.held is not None:  # a transition whose draft part never came
                self._fence(self.held[1], self._receivers())
                self.held = None
            return
        if self.held != (info.version, info.attempt):
            raise ProtocolError(
                f"draft part of version {info.version} attempt {info.attempt}: its base part "
                + (
                    "was not applied (send the base part first, in a base session)"
                    if self.held is None
                    else f"is not the one held (version {self.held[0]} attempt {self.held[1]})"
                )
            )

    @staticmethod
    def _fence(attempt: int, receivers: list[Any]) -> dict[str, Any]:
        """Fence `attempt` in every receiver; the base receiver's answer."""
        return [r.abort(attempt) for r in receivers][0]

    def finish_weight_update(self) -> None:
        """Commit the pending attempt if the commit record names it, else fence it (see the
        module docstring); never raises, reports unless nothing was pending. With a draft: the
        base part's finish holds the attempt, the draft part's decides for both."""
        if self.init is None or self.control is None:
            return
        draft_session = self._draft_session()
        if self.pending is not None and self.pending_draft and not draft_session:
            self.held, self.pending, self.pending_draft = self.pending, None, False
            return  # the draft session's finish decides for both parts
        held, pending = self.held, self.pending
        if pending is None and held is None:
            return
        version, attempt = pending if pending is not None else held  # type: ignore[misc]
        self.pending = self.held = None
        step = reports.finish_step(version, attempt)
        try:
            receivers = self._receivers() if held is not None else [self._receiver()]
            record = CommitLog(self.control).get(version)
            why = None
            if held is not None and not (draft_session and pending == held):
                why = "its draft part was not applied"
            elif record is None or record.attempt != attempt:
                why = "no commit record" if record is None else f"attempt {record.attempt}"
            if why is not None:
                out = self._fence(attempt, receivers)
                self._report(
                    step,
                    {"ok": True, "error": None, "committed": False, "fenced": out, "why": why},
                )
                return
            if self.reported_digest is not None:
                now = self._digest()
                if now != self.reported_digest:
                    self._fence(attempt, receivers)
                    raise DCRError(
                        f"post-apply check: weights changed between the update's report "
                        f"({self.reported_digest[:12]}) and finish ({now[:12]}); not committed"
                    )
            waiting = [  # both parts or neither (one receiver: commit() checks its own state)
                r.role
                for r in receivers
                if len(receivers) > 1
                and (r.state.value != "applied" or r.target_version != version)
            ]
            if waiting:
                self._fence(attempt, receivers)
                raise DCRError(
                    f"the {', '.join(waiting)} model holds no applied version {version}; "
                    "not committed"
                )
            commits = [r.commit(version) for r in receivers]
            out = {"ok": True, "error": None, "committed": True, "commit": commits[0]}
            if len(commits) > 1:
                out["draft_commit"] = commits[1]
            self._report(step, out)
        except Exception as e:
            self._report(step, {**self._error(e), "committed": False})

    def shutdown(self) -> None:
        self.init, self.control, self.pending, self.held = None, None, None, None
