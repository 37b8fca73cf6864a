"""A relay node's spool: the directory through which a node process hands payloads to the
engines of its rollout node. Written (`SpoolWriter`, by the node process) and read
(`read_spool`, `stream_spool`, `wait_manifest`, and `SpoolSource`, the transport seam's source
on a spool, by engines) only here.

Layout of a spool directory, every file written atomically (temporary name, then rename):

    <payload id>.bin                                  one payload, as it arrived (immutable)
    delivery.log                                      payload ids in arrival order
    manifest-v<version:012>-a<attempt:06>.json        every payload the manifest lists is here
    abandoned-v<version:012>-a<attempt:06>.json       the coordinator gave the attempt up

Readers route payloads by their header's (version, attempt); headers are checked here only for
routing, receivers validate payloads fully when staging.

Limitations:
1. Nothing is ever deleted here (retention is the operator's, see docs/operations.md).
2. `stream_spool` remembers each payload file's (version, attempt) per process, so a spool
   directory must not be reused for a different tree while an engine process runs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from shared_codec.format import peek_header
from shared_codec.transport.relay.messages import Abandon, Manifest
from shared_codec.transport.seam import SealedAttempt
from shared_codec.transport.store import TransportError


def _marker(kind: str, version: int, attempt: int) -> str:
    return f"{kind}-v{version:012d}-a{attempt:06d}.json"


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
        pid = peek_header(payload, verify=False).payload_id_hex
        self._write(f"{pid}.bin", payload)
        with open(self.root / "delivery.log", "a") as log:
            log.write(pid + "\n")

    def on_manifest(self, m: Manifest) -> None:
        body = {"version": m.version, "attempt": m.attempt, "payload_ids": list(m.payload_ids)}
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
    for f in sorted(Path(directory).glob("*.bin")):
        data = f.read_bytes()
        try:
            m = peek_header(data, verify=False).meta
        except Exception as e:  # a spool only holds what the node validated; report, skip none
            raise TransportError(f"spooled payload {f.name} is unreadable: {e}") from None
        if (m.version, m.attempt) == (version, attempt):
            found.append(((m.owner, m.sequence), data))
    return [data for _, data in sorted(found, key=lambda x: x[0])]


# spool directory -> {file name: (version, attempt)}: payload files are immutable (named by
# payload id), so a process reads each one's header once
_SPOOL_ROUTES: dict[str, dict[str, tuple[int, int]]] = {}


def stream_spool(
    directory: str,
    version: int,
    attempt: int,
    timeout_s: float = 60.0,
    poll_s: float = 0.01,
    cancelled: Callable[[], bool] | None = None,
) -> Iterator[bytes]:
    """Yield the payloads of (`version`, `attempt`) from a node's spool as they arrive
    (pipelined engines), until the node's manifest notice says every listed payload is here;
    raises TransportError when the attempt was abandoned, when the spool holds a payload of the
    attempt that the manifest does not list, or at `timeout_s` without a manifest notice.
    `cancelled()` true ends the stream quietly at the next poll (its consumer gave up)."""
    root = Path(directory)
    seen: set[str] = set()  # file names looked at in this call
    known = _SPOOL_ROUTES.setdefault(str(root.resolve()), {})  # earlier calls' files
    ids: set[str] = set()  # payload ids of this attempt yielded
    deadline, delay = time.monotonic() + timeout_s, poll_s
    while True:
        if cancelled is not None and cancelled():
            return
        _check_abandoned(root, version, attempt)
        manifest = _manifest_ids(root, version, attempt)
        fresh = sorted(f for f in root.glob("*.bin") if f.name not in seen) if root.exists() else []
        for f in fresh:
            seen.add(f.name)
            if f.name in known and known[f.name] != (version, attempt):
                continue  # another attempt's payload, read by an earlier call
            data = f.read_bytes()
            try:
                h = peek_header(data, verify=False)
            except Exception as e:
                raise TransportError(f"spooled payload {f.name} is unreadable: {e}") from None
            known[f.name] = (h.meta.version, h.meta.attempt)
            if (h.meta.version, h.meta.attempt) == (version, attempt):
                ids.add(h.payload_id_hex)
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
            delay = poll_s
        else:
            time.sleep(delay)
            delay = min(0.05, delay * 1.5)


class SpoolSource:
    """`seam.PayloadSource` on a relay node's spool (spec kind ``spool``)."""

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
        """The payload ids of the node's manifest notice, in its order (waits for it); a relay
        manifest carries no base version (None)."""
        wait_manifest(self.directory, version, attempt, timeout_s)
        f = Path(self.directory) / _marker("manifest", version, attempt)
        ids = json.loads(f.read_text())["payload_ids"]
        return SealedAttempt(
            version=version, attempt=attempt, base_version=None, payload_ids=tuple(ids)
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
