"""Write interception: a TorchDispatchMode that sees every write into model storage.

While vLLM's native ``model.load_weights`` runs on a scratch tensor, `WriteInterceptMode` checks
each aten op's schema for mutated arguments (``alias_info.is_write``: ``copy_``, ``fill_``,
``zero_``, ``index_put_``, ``masked_fill_``, ``out=`` variants, ...). Ops that write no model
storage run normally; ops that do are handed to a handler instead of running:

- `TraceHandler` (prewarm) records them and suppresses them: tracing is side-effect free.
- `ApplyHandler` (apply) turns them into exact in-place updates:
  1. ``copy_`` whose source is a view of scratch with the destination's dtype and shape (the
     *direct* path): the item's flat canonical indices are mapped through the source view's
     geometry to destination storage offsets, and the item's values are XORed in (XOR items) or
     stored (OVERWRITE items). Work is O(entries), independent of tensor size.
  2. ``copy_`` from a transformed source (cast, concatenation, contiguous copy of a transpose: the
     *masked* path, OVERWRITE items only): scratch holds a placeholder at inactive positions; the
     active mask is taken at the first intercepted copy into each destination view (source bits
     differ from the placeholder's image), and only active positions are overwritten.
  3. Any other write (padding ``fill_``, ``zero_``, ...) must provably leave the resident bits
     unchanged: it is run on a clone and compared bitwise; a difference fails the attempt.
  4. Other writes whose source is the item (``index_put_`` from scratch, ...) are unsupported and
     fail the attempt (prewarm reports them in advance).

Limitations:
1. The direct path needs source and destination views with nested strides (any view made by
   slicing, select, unbind, narrow, view or transpose of a contiguous tensor).
2. Parameter rebinding (``param.data = ...``) is not a dispatch op; callers detect it by
   comparing parameter storages before and after (`param_snapshot`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

INT_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INT = INT_DTYPES
aten = torch.ops.aten
COPY_OPS = {aten.copy_.default}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Same-storage signed-integer view of `t`'s bits (bool/uint8 -> int8)."""
    return t.view(_INT[t.element_size()])


def flat_storage_bits(t: torch.Tensor) -> torch.Tensor:
    """1-D integer view over the whole storage of `t`, in elements of `t`'s dtype."""
    storage = t.untyped_storage()
    n = storage.nbytes() // t.element_size()
    out = torch.empty(0, dtype=_INT[t.element_size()], device=t.device)
    return out.set_(storage, 0, (n,), (1,))


def storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def tensors_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `model` with its name."""
    return list(model.named_parameters()) + list(model.named_buffers())


def named_storages(model: torch.nn.Module) -> dict[int, str]:
    """Storage key -> the first parameter or buffer name on it (the model storage to guard)."""
    out: dict[int, str] = {}
    for name, t in tensors_of(model):
        if t.numel():
            out.setdefault(storage_key(t), name)
    return out


def param_snapshot(model: torch.nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Name -> (storage key, shape) of every parameter and buffer: compared before and after a
    loader call, a difference means the loader rebound or replaced a tensor."""
    return {n: (storage_key(p), tuple(p.shape)) for n, p in tensors_of(model)}


@dataclass(frozen=True, slots=True)
class ViewGeom:
    """Geometry of a strided view over its storage, in elements."""

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> ViewGeom:
        return cls(int(t.storage_offset()), tuple(int(s) for s in t.shape), tuple(t.stride()))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def nested(self) -> bool:
        """True when every element has one (offset -> coordinates) decomposition."""
        dims = sorted(
            ((st, sz) for st, sz in zip(self.stride, self.shape, strict=True) if sz > 1),
            reverse=True,
        )
        for (st, _), (st_next, sz_next) in zip(dims, dims[1:], strict=False):
            if st < st_next * sz_next:
                return False
        return all(st >= 1 for st, _ in dims)

    def contiguous(self) -> bool:
        """True when the view is one dense row-major block of its storage."""
        expected = 1
        for sz, st in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if sz != 1 and st != expected:
                return False
            expected *= sz
        return True

    def offsets(self) -> np.ndarray:
        """Storage offsets of every element, in row-major order of the view."""
        out = np.full(self.shape, self.offset, dtype=np.int64)
        for d, (sz, st) in enumerate(zip(self.shape, self.stride, strict=True)):
            shape = [1] * len(self.shape)
            shape[d] = sz
            out = out + (np.arange(sz, dtype=np.int64) * st).reshape(shape)
        return out.reshape(-1)


