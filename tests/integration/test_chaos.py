"""Chaos (slow lane, real processes): a participant of the refit killed or hung at a chosen
point, on the demo's real cluster (`dcr_tools.demo.Demo`: a 2-rank Megatron trainer job serving
the owner service, a rollout ``vllm serve`` refit by DCR, a reference ``vllm serve`` that
dense-loads the trainer's export of each version as the oracle, and the transport: S3 on a local
``moto_server`` holding payloads and control records, or a ZeroMQ relay tree root -> rollout0
with a local control directory). One cluster per transport is shared by its cases (module
fixture, parametrized indirectly), so the cases run in order and each starts from the state
the one before left: a committed version, every engine bit-exact.

Each case ends in one of the two outcomes the protocol promises, and asserts it:
- the version is committed exactly once (the commit history holds one record per version,
  contiguous from 0) and the rollout engine's digest equals a dense load of that version;
  then one more ordinary refit is bit-exact too (the owners' baselines are right);
- or a clear error that names what failed, the commit record unchanged, and the engine back
  at the committed version (bit-exact with its dense load) after the operator's repair.

Cases:
- S3 (coordinator and store): the coordinator SIGKILLed at each protocol step (a child
  process, `tests.integration.chaos_coordinator_program`) and resumed by a new coordinator; the S3
  endpoint hung mid-refit (SIGSTOP) and resumed (SIGCONT).
- relay: the root relay killed mid-attempt and restarted at its address (the attempt fails,
  the retry goes through the new root); a trainer rank killed mid-build (a clear error).

Why a hung S3 endpoint and not a restarted one: ``moto_server`` keeps its objects in memory,
so a restart is a new, empty bucket - with the control records in that bucket it is the loss of
the commit history, not an outage (see docs/operations.md, "Chaos").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from dcr_tools.demo import Demo
from dcr_tools.procs import PYTHON, REPO, base_env
from shared_codec.coordination.commit import PREFIX as COMMITS
from shared_codec.coordination.commit import CommitRecord
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig, RefitResult
from shared_codec.coordination.owners import RemoteOwners
from shared_codec.errors import DCRError, RefitFailed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.megatron,
    pytest.mark.vllm,
    pytest.mark.s3,
    pytest.mark.zmq,
]


class ChaosCluster(Demo):
    """The demo's cluster with the handles the chaos cases need."""

    def __init__(self, transport: str, out: Path) -> None:
        super().__init__(
            argparse.Namespace(
                transport=transport, out=str(out), seed=0, lr=1e-5, endpoint="",
                bucket="dcr-chaos", kill_every=0, replica=True, fetch="engines",
            )
        )  # fmt: skip
        self.transport = transport
        self.steps = 0

    def log(self, msg: str) -> None:
        print("\n".join(f"[chaos] {line}" for line in str(msg).splitlines() or [""]), flush=True)

    @property
    def control_spec(self) -> dict[str, Any]:
        if self.transport == "relay":
            return {"kind": "dir", "root": str(self.work / "control")}
        return dict(self.spec)

    def coordinator(self, owners: RemoteOwners | None = None, **config: Any) -> Coordinator:
        """A new coordinator on the cluster's participants (what an operator starts)."""
        assert self.owners is not None
        return Coordinator(
            self.store,
            owners or self.owners,
            self.members,
            CoordinatorConfig(**{"max_attempts": 3, "ack_timeout_s": 120, **config}),
            log=lambda m: self.log(f"coordinator: {m}"),
            transport=self.sink_spec,
        )

    def train(self) -> None:
        assert self.owners is not None
        self.steps += 1
        self.owners.call("train", step=self.steps)

    def records(self) -> list[CommitRecord]:
        return [CommitRecord.from_json(self.store.get(k)) for k in sorted(self.store.list(COMMITS))]

    def committed(self) -> CommitRecord:
        return self.records()[-1]

    def process(self, match: str) -> subprocess.Popen[bytes]:
        for p in self.procs:
            if p.poll() is None and match in " ".join(map(str, p.args)):  # type: ignore[arg-type]
                return p
        raise LookupError(f"no live process matching {match!r}")

    def trainer_rank(self, rank: int) -> psutil.Process:
        top = psutil.Process(self.process("torch.distributed.run").pid)
        for p in top.children(recursive=True):
            if p.environ().get("RANK") == str(rank):
                return p
        raise LookupError(f"no trainer rank {rank}")

    def rollout_status(self) -> list[dict[str, Any]]:
        return self.rollout.rpc("dcr_status")


