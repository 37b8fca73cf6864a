"""The one way the vLLM test programs start an engine: tiny model, bf16, eager, small KV cache,
greedy-deterministic, with the DCR worker extension."""

from __future__ import annotations

from typing import Any


def start_llm(model: str, tp: int = 1, **extra: Any) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        tensor_parallel_size=tp,
        worker_extension_cls="vllm_dcr_plugin.DCRWorkerExtension",
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        gpu_memory_utilization=0.1,
        **extra,
    )
