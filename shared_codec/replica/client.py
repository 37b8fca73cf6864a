"""Clients of the replica's HTTP service (service.py): `HttpReplica`, the coordinator's handle
of a replica in another process or host (a required receiver, like `ReplicaReceiver` in
process), and `download` / `local_checkpoint`, which bring a committed version's checkpoint to
a local directory with range reads under one lease (a restore or join on any host of the
rollout cluster; `dcr_dense_load` takes the URL `HttpReplica.checkpoint_for` gives).

A checkpoint URL is ``<replica base URL>/replica/checkpoints/<version>``.

Limitations:
1. Each engine rank that dense-loads a URL downloads the checkpoint itself (into a temporary
   directory it removes after the load), so ranks on one node read it once each.
"""

from __future__ import annotations

import json
import mmap
import re
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

from shared_codec.coordination.protocol import EngineAck
from shared_codec.errors import EngineUnreachable, ReplicaError, error_class

_URL = re.compile(r"^(https?://[^/]+)/replica/checkpoints/(\d+)/?$")
CHUNK_BYTES = 64 << 20


def _call(base: str, method: str, path: str, body: Any = None, timeout: float = 600.0) -> Any:
    """One JSON request; the service's typed error raised as its DCR class; a connection that
    fails or times out is `EngineUnreachable`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            err = json.loads(e.read())
        except ValueError:
            raise ReplicaError(f"replica {base}: {method} {path}: HTTP {e.code}") from None
        raise error_class(str(err.get("error_type")))(
            f"replica {base}: {method} {path}: {err.get('error')}"
        ) from None
    except (urllib.error.URLError, OSError) as e:
        raise EngineUnreachable(f"replica {base}: {method} {path}: {e}") from None


class HttpReplica:
    """The coordinator's handle of a replica service (its `Engine` protocol over HTTP): a
    required receiver (`participants.required`). `checkpoint_for(v)` is the checkpoint URL that
    engines' dense loads download."""

    required = True

    def __init__(
        self,
        base_url: str,
        *,
        name: str = "replica",
        timeout_s: float = 60.0,
        launcher: Callable[[], str] | None = None,
    ) -> None:
        """`launcher`: restarts the service (``dcr replica serve`` on the same root) and
        returns its new base URL; `restore` uses it when the service does not answer."""
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.launcher = launcher
        self.last: EngineAck | None = None

    def apply(self, version: int, attempt: int, timeout_s: float) -> EngineAck:
        body = {"version": version, "attempt": attempt, "timeout_s": timeout_s}
        got = _call(self.base_url, "POST", "/replica/apply", body, timeout=timeout_s + 30)
        self.last = EngineAck.parse(got, what=f"replica {self.name} ACK")
        return self.last

    def commit(self, version: int) -> None:
        _call(self.base_url, "POST", "/replica/commit", {"version": version}, self.timeout_s)

    def abort(self, attempt: int) -> None:
        _call(self.base_url, "POST", "/replica/abort", {"attempt": attempt}, self.timeout_s)

    def restore(self, version: int) -> None:
        """The service reopens its store (recovering what a crash left) and must then hold
        committed `version`; a service that does not answer is restarted first (`launcher`)."""
        try:
            _call(self.base_url, "POST", "/replica/restore", {"version": version}, self.timeout_s)
            return
        except EngineUnreachable:
            if self.launcher is None:
                raise
        self.base_url = self.launcher().rstrip("/")
        _call(self.base_url, "POST", "/replica/restore", {"version": version}, self.timeout_s)

    def digest(self) -> str:
        return str(_call(self.base_url, "GET", "/replica/digest", timeout=self.timeout_s)["digest"])

    def status(self) -> dict[str, Any]:
        got: dict[str, Any] = _call(self.base_url, "GET", "/replica/status", timeout=self.timeout_s)
        return got

    def checkpoint_for(self, version: int) -> str:
        return f"{self.base_url}/replica/checkpoints/{int(version)}"


def download(
    url: str,
    dest: str | Path,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    threads: int = 4,
    timeout_s: float = 600.0,
) -> Path:
    """Download the checkpoint at `url` (``.../replica/checkpoints/<v>``) into the new
    directory `dest` under one lease: every file in ranges of `chunk_bytes`, `threads` at a
    time, each checked for its size. `ReplicaError` when the version is not held or a file
    comes back short; `dest` is then removed."""
    m = _URL.match(url)
    if m is None:
        raise ReplicaError(f"not a replica checkpoint URL: {url!r}")
    base, version = m.group(1), int(m.group(2))
    dest = Path(dest)
    lease = _call(base, "POST", "/replica/leases", {"version": version, "ttl_s": timeout_s})
    lease_id = lease["lease"]
    made = False
    try:
        dest.mkdir(parents=True)  # a directory that exists is refused, never overwritten
        made = True
        jobs = []
        for f in lease["files"]:
            target = dest / f["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                out.truncate(f["size"])
            for start in range(0, f["size"], chunk_bytes):
                jobs.append((f["path"], target, start, min(f["size"], start + chunk_bytes)))
        file_url = f"{base}/replica/leases/{lease_id}/files/"
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for _ in pool.map(lambda j: _range_get(file_url, *j, timeout_s=timeout_s), jobs):
                pass
    except BaseException:
        if made:
            shutil.rmtree(dest, ignore_errors=True)
        raise
    finally:
        try:
            _call(base, "DELETE", f"/replica/leases/{lease_id}", timeout=30)
        except Exception:  # it expires on its own
            pass
    return dest


def _range_get(
    file_url: str, rel: str, target: Path, start: int, end: int, *, timeout_s: float
) -> None:
    req = urllib.request.Request(file_url + quote(rel))
    req.add_header("Range", f"bytes={start}-{end - 1}")
    got = 0
    try:
        with (
            urllib.request.urlopen(req, timeout=timeout_s) as resp,
            open(target, "r+b") as out,
            mmap.mmap(out.fileno(), 0) as m,
        ):
            view = memoryview(m)[start:end]  # straight into the file's pages
            try:
                while got < end - start:
                    n = resp.readinto(view[got:])
                    if not n:
                        break
                    got += n
            finally:
                view.release()
    except urllib.error.HTTPError as e:
        raise ReplicaError(f"{rel} [{start}, {end}): HTTP {e.code}: {e.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise EngineUnreachable(f"{rel} [{start}, {end}): {e}") from None
    if got != end - start:
        raise ReplicaError(f"{rel} [{start}, {end}): got {got} bytes")


def is_checkpoint_url(path: str) -> bool:
    return _URL.match(str(path)) is not None


@contextmanager
def local_checkpoint(path: str, *, tmp_dir: str | None = None) -> Iterator[str]:
    """`path` itself when it is a directory path; a replica checkpoint URL downloaded into a
    temporary directory (removed afterwards) otherwise."""
    if not is_checkpoint_url(path):
        yield path
        return
    parent = Path(tempfile.mkdtemp(prefix="dcr-replica-ckpt-", dir=tmp_dir))
    try:
        yield str(download(path, parent / "checkpoint"))
    finally:
        shutil.rmtree(parent, ignore_errors=True)


__all__ = ["HttpReplica", "download", "is_checkpoint_url", "local_checkpoint"]
