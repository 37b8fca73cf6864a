"""Object-storage transport: owners upload each payload once, a manifest is written last,
rollout nodes fetch every payload the manifest lists.

Key layout (under the store's prefix), per transition version and attempt:

    v<version:012>/a<attempt:06>/o<owner:05>/s<sequence:06>-<payload id>.dcrp   payloads
    v<version:012>/a<attempt:06>/owners/o<owner:05>.json                      owner lists
    v<version:012>/a<attempt:06>/manifest.json                                  written last
    v<version:012>/a<attempt:06>/abandoned.json       coordinator: no manifest will come

Call order: each owner ``pub = ObjectPublisher(store, version=, attempt=, owner=)``,
``pub.send(payload)`` per payload (uploads run concurrently, bounded), ``pub.finish()`` (waits
for the uploads, then writes its owner list). The coordinator then calls `write_manifest` with
the owners it expects (create-only: a manifest is never replaced). Rollout nodes call
``ObjectFetcher(store).fetch(version, attempt)``, which waits for the manifest, reads the owner
lists and yields each listed payload after checking its size and payload id. Pipelined rollout
nodes call ``ObjectFetcher(store).stream(version, attempt)`` instead: it yields payloads as
their objects appear, before the manifest exists (so a receiver can stage and apply payload l
while l + 1 is still being built or uploaded), and checks the set against the manifest once it
is written. A coordinator whose owners failed writes the attempt's ``abandoned.json``
(`abandon_attempt`) so that waiting fetchers stop at once instead of at their timeout.

Behind the transport interfaces (`base.py`, opened by `spec.py`): `ObjectSink` is the sink (publisher, manifest as the
seal, abandon marker) and `ObjectFetcher` the source of the ``dir`` and ``s3`` spec kinds.

Cleanup policy: objects of attempts of versions older than the committed version are garbage;
`cleanup(store, committed_version, keep=1)` deletes every attempt of versions below
``committed_version - keep + 1`` (the committed version's own attempts are kept for receivers
that restart and re-fetch). Failed attempts of the current version are deleted by the same call
once their version is old.
"""

from __future__ import annotations

import json
import operator
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from shared_codec.errors import PayloadError
from shared_codec.format import peek_header
from shared_codec.transport.base import ObjectStore, Seal, SealedAttempt, SinkReport
from shared_codec.transport.store import TransportError, poll_interval


def attempt_prefix(version: int, attempt: int) -> str:
    return f"v{version:012d}/a{attempt:06d}/"


class ObjectPublisher:
    """Uploads one owner's payloads of one attempt, then its owner list."""

    def __init__(
        self, store: ObjectStore, *, version: int, attempt: int, owner: int, concurrency: int = 4
    ) -> None:
        self.store = store
        self.version, self.attempt, self.owner = version, attempt, owner
        self.prefix = attempt_prefix(version, attempt)
        self.entries: list[dict] = []
        self.bytes_uploaded = 0
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="dcr-put")
        self._futures: list[Future[None]] = []
        # uploads in flight (running or queued): `send` blocks on a free slot (back-pressure)
        self._slots = threading.BoundedSemaphore(concurrency * 2)

    def send(self, payload: bytes) -> None:
        """Upload one payload (asynchronously; bounded in-flight uploads give back-pressure)."""
        h = peek_header(payload, verify=False)
        m = h.meta
        if (m.version, m.attempt, m.owner) != (self.version, self.attempt, self.owner):
            raise ValueError(
                f"payload {h.payload_id_hex} is for version {m.version} attempt {m.attempt} "
                f"owner {m.owner}, publisher is {self.version}/{self.attempt}/{self.owner}"
            )
        key = f"{self.prefix}o{self.owner:05d}/s{m.sequence:06d}-{h.payload_id_hex}.dcrp"
        self.entries.append(
            {
                "key": key,
                "size": len(payload),
                "payload_id": h.payload_id_hex,
                "sequence": m.sequence,
            }
        )
        self.bytes_uploaded += len(payload)
        self._slots.acquire()
        try:
            future = self._pool.submit(self.store.put, key, payload)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _: self._slots.release())
        self._futures.append(future)

    def finish(self) -> dict:
        """Wait for every upload, then write this owner's list. Returns the list."""
        try:
            for f in self._futures:
                f.result()
        finally:
            self._pool.shutdown(wait=True)
        listing = {
            "owner": self.owner,
            "version": self.version,
            "attempt": self.attempt,
            "payloads": sorted(self.entries, key=lambda e: e["sequence"]),
        }
        self.store.put(
            f"{self.prefix}owners/o{self.owner:05d}.json",
            json.dumps(listing, sort_keys=True).encode(),
        )
        return listing


