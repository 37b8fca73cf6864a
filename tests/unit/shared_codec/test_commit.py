"""Commit record: compare-and-set on a directory store and a real S3 endpoint (moto_server):
exactly one of racing coordinators wins, stale expectations conflict, a retried commit is
idempotent, and a new coordinator resumes from the durable record."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared_codec.coordination.commit import CommitConflict, CommitLog, CommitRecord
from shared_codec.transport import DirectoryStore


def _rec(version: int, attempt: int) -> CommitRecord:
    return CommitRecord(
        version=version,
        base_version=max(version - 1, 0),
        baseline_id=f"baseline-{version}",
        attempt=attempt,
        receivers=("r0", "r1"),
        digests={"r0": f"d{version}", "r1": "x"},
    )


def test_current_reads_forward_from_the_newest_record_seen(tmp_path: Path) -> None:
    """`current()` lists the records once, then reads forward (O(new records), not O(history)):
    it still sees every record another coordinator commits, on the real directory store."""
    lists: list[str] = []

    class Counting(DirectoryStore):  # the real store, counting its listings
        def list(self, prefix: str) -> list[str]:
            lists.append(prefix)
            return super().list(prefix)

    writer = CommitLog(DirectoryStore(tmp_path / "control"))
    writer.commit(None, _rec(0, 0))
    for v in range(1, 40):
        writer.commit(v - 1, _rec(v, 0))
    reader = CommitLog(Counting(tmp_path / "control"))
    assert reader.current().version == 39 and len(lists) == 1
    writer.commit(39, _rec(40, 2))  # another coordinator commits twice
    writer.commit(40, _rec(41, 0))
    cur = reader.current()
    assert cur is not None and (cur.version, cur.attempt) == (41, 0)
    assert reader.get(40).attempt == 2 and reader.current().version == 41
    assert len(lists) == 1  # no listing after the first call
    with pytest.raises(CommitConflict, match="expected committed version 40, found 41"):
        reader.commit(40, _rec(41, 5))
    assert reader.commit(41, _rec(42, 1)).version == 42 and writer.current().version == 42
    assert len(lists) == 1