def dense_block(k: np.ndarray, src: ViewGeom, dst: ViewGeom) -> tuple[int, int, int] | None:
    """For a copy between two dense blocks (whole tensors, row slices: the common case), the
    slice ``k[lo:hi]`` of sorted source offsets `k` inside `src` and the `shift` that maps them
    to destination offsets (``dest = k + shift``), as (lo, hi, shift); None for other views."""
    if not (src.contiguous() and dst.contiguous()):
        return None
    lo, hi = (int(x) for x in np.searchsorted(k, [src.offset, src.offset + src.numel]))
    return lo, hi, dst.offset - src.offset


def map_through_view(k: np.ndarray, src: ViewGeom, dst: ViewGeom) -> tuple[np.ndarray, np.ndarray]:
    """Map source storage offsets `k` (scratch = canonical flat indices) through a copy from view
    `src` to view `dst` (same shape). Returns (mask of k inside `src`, destination offsets).

    `k` must be sorted. Dense blocks on both sides (whole tensors, row slices: the common case)
    take a fast path: a binary search for the block and one subtraction.
    """
    block = dense_block(k, src, dst)
    if block is not None:
        lo, hi, shift = block
        valid = np.zeros(k.shape, dtype=bool)
        valid[lo:hi] = True
        return valid, k[lo:hi] + shift
    r = k - src.offset
    valid = r >= 0
    dest = np.full(k.shape, dst.offset, dtype=np.int64)
    dims = sorted(range(len(src.shape)), key=lambda d: -src.stride[d])
    for d in dims:
        if src.shape[d] == 1:
            continue
        st = src.stride[d]
        c = r // st
        r = r - c * st
        valid &= (c >= 0) & (c < src.shape[d])
        dest += c * dst.stride[d]
    valid &= r == 0
    return valid, dest[valid]


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors an aten op mutates, from its schema (``Tensor(a!)`` arguments)."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if alias is None or not alias.is_write:
            continue
        val = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(val, torch.Tensor):
            out.append(val)
        elif isinstance(val, list | tuple):
            out.extend(v for v in val if isinstance(v, torch.Tensor))
    return out


def tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, list | tuple):
            found.extend(x for x in v if isinstance(x, torch.Tensor))
    return found


def would_change(func: Any, args: tuple, kwargs: dict, dest: torch.Tensor) -> bool:
    """Run a write op on a clone of `dest` and report whether any stored bit would change."""
    shadow = dest.clone()
    new_args = tuple(shadow if a is dest else a for a in args)
    new_kwargs = {k: (shadow if v is dest else v) for k, v in kwargs.items()}
    func(*new_args, **new_kwargs)
    return not torch.equal(int_view(shadow), int_view(dest))


class WriteInterceptMode(TorchDispatchMode):
    """Routes every op that writes model storage to `handler(func, args, kwargs, dests)`."""

    def __init__(self, model_storages: dict[int, str], handler: Callable[..., Any]) -> None:
        super().__init__()
        self.model_storages = model_storages
        self.handler = handler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        dests = [
            t
            for t in written_tensors(func, args, kwargs)
            if t.numel() and storage_key(t) in self.model_storages
        ]
        if not dests:
            return func(*args, **kwargs)
        return self.handler(func, args, kwargs, dests)


@dataclass
class WriteRecord:
    """One intercepted write during a prewarm trace."""

    op: str
    param: str
    dest: ViewGeom
    dest_dtype: str
    from_scratch: bool
    src: ViewGeom | None = None
    src_dtype: str | None = None
    changes_resident: bool | None = None


@dataclass
class TraceHandler:
    """Prewarm: record writes into model storage and suppress them."""

    model_storages: dict[int, str]
    scratch_key: int
    records: list[WriteRecord] = field(default_factory=list)

    def __call__(self, func: Any, args: tuple, kwargs: dict, dests: list[torch.Tensor]) -> Any:
        src_tensors = [t for t in tensors_in(args, kwargs) if all(t is not d for d in dests)]
        from_scratch = any(storage_key(t) == self.scratch_key for t in src_tensors)
        for dest in dests:
            rec = WriteRecord(
                op=str(func.__name__),
                param=self.model_storages[storage_key(dest)],
                dest=ViewGeom.of(dest),
                dest_dtype=str(dest.dtype).removeprefix("torch."),
                from_scratch=from_scratch,
            )
            if func in COPY_OPS:
                src = args[1]
                rec.src = ViewGeom.of(src) if storage_key(src) == self.scratch_key else None
                rec.src_dtype = str(src.dtype).removeprefix("torch.")
            elif not from_scratch:
                rec.changes_resident = would_change(func, args, kwargs, dest)
            self.records.append(rec)
        return args[0] if args and isinstance(args[0], torch.Tensor) else None
