"""The commit record: durable, versioned, changed only by compare-and-set.

The record binding policy version v to its source baseline is an immutable object
``commits/v<version:012>.json`` in an object store (`DirectoryStore`: a file created with an
atomic link, fsynced; `S3Store`: a conditional ``If-None-Match: *`` write). Committing version
v+1 is a compare-and-set on "the current record is v": the coordinator reads the current record,
checks it is v, and creates the v+1 object create-only. Of two racing coordinators exactly one
creates it; the other gets `CommitConflict` (or, if it wrote the identical record, an idempotent
success). A new coordinator reads `current()` to resume: it never commits a version twice and
never loses one, because records are never overwritten or deleted by the protocol.

Record fields (JSON, format version 1): version, base_version, baseline_id, attempt,
receivers (names), digests (receiver -> digest), time (UNIX seconds), format_version.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from shared_codec.errors import CommitConflict, DCRError
from shared_codec.transport.store import ObjectStore

RECORD_FORMAT = 1
PREFIX = "commits/"


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitRecord:
    """One committed policy version and the baseline and attempt it is bound to."""

    version: int
    base_version: int
    baseline_id: str
    attempt: int
    receivers: tuple[str, ...] = ()
    digests: dict[str, str] = field(default_factory=dict)
    time: float = 0.0
    format_version: int = RECORD_FORMAT

    def to_json(self) -> bytes:
        d = asdict(self)
        d["receivers"] = list(self.receivers)
        return json.dumps(d, sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> CommitRecord:
        d = json.loads(data)
        if d.get("format_version") != RECORD_FORMAT:
            raise DCRError(f"commit record format {d.get('format_version')} is not supported")
        d["receivers"] = tuple(d.get("receivers", ()))
        return CommitRecord(**d)


def _key(version: int) -> str:
    return f"{PREFIX}v{version:012d}.json"


class CommitLog:
    """Compare-and-set commit records in an object store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._newest: CommitRecord | None = None  # the newest record this log has seen

    def current(self) -> CommitRecord | None:
        """The latest committed record (None before the first commit).

        The first call lists the records; later calls read forward from the newest record
        seen (versions are dense and records are never deleted, so the next one, if any, is
        version + 1: written by this log or another coordinator): O(new records), not
        O(history), which a run of weeks would make tens of thousands of keys (a listing page
        per 1,000 on S3)."""
        newest = self._newest
        if newest is None:
            keys = [k for k in self.store.list(PREFIX) if k.endswith(".json")]
            if not keys:
                return None
            newest = CommitRecord.from_json(self.store.get(max(keys)))
        while (later := self.get(newest.version + 1)) is not None:
            newest = later
        if self._newest is None or newest.version > self._newest.version:
            self._newest = newest  # (threads sharing this log only ever move it forward)
        return newest

    def get(self, version: int) -> CommitRecord | None:
        try:
            return CommitRecord.from_json(self.store.get(_key(version)))
        except KeyError:
            return None

    def commit(self, expected_version: int | None, record: CommitRecord) -> CommitRecord:
        """Commit `record` if the current version is `expected_version` (None: no record yet).

        Raises CommitConflict when the current record is another version or another
        coordinator created this version first with different content.
        """
        cur = self.current()
        cur_version = None if cur is None else cur.version
        if cur_version != expected_version:
            existing = self.get(record.version)
            if existing is not None and _same(existing, record):
                return existing  # our own earlier commit, retried: idempotent
            raise CommitConflict(
                f"expected committed version {expected_version}, found {cur_version}"
            )
        if record.version != (0 if expected_version is None else expected_version + 1):
            raise ValueError(f"record version {record.version} does not follow {expected_version}")
        if record.time == 0.0:
            record = CommitRecord(
                **{**asdict(record), "receivers": record.receivers, "time": time.time()}
            )
        if self.store.put_if_absent(_key(record.version), record.to_json()):
            return record
        winner = self.get(record.version)
        assert winner is not None
        same = (
            winner.attempt == record.attempt
            and winner.baseline_id == record.baseline_id
            and winner.digests == record.digests
        )
        if same:
            return winner  # our own earlier write (a retried commit): idempotent
        raise CommitConflict(
            f"version {record.version} was committed by another coordinator "
            f"(attempt {winner.attempt})"
        )


def _same(a: CommitRecord, b: CommitRecord) -> bool:
    """Same commit apart from its timestamp."""
    return (a.version, a.base_version, a.baseline_id, a.attempt, a.receivers, a.digests) == (
        b.version,
        b.base_version,
        b.baseline_id,
        b.attempt,
        b.receivers,
        b.digests,
    )
