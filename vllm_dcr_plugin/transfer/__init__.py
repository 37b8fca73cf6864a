"""DCR as vLLM's weight-transfer backend ``dcr`` (front door 2; the worker extension's ``dcr_*``
RPCs are front door 1, and both drive the same per-worker receiver).

- Worker side: `worker_engine.DCRWeightTransferEngine`, created by vLLM in every worker of an
  engine started with ``--weight-transfer-config '{"backend": "dcr"}'``.
- Trainer side: `trainer_engine.DCRTrainerWeightTransferEngine` with `DCRTrainerInitInfo`, used
  through ``WeightTransferTrainerFactory.trainer_init`` with vLLM's own
  ``HTTPVLLMWeightSyncClient`` / ``RayVLLMWeightSyncClient``; each engine is a `NativeEngine`,
  the coordinator's engine handle over the native channel (`native`).
- Results travel as per-rank reports in the control store (`reports`).

`register_backends()` registers both under the name ``dcr`` (lazily: modules are imported when
vLLM creates an engine). The general plugin calls it in every vLLM process; importing
`vllm_dcr_plugin.transfer.trainer_engine` in a trainer process calls it too.
"""

from __future__ import annotations

BACKEND = "dcr"


def register_backends() -> None:
    """Register backend ``dcr`` with vLLM's worker and trainer factories (idempotent: vLLM
    raises on a duplicate name, so an existing entry is left alone)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from vllm_dcr_plugin.patches import backend_registered

    if not backend_registered(WeightTransferEngineFactory, BACKEND):
        WeightTransferEngineFactory.register_engine(
            BACKEND, "vllm_dcr_plugin.transfer.worker_engine", "DCRWeightTransferEngine"
        )
    if not backend_registered(WeightTransferTrainerFactory, BACKEND):
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "vllm_dcr_plugin.transfer.trainer_engine", "DCRTrainerWeightTransferEngine"
        )
