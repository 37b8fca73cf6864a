"""The replica's write-ahead log: one record per staged (version, attempt), holding that
attempt's payloads exactly as they were received (codec-compressed, ~ a payload set's bytes).

A record names the elements an attempt may write: decoding its payloads gives, per canonical
tensor, the flat indices its items touch. Every repair is a copy of the committed slot's bits at
those indices into the shadow: undoing a staged attempt (abort, an overwrite retry, recovery
after a crash: the committed slot holds its base version) and replaying the committed
transition into the slot that lags one version (the committed slot holds its new bits). A copy
of committed bits is an overwrite, so replaying any number of times, in any state a crash left,
ends in the same bits; copying at indices where an attempt changed nothing is harmless.

A record file ``log/v<version>-a<attempt>.dcrlog`` (no pickle; all integers little-endian):
```
offset  size  field
0       4     magic          "DCRL"
4       2     format         2
6       2     flags          0
8       4     header_len     H
12      H     header         UTF-8 JSON: {"version", "base_version", "attempt",
                             "payloads": [byte length, ...]}
12+H    B     body           the payloads, in header order, concatenated
12+H+B  32    checksum       BLAKE2b-256 of bytes [0, 12+H+B)
```
The file is written whole to a temporary name, fsynced, renamed into place and the directory
fsynced (`durable.atomic_write`) before any slot is touched; `read_record` checks every length
and the checksum and raises `LogCorrupt` for anything else, so a torn or foreign record is never
replayed. Its payloads are decoded again with the codec (digest, key, lengths, indices) when a
repair reads it back; a store that wrote a record keeps its indices in memory and reads the log
only after a restart.

Format 1 (before 2026-12-07) held the indices with the old and new bits (12 bytes per changed
BF16 element, ~8x a payload set); a format-1 record is `LogCorrupt`, which a repair handles by
copying the committed slot.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared_codec.errors import ReplicaError
from shared_codec.replica import durable

MAGIC = b"DCRL"
FORMAT = 2
_HEAD = struct.Struct("<4sHHI")
_SUM = 32
_NAME = re.compile(r"^v(\d+)-a(\d+)\.dcrlog$")


class LogCorrupt(ReplicaError):
    """A log record is missing, torn or not a record of this (version, attempt). Caught inside
    the store, which then rebuilds the slot from the committed one; never raised to callers."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Touched:
    """The elements of one tensor an attempt may have written: sorted unique flat indices."""

    name: str
    indices: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Logged:
    """A record as written: (version, attempt) over `base_version` and its payloads."""

    version: int
    base_version: int
    attempt: int
    payloads: tuple[bytes, ...]


def record_name(version: int, attempt: int) -> str:
    return f"v{version}-a{attempt}.dcrlog"


def parse_name(name: str) -> tuple[int, int] | None:
    """(version, attempt) of a record file name, None for any other name."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def encode_record(
    version: int, base_version: int, attempt: int, payloads: Sequence[bytes]
) -> list[bytes]:
    """The record's bytes, as parts to write in order (the payloads are not copied)."""
    header = {
        "version": version,
        "base_version": base_version,
        "attempt": attempt,
        "payloads": [len(p) for p in payloads],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [_HEAD.pack(MAGIC, FORMAT, 0, len(head)), head, *payloads]
    h = hashlib.blake2b(digest_size=_SUM)
    for p in parts:
        h.update(p)
    return [*parts, h.digest()]


def decode_record(data: bytes, *, version: int, attempt: int) -> Logged:
    """The record in `data`; `LogCorrupt` unless it is whole, intact and of (version,
    attempt)."""
    if len(data) < _HEAD.size + _SUM:
        raise LogCorrupt(f"record v{version}/a{attempt}: {len(data)} bytes, too short")
    view = memoryview(data)
    if hashlib.blake2b(view[:-_SUM], digest_size=_SUM).digest() != data[-_SUM:]:
        raise LogCorrupt(f"record v{version}/a{attempt}: checksum mismatch (torn or damaged)")
    magic, fmt, flags, hlen = _HEAD.unpack_from(data)
    if magic != MAGIC or fmt != FORMAT or flags != 0 or _HEAD.size + hlen > len(data) - _SUM:
        raise LogCorrupt(
            f"record v{version}/a{attempt}: bad magic, format ({fmt}, this store reads "
            f"{FORMAT}) or header length"
        )
    try:
        header = json.loads(bytes(view[_HEAD.size : _HEAD.size + hlen]))
        got = (int(header["version"]), int(header["attempt"]), int(header["base_version"]))
        lengths = [int(n) for n in header["payloads"]]
    except (KeyError, TypeError, ValueError) as e:
        raise LogCorrupt(f"record v{version}/a{attempt}: malformed header ({e})") from None
    if got[:2] != (version, attempt):
        raise LogCorrupt(f"record v{version}/a{attempt}: holds v{got[0]}/a{got[1]}")
    pos, end = _HEAD.size + hlen, len(data) - _SUM
    if any(n < 0 for n in lengths) or pos + sum(lengths) != end:
        raise LogCorrupt(f"record v{version}/a{attempt}: body length does not match its header")
    payloads = []
    for n in lengths:
        payloads.append(bytes(view[pos : pos + n]))
        pos += n
    return Logged(version=got[0], base_version=got[2], attempt=got[1], payloads=tuple(payloads))


def write_record(
    log_dir: Path,
    version: int,
    base_version: int,
    attempt: int,
    payloads: Sequence[bytes],
    *,
    before_rename: Callable[[], None] | None = None,
) -> Path:
    """Write the record durably (temporary, fsync, rename, directory fsync); returns its path."""
    path = log_dir / record_name(version, attempt)
    durable.atomic_write(
        path, encode_record(version, base_version, attempt, payloads), before_rename=before_rename
    )
    return path


def read_record(log_dir: Path, version: int, attempt: int) -> Logged:
    """The record of (version, attempt); `LogCorrupt` when it is missing, torn or foreign."""
    path = log_dir / record_name(version, attempt)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise LogCorrupt(f"record v{version}/a{attempt}: missing ({path})") from None
    return decode_record(data, version=version, attempt=attempt)


def prune_records(log_dir: Path, keep: set[tuple[int, int]]) -> None:
    """Remove every record whose (version, attempt) is not in `keep` (durably: the directory
    is fsynced when something was removed)."""
    removed = False
    for f in log_dir.iterdir() if log_dir.is_dir() else ():
        key = parse_name(f.name)
        if key is not None and key not in keep:
            f.unlink()
            removed = True
    if removed:
        durable.fsync_dir(log_dir)