def write_manifest(
    store: ObjectStore, *, version: int, base_version: int, attempt: int, owners: list[int]
) -> dict:
    """Write the attempt's manifest (create-only) after checking every owner list exists."""
    prefix = attempt_prefix(version, attempt)
    counts = {}
    for o in owners:
        try:
            listing = json.loads(store.get(f"{prefix}owners/o{o:05d}.json"))
        except KeyError:
            raise TransportError(
                f"manifest for version {version} attempt {attempt}: owner {o} has not finished "
                "publishing (no owner list)"
            ) from None
        counts[str(o)] = len(listing["payloads"])
    manifest = {
        "version": version,
        "base_version": base_version,
        "attempt": attempt,
        "owners": sorted(owners),
        "payload_counts": counts,
    }
    if not store.put_if_absent(
        f"{prefix}manifest.json", json.dumps(manifest, sort_keys=True).encode()
    ):
        existing = json.loads(store.get(f"{prefix}manifest.json"))
        if existing != manifest:
            raise TransportError(
                f"a different manifest exists for version {version} attempt {attempt}"
            )
    return manifest


def abandon_attempt(store: ObjectStore, *, version: int, attempt: int, reason: str) -> None:
    """Tell every fetcher of the attempt that no manifest will come (the coordinator, when the
    owners' build failed). Fetchers raise TransportError naming `reason`."""
    store.put_if_absent(
        f"{attempt_prefix(version, attempt)}abandoned.json",
        json.dumps({"version": version, "attempt": attempt, "reason": reason}).encode(),
    )


