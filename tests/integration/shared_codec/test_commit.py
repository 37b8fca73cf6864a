"""Commit record: compare-and-set on a directory store and a real S3 endpoint (moto_server):
exactly one of racing coordinators wins, stale expectations conflict, a retried commit is
idempotent, and a new coordinator resumes from the durable record.

The cases against a real S3 endpoint are here; the local ones in tests/unit/shared_codec/test_commit.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from shared_codec.coordination.commit import CommitConflict, CommitLog
from shared_codec.transport import DirectoryStore, S3Store
from tests.unit.shared_codec.test_commit import (
    _rec,
)


def _store(kind: str, tmp_path: Path, endpoint: str, bucket: str):
    if kind == "dir":
        return DirectoryStore(tmp_path / "control")
    return S3Store(bucket, endpoint_url=endpoint, prefix="control", create_bucket=True)


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["dir", "s3"])
def test_compare_and_set_and_races(kind, tmp_path, moto_endpoint) -> None:
    log = CommitLog(_store(kind, tmp_path, moto_endpoint, f"commits-{kind}"))
    assert log.current() is None
    log.commit(None, _rec(0, 0))  # bootstrap: the version the engines start with
    with pytest.raises(CommitConflict, match="expected committed version 5"):
        log.commit(5, _rec(6, 0))
    # eight coordinators race to commit version 1 with different attempts: exactly one wins
    wins, conflicts = [], []
    barrier = threading.Barrier(8)

    def race(attempt: int) -> None:
        barrier.wait()
        try:
            wins.append(log.commit(0, _rec(1, attempt)))
        except CommitConflict:
            conflicts.append(attempt)

    threads = [threading.Thread(target=race, args=(a,)) for a in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(conflicts) == 7
    # a new coordinator resumes from the durable record
    fresh = CommitLog(log.store)
    cur = fresh.current()
    assert cur is not None and cur.version == 1 and cur.attempt == wins[0].attempt
    # the winner retrying its own commit is idempotent; a loser retrying still conflicts
    assert fresh.commit(0, _rec(1, wins[0].attempt)).attempt == wins[0].attempt
    with pytest.raises(CommitConflict):
        fresh.commit(0, _rec(1, conflicts[0]))
    assert fresh.commit(1, _rec(2, 3)).version == 2
    assert fresh.current().version == 2 and fresh.get(1).attempt == wins[0].attempt
