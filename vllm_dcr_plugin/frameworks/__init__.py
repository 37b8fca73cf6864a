"""DCR where RL frameworks own the loop (docs/frameworks.md): each integration registers
through the framework's own plug point and hands the framework's HF-named full tensors to the
named-tensor owner (shared_codec.named); rank 0 runs DCR's transitions through the ``dcr``
trainer engine (vllm_dcr_plugin.transfer.trainer_engine).

- ``verl``: the ``dcr`` checkpoint engine (verl's ``CheckpointEngineRegistry``) and the
  checkpoint manager that drives it (``rollout.checkpoint_manager_class``).
- ``skyrl``: SkyRL's weight sync (``build_trainer_engine``, its sources and client) routed to
  backend ``dcr``, patching only SkyRL's closed backend switch.

`committed_baseline` is what both need first: the checkpoint the owners diff against.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def committed_baseline(config: Mapping[str, Any], model_path: str | None) -> tuple[str, int]:
    """(the committed canonical checkpoint, its version) for owners that start or restart:
    the version the commit record in ``config["control"]`` names (0 without one); its
    checkpoint is ``config["checkpoint_for"]`` (a path template with ``{version}``) after
    version 0, and ``config["baseline"]`` or the framework's model path (the model the
    engines started from) at version 0. `ArgumentError` when it cannot be named."""
    from shared_codec.coordination.commit import CommitLog
    from shared_codec.errors import ArgumentError
    from shared_codec.transport.spec import Role, TransportSpec

    store = TransportSpec.parse(config["control"], role=Role.STORE, what="control").open_store()
    record = CommitLog(store).current()
    version = 0 if record is None else record.version
    if version == 0:
        path = config.get("baseline") or model_path
    else:
        template = config.get("checkpoint_for")
        if not isinstance(template, str):
            raise ArgumentError(
                f"version {version} is committed; its checkpoint (the owners' baseline) needs "
                "checkpoint_for, a path template with {version}"
            )
        path = template.format(version=version)
    if not path:
        raise ArgumentError("no baseline checkpoint: give 'baseline' (the engines' model)")
    return str(path), version


__all__ = ["committed_baseline"]
