"""Durable file operations of the replica store: atomic replace, directory fsync, durable copy.

Every helper makes its effect durable before it returns (POSIX: data fsynced before the rename
that publishes it, the directory fsynced after), so a crash (process kill or power loss) leaves
either the old or the new file under the final name, never a torn one. Temporary files carry
the prefix `TMP_PREFIX` in the directory of their target; `remove_temporaries` sweeps them.

Limitations:
1. Durability assumes a local POSIX file system that honours fsync on files and directories
   (ext4, xfs); network file systems that do not are out of scope.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

#: every temporary file or directory the replica writes starts with this prefix
TMP_PREFIX = ".dcr-tmp-"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so the names created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file's data and metadata (after writes through a memory map or another fd)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: Path,
    data: bytes | Sequence[bytes],
    *,
    before_rename: Callable[[], None] | None = None,
) -> None:
    """Replace `path` with `data` (bytes, or parts written in order) atomically and durably:
    write a temporary file beside it, fsync it, rename it over `path`, fsync the directory.
    `before_rename`, when given, is called between the fsync and the rename (the store's crash
    points use it)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def copy_file(src: Path, dst: Path) -> None:
    """Copy `src` over `dst` durably and atomically (a temporary beside `dst`, fsync, rename,
    fsync the directory): a reader or a crash sees the old or the new file whole."""
    tmp = dst.with_name(f"{TMP_PREFIX}{dst.name}")
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        shutil.copyfileobj(fin, fout, 16 << 20)
        fout.flush()
        os.fsync(fout.fileno())
    shutil.copystat(src, tmp)
    os.replace(tmp, dst)
    fsync_dir(dst.parent)


def files_of(root: Path) -> list[Path]:
    """The regular files under `root`, relative to it, sorted (temporaries excluded)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(TMP_PREFIX))
        for name in filenames:
            if not name.startswith(TMP_PREFIX):
                out.append(Path(dirpath, name).relative_to(root))
    return sorted(out)


def copy_tree(src: Path, dst: Path) -> None:
    """Copy the regular files of directory `src` into a new directory `dst` durably: every file
    and directory fsynced, `dst` itself published by a rename from a temporary name (a crash
    leaves no partial `dst`). `dst` must not exist."""
    if dst.exists():
        raise FileExistsError(dst)
    tmp = dst.with_name(f"{TMP_PREFIX}{dst.name}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    dirs = {tmp}
    for rel in files_of(src):
        target = tmp / rel
        if target.parent not in dirs:
            target.parent.mkdir(parents=True, exist_ok=True)
            dirs.add(target.parent)
        with open(src / rel, "rb") as fin, open(target, "wb") as fout:
            shutil.copyfileobj(fin, fout, 16 << 20)
            fout.flush()
            os.fsync(fout.fileno())
        shutil.copystat(src / rel, target)
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)
    os.replace(tmp, dst)
    fsync_dir(dst.parent)


def remove_temporaries(root: Path) -> list[Path]:
    """Remove every temporary (`TMP_PREFIX`) file or directory under `root`; returns them.
    Only the store's own temporaries carry the prefix, so this removes nothing else."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            if name.startswith(TMP_PREFIX):
                found.append(Path(dirpath, name))
        dirnames[:] = [d for d in dirnames if not d.startswith(TMP_PREFIX)]
    for p in found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    for parent in {p.parent for p in found}:
        fsync_dir(parent)
    return found


def checkpoint_identity(directory: Path) -> str:
    """A digest over the relative path and bytes of every file of a checkpoint directory (what
    tells the initial checkpoint a root was bootstrapped from from another one)."""
    h = hashlib.blake2b(digest_size=16)
    for rel in files_of(directory):
        h.update(f"{rel.as_posix()}\0".encode())
        with open(directory / rel, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()
