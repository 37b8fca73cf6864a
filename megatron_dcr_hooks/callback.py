"""`DCRCallback`: DCR as a Megatron-Bridge training callback and as a post-optimizer-step hook.

Megatron-Bridge (0.6) trains with ``pretrain(config, forward_step_func, callbacks=[...])``; its
loop fires ``on_train_start`` (model and optimizer ready, before the first step) and, after
every optimizer step, ``on_train_step_end`` with ``skipped_iter`` (the optimizer refused the
update: non-finite gradients, a rerun-state-machine skip); checked against Bridge 0.3.1's and
0.6.2's ``CallbackManager``. ``DCRCallback(DCRConfig(...))`` plugs DCR into it::

    from megatron_dcr_hooks import DCRCallback, DCRConfig

    dcr = DCRCallback(DCRConfig(architecture="Qwen3ForCausalLM", sink=send_payload))
    pretrain(config, forward_step_func, callbacks=[dcr])

Call order (every trainer rank, the same events in the same order; the hook's collectives run
inside the events):

1. ``on_train_start`` (or, the first time, ``on_train_step_start``): `attach` creates the
   `DCRHook` from the context's model chunks. Its baseline is the weights at that moment, so
   they must be the weights the rollout engines hold (version 0).
2. ``on_train_step_end`` after a successful step: the next version is built. Without a
   service, ``hook.after_step()`` builds ``committed + 1`` and hands the payloads to
   ``config.sink`` (exactly what `enable_dcr`'s wrapped ``optimizer.step`` does); the caller
   commits with ``callback.hook.commit()``. With ``service=`` (`ServiceSpec`), the callback
   serves the owner service (`megatron_dcr_hooks.service.OwnerService`) until the coordinator
   releases the trainer with ``stop`` (`RemoteOwners.stop`): the coordinator's ``build`` /
   ``verify`` / ``commit`` (and the spec's own ops, e.g. ``export``) run while training waits,
   so the version the coordinator commits is this step's weights. Rank 0's REP socket is
   bound once and stays bound while the job trains, so a coordinator may send its next
   request (``status``: wait for the next step) right after ``stop``; ``on_train_end``
   (or `close`) unbinds it.
3. ``on_train_step_end`` with ``skipped_iter``: nothing is built, published or served (the
   weights did not change); `skipped_steps` counts it.

Plain hook (no Bridge): loops that call the optimizer themselves (Megatron-LM's
``train_step``, NeMo RL's Megatron policy worker) call ``callback.attach(model_chunks)`` once
after loading the weights the engines hold, and ``callback.after_optimizer_step(skipped=not
update_successful)`` after every ``optimizer.step()``; in served mode, ``callback.close()`` after
the last step.

Megatron DDP chunks that overlap the parameter all-gather with the next forward
(``ddp_config.overlap_param_gather``) are synced by the hook before every build (detection.py);
otherwise the detector would read stale parameters (docs/parallel-layouts.md).

Limitations:
1. The callback does not wrap ``optimizer.step``: ``config.wrap_step`` is ignored (the events
   are the step hook).
2. Served mode is synchronous RL: training waits for the coordinator after every successful
   step until it sends ``stop``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_dcr_hooks.groups import ParallelGroups
from megatron_dcr_hooks.hook import BuildReport, DCRConfig, DCRHook
from shared_codec.errors import ProtocolError

log = logging.getLogger("dcr.callback")


@dataclass(frozen=True, kw_only=True)
class ServiceSpec:
    """Serve the owner service after every successful step (module docstring, 2).

    `transport`: the payload sink spec every rank sends to (`shared_codec.transport.spec`);
    `endpoint`: rank 0's ZeroMQ REP address; `handlers`: extra ops, ``name -> fn(request) ->
    dict``, run on every rank (e.g. ``export`` for dense references)."""

    transport: str | Mapping[str, Any]
    endpoint: str
    handlers: Mapping[str, Any] = field(default_factory=dict)


class DCRCallback:
    """Megatron-Bridge ``Callback`` (duck-typed: Bridge's ``CallbackManager.add`` registers the
    ``on_*`` methods a callback defines) and post-optimizer-step hook; module docstring.

    `groups`: the hook's process groups (default `ParallelGroups.from_megatron()`).
    Attributes: `hook` (None until attached), `steps` / `skipped_steps` (successful and skipped
    optimizer steps seen), `built` (the versions built or served, one per successful step).
    """

    def __init__(
        self,
        config: DCRConfig,
        *,
        service: ServiceSpec | None = None,
        groups: ParallelGroups | None = None,
    ) -> None:
        if not isinstance(config, DCRConfig):
            raise ValueError(f"DCRCallback takes a DCRConfig, not {type(config).__name__}")
        self.config = dataclasses.replace(config, wrap_step=False)
        self.service = service
        self.groups = groups
        self.hook: DCRHook | None = None
        self.steps = 0
        self.skipped_steps = 0
        self.built: list[int] = []
        self._service: Any = None
        self._chunks: list[Any] = []

    # -- the plain hook ------------------------------------------------------------------------
    def attach(self, model_chunks: list[Any]) -> DCRHook:
        """Create the hook from `model_chunks` (collective; idempotent). The current weights
        become the committed baseline (version 0): call it before the first optimizer step."""
        if self.hook is None:
            self._chunks = list(model_chunks)
            self.hook = DCRHook(self._chunks, self.config, groups=self.groups)
        return self.hook

    def after_optimizer_step(self, *, skipped: bool = False) -> BuildReport | None:
        """Call after every ``optimizer.step()`` (every rank). A skipped step publishes
        nothing; a successful one builds the next version (or serves the coordinator, which
        builds it). Returns the build report (None for a skipped step or in served mode)."""
        if self.hook is None:
            raise ProtocolError(
                "DCRCallback: attach(model_chunks) (or Bridge's on_train_start) must run before "
                "the first optimizer step: the baseline is the weights the engines hold"
            )
        if skipped:
            self.skipped_steps += 1
            log.info("dcr: optimizer step skipped, nothing published")
            return None
        self.steps += 1
        if self.service is not None:
            self._serve()
            self.built.append(self.hook.committed_version)
            return None
        report = self.hook.after_step()
        assert report is not None  # after_step always builds
        self.built.append(report.version)
        return report

    def _serve(self) -> None:
        from megatron_dcr_hooks.service import OwnerService

        assert self.hook is not None and self.service is not None
        if self._service is None:  # one service (one bound socket) for the whole job
            self._service = OwnerService(
                self.hook,
                self.service.transport,
                self.service.endpoint,
                dict(self.service.handlers),
            )
        self._service.serve()

    def close(self) -> None:
        """Unbind the owner service's socket (served mode; Bridge's ``on_train_end``)."""
        if self._service is not None:
            self._service.close()
            self._service = None

    # -- Megatron-Bridge events ----------------------------------------------------------------
    def on_train_start(self, context: Any) -> None:
        """Bridge event: model and optimizer are ready, no step taken yet; attach."""
        self.attach(context.model)

    def on_train_step_start(self, context: Any) -> None:
        """Bridge event: attach if ``on_train_start`` was not fired (before any update)."""
        if self.hook is None:
            self.attach(context.model)

    def on_train_step_end(self, context: Any) -> None:
        """Bridge event after the optimizer step: build (or serve) unless ``skipped_iter``."""
        self.after_optimizer_step(skipped=bool(context.skipped_iter))

    def on_train_end(self, context: Any) -> None:
        """Bridge event after the last step: `close` (served mode's socket)."""
        self.close()
