"""A relay node's spool: the directory through which a node process hands payloads to the
engines of its rollout node. Written (`SpoolWriter`, by the node process) and read
(`read_spool`, `stream_spool`, `wait_manifest`, and `SpoolSource`, the transport's source
on a spool, by engines) only here.

Layout of a spool directory, every file written atomically (temporary name, then rename):

    v<version:012>-a<attempt:06>-<payload id>.bin     one payload, as it arrived (immutable)
    delivery-v<version:012>.log                       the version's payload ids, arrival order
    manifest-v<version:012>-a<attempt:06>.json        every payload the manifest lists is here
    abandoned-v<version:012>-a<attempt:06>.json       the coordinator gave the attempt up

Readers list only the files of the (version, attempt) they read (so a reader's cost does not
grow with the spool) and check each header against its name; receivers validate payloads fully
when staging. Retention (`SpoolWriter.forget`, on the tree's `Forget` message): every file of
versions below the given one is removed.

Limitations:
1. A payload file is named from its header's (version, attempt) when the node spools it; a
   header that disagrees with its file name is reported (TransportError), never read as
   another attempt's.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from shared_codec.format import PayloadHeader, peek_header
from shared_codec.transport.base import SealedAttempt
from shared_codec.transport.relay.messages import Abandon, Forget, Manifest
from shared_codec.transport.store import DirectoryStore, TransportError


def _marker(kind: str, version: int, attempt: int) -> str:
    return f"{kind}-v{version:012d}-a{attempt:06d}.json"


def _payload_files(root: Path, version: int, attempt: int) -> list[Path]:
    """The attempt's payload files in `root` (one directory read: a poll stays cheap)."""
    head, tail = f"v{version:012d}-a{attempt:06d}-", ".bin"
    try:
        with os.scandir(root) as it:
            return [Path(e.path) for e in it if e.name.startswith(head) and e.name.endswith(tail)]
    except FileNotFoundError:
        return []


# the version of every file a spool writes (payloads, delivery logs, notices)
_VERSION_IN_NAME = re.compile(r"^(?:[a-z]+-)?v(\d{12})[-.]")


