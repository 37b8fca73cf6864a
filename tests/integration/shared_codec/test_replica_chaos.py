"""Chaos on the replica service: ``dcr replica serve`` (replica_serve_program: the store's
test-only crash hook armed) SIGKILLed mid-apply and mid-commit while a real `Coordinator` drives
it over HTTP. Each case ends with nothing lost: every committed version readable and bit-exact
on every member, one commit record per version.

TEST DOUBLES (labelled): `LineageOwners` (replica_cases.py) stands in for the owner service; the
"engine" member is a `ReplicaReceiver` on its own root reading the same directory store (a
receiver of canonical payloads, so its stored bits are compared with the lineage).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from dcr_tools.procs import PYTHON, REPO, base_env, kill_group
from shared_codec.checkpoint import combined_digest, load_checkpoint, state_digests
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.errors import EngineUnreachable
from shared_codec.replica import ReplicaStore, lease
from shared_codec.replica.client import HttpReplica
from shared_codec.replica.receiver import ReplicaReceiver
from shared_codec.transport.store import DirectoryStore
from tests.unit.shared_codec.replica_cases import (
    LineageOwners,
    caught_up,
    lineage_of,
    write_checkpoint,
)


@pytest.fixture(scope="module")
def lineage(tmp_path_factory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    initial = write_checkpoint(tmp_path_factory.mktemp("chaos") / "initial")
    return initial, lineage_of(initial, 4, seed=40)


class Served:
    """The replica service as its own process on `root` (`start` returns its URL)."""

    def __init__(self, root: Path, source: dict, log: Path) -> None:
        self.root, self.source, self.log = root, source, log
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, kill_at: str = "") -> str:
        self.stop()
        env = base_env(DCR_TEST_REPLICA_KILL_AT=kill_at)
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "tests.integration.shared_codec.replica_serve_program",
                 str(self.root), "--source", json.dumps(self.source), "--lease-timeout", "5"],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                start_new_session=True,
            )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the replica service did not start: {self.log.read_text()[-2000:]}"
        self.starts += 1
        return str(json.loads(line)["url"])

    def killed(self) -> bool:
        return self.proc is not None and self.proc.wait(timeout=30) == -9

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None


def digest_of(t: dict[str, torch.Tensor]) -> str:
    return combined_digest(state_digests(t))


def held(root: Path, version: int) -> str:
    """The digest of `version` read from the root's slot under a lease (any process)."""
    with lease(root, version) as path:
        return digest_of(load_checkpoint(path))


@pytest.mark.timeout(300)
def test_replica_killed_mid_apply_and_mid_commit(lineage, tmp_path) -> None:
    initial, versions = lineage
    spec = {"kind": "dir", "root": str(tmp_path / "payloads")}
    roots = {n: tmp_path / n for n in ("replica", "engine")}
    for r in roots.values():
        with ReplicaStore(r) as s:
            s.bootstrap(initial)
    served = Served(roots["replica"], spec, tmp_path / "replica.log")
    replica = HttpReplica(served.start(kill_at="apply_partial"), launcher=served.start)
    engine = ReplicaReceiver(roots["engine"], spec, name="engine")
    control = DirectoryStore(tmp_path / "control")
    coord = Coordinator(
        control, LineageOwners(versions, spec), [replica, engine],
        CoordinatorConfig(ack_timeout_s=60.0), log=lambda m: print(f"[coordinator] {m}"),
        transport=spec,
    )  # fmt: skip
    try:
        coord.initialize()
        # 1. killed mid-apply (part of the attempt's new bits written to the shadow slot): the
        # attempt fails with the replica unreachable; the coordinator restarts it (launcher),
        # its recovery undoes the partial slot, the overwrite retry commits
        res = coord.refit()
        assert served.starts == 2
        first = res.attempts[0]
        assert first.unreachable == {"replica"} and "EngineUnreachable" in first.failed["replica"]
        assert res.record.version == 1 and res.record.attempt == 1
        assert set(res.record.digests.values()) == {digest_of(versions[1])}
        for r in roots.values():  # v1 committed on both slots (caught up): nothing lost
            assert held(r, 1) == digest_of(versions[1])
            assert [digest_of(t) for t in caught_up(r, 1)] == [digest_of(versions[1])] * 2

        # 2. killed mid-commit (the new STATE.json written, not yet renamed): the record is
        # durable, the refit raises on the notification; restored, the replica finds v2
        # staged and commits it; a new coordinator's resume commits nothing twice
        replica.base_url = served.start(kill_at="committed_tmp")
        with pytest.raises(EngineUnreachable):
            coord.refit()
        assert served.killed()
        assert coord.commits.current().version == 2
        replica.restore(2)
        assert replica.status()["committed"] == 2
        fresh = Coordinator(
            control, coord.owners, [replica, engine], coord.config,
            log=lambda m: print(f"[coordinator] {m}"), transport=spec,
        )  # fmt: skip
        assert fresh.resume() == 2
        for r in roots.values():
            assert held(r, 2) == digest_of(versions[2])
            assert [digest_of(t) for t in caught_up(r, 2)] == [digest_of(versions[2])] * 2
        res = fresh.refit()
        assert res.record.version == 3 and res.retries == 0
        assert set(res.record.digests.values()) == {digest_of(versions[3])}
        commits = sorted(control.list("commits/"))
        assert commits == [f"commits/v{v:012d}.json" for v in range(4)]
    finally:
        engine.close()
        served.stop()
