"""Coordinator end to end on real components: a Megatron trainer job (2 gloo ranks, TP=2) doing
real optimizer steps behind the owner service, two `vllm serve` receivers driven over HTTP
(`/collective_rpc`), a directory store. Refits commit through the compare-and-set record; a
receiver killed mid-apply and another failing part-way are repaired by the overwrite retry and
a restart + dense load; a coordinator that dies between the ACKs and the commit is replaced by a
new one that resumes without a double commit; a payload lost in transport fails the attempt,
late payloads of the failed attempt are refused and duplicates apply once; owners failing while
pipelined receivers wait make the coordinator abandon the attempt; the request gate refuses an
apply while a generation runs; an optimizer step between build and commit is refused by the
candidate guard (nothing committed, engines restored); an engine leaves and joins again between
transitions; an engine is restarted while the trainer job is down. The main test keeps the
rollout cluster's canonical replica as a required receiver, and engines restore from it. Every
committed version is checked bit for bit against a dense load of the trainer's export of that
version (the export is only the oracle), and the replica's checkpoint against the export."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dcr_tools.procs import PYTHON
from shared_codec.checkpoint import combined_digest, load_checkpoint, state_digests
from shared_codec.coordination.coordinator import Coordinator
from shared_codec.errors import DCRError, RefitFailed
from tests.integration._cluster import Cluster

NAMES = ("engine0", "engine1")


def _dcr_verify(*args: str) -> subprocess.CompletedProcess:
    dcr = str(Path(PYTHON).with_name("dcr"))
    return subprocess.run([dcr, "verify", *args, "--json"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


class WrappedOwners:
    """Delegates the owner protocol to the real owner service (`inner`); subclasses change
    `build`."""

    inner: Any

    def build(self, version: int, attempt: int, retry: bool) -> dict:
        return self.inner.build(version, attempt, retry)

    def verify(self, version: int) -> None:
        self.inner.verify(version)

    def commit(self, version: int) -> None:
        self.inner.commit(version)

    def abort(self, version: int, attempt: int) -> None:
        self.inner.abort(version, attempt)


class LossyOwners(WrappedOwners):
    """Wraps the real owner service: deletes the last payload of attempt 0 from the store after
    it was published (a payload lost in transport); when the retry is built, first delivers
    attempt 0's payloads late to every receiver and records the refusal, then (after the retry
    is published) delivers the retry once ahead of the coordinator (a duplicate delivery)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.inner = cluster, cluster.owners
        self.dropped: list[str] = []
        self.late: dict[str, str] = {}
        self.duplicates: list[dict] = []

    def build(self, version: int, attempt: int, retry: bool) -> dict:
        store = self.cluster.store
        if attempt == 1:  # attempt 0 was fenced by now: its payloads must be refused
            for r in self.cluster.receivers:
                try:
                    r.rpc("dcr_fetch", r.store, version, 0, 30)
                    self.late[r.name] = "accepted"
                except Exception as e:
                    self.late[r.name] = str(e)
        out = self.inner.build(version, attempt, retry)
        if attempt == 0:
            keys = [k for k in store.list(f"v{version:012d}/a000000/") if k.endswith(".dcrp")]
            store.delete(keys[-1])
            self.dropped.append(keys[-1])
        else:
            for r in self.cluster.receivers:
                r.rpc("dcr_fetch", r.store, version, attempt, 30)
                (again,) = r.rpc("dcr_fetch", r.store, version, attempt, 30)
                self.duplicates.append(again)
        return out


class FailingOwners(WrappedOwners):
    """Wraps the real owner service: the first build fails before publishing anything (a
    trainer rank lost while the pipelined receivers already wait for payloads); later builds
    are real."""

    def __init__(self, inner) -> None:
        self.inner, self.failures = inner, 0

    def build(self, version: int, attempt: int, retry: bool) -> dict:
        if not self.failures:
            self.failures += 1
            time.sleep(2)  # the receivers' streaming fetches are polling the store by now
            raise RuntimeError("owner rank 1 lost")
        return self.inner.build(version, attempt, retry)