def one_commit_per_version(c: ChaosCluster) -> list[CommitRecord]:
    """The commit history: one record per version, contiguous from 0, each on its base."""
    recs = c.records()
    assert [r.version for r in recs] == list(range(len(recs))), [r.version for r in recs]
    assert all(r.base_version == max(0, r.version - 1) for r in recs)
    return recs


def assert_bit_exact(c: ChaosCluster, version: int) -> None:
    """The rollout engine holds exactly `version`: its digest equals a dense load of the
    trainer's export of `version` on the reference engine, and the commit record's digest;
    engine and owners are committed at `version`."""
    assert c.owners is not None
    c.owners.call("export", path=c.ckpt(version))
    c.reference.rpc("dcr_dense_load", c.ckpt(version), version)
    digest = c.rollout.digest()
    assert digest == c.reference.digest(), f"rollout != dense load of version {version}"
    record = c.records()[version]
    assert record.digests.get("rollout") in (None, digest)
    assert all(s["committed_version"] == version for s in c.rollout_status())
    assert all(s["state"] == "clean" for s in c.rollout_status())
    assert c.owners.call("status")["committed_version"] == version
    assert c.replica_exact(version), f"the replica does not hold the export of {version}"


def ordinary_refit(c: ChaosCluster, coord: Coordinator) -> RefitResult:
    """One more step + refit after a case: one attempt, bit-exact (baselines are right)."""
    c.train()
    res = coord.refit()
    assert len(res.attempts) == 1, [a.failed for a in res.attempts]
    one_commit_per_version(c)
    assert_bit_exact(c, res.version)
    return res


@pytest.fixture(scope="module")
def chaos(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ChaosCluster]:
    c = ChaosCluster(request.param, tmp_path_factory.mktemp(f"chaos-{request.param}"))
    try:
        c.start()
        ordinary_refit(c, c.coord)  # v1: the cluster works before any chaos
        yield c
    finally:
        c.stop()


def _timed(name: str, t0: float) -> None:
    print(f"[chaos] case {name}: {time.perf_counter() - t0:.1f}s", flush=True)


