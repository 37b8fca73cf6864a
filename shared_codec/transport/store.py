"""Object stores: the same key layout on a local directory or any S3-compatible endpoint.

`ObjectStore` (`base.py`) is the narrow interface the object-storage transport needs: ``put`` (whole
object, overwriting), ``put_if_absent`` (create-only; False when the key exists), ``get``,
``exists``, ``list`` (keys under a prefix) and ``delete``.

- `DirectoryStore`: the embedded default. Writes go to a temporary file in the same directory,
  are fsynced and renamed into place, so readers never see partial objects.
- `S3Store`: boto3 with an ``endpoint_url`` (AWS S3, MinIO and moto_server alike; no
  hard-coded AWS host names). Large objects use multipart uploads with concurrent parts
  (boto3 TransferConfig); every call is retried with exponential backoff on throttling, 5xx
  responses, timeouts and connection errors (`retrying`), on top of botocore's own retries.
  ``put_if_absent`` uses a conditional write (``If-None-Match: *``).

A store may carry ``poll_s = (first, cap)``: how often a watcher of a prefix lists it (first
poll interval, and the cap it backs off to while nothing new appears; `poll_interval`). A local
directory lists one directory in tens of microseconds and polls every 2-5 ms; S3 keeps 10-50 ms
(each LIST is a billed request with a round trip of its own).

Limitations:
1. boto3 is imported only when an S3Store is created (the ``s3`` extra).
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shared_codec.errors import TransportError
from shared_codec.transport.base import ObjectStore

T = TypeVar("T")


#: Watchers' poll interval (first, cap) for stores that do not say (`poll_interval`).
DEFAULT_POLL_S = (0.01, 0.05)


def poll_interval(store: object) -> tuple[float, float]:
    """How often a watcher lists `store`: its ``poll_s`` (first interval, back-off cap), or
    `DEFAULT_POLL_S`."""
    first, cap = getattr(store, "poll_s", DEFAULT_POLL_S)
    return float(first), float(cap)


class DirectoryStore:
    """Objects as files under `root` (keys are relative paths with "/")."""

    poll_s = (0.002, 0.005)  # a listing is one local directory read

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid object key {key!r}")
        return self.root / key

    def _write_tmp(self, path: Path, data: bytes) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.replace(self._write_tmp(path, data), path)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._write_tmp(path, data)
        try:
            os.link(tmp, path)  # atomic create-only
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        """Keys starting with `prefix`, sorted; walks only the prefix's directory (a poll of
        one attempt's prefix does not walk every version the store holds)."""
        head = prefix.rpartition("/")[0]
        base = self._path(head) if head else self.root
        out: list[str] = []
        todo = [(str(base), f"{head}/" if head else "")]
        while todo:  # os.scandir: a poll must stay cheap (pathlib's rglob costs ~100x more)
            path, rel = todo.pop()
            try:
                entries = list(os.scandir(path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for e in entries:
                key = rel + e.name
                if e.is_dir(follow_symlinks=False):
                    if key.startswith(prefix) or prefix.startswith(f"{key}/"):
                        todo.append((e.path, f"{key}/"))
                elif key.startswith(prefix) and not e.name.startswith(".tmp-") and e.is_file():
                    out.append(key)
        return sorted(out)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff with jitter: `attempts` tries, first delay `base_s`, capped."""

    attempts: int = 6
    base_s: float = 0.1
    max_s: float = 5.0


def _retryable(exc: BaseException) -> bool:
    try:
        from botocore.exceptions import (
            ClientError,
            ConnectTimeoutError,
            ReadTimeoutError,
        )
        from botocore.exceptions import (
            ConnectionError as BotoConnectionError,
        )
    except ImportError:  # pragma: no cover - boto3 not installed
        return False
    if isinstance(exc, ConnectTimeoutError | ReadTimeoutError | BotoConnectionError):
        return True
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        code = str(err.get("Code", ""))
        return (
            status >= 500
            or status == 429
            or code
            in (
                "Throttling",
                "ThrottlingException",
                "SlowDown",
                "RequestTimeout",
                "InternalError",
                "ServiceUnavailable",
                "RequestLimitExceeded",
            )
        )
    return False


def retrying(
    fn: Callable[[], T], what: str, policy: RetryPolicy, log: list[str] | None = None
) -> T:
    """Run `fn`, retrying retryable S3 errors with backoff; TransportError after the last try."""
    delay = policy.base_s
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as e:
            if not _retryable(e) or attempt == policy.attempts:
                if isinstance(e, KeyError):
                    raise
                raise TransportError(f"{what} failed after {attempt} tries: {e}") from e
            if log is not None:
                log.append(f"{what}: retry {attempt} after {type(e).__name__}")
            time.sleep(min(policy.max_s, delay) * (0.5 + random.random()))
            delay *= 2
    raise AssertionError("unreachable")


class S3Store:
    """Objects in an S3 bucket (any S3-compatible endpoint) under an optional key prefix."""

    def __init__(
        self,
        bucket: str,
        *,
        endpoint_url: str | None = None,
        prefix: str = "",
        region: str = "us-east-1",
        retry: RetryPolicy | None = None,
        multipart_threshold: int = 8 << 20,
        max_concurrency: int = 4,
        client: Any = None,
        create_bucket: bool = False,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.retry = retry or RetryPolicy()
        self.retry_log: list[str] = []
        self.client = client or boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            config=Config(
                retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=60
            ),
        )
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_threshold,
            max_concurrency=max_concurrency,
        )
        if create_bucket:
            try:
                self.client.create_bucket(Bucket=bucket)
            except self.client.exceptions.BucketAlreadyOwnedByYou:
                pass

    def _k(self, key: str) -> str:
        return self.prefix + key

    def put(self, key: str, data: bytes) -> None:
        import io

        def go() -> None:
            self.client.upload_fileobj(
                io.BytesIO(data), self.bucket, self._k(key), Config=self.transfer
            )

        retrying(go, f"put s3://{self.bucket}/{self._k(key)}", self.retry, self.retry_log)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        def go() -> bool:
            try:
                self.client.put_object(
                    Bucket=self.bucket, Key=self._k(key), Body=data, IfNoneMatch="*"
                )
                return True
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status in (409, 412):
                    return False
                raise

        return retrying(go, f"create s3://{self.bucket}/{self._k(key)}", self.retry, self.retry_log)

    def get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        def go() -> bytes:
            try:
                return self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise KeyError(key) from None
                raise

        return retrying(go, f"get s3://{self.bucket}/{self._k(key)}", self.retry, self.retry_log)

    def exists(self, key: str) -> bool:
        try:
            self.get(key)
            return True
        except KeyError:
            return False

    def list(self, prefix: str) -> list[str]:
        def go() -> list[str]:
            out = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._k(prefix)
            )
            for page in pages:
                out += [o["Key"][len(self.prefix) :] for o in page.get("Contents", [])]
            return sorted(out)

        return retrying(
            go, f"list s3://{self.bucket}/{self._k(prefix)}", self.retry, self.retry_log
        )

    def delete(self, key: str) -> None:
        retrying(
            lambda: self.client.delete_object(Bucket=self.bucket, Key=self._k(key)),
            f"delete s3://{self.bucket}/{self._k(key)}",
            self.retry,
            self.retry_log,
        )


class ThrottledStore:
    """An `ObjectStore` whose payload bytes (put and get bodies) pass a token bucket of
    `bytes_per_s`, shared by every thread of this process: one emulated network link per process
    (benchmarks: the same limit for DCR and for a full-checkpoint transfer). Listing, existence
    checks and deletes are not throttled."""

    def __init__(self, inner: ObjectStore, bytes_per_s: float) -> None:
        import threading

        if bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be positive, got {bytes_per_s}")
        self.inner = inner
        self.poll_s = poll_interval(inner)  # listing is not throttled
        self.rate = float(bytes_per_s)
        self._lock = threading.Lock()
        self._next = time.monotonic()  # when the link is free again
        self.bytes = 0

    def _reserve(self, nbytes: int, since: float | None = None) -> float:
        """Book `nbytes` on the link (starting no earlier than `since`); returns when the
        transfer finishes on it."""
        with self._lock:
            start = max(self._next, time.monotonic() if since is None else since)
            self._next = start + nbytes / self.rate
            self.bytes += nbytes
            return self._next

    @staticmethod
    def _until(deadline: float) -> None:
        wait = deadline - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    # the store's own I/O overlaps the emulated transfer: an operation takes
    # max(its I/O time, its bytes / bandwidth), as on a real link
    def put(self, key: str, data: bytes) -> None:
        done = self._reserve(len(data))
        self.inner.put(key, data)
        self._until(done)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        done = self._reserve(len(data))
        created = self.inner.put_if_absent(key, data)
        self._until(done)
        return created

    def get(self, key: str) -> bytes:
        t0 = time.monotonic()
        data = self.inner.get(key)
        self._until(self._reserve(len(data), since=t0))
        return data

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
