"""Kill the replica's writer at every crash point and recover (docs/replica.md, "Crash points").

A child process (forked from the test process, so no interpreter start per point; the `slow`
variant runs a fresh interpreter per point) runs replica_kill_program's script and SIGKILLs
itself at one crash point (`CRASH_POINTS`, and later arrivals at some of them). The parent
then opens the store, which recovers, and checks:
- the committed version is readable and bit-exact (every tensor against the oracle), the
  non-tensor files and the tensor-to-file mapping are the initial checkpoint's;
- the other slot holds what its state says, bit-exact: committed - 1 or the committed version
  (clean), or exactly the staged attempt (a staged attempt survives: its commit may come);
- no temporary file is left, the log holds only records the state names;
- the store goes on: a staged full attempt commits, then the next version stages (an
  overwrite retry over whatever attempt was staged, catching the lagging slot up) and commits,
  bit-exact on both slots.
Plus: a writer killed during recovery itself, and a reader killed while holding a lease.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dcr_tools.procs import PYTHON, REPO, base_env
from shared_codec.checkpoint import combined_digest, load_checkpoint, state_digests
from shared_codec.replica import CRASH_POINTS, ReplicaStore, crash
from shared_codec.replica.durable import TMP_PREFIX
from shared_codec.replica.log import parse_name
from shared_codec.replica.state import SlotStatus
from tests.integration.shared_codec import replica_kill_program as program
from tests.unit.shared_codec.replica_cases import (
    applied,
    encode,
    evolve,
    items_between,
    other_files,
    same_bits,
    tensor_files,
    write_checkpoint,
)

#: the default lane: one point of each phase (bootstrap, the record, the dirty mark, the
#: catch-up, the retry's undo and its write with two attempts touched, the staged mark, the
#: commit, the abort's repair and clean mark, the sync, an unsynced commit, the redo of a
#: staged and of a committed attempt after a restart); every other point and arrival runs in
#: `slow`
DEFAULT = (
    "bootstrap_slot0", "log", "dirty", "catchup_partial", "undo_partial", "apply_partial#3",
    "slot_written", "staged_tmp", "committed_tmp", "committed", "repair_partial", "clean_tmp",
    "synced", "committed#2", "redo_partial", "redo_partial#2",
)  # fmt: skip
#: later arrivals at a point: the second stage (catch-up), the retry, the abort, later commits
#: (#2: the unsynced one), the second redo (of the staged attempt)
LATER = (
    "log#3", "dirty#2", "dirty#3", "dirty#5", "apply_partial#2", "apply_partial#3",
    "slot_written#3", "staged#3", "staged_tmp#2", "committed_tmp#2", "committed#2",
    "committed#3", "redo_partial#2", "synced#2",
)  # fmt: skip
ALL_POINTS = (*CRASH_POINTS, *LATER)
LAST = 4


class Cases:
    """The initial checkpoint, the oracle of every version, and every attempt's payloads and
    expected staged state, written under one directory for the child."""

    def __init__(self, root: Path) -> None:
        self.dir = root
        self.initial = write_checkpoint(root / "initial")
        self.oracle = [load_checkpoint(self.initial)]
        for v in range(1, LAST + 1):
            self.oracle.append(evolve(self.oracle[-1], seed=10 + v))
        o = self.oracle
        partial = [it for it in items_between(o[1], o[2], "xor") if it.owner == 0]
        bogus = items_between(o[2], evolve(o[2], seed=99), "xor")
        attempts = {
            (1, 0): items_between(o[0], o[1], "xor"),
            (2, 0): partial,
            (2, 1): items_between(o[1], o[2], "overwrite"),
            (3, 0): bogus,
            (3, 1): items_between(o[2], o[3], "mixed"),
        }
        for v in range(1, LAST + 1):
            attempts[(v, 7)] = items_between(o[v - 1], o[v], "overwrite")
        self.expected: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for (v, a), items in attempts.items():
            self.expected[(v, a)] = applied(o[v - 1], items)
            d = root / f"v{v}-a{a}"
            d.mkdir()
            for i, data in enumerate(encode(items, v, a)):
                (d / f"{i:03d}.dcrp").write_bytes(data)
        self.files, self.mapping = other_files(self.initial), tensor_files(self.initial)

    def full(self, version: int, attempt: int) -> bool:
        """Whether the attempt stages the version's oracle (not a partial or bogus one)."""
        return same_bits(self.expected[(version, attempt)], self.oracle[version]) == []


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Cases:
    return Cases(tmp_path_factory.mktemp("replica-kill"))