class ObjectSink:
    """`base.PayloadSink` on an object store: an `ObjectPublisher` for an owner, the manifest
    as the seal, the ``abandoned.json`` marker as the abandon. Without an owner (the
    coordinator) it sends nothing."""

    def __init__(
        self, store: ObjectStore, *, version: int, attempt: int, owner: int | None = None
    ) -> None:
        self.store = store
        self.version, self.attempt, self.owner = version, attempt, owner
        self._pub = (
            None
            if owner is None
            else ObjectPublisher(store, version=version, attempt=attempt, owner=owner)
        )
        self._finished = False

    def send(self, payload: bytes) -> None:
        if self._pub is None:
            raise ValueError("a sink opened without an owner cannot send payloads")
        self._pub.send(payload)

    def finish(self) -> SinkReport:
        if self._pub is None:
            return SinkReport(payload_ids=(), bytes=0)
        listing = self._pub.finish()
        self._finished = True
        return SinkReport(
            payload_ids=tuple(e["payload_id"] for e in listing["payloads"]),
            bytes=self._pub.bytes_uploaded,
        )

    def seal(self, seal: Seal) -> None:
        write_manifest(
            self.store,
            version=self.version,
            base_version=seal.base_version,
            attempt=self.attempt,
            owners=list(seal.owners),
        )

    def abandon(self, reason: str) -> None:
        abandon_attempt(self.store, version=self.version, attempt=self.attempt, reason=reason)

    def close(self) -> None:
        """Waits for uploads still running (a sink given up without `finish`); writes no list."""
        if self._pub is not None and not self._finished:
            self._pub._pool.shutdown(wait=True)

    def __enter__(self) -> ObjectSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_size(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_id(v: object) -> bool:
    return isinstance(v, str) and len(v) == 32 and set(v) <= set("0123456789abcdef")


class ObjectFetcher:
    """A rollout node's reader: every payload of an attempt, exactly once, verified."""

    def __init__(self, store: ObjectStore, *, key: bytes | None = None) -> None:
        self.store = store
        self.key = key
        self.bytes_fetched = 0

    def _try_manifest(self, version: int, attempt: int) -> dict | None:
        """The manifest if written; raises TransportError if the attempt was abandoned."""
        prefix = attempt_prefix(version, attempt)
        try:
            m = json.loads(self.store.get(f"{prefix}manifest.json"))
        except KeyError:
            pass
        except ValueError as e:  # not JSON (a stored object written by something else)
            raise TransportError(f"{prefix}manifest.json is not JSON: {e}") from None
        else:
            if not isinstance(m, dict):
                raise TransportError(f"{prefix}manifest.json is not a JSON object")
            return m
        try:
            why = json.loads(self.store.get(f"{prefix}abandoned.json")).get("reason", "")
        except KeyError:
            return None
        except (ValueError, AttributeError):
            why = "(unreadable abandon marker)"
        raise TransportError(
            f"version {version} attempt {attempt} was abandoned by the coordinator: {why}"
        )

    def manifest(self, version: int, attempt: int, timeout_s: float = 60.0) -> dict:
        """Wait (polling with backoff) for the attempt's manifest."""
        deadline, delay = time.monotonic() + timeout_s, 0.02
        while True:
            m = self._try_manifest(version, attempt)
            if m is not None:
                return m
            if time.monotonic() > deadline:
                raise TransportError(
                    f"no manifest for version {version} attempt {attempt} after "
                    f"{timeout_s:.0f}s ({attempt_prefix(version, attempt)}manifest.json): "
                    "owners or the coordinator did not finish"
                )
            time.sleep(delay)
            delay = min(1.0, delay * 2)

    def _get_checked(self, key: str, size: int | None, payload_id: str | None) -> bytes:
        try:
            data = self.store.get(key)
        except KeyError:
            raise TransportError(f"payload {key} listed in the manifest is missing") from None
        if size is not None and len(data) != size:
            raise TransportError(f"payload {key}: {len(data)} bytes, listed {size}")
        try:
            h = peek_header(data, key=self.key)
        except PayloadError as err:
            raise TransportError(f"payload {key}: {err}") from None
        if payload_id is not None and h.payload_id_hex != payload_id:
            raise TransportError(f"payload {key}: id does not match the listing")
        self.bytes_fetched += len(data)
        return data

    def _listed(self, version: int, attempt: int, m: dict) -> list[dict]:
        """The manifest's payload entries in (owner, sequence) order, each checked to be
        ``{"key": str, "size": int >= 0, "payload_id": 32 lowercase hex digits}``; a malformed
        manifest or owner list (wrong type, missing field, bad id) is a TransportError."""
        prefix = attempt_prefix(version, attempt)
        entries: list[dict] = []
        try:
            for owner in m["owners"]:
                listing = json.loads(
                    self.store.get(f"{prefix}owners/o{operator.index(owner):05d}.json")
                )
                if len(listing["payloads"]) != m["payload_counts"][str(owner)]:
                    raise TransportError(f"owner {owner} list disagrees with the manifest")
                entries.extend(listing["payloads"])
            for e in entries:
                size, pid = e["size"], e["payload_id"]
                if not isinstance(e["key"], str) or not _is_size(size) or not _is_id(pid):
                    raise ValueError(f"bad payload entry {e!r:.200}")
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise TransportError(
                f"version {version} attempt {attempt}: malformed manifest or owner list: "
                f"{type(err).__name__}: {err}"
            ) from None
        return entries

    def sealed(self, version: int, attempt: int, timeout_s: float = 60.0) -> SealedAttempt:
        """The payload ids the manifest's owner lists name and its base version (waits for
        the manifest)."""
        m = self.manifest(version, attempt, timeout_s)
        return SealedAttempt(
            version=version,
            attempt=attempt,
            base_version=int(m["base_version"]),
            payload_ids=tuple(e["payload_id"] for e in self._listed(version, attempt, m)),
        )

    def fetch(self, version: int, attempt: int, timeout_s: float = 60.0) -> Iterator[bytes]:
        """Yield every payload listed by the manifest, in (owner, sequence) order."""
        m = self.manifest(version, attempt, timeout_s)
        for e in self._listed(version, attempt, m):
            yield self._get_checked(e["key"], e["size"], e["payload_id"])

    def stream(
        self,
        version: int,
        attempt: int,
        timeout_s: float = 60.0,
        poll_s: tuple[float, float] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[bytes]:
        """Yield each payload of the attempt as soon as its object exists (listing the attempt's
        prefix every ``poll_s[0]`` s, backing off to ``poll_s[1]`` while nothing new appears;
        default: the store's own, `store.poll_interval`: 2-5 ms on a local directory, 10-50 ms
        on S3), then, once the manifest is written, the listed payloads not yet yielded. Raises
        TransportError when a yielded object is not listed by the manifest (the caller fails the
        attempt), when a listed payload is missing or differs, when the attempt is abandoned, or
        at `timeout_s` without a manifest. Objects are only ever seen whole (stores publish
        atomically). `cancelled()` true ends the stream quietly at the next poll (its consumer
        gave up)."""
        prefix = attempt_prefix(version, attempt)
        seen: dict[str, str] = {}  # key -> payload id (hex)
        first, cap = poll_interval(self.store) if poll_s is None else poll_s
        deadline, delay = time.monotonic() + timeout_s, first
        while True:
            if cancelled is not None and cancelled():
                return
            m = self._try_manifest(version, attempt)
            fresh = sorted(
                k
                for k in self.store.list(f"{prefix}o")
                if k.endswith(".dcrp") and k not in seen and not k.startswith(f"{prefix}owners/")
            )
            for k in fresh:
                data = self._get_checked(k, None, None)
                seen[k] = peek_header(data, verify=False).payload_id_hex
                yield data
            if m is not None:
                break
            if time.monotonic() > deadline:
                raise TransportError(
                    f"no manifest for version {version} attempt {attempt} after "
                    f"{timeout_s:.0f}s ({prefix}manifest.json): owners or the coordinator did "
                    "not finish"
                )
            if fresh:
                delay = first
            else:
                time.sleep(delay)
                delay = min(cap, delay * 1.5)
        listed = self._listed(version, attempt, m)
        keys = {e["key"] for e in listed}
        stray = sorted(set(seen) - keys)
        if stray:
            raise TransportError(
                f"version {version} attempt {attempt}: {len(stray)} payload object(s) not listed "
                f"by the manifest (first: {stray[0]})"
            )
        for e in listed:
            if e["key"] in seen:
                if seen[e["key"]] != e["payload_id"]:
                    raise TransportError(f"payload {e['key']}: id does not match the listing")
                continue
            yield self._get_checked(e["key"], e["size"], e["payload_id"])


def forget(store: ObjectStore, before_version: int) -> int:
    """Delete every payload object (every attempt, manifests and abandon notices included) of
    versions below `before_version`; returns how many."""
    removed = 0
    for key in store.list("v"):
        try:
            version = int(key[1:13])
        except ValueError:
            continue
        if version < before_version:
            store.delete(key)
            removed += 1
    return removed


def cleanup(store: ObjectStore, committed_version: int, keep: int = 1) -> int:
    """Delete every object of versions older than the last `keep` committed ones."""
    return forget(store, committed_version - keep + 1)
