"""Where each canonical tensor's bytes lie in a checkpoint directory's safetensors files, and
in-place reads and writes of single elements there through memory maps.

A safetensors file is ``u64 N`` (little-endian), ``N`` bytes of JSON header (per tensor:
``dtype``, ``shape``, ``data_offsets [begin, end)`` relative to the data that follows the
header), then the data. `read_layout` parses the headers of every ``*.safetensors`` file of a
directory (no tensor data read) and checks every field; `SlotFiles` maps the files of one slot
and reads or writes the stored bits of a tensor at flat indices (O(indices), no tensor copy).

Limitations:
1. The dtypes are the codec's (docs/format.md) that safetensors names: BF16, F16, F32, F64,
   F8_E4M3, F8_E5M2, I8, U8, I16, I32, I64, BOOL; a file holding another dtype is refused.
2. Little-endian hosts only (safetensors data is little-endian; the maps are read natively).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared_codec.checkpoint import bytes_digest
from shared_codec.dtypes import DType, dtype_of
from shared_codec.errors import ReplicaError

#: safetensors dtype names -> the codec's dtype names
ST_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8",
    "I16": "int16", "I32": "int32", "I64": "int64", "BOOL": "bool",
}  # fmt: skip

#: largest safetensors header accepted (the format's own limit is 100 MB)
MAX_HEADER = 100_000_000

assert sys.byteorder == "little", "the replica store maps little-endian safetensors data"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorLoc:
    """One tensor of a checkpoint: the file holding it (relative to the checkpoint directory),
    its dtype (codec name), shape, and the absolute byte offset and length of its data."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def dtype_info(self) -> DType:
        return dtype_of(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_layout(directory: Path) -> dict[str, TensorLoc]:
    """Every tensor of the ``*.safetensors`` files of `directory`, by name, from the headers.
    `ReplicaError` naming the file for a checkpoint the store cannot hold in place: no file, a
    malformed header, a dtype the codec does not carry, overlapping or out-of-file data, a
    tensor in two files."""
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise ReplicaError(f"no *.safetensors files in checkpoint directory {directory}")
    out: dict[str, TensorLoc] = {}
    for f in files:
        for loc in _file_layout(f):
            if loc.name in out:
                raise ReplicaError(
                    f"{directory}: tensor {loc.name} is in both {out[loc.name].file} and {f.name}"
                )
            out[loc.name] = loc
    return out


def _file_layout(path: Path) -> list[TensorLoc]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ReplicaError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise ReplicaError(f"{path}: safetensors header length {n} does not fit the file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ReplicaError(f"{path}: malformed safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ReplicaError(f"{path}: malformed safetensors header (not an object)")
    base = 8 + n
    locs: list[TensorLoc] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            st_dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(s) for s in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise ReplicaError(f"{path}: tensor {name}: malformed header entry") from None
        dtype = ST_DTYPES.get(st_dtype)
        if dtype is None:
            raise ReplicaError(f"{path}: tensor {name} has dtype {st_dtype}, not carried by DCR")
        loc = TensorLoc(
            name=name, file=path.name, dtype=dtype, shape=shape, offset=base + begin,
            nbytes=end - begin,
        )  # fmt: skip
        if any(s < 0 for s in shape) or loc.nbytes != loc.numel * loc.dtype_info.itemsize:
            raise ReplicaError(f"{path}: tensor {name}: data_offsets do not match its shape")
        if begin < 0 or base + end > size:
            raise ReplicaError(f"{path}: tensor {name}: data lies outside the file")
        locs.append(loc)
    locs.sort(key=lambda t: t.offset)
    for a, b in zip(locs, locs[1:], strict=False):
        if a.offset + a.nbytes > b.offset:
            raise ReplicaError(f"{path}: tensors {a.name} and {b.name} overlap")
    return locs


class SlotFiles:
    """The safetensors files of one checkpoint directory, memory-mapped on first use, read-only
    or writable. Use as a context manager; `close` unmaps (after `sync` for writes)."""

    def __init__(self, directory: Path, layout: dict[str, TensorLoc], *, write: bool) -> None:
        self.directory, self.layout, self.write = directory, layout, write
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}
        self.touched: set[str] = set()

    def __enter__(self) -> SlotFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _map(self, file: str) -> mmap.mmap:
        if file not in self._maps:
            path = self.directory / file
            fd = os.open(path, os.O_RDWR if self.write else os.O_RDONLY)
            try:
                access = mmap.ACCESS_WRITE if self.write else mmap.ACCESS_READ
                self._maps[file] = (fd, mmap.mmap(fd, 0, access=access))
            except BaseException:
                os.close(fd)
                raise
        return self._maps[file][1]

    def bits(self, name: str) -> np.ndarray:
        """The stored bits of tensor `name`, flat, as a view into the file's map (unsigned
        words of the dtype's width); writable when the files were opened for writing."""
        loc = self.layout[name]
        d = loc.dtype_info
        if loc.numel == 0:
            return np.zeros(0, dtype=d.bits_np)
        buf = np.frombuffer(
            self._map(loc.file), dtype=np.uint8, count=loc.nbytes, offset=loc.offset
        )
        return buf.view(d.bits_np)

    def read(self, name: str, indices: np.ndarray) -> np.ndarray:
        """A copy of the stored bits of `name` at `indices`."""
        return self.bits(name)[indices].copy()

    def put(self, name: str, indices: np.ndarray, values: np.ndarray) -> None:
        """Write `values` (stored bits) at `indices` of `name` in place."""
        assert self.write, "SlotFiles opened read-only"
        if indices.shape[0]:
            self.bits(name)[indices] = values
            self.touched.add(self.layout[name].file)

    def digest(self, name: str) -> str:
        """`checkpoint.tensor_digest` of tensor `name` as stored in the file."""
        loc = self.layout[name]
        raw = self.bits(name).view(np.uint8)
        return bytes_digest(f"torch.{loc.dtype}", loc.shape, raw.data)

    def sync(self) -> None:
        """Make every write durable: msync each written map, then fsync its file."""
        for file in sorted(self.touched):
            fd, m = self._maps[file]
            m.flush()
            os.fsync(fd)
        self.touched.clear()

    def close(self) -> None:
        maps, self._maps = self._maps, {}
        self.touched.clear()
        for fd, m in maps.values():
            try:
                m.close()
            except BufferError:  # a view still exported: the map closes when it is collected
                pass
            os.close(fd)