class SpoolWriter:
    """The node process's side: `deliver` and the two notices (node callbacks)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)

    def _write(self, name: str, data: bytes) -> None:
        tmp = self.root / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.root / name)

    def deliver(self, payload: bytes) -> None:
        h = peek_header(payload, verify=False)
        m, pid = h.meta, h.payload_id_hex
        self._write(f"v{m.version:012d}-a{m.attempt:06d}-{pid}.bin", payload)
        with open(self.root / f"delivery-v{m.version:012d}.log", "a") as log:
            log.write(pid + "\n")

    def forget(self, f: Forget) -> int:
        """Remove every file of versions below ``f.before_version``; returns how many."""
        removed = 0
        for entry in os.scandir(self.root):
            m = _VERSION_IN_NAME.match(entry.name)
            if m is not None and int(m.group(1)) < f.before_version:
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def on_manifest(self, m: Manifest) -> None:
        body = {
            "version": m.version,
            "attempt": m.attempt,
            "base_version": m.base_version,
            "payload_ids": list(m.payload_ids),
        }
        self._write(_marker("manifest", m.version, m.attempt), json.dumps(body).encode())

    def on_abandon(self, a: Abandon) -> None:
        body = {"version": a.version, "attempt": a.attempt, "reason": a.reason}
        self._write(_marker("abandoned", a.version, a.attempt), json.dumps(body).encode())


def _check_abandoned(root: Path, version: int, attempt: int) -> None:
    abandoned = root / _marker("abandoned", version, attempt)
    if abandoned.exists():
        why = json.loads(abandoned.read_text()).get("reason", "")
        raise TransportError(
            f"version {version} attempt {attempt} was abandoned by the coordinator: {why}"
        )


def _manifest_ids(root: Path, version: int, attempt: int) -> set[str] | None:
    f = root / _marker("manifest", version, attempt)
    return set(json.loads(f.read_text())["payload_ids"]) if f.exists() else None


def wait_manifest(directory: str, version: int, attempt: int, timeout_s: float = 60.0) -> set[str]:
    """The payload ids of the node's manifest notice for (`version`, `attempt`), waiting for it
    up to `timeout_s`; raises TransportError when the attempt was abandoned or at the timeout."""
    root = Path(directory)
    deadline, delay = time.monotonic() + timeout_s, 0.01
    while True:
        _check_abandoned(root, version, attempt)
        ids = _manifest_ids(root, version, attempt)
        if ids is not None:
            return ids
        if time.monotonic() > deadline:
            raise TransportError(
                f"no manifest notice for version {version} attempt {attempt} in {directory} "
                f"after {timeout_s:.0f}s: owners, the tree or the coordinator did not finish"
            )
        time.sleep(delay)
        delay = min(0.2, delay * 2)


def read_spool(directory: str, version: int, attempt: int) -> list[bytes]:
    """The payloads of (`version`, `attempt`) spooled in `directory`, in (owner, sequence)
    order, as they are now (no waiting: call it after the tree's completion acknowledgement,
    or after `wait_manifest`)."""
    found = []
    for f in sorted(_payload_files(Path(directory), version, attempt)):
        data = f.read_bytes()
        m = _checked_header(f, data, version, attempt).meta
        found.append(((m.owner, m.sequence), data))
    return [data for _, data in sorted(found, key=lambda x: x[0])]


def _checked_header(f: Path, data: bytes, version: int, attempt: int) -> PayloadHeader:
    """The header of spooled payload file `f`, which must be of (`version`, `attempt`)."""
    try:
        h = peek_header(data, verify=False)
    except Exception as e:  # a spool only holds what the node validated; report, skip none
        raise TransportError(f"spooled payload {f.name} is unreadable: {e}") from None
    if (h.meta.version, h.meta.attempt) != (version, attempt) or not f.name.endswith(
        f"-{h.payload_id_hex}.bin"
    ):
        raise TransportError(
            f"spooled payload {f.name} holds payload {h.payload_id_hex} of version "
            f"{h.meta.version} attempt {h.meta.attempt}: its name says otherwise"
        )
    return h


def stream_spool(
    directory: str,
    version: int,
    attempt: int,
    timeout_s: float = 60.0,
    poll_s: tuple[float, float] = DirectoryStore.poll_s,
    cancelled: Callable[[], bool] | None = None,
) -> Iterator[bytes]:
    """Yield the payloads of (`version`, `attempt`) from a node's spool as they arrive
    (listing it every ``poll_s[0]`` s, backing off to ``poll_s[1]``: a local directory)
    (pipelined engines), until the node's manifest notice says every listed payload is here;
    raises TransportError when the attempt was abandoned, when the spool holds a payload of the
    attempt that the manifest does not list, or at `timeout_s` without a manifest notice.
    `cancelled()` true ends the stream quietly at the next poll (its consumer gave up)."""
    root = Path(directory)
    seen: set[str] = set()  # file names looked at in this call
    ids: set[str] = set()  # payload ids of this attempt yielded
    first, cap = poll_s
    deadline, delay = time.monotonic() + timeout_s, first
    while True:
        if cancelled is not None and cancelled():
            return
        _check_abandoned(root, version, attempt)
        manifest = _manifest_ids(root, version, attempt)
        fresh = sorted(f for f in _payload_files(root, version, attempt) if f.name not in seen)
        for f in fresh:
            seen.add(f.name)
            data = f.read_bytes()
            ids.add(_checked_header(f, data, version, attempt).payload_id_hex)
            yield data
        if manifest is not None:
            stray = ids - manifest
            if stray:
                raise TransportError(
                    f"version {version} attempt {attempt}: {len(stray)} spooled payload(s) not "
                    f"listed by the manifest (first: {sorted(stray)[0]})"
                )
            if manifest <= ids:
                return
            # the notice is written only after local delivery: a later listing will have them
        if time.monotonic() > deadline:
            raise TransportError(
                f"no manifest notice for version {version} attempt {attempt} in {directory} "
                f"after {timeout_s:.0f}s: owners, the tree or the coordinator did not finish"
            )
        if fresh:
            delay = first
        else:
            time.sleep(delay)
            delay = min(cap, delay * 1.5)


class SpoolSource:
    """`base.PayloadSource` on a relay node's spool (spec kind ``spool``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def fetch(self, version: int, attempt: int, timeout_s: float = 60.0) -> Iterator[bytes]:
        """Every payload the node's manifest notice lists, in (owner, sequence) order: waits
        for the notice (written before the node acknowledges the attempt up the tree), raises
        TransportError when the attempt was abandoned or a listed payload is not spooled."""
        ids = wait_manifest(self.directory, version, attempt, timeout_s)
        payloads = read_spool(self.directory, version, attempt)
        have = {peek_header(p, verify=False).payload_id_hex for p in payloads}
        if have != ids:
            raise TransportError(
                f"version {version} attempt {attempt} in {self.directory}: "
                f"{len(ids - have)} listed payload(s) missing, {len(have - ids)} not listed"
            )
        yield from payloads

    def sealed(self, version: int, attempt: int, timeout_s: float = 60.0) -> SealedAttempt:
        """The payload ids of the node's manifest notice, in its order, and the base version
        the sealing party named (None when its manifest did not say); waits for the notice."""
        wait_manifest(self.directory, version, attempt, timeout_s)
        f = Path(self.directory) / _marker("manifest", version, attempt)
        notice = json.loads(f.read_text())
        return SealedAttempt(
            version=version,
            attempt=attempt,
            base_version=notice.get("base_version"),
            payload_ids=tuple(notice["payload_ids"]),
        )

    def stream(
        self,
        version: int,
        attempt: int,
        timeout_s: float = 60.0,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[bytes]:
        return stream_spool(self.directory, version, attempt, timeout_s, cancelled=cancelled)
