"""The replica's write-ahead log: one record per staged (version, attempt), holding for every
tensor it changes the canonical flat indices, the committed (old) bits and the staged (new) bits.

The old bits undo the attempt in a slot (abort, an overwrite retry, recovery after a crash);
the new bits replay the committed transition into the slot that lags one version behind. Both
are plain overwrites, so replaying a record any number of times, in any state a crash left, ends
in the same bits.

A record file ``log/v<version>-a<attempt>.dcrlog`` (no pickle; all integers little-endian):
```
offset  size  field
0       4     magic          "DCRL"
4       2     format         1
6       2     flags          0
8       4     header_len     H
12      H     header         UTF-8 JSON: {"version", "base_version", "attempt",
                             "tensors": [{"name", "dtype", "count"}, ...]}
12+H    B     body           per tensor, in header order: int64 indices[count], old bits
                             [count], new bits[count] (unsigned words of the dtype's width)
12+H+B  32    checksum       BLAKE2b-256 of bytes [0, 12+H+B)
```
The file is written whole to a temporary name, fsynced, renamed into place and the directory
fsynced (`durable.atomic_write`) before any slot is touched; `read_record` checks every length
and the checksum and raises `LogCorrupt` for anything else, so a torn or foreign record is never
replayed.

Limitations:
1. The body is not compressed: 8 + 2 x item size bytes per changed element (a payload's
   entries cost less); the log holds at most three records (docs/replica.md, "Layout").
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared_codec.dtypes import dtype_of
from shared_codec.errors import ReplicaError
from shared_codec.replica import durable

MAGIC = b"DCRL"
FORMAT = 1
_HEAD = struct.Struct("<4sHHI")
_SUM = 32
_NAME = re.compile(r"^v(\d+)-a(\d+)\.dcrlog$")


class LogCorrupt(ReplicaError):
    """A log record is missing, torn or not a record of this (version, attempt). Caught inside
    the store, which then rebuilds the slot from the committed one; never raised to callers."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TensorChange:
    """One tensor's part of a record: sorted unique flat indices, committed and staged bits."""

    name: str
    dtype: str
    indices: np.ndarray
    old: np.ndarray
    new: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Record:
    """What one staged attempt writes into a slot: committed `base_version` -> `version`."""

    version: int
    base_version: int
    attempt: int
    changes: tuple[TensorChange, ...]

    @property
    def elements(self) -> int:
        return sum(int(c.indices.shape[0]) for c in self.changes)


def record_name(version: int, attempt: int) -> str:
    return f"v{version}-a{attempt}.dcrlog"


def parse_name(name: str) -> tuple[int, int] | None:
    """(version, attempt) of a record file name, None for any other name."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def encode_record(rec: Record) -> bytes:
    header = {
        "version": rec.version,
        "base_version": rec.base_version,
        "attempt": rec.attempt,
        "tensors": [{"name": c.name, "dtype": c.dtype, "count": int(c.indices.shape[0])}
                    for c in rec.changes],
    }  # fmt: skip
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [_HEAD.pack(MAGIC, FORMAT, 0, len(head)), head]
    for c in rec.changes:
        bits = dtype_of(c.dtype).bits_np
        parts.append(np.ascontiguousarray(c.indices, dtype="<i8").tobytes())
        parts.append(np.ascontiguousarray(c.old, dtype=bits).tobytes())
        parts.append(np.ascontiguousarray(c.new, dtype=bits).tobytes())
    body = b"".join(parts)
    return body + hashlib.blake2b(body, digest_size=_SUM).digest()


def decode_record(data: bytes, *, version: int, attempt: int) -> Record:
    """The record in `data`; `LogCorrupt` unless it is whole, intact and of (version,
    attempt)."""
    if len(data) < _HEAD.size + _SUM:
        raise LogCorrupt(f"record v{version}/a{attempt}: {len(data)} bytes, too short")
    if hashlib.blake2b(data[:-_SUM], digest_size=_SUM).digest() != data[-_SUM:]:
        raise LogCorrupt(f"record v{version}/a{attempt}: checksum mismatch (torn or damaged)")
    magic, fmt, flags, hlen = _HEAD.unpack_from(data)
    if magic != MAGIC or fmt != FORMAT or flags != 0 or _HEAD.size + hlen > len(data) - _SUM:
        raise LogCorrupt(f"record v{version}/a{attempt}: bad magic, format or header length")
    try:
        header = json.loads(data[_HEAD.size : _HEAD.size + hlen])
        got = (int(header["version"]), int(header["attempt"]), int(header["base_version"]))
        tensors = [(str(t["name"]), str(t["dtype"]), int(t["count"])) for t in header["tensors"]]
        widths = [dtype_of(dt).itemsize for _, dt, _ in tensors]
    except (KeyError, TypeError, ValueError) as e:
        raise LogCorrupt(f"record v{version}/a{attempt}: malformed header ({e})") from None
    if got[:2] != (version, attempt):
        raise LogCorrupt(f"record v{version}/a{attempt}: holds v{got[0]}/a{got[1]}")
    pos, end = _HEAD.size + hlen, len(data) - _SUM
    if pos + sum(n * (8 + 2 * w) for (_, _, n), w in zip(tensors, widths, strict=True)) != end:
        raise LogCorrupt(f"record v{version}/a{attempt}: body length does not match its header")
    changes = []
    for (name, dt, n), w in zip(tensors, widths, strict=True):
        bits = dtype_of(dt).bits_np
        idx = np.frombuffer(data, dtype="<i8", count=n, offset=pos).astype(np.int64)
        old = np.frombuffer(data, dtype=bits, count=n, offset=pos + 8 * n).copy()
        new = np.frombuffer(data, dtype=bits, count=n, offset=pos + (8 + w) * n).copy()
        pos += n * (8 + 2 * w)
        changes.append(TensorChange(name=name, dtype=dt, indices=idx, old=old, new=new))
    return Record(version=got[0], base_version=got[2], attempt=got[1], changes=tuple(changes))


def write_record(
    log_dir: Path, rec: Record, *, before_rename: Callable[[], None] | None = None
) -> Path:
    """Write `rec` durably (temporary, fsync, rename, directory fsync); returns its path."""
    path = log_dir / record_name(rec.version, rec.attempt)
    durable.atomic_write(path, encode_record(rec), before_rename=before_rename)
    return path


def read_record(log_dir: Path, version: int, attempt: int) -> Record:
    """The record of (version, attempt); `LogCorrupt` when it is missing, torn or foreign."""
    path = log_dir / record_name(version, attempt)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise LogCorrupt(f"record v{version}/a{attempt}: missing ({path})") from None
    return decode_record(data, version=version, attempt=attempt)