class SteppingOwners(WrappedOwners):
    """Wraps the real owner service: right after the first build, the trainer takes another
    optimizer step (an async trainer stepping between build and commit)."""

    def __init__(self, inner) -> None:
        self.inner, self.stepped = inner, False

    def build(self, version: int, attempt: int, retry: bool) -> dict:
        out = self.inner.build(version, attempt, retry)
        if not self.stepped:
            self.stepped = True
            self.inner.call("train", step=7)
        return out


def _check_exact(cluster: Cluster, version: int) -> None:
    refit = [r.digest() for r in cluster.receivers]
    assert len(set(refit)) == 1, refit
    cluster.owners.call("export", path=cluster.checkpoint_for(version))
    if cluster.replica is not None:  # the replica's canonical checkpoint: the export's bits
        assert cluster.replica.committed_version() == version
        oracle = load_checkpoint(cluster.checkpoint_for(version))
        assert cluster.replica.digest() == combined_digest(state_digests(oracle))
    # dense reference on the last receiver, after the refit digests were taken
    assert cluster.dense_digest(version, receiver=len(cluster.receivers) - 1) == refit[0]


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_coordinator_commits_retries_and_resumes(tiny_models, tmp_path: Path) -> None:
    cluster = Cluster(tiny_models["qwen3"], tmp_path, replica=True)
    try:
        cluster.start()
        coord = cluster.coordinator(ack_timeout_s=240)
        rec0 = coord.initialize("export-v0")
        assert rec0.version == 0 and rec0.receivers == ("replica", *NAMES)
        assert rec0.digests["engine0"] == rec0.digests["engine1"]
        # the replica, bootstrapped from the engines' initial checkpoint: the trainer's v0
        initial = combined_digest(state_digests(load_checkpoint(cluster.checkpoint_for(0))))
        assert rec0.digests["replica"] == initial

        # 1. a clean refit: one attempt, XOR + overwrite payloads, committed
        cluster.owners.call("train", step=1)
        res = coord.refit()
        assert res.version == 1 and res.retries == 0 and res.record.attempt == 0
        assert res.attempts[0].owners["payloads"] > 1
        assert all(a["ok"] for a in res.attempts[0].acks.values())
        # pipelined: each engine applied the payloads as they arrived (what has arrived together,
        # so the number of passes depends on timing: at least one)
        acks = [res.attempts[0].acks[n] for n in NAMES]
        assert all(a["pipelined"] and a["ranks"][0]["pipelined_parts"] >= 1 for a in acks), acks
        # the replica staged the whole sealed set before its ACK (durable, not yet visible)
        replica_ack = res.attempts[0].acks["replica"]
        assert replica_ack.payloads == acks[0].payloads and replica_ack.elements_written > 0
        assert coord.committed_version() == 1
        _check_exact(cluster, 1)  # leaves engine1 dense-loaded at v1: still clean at v1
        # the endpoint plugin (VLLM_PLUGINS=dcr): the engine's status and metrics over HTTP
        for r in cluster.receivers:
            with urllib.request.urlopen(r.base_url + "/dcr/status", timeout=60) as resp:
                status = json.loads(resp.read())
            assert status["committed_version"] == 1
            assert [(x["rank"], x["state"]) for x in status["ranks"]] == [(0, "clean")]
            with urllib.request.urlopen(r.base_url + "/dcr/metrics", timeout=60) as resp:
                metrics = resp.read().decode()
            assert 'dcr_committed_version{rank="0"} 1.0' in metrics.splitlines()
        applies = re.search(r'dcr_applies_total\{rank="0",result="ok"\} (\d+)', metrics)
        assert applies is not None and int(applies.group(1)) >= 1, metrics

        # the request gate: while a completion streams on engine0, applying is refused and no
        # weight changes; once it has finished, the gate is open again
        r0 = cluster.receivers[0]
        before = r0.digest()
        body = {"model": "policy", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True,
                "stream": True, "temperature": 0}  # fmt: skip
        req = urllib.request.Request(
            r0.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            assert resp.readline().startswith(b"data: ")  # the request holds worker state now
            with pytest.raises(DCRError, match="request gate closed for apply"):
                r0.rpc("dcr_apply", 99)
            resp.read()
        assert r0.digest() == before
        (ack,) = r0.rpc("dcr_apply", 99)  # nothing staged for attempt 99: an empty, allowed apply
        assert ack["ok"] and ack["items"] == 0

        # 2. engine0 is killed mid-apply, engine1 fails part-way: attempt 0 fails, both are
        # fenced, engine0 restarts and dense-loads v1, the overwrite retry repairs engine1
        cluster.owners.call("train", step=2)
        cluster.arm_fault(0, kill_after_items=3)
        cluster.arm_fault(1, fail_after_items=2)
        res = coord.refit()
        first = res.attempts[0]
        assert not first.ok and first.unreachable == {"engine0"}
        assert "injected failure" in first.failed["engine1"]
        assert res.retries == 1 and res.attempts[1].retry and res.record.attempt == 1
        assert res.record.version == 2 and res.record.base_version == 1
        _check_exact(cluster, 2)

        # 3. the coordinator dies after every ACK, before the compare-and-set
        cluster.owners.call("train", step=3)
        attempt, retry = coord.prepare(3)
        assert (attempt, retry) == (0, False)
        assert coord._attempt(3, attempt, retry).ok  # receivers now hold an applied v3
        del coord
        fresh = cluster.coordinator(ack_timeout_s=240)
        assert fresh.resume() == 2  # nothing committed twice, nothing lost
        res = fresh.refit()
        assert res.record.version == 3 and res.record.attempt == 1 and res.attempts[0].retry
        _check_exact(cluster, 3)

        # a duplicate commit of an old version is refused by the record
        assert fresh.commits.current().version == 3
        with pytest.raises(ValueError, match="committed version is 3"):
            fresh.prepare(3)

        # 4. a payload lost in transport fails attempt 0 on every receiver (named in the error);
        # when the retry starts, attempt 0's payloads arriving late are refused (fenced); the
        # retry's payloads delivered twice are staged once and applied once
        cluster.owners.call("train", step=4)
        lossy = LossyOwners(cluster)
        res = Coordinator(cluster.store, lossy, cluster.members, fresh.config).refit()
        assert lossy.dropped and all("is missing" in res.attempts[0].failed[r] for r in NAMES)
        assert all("fenced" in lossy.late[r] for r in NAMES), lossy.late
        assert all(d["duplicates"] == d["payloads"] > 0 for d in lossy.duplicates), lossy.duplicates
        assert res.record.version == 4 and res.record.attempt == 1
        _check_exact(cluster, 4)

        # 5. the owners fail while the pipelined receivers wait for payloads: the coordinator
        # abandons the attempt, the receivers stop at once (not at their deadline: nobody is
        # unreachable or restarted), the retry commits
        cluster.owners.call("train", step=5)
        failing = FailingOwners(cluster.owners)
        coord5 = Coordinator(
            cluster.store, failing, cluster.members, fresh.config, transport=cluster.store_spec
        )
        res = coord5.refit()
        first = res.attempts[0]
        assert "owner rank 1 lost" in first.failed["owners"]
        assert all("abandoned by the coordinator" in first.failed[r] for r in NAMES), first.failed
        assert not first.unreachable
        assert res.record.version == 5 and res.record.attempt == 1
        _check_exact(cluster, 5)

        # 6. the candidate guard: an optimizer step between the build and the commit (an async
        # trainer) is refused before the compare-and-set: nothing committed, every engine
        # restored to v5; the next refit builds v6 from the current weights, bit-exact
        before = [r.digest() for r in cluster.receivers]
        cluster.owners.call("train", step=6)
        coord6 = Coordinator(
            cluster.store,
            SteppingOwners(cluster.owners),
            cluster.members,
            fresh.config,
            transport=cluster.store_spec,
        )
        with pytest.raises(RefitFailed, match=r"CandidateChanged.*nothing committed"):
            coord6.refit()
        assert coord6.committed_version() == 5 and len(coord6.attempts_of(6)) == 1
        assert [r.digest() for r in cluster.receivers] == before
        res = coord6.refit()
        assert res.record.version == 6 and res.record.attempt == 1 and res.retries == 0
        _check_exact(cluster, 6)

        # `dcr verify`: both engines against the commit record and a dense load of v6 (exact),
        # then against v5's checkpoint (engine0 differs tensor by tensor; engine1, the
        # reference, then holds v5 and no longer matches the commit record)
        urls = [r.base_url for r in cluster.receivers]
        spec = json.dumps(cluster.store_spec)
        good = _dcr_verify(*urls, "--store", spec, "--checkpoint", cluster.checkpoint_for(6),
                           "--reference", urls[1], "--version", "6")  # fmt: skip
        assert good.returncode == 0, good.stdout + good.stderr
        report = json.loads(good.stdout)
        assert report["ok"] and report["commit"]["version"] == 6
        assert all(r["mismatched_tensors"] == [] for r in report["receivers"].values())
        bad = _dcr_verify(*urls, "--store", spec, "--checkpoint", cluster.checkpoint_for(5),
                          "--reference", urls[1], "--version", "5")  # fmt: skip
        assert bad.returncode == 1
        report = json.loads(bad.stdout)
        assert report["receivers"][urls[0]]["mismatched_tensors"]
        assert report["receivers"][urls[1]]["mismatched_tensors"] == []
        assert not report["ok"]
        now = _dcr_verify(*urls, "--store", spec)  # engine1 was dense-loaded with v5 above
        report = json.loads(now.stdout)
        assert now.returncode == 1 and report["receivers"][urls[0]]["matches_commit_record"]
        assert not report["receivers"][urls[1]]["matches_commit_record"]

        # 7. membership: engine1 (holding v5) leaves; v7 commits with the replica and engine0;
        # engine1 joins again, restored from the replica's v7 (not from a trainer export): its
        # weights equal engine0's delta-refit ones; v8 includes it, bit-exact
        engine0, engine1 = cluster.receivers
        assert coord6.leave("engine1") is engine1
        cluster.owners.call("train", step=7)
        res = coord6.refit()
        assert res.record.version == 7 and res.record.receivers == ("replica", "engine0")
        assert res.record.digests["engine0"] == engine0.digest()
        coord6.join(engine1)
        assert engine1.digest() == engine0.digest()
        assert coord6.members == ("replica", "engine0", "engine1")
        cluster.owners.call("train", step=8)
        res = coord6.refit()
        assert res.record.receivers == ("replica", "engine0", "engine1")
        _check_exact(cluster, 8)

        # 8. restore while the trainer job is down: engine0's server is killed and restarted,
        # and dense-loads the committed v8 from the replica
        cluster.owners.stop(timeout_s=60)
        assert cluster.trainer is not None and cluster.trainer.wait(120) is not None
        cluster.servers[0].stop()
        engine0.restore(8)
        assert engine0.digest() == engine1.digest()
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.timeout(5400)
def test_randomised_kill_trials(tiny_models, tmp_path: Path) -> None:
    """20 transitions, each with a random fault on a random receiver: killed mid-apply, killed
    mid-transfer, failing part-way, or none. Every transition must commit bit-exact."""
    import random

    rng = random.Random(20261202)
    faults = [
        ("kill mid-apply", "kill_after_items"),
        ("kill mid-transfer", "kill_after_payloads"),
        ("fail part-way", "fail_after_items"),
        ("none", ""),
    ]
    cluster = Cluster(tiny_models["qwen3"], tmp_path)
    seen = []
    try:
        cluster.start()
        coord = cluster.coordinator(ack_timeout_s=240)
        coord.initialize("export-v0")
        for trial in range(1, 21):
            cluster.owners.call("train", step=trial)
            label, key = rng.choice(faults)
            victim = rng.randrange(len(cluster.receivers))
            if key:
                cluster.arm_fault(victim, **{key: rng.randint(0, 4)})
            res = coord.refit()
            seen.append((trial, label, victim, len(res.attempts)))
            print(f"[trial {trial}] {label} on engine{victim}: {len(res.attempts)} attempt(s)")
            assert res.record.version == trial
            _check_exact(cluster, trial)
        assert {label for _, label, _, _ in seen} >= {"kill mid-apply", "kill mid-transfer"}
    finally:
        cluster.stop()