def fork_and_wait(child: Callable[[], None], timeout_s: float = 60.0) -> int:
    """Run `child` in a forked process; its wait status. The child never returns into pytest."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            child()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the writer did not finish within {timeout_s} s")
        time.sleep(0.005)


def killed(status: int) -> bool:
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def check_recovered(cases: Cases, root: Path) -> None:
    """The checks of the module docstring, then the store goes on (one more version)."""
    with ReplicaStore(root) as store:
        if store._state is None:  # killed inside the bootstrap: nothing was committed
            assert not (root / "STATE.json").exists()
            store.bootstrap(cases.initial)
        st = store.status()
        c = st.committed
        path = store.checkpoint_for(c)
        assert same_bits(load_checkpoint(path), cases.oracle[c]) == [], f"committed {c}"
        assert other_files(path) == cases.files
        assert tensor_files(path) == cases.mapping
        shadow = st.slots[1 - st.committed_slot]
        spath = root / f"slot{1 - st.committed_slot}"
        if shadow.status == SlotStatus.CLEAN:
            assert shadow.version in (c, c - 1)
            assert same_bits(load_checkpoint(spath), cases.oracle[shadow.version]) == []
        else:
            assert shadow.status == SlotStatus.STAGED, shadow
            assert shadow.target is not None and shadow.attempt is not None
            want = cases.expected[(shadow.target, shadow.attempt)]
            assert same_bits(load_checkpoint(spath), want) == [], "staged attempt"
        assert other_files(spath) == cases.files
        assert [p for p in root.rglob(f"{TMP_PREFIX}*")] == []
        needed = {(c, st.committed_attempt), (shadow.target, shadow.attempt)}
        records = {parse_name(p.name) for p in (root / "log").iterdir()}
        assert records <= needed, records
        # the store goes on
        if shadow.status == SlotStatus.STAGED and cases.full(shadow.target, shadow.attempt):
            assert store.commit(shadow.target, shadow.attempt)
            c = shadow.target
        v = c + 1  # an overwrite retry over whatever attempt is staged, then its commit
        store.stage(v, 7, program.attempt_payloads(cases.dir, v, 7))
        assert store.digest(v) == combined_digest(state_digests(cases.oracle[v]))
        assert store.commit(v, 7)
        assert same_bits(load_checkpoint(store.checkpoint_for(v)), cases.oracle[v]) == []
        assert same_bits(load_checkpoint(store.checkpoint_for(v - 1)), cases.oracle[v - 1]) == []


@pytest.mark.parametrize(
    "point", [p if p in DEFAULT else pytest.param(p, marks=pytest.mark.slow) for p in ALL_POINTS]
)
def test_kill_at_each_point_then_recover(cases, tmp_path, point) -> None:
    root = tmp_path / "root"

    def child() -> None:
        program.arm(point)
        program.run(root, cases.dir)

    status = fork_and_wait(child)
    assert killed(status), f"{point}: the writer was not killed there (wait status {status})"
    check_recovered(cases, root)


def test_script_reaches_every_point(cases, tmp_path) -> None:
    root, seen = tmp_path / "root", tmp_path / "points.txt"

    def child() -> None:
        points: list[str] = []
        crash._hook = points.append
        program.run(root, cases.dir)
        seen.write_text("\n".join(points))

    assert fork_and_wait(child) == 0
    points = seen.read_text().split()
    assert set(points) == set(CRASH_POINTS)
    assert set(DEFAULT) <= set(ALL_POINTS)
    for later in LATER:  # every later arrival the kill tests name happens
        point, _, nth = later.partition("#")
        assert points.count(point) >= int(nth), later
    check_recovered(cases, root)


def test_kill_during_recovery(cases, tmp_path) -> None:
    root = tmp_path / "root"

    def writer() -> None:
        program.arm("apply_partial#3")  # the retry: the shadow is dirty with two attempts
        program.run(root, cases.dir)

    def recoverer() -> None:
        program.arm("repair_partial")
        ReplicaStore(root)

    assert killed(fork_and_wait(writer))
    assert killed(fork_and_wait(recoverer))
    check_recovered(cases, root)


def test_killed_lease_holder_releases_its_slot(cases, tmp_path) -> None:
    root = tmp_path / "root"
    with ReplicaStore(root) as store:
        store.bootstrap(cases.initial)
        store.stage(1, 7, program.attempt_payloads(cases.dir, 1, 7))
        store.commit(1, 7)

    def reader() -> None:
        from shared_codec.replica import lease

        with lease(root, 0, holder="doomed restore"):
            os.kill(os.getpid(), signal.SIGKILL)

    assert killed(fork_and_wait(reader))
    with ReplicaStore(root) as store:  # slot0 (version 0) is free again: the stage dirties it
        store.stage(2, 7, program.attempt_payloads(cases.dir, 2, 7), lease_timeout_s=0)
        store.commit(2, 7)
    assert list((root / "leases").glob("slot*.*.*")) == []  # the dead holder's file was swept
    check_recovered(cases, root)


@pytest.mark.slow
@pytest.mark.parametrize("point", ALL_POINTS)
def test_kill_fresh_interpreter_at_each_point(cases, tmp_path, point) -> None:
    """The same with a fresh interpreter per point (no state inherited from the test)."""
    root = tmp_path / "root"
    proc = subprocess.run(
        [PYTHON, "-m", "tests.integration.shared_codec.replica_kill_program", root, cases.dir],
        env=base_env(**{program.ENV: point}),
        cwd=REPO,
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr[-2000:])
    check_recovered(cases, root)
