"""Delta records in canonical coordinates.

A `DeltaItem` is one owner's entries for one canonical tensor: the HF tensor name, dtype and
shape, the owner id, the kind (XOR mask or OVERWRITE value), sorted unique flat row-major
indices, and one value per index as raw stored bits. Items of one tensor may be split over
several payloads by index range (buckets.py does so when an item exceeds a bucket).

Reference helpers (`diff_tensors`, `apply_items`) compute and apply items on plain tensors: the
oracle for tests and the canonical-checkpoint path; receivers apply through vLLM's loader.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from shared_codec.dtypes import DType, dtype_of, tensor_bits


class Kind(IntEnum):
    """How an entry is applied: XOR into resident bits, or overwrite with the value's bits."""

    XOR = 0
    OVERWRITE = 1


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DeltaItem:
    """One owner's entries for one canonical tensor.

    `indices`: int64, strictly increasing, each < numel(shape). `values`: unsigned integer array
    of the dtype's width (bits), same length. Constructed items are validated (`validate`).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    owner: int
    kind: Kind
    indices: np.ndarray
    values: np.ndarray

    @property
    def dtype_info(self) -> DType:
        return dtype_of(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def count(self) -> int:
        return int(self.indices.shape[0])

    @property
    def raw_bytes(self) -> int:
        """Raw record bytes: an int64 index plus the stored value per entry (benchmarks' unit)."""
        return self.count * (8 + self.dtype_info.itemsize)

    def validate(self, *, order: bool = True) -> DeltaItem:
        """Raise ValueError unless the item is internally consistent; return self. `order=False`
        skips the strictly-increasing check (for a caller that checks it on differences it
        computes anyway: the payload encoder)."""
        d = self.dtype_info
        if not self.name or len(self.name.encode()) > 65535:
            raise ValueError(f"item name {self.name!r}: empty or longer than 65535 bytes")
        if any(int(s) < 0 for s in self.shape) or len(self.shape) > 255:
            raise ValueError(f"item {self.name}: invalid shape {self.shape}")
        if self.indices.dtype != np.int64 or self.indices.ndim != 1:
            raise ValueError(f"item {self.name}: indices must be a 1-D int64 array")
        if self.values.dtype != d.bits_np or self.values.shape != self.indices.shape:
            raise ValueError(
                f"item {self.name}: values must be {np.dtype(d.bits_np).name}[{self.count}]"
            )
        if self.count:
            if int(self.indices[0]) < 0 or int(self.indices[-1]) >= self.numel:
                raise ValueError(f"item {self.name}: index out of range for shape {self.shape}")
            if order and self.count > 1 and not bool(np.all(np.diff(self.indices) > 0)):
                raise ValueError(f"item {self.name}: indices not strictly increasing")
        return self

    def same_as(self, other: DeltaItem) -> bool:
        """Field-by-field equality, arrays compared exactly."""
        return (
            self.name == other.name
            and self.dtype == other.dtype
            and tuple(self.shape) == tuple(other.shape)
            and self.owner == other.owner
            and self.kind == other.kind
            and np.array_equal(self.indices, other.indices)
            and np.array_equal(self.values, other.values)
        )


def make_item(
    name: str,
    dtype: str | torch.dtype,
    shape: Iterable[int],
    owner: int,
    kind: Kind,
    indices: np.ndarray,
    values: np.ndarray,
) -> DeltaItem:
    """Build and validate an item (normalises dtype name, shape tuple and array dtypes)."""
    d = dtype_of(dtype)
    vals = np.ascontiguousarray(values)
    if vals.dtype.itemsize != d.itemsize:
        raise ValueError(
            f"item {name}: values are {vals.dtype} but {d.name} bits need {d.itemsize} bytes"
        )
    return DeltaItem(
        name=name,
        dtype=d.name,
        shape=tuple(int(s) for s in shape),
        owner=int(owner),
        kind=Kind(kind),
        indices=np.ascontiguousarray(indices, dtype=np.int64),
        values=vals.view(d.bits_np),
    ).validate()


def diff_tensors(
    name: str, old: torch.Tensor, new: torch.Tensor, *, owner: int = 0, kind: Kind = Kind.XOR
) -> DeltaItem:
    """The item turning `old` into `new` (same dtype/shape), compared by stored bits."""
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(
            f"{name}: cannot diff {old.dtype}{tuple(old.shape)} against {new.dtype}{tuple(new.shape)}"
        )
    a, b = tensor_bits(old), tensor_bits(new)
    idx = np.flatnonzero(a != b).astype(np.int64, copy=False)
    vals = b[idx] if kind == Kind.OVERWRITE else (a[idx] ^ b[idx])
    return make_item(name, new.dtype, new.shape, owner, kind, idx, vals)


def diff_checkpoints(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    kind: Kind = Kind.XOR,
    overwrite: Container[str] = (),
    owner: int = 0,
) -> list[DeltaItem]:
    """The non-empty items turning checkpoint `old` into `new`, by tensor name in sorted order:
    `kind` for every tensor but those named in `overwrite` (always `Kind.OVERWRITE`)."""
    items = []
    for name in sorted(old):
        k = Kind.OVERWRITE if name in overwrite else kind
        item = diff_tensors(name, old[name], new[name], owner=owner, kind=k)
        if item.count:
            items.append(item)
    return items


def apply_item(tensor: torch.Tensor, item: DeltaItem) -> None:
    """Apply `item` in place to a contiguous CPU `tensor` (the reference applier)."""
    d = item.dtype_info
    if d.torch_dtype != tensor.dtype or tuple(tensor.shape) != tuple(item.shape):
        raise ValueError(
            f"{item.name}: item is {item.dtype}{item.shape}, tensor is "
            f"{tensor.dtype}{tuple(tensor.shape)}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{item.name}: reference apply needs a contiguous tensor")
    bits = tensor_bits(tensor)  # shares memory with `tensor`
    if item.kind == Kind.XOR:
        bits[item.indices] ^= item.values
    else:
        bits[item.indices] = item.values


def apply_items(tensors: MutableMapping[str, torch.Tensor], items: Iterable[DeltaItem]) -> int:
    """Apply items to a name -> tensor mapping in place; KeyError names unknown tensors.

    Returns the number of entries applied.
    """
    n = 0
    for item in items:
        if item.name not in tensors:
            raise KeyError(f"delta item for unknown tensor {item.name!r}")
        apply_item(tensors[item.name], item)
        n += item.count
    return n
