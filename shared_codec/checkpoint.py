"""Canonical checkpoints: read and write Hugging Face safetensors directories, and digest tensors.

Canonical coordinates are HF tensor names plus flat row-major indices. This module gives the
bitwise helpers every package uses to compare tensors by their stored bits (never float equality).

Limitations:
1. Reads every ``*.safetensors`` file of a directory (sharded or not); no index.json needed.
2. Needs ``safetensors`` for reading/writing files (ships with vLLM and transformers).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from shared_codec.errors import ProtocolError

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """A same-storage integer view of `t`'s stored bits (flattened, contiguous copy if needed)."""
    t = t.detach().reshape(-1)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype.is_floating_point or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(_INT_VIEW[t.element_size()])
    return t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when `a` and `b` have the same dtype, shape and stored bits (NaN payloads included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_view(a), bits_view(b))


def tensor_digest(t: torch.Tensor) -> str:
    """BLAKE2b-128 hex digest of (dtype, shape, stored bytes) of `t`."""
    t = t.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().data
    return bytes_digest(str(t.dtype), tuple(t.shape), raw)


def bytes_digest(dtype: str, shape: Iterable[int], data: bytes | memoryview) -> str:
    """`tensor_digest` of a tensor given as its dtype (``"torch.bfloat16"``), shape and stored
    bytes (any buffer, e.g. a memory map of a safetensors file: nothing is copied)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{dtype}|{tuple(int(s) for s in shape)}|".encode())
    h.update(data)
    return h.hexdigest()


def state_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Per-name digests of a name -> tensor mapping."""
    return {name: tensor_digest(t) for name, t in sorted(tensors.items())}


def combined_digest(digests: Mapping[str, str]) -> str:
    """One digest over a name -> digest mapping (order independent)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return h.hexdigest()


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Load every tensor of the safetensors files in directory `path` (CPU, stored dtypes)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            if name in out:
                raise ValueError(f"tensor {name} appears in more than one file of {path}")
            out[name] = t
    return out


def iter_checkpoint(path: str | os.PathLike[str]) -> Iterable[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) of a checkpoint directory one file at a time (bounded memory)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def save_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    like: str | os.PathLike[str] | None = None,
) -> Path:
    """Write `tensors` as ``model.safetensors`` into directory `path`.

    When `like` names a checkpoint directory, its non-weight files (config, tokenizer) are copied
    so the result is a loadable HF checkpoint.
    """
    import shutil

    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if like is not None:
        for f in Path(like).iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy2(f, out / f.name)
    contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


_ST_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip


def tensor_table(path: str | os.PathLike[str]) -> list[list]:
    """``[[name, dtype, shape], ...]`` of a checkpoint directory from the safetensors headers
    (no tensor data read): the table ``dcr_prewarm`` takes."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path}")
    table: list[list] = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                sl = sf.get_slice(name)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ValueError(
                        f"{f.name}: tensor {name} has unsupported dtype {sl.get_dtype()}"
                    )
                table.append([name, dtype, list(sl.get_shape())])
    return sorted(table)


def header_shapes(path: str | os.PathLike[str]) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(file name, tensor name, shape) of every tensor of the checkpoint directory `path`, from
    the safetensors headers only (no tensor data read); nothing for a directory without files."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield f.name, name, tuple(sf.get_slice(name).get_shape())


def check_shapes(
    path: str | os.PathLike[str], expected: Mapping[str, tuple[int, ...]], what: str
) -> None:
    """`ProtocolError` naming `what` (nothing loaded) when a tensor of the checkpoint at `path`
    that `expected` (the prewarm table: name -> shape) names has another shape: a checkpoint of
    another model would stop a loader part-way. Reads the files' headers only."""
    for file, name, shape in header_shapes(path):
        want = expected.get(name)
        if want is not None and shape != tuple(want):
            raise ProtocolError(
                f"{what}: tensor {name} in {file} has shape {list(shape)}, the prewarm table "
                f"says {list(want)} (a checkpoint of another model?); nothing loaded"
            )
