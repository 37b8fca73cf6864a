"""Dtypes the codec carries, all as raw stored bits.

Each dtype has a one-byte wire code (docs/format.md), an item size, and the unsigned integer
numpy type used to carry its bits. Values are never interpreted as numbers: comparison, XOR and
overwrite all act on stored bits, so NaN payloads, signed zeros and subnormals survive exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class DType:
    """A carried dtype: wire `code`, canonical `name` (torch's, without "torch."), item size."""

    code: int
    name: str
    itemsize: int
    torch_dtype: torch.dtype
    is_float: bool

    @property
    def bits_np(self) -> type[np.unsignedinteger]:
        return _UINT[self.itemsize]


_UINT: dict[int, type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}

_TABLE = [
    DType(1, "bfloat16", 2, torch.bfloat16, True),
    DType(2, "float16", 2, torch.float16, True),
    DType(3, "float32", 4, torch.float32, True),
    DType(4, "float64", 8, torch.float64, True),
    DType(5, "float8_e4m3fn", 1, torch.float8_e4m3fn, True),
    DType(6, "float8_e5m2", 1, torch.float8_e5m2, True),
    DType(16, "int8", 1, torch.int8, False),
    DType(17, "uint8", 1, torch.uint8, False),
    DType(18, "int16", 2, torch.int16, False),
    DType(19, "int32", 4, torch.int32, False),
    DType(20, "int64", 8, torch.int64, False),
    DType(21, "bool", 1, torch.bool, False),
]

BY_CODE: dict[int, DType] = {d.code: d for d in _TABLE}
BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_TORCH: dict[torch.dtype, DType] = {d.torch_dtype: d for d in _TABLE}


def dtype_of(x: str | torch.dtype | DType) -> DType:
    """Look up a carried dtype by name, torch dtype or DType; ValueError names unsupported ones."""
    if isinstance(x, DType):
        return x
    if isinstance(x, torch.dtype):
        found = BY_TORCH.get(x)
    else:
        found = BY_NAME.get(str(x).removeprefix("torch."))
    if found is None:
        raise ValueError(f"dtype {x} is not carried by DCR; supported: {sorted(BY_NAME)}")
    return found


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """The stored bits of `t`, flattened, as a numpy unsigned array sharing memory when possible."""
    d = dtype_of(t.dtype)
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    as_bytes = flat.view(torch.uint8) if d.itemsize > 1 or t.dtype != torch.uint8 else flat
    return as_bytes.numpy().view(d.bits_np)


def bits_to_tensor(
    bits: np.ndarray, dtype: str | torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor of `dtype`/`shape` whose stored bits are `bits` (copied)."""
    d = dtype_of(dtype)
    raw = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8).copy())
    return raw.view(d.torch_dtype).reshape(shape)