# -- coordinator killed at each protocol step (S3 cluster: control records in the bucket) -------
KILL_STEPS = ("after_prepare", "during_apply", "after_acks", "after_cas", "during_owner_commit")
BEFORE_CAS = ("after_prepare", "during_apply", "after_acks")
# the engine's (state, committed version) a coordinator killed at each step leaves for version v:
# the build and the engine's pipelined apply run on without the coordinator (during_apply)
LEFT_BEHIND = {
    "after_prepare": lambda v: ("clean", v - 1),
    "during_apply": lambda v: ("applied", v - 1),
    "after_acks": lambda v: ("applied", v - 1),
    "after_cas": lambda v: ("applied", v - 1),  # the record says v; nobody was told
    "during_owner_commit": lambda v: ("clean", v),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("chaos", ["s3"], indirect=True)
@pytest.mark.parametrize("step", KILL_STEPS)
def test_coordinator_killed_then_resumed(chaos: ChaosCluster, step: str) -> None:
    """A coordinator SIGKILLed at `step` of version v; a new coordinator resumes: v is committed
    exactly once (a retry when the kill came before the compare-and-set, the dead coordinator's
    attempt when after it) and the engine is bit-exact."""
    c = chaos
    t0 = time.perf_counter()
    v = c.committed().version + 1
    c.train()
    cfg = {
        "kill": step,
        "control": c.control_spec,
        "transport": c.sink_spec,
        "owners": c.owners.endpoint if c.owners else "",
        "engines": [{"name": "rollout", "url": c.rollout.base_url}],
        "replica": c.replica.base_url if c.replica is not None else None,
        "engine_store": c.spec,
        "ckpts": str(c.work / "ckpts"),
    }
    proc = subprocess.run(
        [PYTHON, "-m", "tests.integration.chaos_coordinator_program", json.dumps(cfg)],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == -signal.SIGKILL and f"CHAOS kill at {step}" in out, out[-3000:]
    committed_by_dead = c.committed().version
    assert committed_by_dead == (v - 1 if step in BEFORE_CAS else v), out[-3000:]
    # what the dead coordinator left behind (the engine answers once its own work is done)
    engine = c.rollout_status()[0]
    owners = c.owners.call("status") if c.owners else {}
    print(f"[chaos] after the kill at {step}: engine {engine['state']} committed "
          f"{engine['committed_version']} target {engine['target_version']}; owners committed "
          f"{owners.get('committed_version')} candidate {owners.get('candidate')}", flush=True)  # fmt: skip
    assert (engine["state"], engine["committed_version"]) == LEFT_BEHIND[step](v), engine

    coord = c.coordinator()  # the new coordinator
    assert coord.resume() == committed_by_dead
    if committed_by_dead < v:
        res = coord.refit()
        assert res.version == v
        # the dead coordinator's attempt 0 is never committed: the new one retries with overwrites
        assert res.attempts[0].attempt >= 1 and res.attempts[0].retry, res.attempts
    recs = one_commit_per_version(c)
    # before the compare-and-set the dead coordinator's attempt 0 is never committed (the new
    # one retried with overwrites); after it, the record is the dead coordinator's attempt 0
    assert (recs[v].attempt >= 1) if step in BEFORE_CAS else (recs[v].attempt == 0), recs[v]
    assert_bit_exact(c, v)
    ordinary_refit(c, coord)
    _timed(f"coordinator killed {step}", t0)


# -- S3 endpoint hung mid-refit -------------------------------------------------------------------
class HangingOwners(RemoteOwners):
    """The owners handle of a case that hangs the S3 endpoint: when the coordinator asks for
    the build (the engine's pipelined fetch has just started), ``moto_server`` gets SIGSTOP, and
    SIGCONT `hold_s` later - a deterministic point in the attempt."""

    def __init__(self, endpoint: str, moto_pid: int, hold_s: float) -> None:
        super().__init__(endpoint, timeout_s=300)
        self.moto_pid, self.hold_s = moto_pid, hold_s
        self.hung = False

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        if not self.hung:
            self.hung = True
            os.kill(self.moto_pid, signal.SIGSTOP)
            threading.Timer(self.hold_s, os.kill, (self.moto_pid, signal.SIGCONT)).start()
        return super().build(version, attempt, retry)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("chaos", ["s3"], indirect=True)
@pytest.mark.parametrize(("hold_s", "ack_timeout_s"), [(8.0, 120.0), (30.0, 10.0)])
def test_s3_endpoint_hung_mid_refit(
    chaos: ChaosCluster, hold_s: float, ack_timeout_s: float
) -> None:
    """``moto_server`` SIGSTOPped when the build starts and SIGCONTed `hold_s` later (requests
    are delayed, not lost: botocore's read timeout is 60 s). Within the engines' ACK deadline
    the attempt just takes longer; beyond it the attempt fails naming the engine (no ACK in
    time), the engine is restored to the committed version and the overwrite retry commits.
    Either way one commit, bit-exact."""
    c = chaos
    assert c.owners is not None
    t0 = time.perf_counter()
    moto = c.process("moto_server")
    v = c.committed().version + 1
    c.train()
    owners = HangingOwners(c.owners.endpoint, moto.pid, hold_s)
    coord = c.coordinator(owners=owners, ack_timeout_s=ack_timeout_s)
    try:
        t1 = time.perf_counter()
        res = coord.refit()
        refit_s = time.perf_counter() - t1
    finally:
        time.sleep(max(0.0, hold_s - (time.perf_counter() - t0)))  # never leave moto stopped
        os.kill(moto.pid, signal.SIGCONT)
        owners.close()
    failed = [a.failed for a in res.attempts]
    print(f"[chaos] S3 hung {hold_s:.0f}s (ACK deadline {ack_timeout_s:.0f}s): refit "
          f"{refit_s:.1f}s, attempts {failed}", flush=True)  # fmt: skip
    assert res.version == v and refit_s >= hold_s  # the attempt really waited on the endpoint
    if hold_s < ack_timeout_s:
        assert len(res.attempts) == 1, failed
    else:
        # the engine's fetch RPC timed out inside vLLM (HTTP 500 "timed out") or missed the
        # coordinator's deadline: either names the engine; its replies are out of step, so the
        # coordinator's restore restarted it (engines.py) before the dense load
        assert len(res.attempts) == 2 and "rollout" in failed[0], failed
        assert "timed out" in failed[0]["rollout"] or "no ACK" in failed[0]["rollout"], failed
    one_commit_per_version(c)
    assert_bit_exact(c, v)
    ordinary_refit(c, c.coordinator())
    _timed(f"S3 endpoint hung {hold_s:.0f}s, ACK deadline {ack_timeout_s:.0f}s", t0)


# -- S3 endpoint restarted empty (last S3 case: the run's control records are gone) -------------
@pytest.mark.timeout(900)
@pytest.mark.parametrize("chaos", ["s3"], indirect=True)
def test_s3_endpoint_restarted_empty_fails_closed(chaos: ChaosCluster) -> None:
    """``moto_server`` SIGKILLed and restarted at its address with a fresh, empty bucket (moto
    keeps objects in memory): with the control records in that bucket, the commit history is
    gone. A new coordinator refuses to refit (no commit record); an operator who wrongly
    initializes version 0 again gets `RefitFailed` naming the owners' refusal (they hold a later
    committed version) and nothing is applied. The engine keeps the last committed version
    throughout (bit-exact with its dense load)."""
    import boto3

    c = chaos
    assert c.owners is not None
    t0 = time.perf_counter()
    committed = c.committed()
    c.owners.call("export", path=c.ckpt(committed.version))
    moto = c.process("moto_server")
    cmd = list(map(str, moto.args))  # type: ignore[arg-type]
    os.killpg(moto.pid, signal.SIGKILL)
    moto.wait(timeout=30)
    log = open(c.work / "moto.log", "ab")  # noqa: SIM115
    c.procs.append(
        subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    )
    s3 = boto3.client("s3", endpoint_url=c.spec["endpoint_url"], region_name="us-east-1")
    for _ in range(100):
        try:
            s3.create_bucket(Bucket=c.spec["bucket"])
            break
        except Exception:
            time.sleep(0.2)
    assert c.records() == []  # the commit history went with the old endpoint

    c.train()
    coord = c.coordinator()
    with pytest.raises(DCRError, match="no commit record") as err:
        coord.refit()
    print(f"[chaos] S3 restarted empty: {err.value}", flush=True)
    # the wrong repair: a second "version 0" record; the owners refuse to build version 1
    coord.initialize("export-v0")
    with pytest.raises(RefitFailed) as failed:
        coord.refit()
    print(f"[chaos] S3 restarted empty, re-initialized: {failed.value}", flush=True)
    assert f"<= committed {committed.version}" in str(failed.value), failed.value
    status = c.rollout_status()[0]
    assert (status["committed_version"], status["state"]) == (committed.version, "clean")
    c.reference.rpc("dcr_dense_load", c.ckpt(committed.version), committed.version)
    assert c.rollout.digest() == c.reference.digest() == committed.digests["rollout"]
    _timed("S3 endpoint restarted empty", t0)


def _refit_in_thread(coord: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``coord.refit()`` in a thread; the box gets ``res`` or the ``error`` it raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["res"] = coord.refit()
        except Exception as e:  # the caller asserts on it
            box["error"] = e

    th = threading.Thread(target=run)
    th.start()
    return th, box


# -- relay root killed mid-attempt ----------------------------------------------------------------
@pytest.mark.timeout(900)
@pytest.mark.parametrize("chaos", ["relay"], indirect=True)
def test_relay_root_killed_mid_attempt(chaos: ChaosCluster) -> None:
    """The root relay SIGKILLed while it holds an attempt (its child ``rollout0`` is held with
    SIGSTOP, so the root has taken the owners' payloads and manifest and waits for the subtree)
    and restarted at the same address, as its supervisor would; then ``rollout0`` goes on. The
    owners' seal never completes (the dead root took it along), so the attempt fails naming the
    owners' transport; the retry (overwrites) goes through the new root; one commit,
    bit-exact."""
    c = chaos
    t0 = time.perf_counter()
    root, node = c.process('"name": "root"'), c.process('"name": "rollout0"')
    cmd = list(map(str, root.args))  # type: ignore[arg-type]
    v = c.committed().version + 1
    c.train()
    coord = c.coordinator()
    os.kill(node.pid, signal.SIGSTOP)
    try:
        th, box = _refit_in_thread(coord)
        time.sleep(3.0)  # the root holds attempt 0: payloads queued, manifest pending
        os.killpg(root.pid, signal.SIGKILL)
        root.wait(timeout=30)
        log = open(c.work / "relay-root.log", "ab")  # noqa: SIM115
        c.procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
    finally:
        os.kill(node.pid, signal.SIGCONT)
    th.join(timeout=800)
    assert not th.is_alive()
    assert "error" not in box, box.get("error")
    res: RefitResult = box["res"]
    print(f"[chaos] relay root killed: attempts {[a.failed for a in res.attempts]}", flush=True)
    assert res.version == v and len(res.attempts) >= 2, [a.failed for a in res.attempts]
    first = res.attempts[0]
    assert not first.ok and "owners" in first.failed, first.failed
    assert res.attempts[-1].retry
    one_commit_per_version(c)
    assert_bit_exact(c, v)
    ordinary_refit(c, coord)
    _timed("relay root killed", t0)


# -- a trainer rank killed mid-build (last: the trainer job is gone afterwards) -------------------
@pytest.mark.timeout(900)
@pytest.mark.parametrize("chaos", ["relay"], indirect=True)
def test_trainer_rank_killed_mid_build(chaos: ChaosCluster) -> None:
    """Trainer rank 1 held (SIGSTOP) while the owners build, then SIGKILLed: the build fails on
    rank 0 (its collective loses its peer) and the job goes down; the transition ends with
    `RefitFailed` naming the owners, the commit record is unchanged, and after the operator's
    repair (a dense load of the committed version) the engine is bit-exact with it."""
    c = chaos
    t0 = time.perf_counter()
    assert c.owners is not None
    before = one_commit_per_version(c)
    committed = before[-1].version
    c.owners.call("export", path=c.ckpt(committed))  # the operator's repair loads it
    c.train()
    coord = c.coordinator(owners=RemoteOwners(c.owners.endpoint, timeout_s=30))
    rank1 = c.trainer_rank(1)
    rank1.send_signal(signal.SIGSTOP)
    th, box = _refit_in_thread(coord)
    time.sleep(3.0)  # rank 0 is in the build, waiting for rank 1 in a collective
    rank1.send_signal(signal.SIGKILL)
    th.join(timeout=800)
    assert not th.is_alive()
    err = box.get("error")
    assert isinstance(err, RefitFailed), box
    print(f"[chaos] trainer rank killed: {err}", flush=True)
    assert "owner" in str(err), err
    assert one_commit_per_version(c) == before  # nothing committed, nothing lost
    # the operator's repair: the engine back at the committed version by a dense load
    c.rollout.restore(committed)
    c.reference.rpc("dcr_dense_load", c.ckpt(committed), committed)
    assert c.rollout.digest() == c.reference.digest() == before[-1].digests["rollout"]
    _timed("trainer rank killed", t0)
