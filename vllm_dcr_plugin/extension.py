"""DCRWorkerExtension: the RPC surface DCR adds to every vLLM worker.

vLLM mixes this class into its worker class (``--worker-extension-cls
vllm_dcr_plugin.DCRWorkerExtension``); an orchestrator calls the methods with
``llm.collective_rpc("dcr_info")`` / ``engine.collective_rpc(...)``. Every method is prefixed
``dcr_`` so it cannot collide with worker attributes, takes and returns plain values only
(str, int, float, bytes, lists and dicts of those), and runs on every worker rank.

Limitations:
1. This revision exposes ``dcr_info`` only; prewarm/stage/apply come with the receiver issue.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_dcr_plugin import PLUGIN_VERSION, cpu_compat, registration_count

# Resolving this class is how vLLM tells a worker process that it serves DCR: enable the CPU
# loader condition before the worker loads its model.
cpu_compat.mark_dcr_enabled()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DCRWorkerExtension:
    """Mixed into vLLM's worker; see the module docstring for the calling convention."""

    def _dcr_model(self) -> torch.nn.Module:
        runner = getattr(self, "model_runner", None)
        model = getattr(runner, "model", None)
        if model is None:
            raise RuntimeError("DCR: the worker has no loaded model (call after engine start)")
        return model

    def _dcr_ranks(self) -> dict[str, int]:
        from vllm.distributed import parallel_state as ps

        return {
            "rank": int(getattr(self, "rank", 0)),
            "tp_rank": int(ps.get_tensor_model_parallel_rank()),
            "tp_size": int(ps.get_tensor_model_parallel_world_size()),
            "pp_rank": int(ps.get_pp_group().rank_in_group),
            "pp_size": int(ps.get_pp_group().world_size),
        }

    def dcr_info(self) -> dict[str, Any]:
        """Versions, ranks and the rank-local parameters/buffers (name -> shape, dtype).

        Returns a plain dict: ``plugin_version``, ``format_version``, ``vllm_version``, the rank
        fields, ``cpu_compat`` (loader-condition state), ``plugin_registrations`` (how often vLLM
        called the general plugin's ``register()`` in this worker process), ``parameters`` and ``buffers`` (lists of
        ``[name, shape, dtype]``). Callable on every rank; no side effects.
        """
        import vllm

        from shared_codec import FORMAT_VERSION

        model = self._dcr_model()
        params = [[n, list(p.shape), _dtype_name(p.dtype)] for n, p in model.named_parameters()]
        buffers = [[n, list(b.shape), _dtype_name(b.dtype)] for n, b in model.named_buffers()]
        return {
            "plugin_version": PLUGIN_VERSION,
            "format_version": FORMAT_VERSION,
            "vllm_version": vllm.__version__,
            **self._dcr_ranks(),
            "cpu_compat": cpu_compat.status(),
            "plugin_registrations": registration_count(),
            "parameters": params,
            "buffers": buffers,
        }
