"""PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``), the
canonical form of a LoRA adapter for both sides: the owner writes the trainer's adapter of a
version (megatron_dcr_hooks.lora), the receiver reads a dense adapter and writes each version it
builds for vLLM's LoRA manager (vllm_dcr_plugin.adapters)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from shared_codec.errors import ProtocolError

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def read_adapter(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT LoRA directory's config and tensors. `ProtocolError` when it is not one."""
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / CONFIG).is_file() or not (root / WEIGHTS).is_file():
        raise ProtocolError(f"adapter path {path}: expected a PEFT directory ({CONFIG}, {WEIGHTS})")
    config = json.loads((root / CONFIG).read_text())
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise ProtocolError(f"adapter path {path}: {CONFIG} is not a LoRA adapter config")
    return config, {n: t.contiguous() for n, t in load_file(str(root / WEIGHTS)).items()}


def write_adapter(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write a PEFT adapter directory (atomically: a temporary directory renamed into place)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    save_file(
        {n: t.contiguous() for n, t in tensors.items()},
        str(tmp / WEIGHTS),
        metadata={"format": "pt"},
    )
    (tmp / CONFIG).write_text(json.dumps(config, sort_keys=True))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
