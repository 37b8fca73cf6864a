"""Per-tensor digests of the replica's committed version and of its staged attempt, computed
on demand: a stage names the tensors it changed and hashes nothing, so a refit's ACK never
waits for a hash of whole tensors; `ReplicaStore.digest` hashes what it needs then (every
committed tensor once after a root is opened, later only the tensors a transition changed).

The combined digest is `checkpoint.combined_digest` of every tensor's `tensor_digest`, the same
value as ``combined_digest(state_digests(load_checkpoint(dir)))`` of the slot's directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from shared_codec.replica.layout import SlotFiles, TensorLoc

#: reads the digests of the named tensors from one slot's files
Reader = Callable[[Iterable[str]], dict[str, str]]


def slot_reader(directory: Path, layout: dict[str, TensorLoc]) -> Reader:
    """A `Reader` of the slot `directory` (its files mapped read-only for each call)."""

    def read(names: Iterable[str]) -> dict[str, str]:
        with SlotFiles(directory, layout, write=False) as f:
            return {n: f.digest(n) for n in names}

    return read


class DigestCache:
    """See the module docstring. Not thread-safe (the store's one caller)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything (a root opened or recovered)."""
        self._committed: dict[str, str] | None = None
        self._stale: set[str] = set()  # committed tensors whose digest must be read again
        self._staged: tuple[int, int, frozenset[str]] | None = None
        self._staged_digests: dict[str, str] = {}

    def staged(self, version: int, attempt: int, changed: Iterable[str]) -> None:
        """Attempt (`version`, `attempt`) is staged; it differs from the committed version in
        the tensors `changed` only."""
        self._staged = (version, attempt, frozenset(changed))
        self._staged_digests = {}

    def unstaged(self) -> None:
        """The shadow is back at the committed version (abort, repair)."""
        self._staged, self._staged_digests = None, {}

    def committed(self, version: int, attempt: int | None) -> None:
        """(`version`, `attempt`) became the committed version."""
        if self._staged is None or self._staged[:2] != (version, attempt):
            self._committed, self._stale = None, set()
        elif self._committed is not None:
            for name in self._staged[2]:
                if name in self._staged_digests:
                    self._committed[name] = self._staged_digests[name]
                else:
                    self._stale.add(name)
        self.unstaged()

    def of_committed(self, names: Iterable[str], read: Reader) -> dict[str, str]:
        """Every committed tensor's digest (`names`: all of them), reading what is not known."""
        if self._committed is None:
            self._committed, self._stale = read(sorted(names)), set()
        elif self._stale:
            self._committed.update(read(sorted(self._stale)))
            self._stale = set()
        return self._committed

    def of_staged(
        self, version: int, attempt: int, names: Iterable[str], committed: Reader, shadow: Reader
    ) -> dict[str, str]:
        """Every tensor's digest in the staged attempt: the committed ones, with the changed
        tensors read from the shadow (all of them when the stage happened before this cache
        knew of it: a root opened with an attempt staged)."""
        names = sorted(names)
        if self._staged is None or self._staged[:2] != (version, attempt):
            self._staged = (version, attempt, frozenset(names))
            self._staged_digests = shadow(names)
        out = dict(self.of_committed(names, committed))
        todo = [n for n in self._staged[2] if n not in self._staged_digests]
        if todo:
            self._staged_digests.update(shadow(todo))
        out.update(self._staged_digests)
        return out


__all__ = ["DigestCache", "Reader", "slot_reader"]
