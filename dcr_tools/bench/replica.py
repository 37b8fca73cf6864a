"""``dcr bench replica``: what the rollout cluster's canonical replica (issue 31) costs, on real
components on one machine, every ratio measured side by side in one run.

Set-up: a Qwen3 model (``medium`` ~166M parameters BF16, or ``small``; `apply.SIZES`) written
locally, and versions v1..vN derived one from the other (`fixtures.perturb_checkpoint`, as
``dcr bench apply`` derives its versions: a uniform `rate`, default 1%, of every tensor's
elements changed); one ``vllm serve`` engine with the DCR worker extension (`HttpEngine`);
the replica bootstrapped from v0 and served by a ``dcr replica serve`` process
(`HttpReplica`); a ``{"kind": "dir"}`` payload store and a directory control store.

Owners: a labelled STAND-IN (`ChainOwners`), no trainer. Attempt a of version v encodes the
canonical diff v-1 -> v (computed before the run, mixed XOR / overwrite as the engine's
prewarm asks) with the codec (`buckets.encode_items`, 2 MiB buckets) and publishes it through
real sinks with a seal. Its build is encode + publish, no construction, so nothing dilutes
the replica's share of a refit.

Method (one warm-up of each kind, then `repeats` rounds, order alternating per round):
- refit latency: a real `Coordinator` with ``[engine]`` and one with ``[replica, engine]``
  over the same control store (pipelined, the defaults; digests not recorded, one attempt:
  a failed attempt fails the run). Each refit advances the version; after a refit without it,
  the replica is brought to that version outside the timed window (``apply`` + ``commit``
  of the committed attempt, whose payloads are still in the store). Time: ``coord.refit()``
  wall seconds; the ACKs' ``fetch_s`` / ``apply_s`` are kept per receiver.
- apply throughput, from the refits with the replica: changed elements per second of the
  replica's stage (its ACK's ``apply_s``: decode, validation, log, slot writes and fsyncs) and
  of the engine's apply in the same refit (its ranks' ``decode_s + apply_s``: the writes into
  the weights; payloads are decoded while they are fetched, outside that figure).
- restore: ``dcr_dense_load`` of the committed version from its local directory vs from
  ``replica.checkpoint_for(v)`` (the worker downloads it with range reads, loads, removes it:
  an engine on another host) vs from the replica's slot under a lease (an engine on the
  replica's host): RPC wall seconds (the goals) and the worker's own load seconds.
- bit-exactness: the replica's digest after every refit and catch-up equals the canonical
  digest of that version's checkpoint (`combined_digest(state_digests(...))`); the engine's
  digest after each restore equals its digest after the refits. A mismatch fails the run.

Goals (issue 31): refit with / without the replica <= 1.05x; restore from the replica / a
dense load from local disk <= 1.1x (over HTTP, and from the slot under a lease); apply
throughput replica / engine reported.

``--pin``: the replica service runs alone on one half of the CPUs (its own host, as on a
cluster), this process (coordinator, owners) and the engine on the other half (vLLM's OpenMP
binding there too); the processes' affinity is read back after the warm-up (`settings.pin`).

Limitations:
1. The owners are a stand-in (above); construction time would make the refit ratio smaller.
2. One machine: the engine, the replica service, the coordinator and the owners share its
   cores (``--pin`` gives the replica its own; on 2 CPUs the engine then has one), and the
   restore's download is loopback.
3. The issue's fourth row (cross-cluster bytes with 1, 2, 4 engines) is `dcr bench fanout`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dcr_tools.bench.apply import SIZES
from dcr_tools.bench.stats import aggregate, machine

#: goals of issue 31, as upper bounds of the median ratio
GOALS = {
    "refit_with_vs_without": 1.05,
    "restore_replica_vs_local": 1.1,  # over HTTP (an engine on another host of the cluster)
    "restore_lease_vs_local": 1.1,  # on the replica's host: its slot, under a lease
}
REFIT_FIGURES = ("with_s", "without_s", "with_vs_without", "catchup_s")
THROUGHPUT_FIGURES = ("replica_elements_per_s", "engine_elements_per_s", "replica_vs_engine")
RESTORE_FIGURES = (
    "local_s",
    "replica_s",
    "replica_vs_local",
    "lease_s",
    "lease_vs_local",
    "local_worker_s",
    "replica_worker_s",
)
BUCKET_BYTES, MIN_BUCKET_BYTES = 2 << 20, 256 << 10  # as `dcr bench refit`'s owners


# --- pure arithmetic (tests/unit/test_bench_replica_units.py) ---------------------------------


def refit_round(with_: Mapping[str, Any], without: Mapping[str, Any]) -> dict[str, float]:
    """One round's refit figures: both latencies, their ratio, the untimed catch-up."""
    return {
        "with_s": float(with_["refit_s"]),
        "without_s": float(without["refit_s"]),
        "with_vs_without": float(with_["refit_s"]) / float(without["refit_s"]),
        "catchup_s": float(without["catchup_s"]),
    }


def throughput_round(with_: Mapping[str, Any]) -> dict[str, float]:
    """Changed elements per second of the replica's stage and of the engine's apply, from one
    refit with the replica (`refit_one`'s record)."""
    replica = float(with_["replica_elements"]) / float(with_["replica_apply_s"])
    engine = float(with_["engine_elements"]) / float(with_["engine_work_s"])
    return {
        "replica_elements_per_s": replica,
        "engine_elements_per_s": engine,
        "replica_vs_engine": replica / engine,
    }


def restore_round(
    local: Mapping[str, float], replica: Mapping[str, float], lease: Mapping[str, float]
) -> dict[str, float]:
    """One round's restore figures (``wall_s``, ``worker_s`` of each dense load): from a
    local directory, from the replica over HTTP, from the replica's slot under a lease."""
    return {
        "local_s": local["wall_s"],
        "replica_s": replica["wall_s"],
        "replica_vs_local": replica["wall_s"] / local["wall_s"],
        "lease_s": lease["wall_s"],
        "lease_vs_local": lease["wall_s"] / local["wall_s"],
        "local_worker_s": local["worker_s"],
        "replica_worker_s": replica["worker_s"],
    }


def verdicts(refit: Mapping[str, float], restore: Mapping[str, float]) -> dict[str, Any]:
    """Each goal's median ratio, its min-max, the bound, and whether the median meets it."""
    got = {
        "refit_with_vs_without": (refit, "with_vs_without"),
        "restore_replica_vs_local": (restore, "replica_vs_local"),
        "restore_lease_vs_local": (restore, "lease_vs_local"),
    }
    out = {}
    for goal, (summary, key) in got.items():
        value = float(summary[key])
        out[goal] = {
            "ratio": value,
            "min": float(summary[f"{key}_min"]),
            "max": float(summary[f"{key}_max"]),
            "at_most": GOALS[goal],
            "met": value <= GOALS[goal],
        }
    return out


# --- the stand-in owners ----------------------------------------------------------------------


class ChainOwners:
    """STAND-IN for a trainer's owners (no trainer; module docstring): attempt 0 of version v
    encodes `items[v]` (the canonical diff v-1 -> v) as owner 0 and publishes it on
    `transport` (`publish_attempt`: its sink, then the seal). A retry is refused: the benchmark allows no failed
    attempt."""

    def __init__(self, items: Mapping[int, list[Any]], transport: dict[str, Any], numel: int):
        self.items, self.transport, self.numel = items, transport, numel

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        from shared_codec.buckets import BucketConfig, encode_items
        from shared_codec.format import PayloadMeta
        from shared_codec.transport.publish import publish_attempt

        if retry:
            raise RuntimeError(f"version {version}: a retry (attempt {attempt}) in the benchmark")
        t0 = time.perf_counter()
        items = self.items[version]
        meta = PayloadMeta(
            version=version, base_version=version - 1, attempt=attempt, owner=0, sequence=0
        )
        config = BucketConfig(bucket_bytes=BUCKET_BYTES, min_bucket_bytes=MIN_BUCKET_BYTES)
        payloads = encode_items(items, meta, config)
        publish_attempt(
            self.transport, version=version, attempt=attempt, base_version=version - 1,
            payloads={0: payloads},
        )  # fmt: skip
        return {
            "baseline_id": f"bench-v{version - 1}",
            "version": version,
            "attempt": attempt,
            "payloads": len(payloads),
            "payload_bytes": sum(len(p) for p in payloads),
            "build_s": time.perf_counter() - t0,
            "element_change_rate": sum(i.count for i in items) / self.numel,
        }

    def verify(self, version: int) -> None:
        pass  # nothing moves the versions after the build

    def commit(self, version: int) -> None:
        pass

    def abort(self, version: int, attempt: int) -> None:
        pass


# --- the run ----------------------------------------------------------------------------------


def derive_versions(v0: Path, work: Path, count: int, rate: float, overwrite: set[str]) -> Any:
    """v1..v`count`, each from the one before with `rate` of every tensor's elements changed.
    Returns (items by version, canonical digest by version, last version's directory); the
    directories in between are removed once diffed."""
    from dcr_tools.fixtures import perturb_checkpoint
    from shared_codec.checkpoint import combined_digest, load_checkpoint, state_digests
    from shared_codec.records import diff_checkpoints

    prev_dir, prev = v0, load_checkpoint(v0)
    items, digests = {}, {0: combined_digest(state_digests(prev))}
    for v in range(1, count + 1):
        path = work / f"v{v}"
        perturb_checkpoint(prev_dir, path, seed=1000 + v, rate=(rate, rate))
        new = load_checkpoint(path)
        items[v] = diff_checkpoints(prev, new, overwrite=overwrite)
        digests[v] = combined_digest(state_digests(new))
        if prev_dir != v0:
            shutil.rmtree(prev_dir)
        prev_dir, prev = path, new
    return items, digests, prev_dir


def _engine_work(ack: Any) -> float:
    """The slowest rank's apply work (decode + writes) of an engine ACK."""
    return max(float(r.timings.decode_s) + float(r.timings.apply_s) for r in ack.ranks)


def refit_one(coord: Any, mode: str, replica: Any, digests: Mapping[int, str]) -> dict[str, Any]:
    """One timed refit through `coord` (`mode` ``with`` or ``without`` the replica), then,
    untimed: the replica brought to the committed version when it was not a member, and its
    digest checked against the version's canonical digest."""
    os.sync()  # earlier writes (catch-ups, derivation) must not land in this refit's fsyncs
    t0 = time.perf_counter()
    res = coord.refit()
    refit_s = time.perf_counter() - t0
    coord.wait_retention()
    last = res.attempts[-1]
    engine = last.acks["engine"]
    row: dict[str, Any] = {
        "mode": mode,
        "version": res.version,
        "refit_s": refit_s,
        "build_s": last.seconds.get("build", 0.0),
        "commit_s": last.seconds.get("commit", 0.0),
        "payloads": last.owners.payloads,
        "payload_bytes": last.owners.payload_bytes,
        "engine_fetch_s": engine.fetch_s,
        "engine_apply_s": engine.apply_s,
        "engine_work_s": _engine_work(engine),
        "engine_elements": engine.elements_written,
    }
    if mode == "with":
        ack = last.acks["replica"]
    else:
        t1 = time.perf_counter()
        ack = replica.apply(res.version, last.attempt, 600.0)
        if not ack.ok:
            raise RuntimeError(f"replica catch-up to version {res.version}: {ack.error}")
        replica.commit(res.version)
        row["catchup_s"] = time.perf_counter() - t1
    row.update(
        replica_fetch_s=ack.fetch_s,
        replica_apply_s=ack.apply_s,
        replica_elements=ack.elements_written,
    )
    if replica.digest() != digests[res.version]:
        raise RuntimeError(f"version {res.version}: the replica is not bit-exact")
    return row


def restore_one(engine: Any, source: str, version: int, want: str) -> dict[str, float]:
    """`dcr_dense_load` of `source` (a directory or a replica checkpoint URL) as `version`:
    RPC wall and worker seconds; the engine's digest must then be `want`."""
    os.sync()
    t0 = time.perf_counter()
    (reply,) = engine.rpc("dcr_dense_load", source, version)
    wall = time.perf_counter() - t0
    engine.reset_prefix_cache()
    if engine.digest() != want:
        raise RuntimeError(f"dense load of {source} is not bit-exact with the refits")
    return {"wall_s": wall, "worker_s": float(reply["seconds"])}


def start_replica(
    root: Path, spec: dict[str, Any], log: Path, env: dict[str, str], cpus: set[int] | None = None
) -> Any:
    """``dcr replica serve`` on `root` (its own process group; on `cpus` only when given):
    (process, base URL)."""
    from dcr_tools.procs import taskset_prefix

    dcr = str(Path(sys.executable).with_name("dcr"))
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [*taskset_prefix(cpus), dcr, "replica", "serve", str(root), "--source",
             json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True,
        )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise RuntimeError(f"dcr replica serve exited with {proc.returncode}; see {log}")
    return proc, json.loads(line)["url"]


def pinned_affinity(
    engine_pid: int, replica_pid: int, cpus: tuple[set[int], set[int]]
) -> dict[str, Any]:
    """Read back the affinity of the engine's and the replica service's processes (with every
    thread's own mask); raise when one runs outside its CPUs."""
    from dcr_tools.procs import tree_affinity

    engine, replica = tree_affinity(engine_pid), tree_affinity(replica_pid)
    bad = [p for p in engine if not set(p["cpus"]) <= cpus[0]]  # type: ignore[call-overload]
    bad += [p for p in replica if not set(p["cpus"]) <= cpus[1]]  # type: ignore[call-overload]
    if bad or not engine or not replica:
        raise RuntimeError(f"--pin did not take (or no process found): {bad or (engine, replica)}")
    return {"main_cpus": sorted(cpus[0]), "replica_cpus": sorted(cpus[1]), "engine": engine,
            "replica": replica}  # fmt: skip


def run(
    size: str = "medium", repeats: int = 5, rate: float = 0.01, pin: bool = False
) -> dict[str, Any]:
    """The whole benchmark (module docstring)."""
    from dcr_tools.bench.refit import split_cpus
    from dcr_tools.fixtures import write_tiny_model
    from dcr_tools.procs import ServeProcess, base_env, free_port, kill_group
    from shared_codec.checkpoint import tensor_table
    from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
    from shared_codec.coordination.engines import HttpEngine
    from shared_codec.replica import ReplicaStore, lease
    from shared_codec.replica.client import HttpReplica
    from shared_codec.transport.store import DirectoryStore

    if size not in ("medium", "small"):
        raise ValueError(f"--size must be medium or small, got {size!r}")
    if repeats < 1 or not 0 < rate < 1:
        raise ValueError(f"need repeats >= 1 and 0 < rate < 1, got {repeats} / {rate}")
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-replica-"))
    refits = 2 * (repeats + 1)  # a warm-up and `repeats` rounds, each one refit per mode
    server, replica_proc = None, None
    before = os.sched_getaffinity(0)
    cpus = split_cpus(before) if pin else None
    host = machine()  # before pinning: the machine's CPUs
    try:
        if cpus is not None:  # this process (coordinator, owners) and the engine on one half
            os.sched_setaffinity(0, cpus[0])
        dims = SIZES[size]
        print(f"[bench replica] writing the {size} model to {work}; starting vLLM", flush=True)
        v0 = write_tiny_model("qwen3", work / "v0", seed=0, **dims)
        table = tensor_table(v0)
        numel = sum(math.prod(shape) for _, _, shape in table)
        ckpt_bytes = sum(f.stat().st_size for f in v0.glob("*.safetensors"))
        spec = {"kind": "dir", "root": str(work / "payloads")}
        env = base_env(VLLM_SERVER_DEV_MODE="1")
        engine_env = dict(env)
        if cpus is not None:  # vLLM's OpenMP binding on the engine's half, nothing reserved
            engine_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(cpus[0]))
            engine_env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        server = ServeProcess(
            v0, free_port(), log=work / "engine.log", env=engine_env,
            cpus=cpus[0] if cpus else None,
        )  # fmt: skip
        url = server.start(timeout_s=900)
        dirs: dict[int, Path] = {0: v0}
        engine = HttpEngine(
            "engine", url, store=spec, checkpoint_for=lambda v: str(dirs[v]), tensors=table
        )
        engine.rpc("dcr_dense_load", str(v0), 0)
        reports = engine.prewarm(0)
        overwrite = {n for r in reports for n in r["overwrite_only"]}
        print(f"[bench replica] deriving {refits} versions at {rate:.0%}", flush=True)
        items, digests, last_dir = derive_versions(v0, work, refits, rate, overwrite)
        dirs[refits] = last_dir
        with ReplicaStore(work / "replica") as store:
            store.bootstrap(v0)
        replica_proc, replica_url = start_replica(
            work / "replica", spec, work / "replica.log", env, cpus[1] if cpus else None
        )
        replica = HttpReplica(replica_url)
        owners = ChainOwners(items, spec, numel)
        control = DirectoryStore(work / "control")
        config = CoordinatorConfig(max_attempts=1, ack_timeout_s=600, record_digests=False)
        coords = {
            mode: Coordinator(control, owners, members, config, lambda _m: None, spec)  # type: ignore[arg-type]
            for mode, members in (("with", [replica, engine]), ("without", [engine]))
        }
        coords["with"].initialize("bench-v0")
        modes: tuple[str, ...] = ("with", "without")
        warmup = {m: refit_one(coords[m], m, replica, digests) for m in modes}
        pinned = None
        if cpus is not None:
            assert server.proc is not None
            pinned = pinned_affinity(server.proc.pid, replica_proc.pid, cpus)
        refit_runs, throughput_runs = [], []
        for k in range(repeats):
            order = modes if k % 2 == 0 else modes[::-1]
            done = {m: refit_one(coords[m], m, replica, digests) for m in order}
            refit_runs.append({"round": k, "order": list(order), **done})
            refit_runs[-1].update(refit_round(done["with"], done["without"]))
            throughput_runs.append(throughput_round(done["with"]))
            print(
                f"[bench replica] refit round {k + 1}/{repeats}: with "
                f"{done['with']['refit_s']:.3f} s, without {done['without']['refit_s']:.3f} s "
                f"({refit_runs[-1]['with_vs_without']:.2f}x)",
                flush=True,
            )
        version = coords["with"].committed_version()
        assert version == refits
        want = engine.digest()
        sources = {"local": str(dirs[version]), "replica": replica.checkpoint_for(version)}

        def restore(source: str) -> dict[str, float]:
            if source != "lease":
                return restore_one(engine, sources[source], version, want)
            with lease(work / "replica", version, holder="bench") as path:  # the replica's host
                return restore_one(engine, str(path), version, want)

        names = ("local", "replica", "lease")
        restore_warmup = {s: restore(s) for s in names}
        restore_runs = []
        for k in range(repeats):
            order = names[k % 3 :] + names[: k % 3]
            done_r = {s: restore(s) for s in order}
            restore_runs.append(
                {"round": k, "order": list(order), **done_r}
                | restore_round(done_r["local"], done_r["replica"], done_r["lease"])
            )
            print(
                f"[bench replica] restore round {k + 1}/{repeats}: local "
                f"{done_r['local']['wall_s']:.3f} s, replica {done_r['replica']['wall_s']:.3f} s, "
                f"lease {done_r['lease']['wall_s']:.3f} s",
                flush=True,
            )
        served = replica.status().get("served", {})
        refit_summary = aggregate(refit_runs, REFIT_FIGURES)
        restore_summary = aggregate(restore_runs, RESTORE_FIGURES)
        return {
            "benchmark": "replica",
            "machine": host,
            "settings": {
                "size": size,
                **dims,
                "parameters": numel,
                "checkpoint_bytes": ckpt_bytes,
                "rate": rate,
                "repeats": repeats,
                "versions": refits,
                "bucket_bytes": BUCKET_BYTES,
                "min_bucket_bytes": MIN_BUCKET_BYTES,
                "overwrite_only": sorted(overwrite),
                "owners": "stand-in (no trainer): precomputed diffs encoded and published",
                # --pin: the replica service alone on one half of the CPUs (its own host, as
                # on a cluster), this process and the engine on the other; read back after
                # the warm-up
                "pin": pinned,
            },
            "refit": {"summary": refit_summary, "warmup": warmup, "runs": refit_runs},
            "throughput": {
                "summary": aggregate(throughput_runs, THROUGHPUT_FIGURES),
                "runs": throughput_runs,
            },
            "restore": {
                "version": version,
                "summary": restore_summary,
                "warmup": restore_warmup,
                "runs": restore_runs,
                "served": served,
            },
            "bit_exact": True,  # every check above raises otherwise
            "goals": verdicts(refit_summary, restore_summary),
            "not_measured": "cross-cluster bytes with 1/2/4 engines: dcr bench fanout",
        }
    finally:
        if replica_proc is not None:
            kill_group(replica_proc)
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
        os.sched_setaffinity(0, before)


# --- output -----------------------------------------------------------------------------------


def _cell(summary: Mapping[str, float], key: str, fmt: str = ".3f", scale: float = 1.0) -> str:
    """``median [min-max]`` of one figure."""
    lo, mid, hi = (scale * summary[k] for k in (f"{key}_min", key, f"{key}_max"))
    return f"{mid:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]"


def render(res: dict[str, Any]) -> str:
    s, m = res["settings"], res["machine"]
    ref, thr, rst = (res[k]["summary"] for k in ("refit", "throughput", "restore"))
    goals = res["goals"]

    def met(goal: str) -> str:
        return "met" if goals[goal]["met"] else "NOT met"

    w = 30
    out = [
        f"Canonical replica (issue 31): {s['size']} Qwen3, {s['parameters'] / 1e6:.1f}M params, "
        f"{s['checkpoint_bytes'] / 1e6:.0f} MB BF16; {s['rate']:.0%} of elements per version; "
        f"median [min-max] of {s['repeats']} rounds after a warm-up, interleaved; "
        f"{m['cpus']} CPUs ({m['processor']}), {m['date']}"
        + (
            f"; pinned: replica on CPUs {s['pin']['replica_cpus']}, engine and coordinator on "
            f"{s['pin']['main_cpus']}"
            if s.get("pin")
            else ""
        ),
        f"{'what':<42} | {'replica side':>{w}} | {'reference':>{w}} | {'ratio':>{w}} | goal",
        f"{'refit latency s: with / without replica':<42} | {_cell(ref, 'with_s'):>{w}} | "
        f"{_cell(ref, 'without_s'):>{w}} | {_cell(ref, 'with_vs_without'):>{w}} | "
        f"<= {GOALS['refit_with_vs_without']}x: {met('refit_with_vs_without')}",
        f"{'restore s: replica over HTTP / local dense':<42} | {_cell(rst, 'replica_s'):>{w}} | "
        f"{_cell(rst, 'local_s'):>{w}} | {_cell(rst, 'replica_vs_local'):>{w}} | "
        f"<= {GOALS['restore_replica_vs_local']}x: {met('restore_replica_vs_local')}",
        f"{'restore s: replica slot (lease) / local':<42} | {_cell(rst, 'lease_s'):>{w}} | "
        f"{_cell(rst, 'local_s'):>{w}} | {_cell(rst, 'lease_vs_local'):>{w}} | "
        f"<= {GOALS['restore_lease_vs_local']}x: {met('restore_lease_vs_local')}",
        f"{'apply M changed elem/s: replica / engine':<42} | "
        f"{_cell(thr, 'replica_elements_per_s', '.1f', 1e-6):>{w}} | "
        f"{_cell(thr, 'engine_elements_per_s', '.1f', 1e-6):>{w}} | "
        f"{_cell(thr, 'replica_vs_engine'):>{w}} | reported",
        "",
        f"restore, the worker's load alone (s): from replica {_cell(rst, 'replica_worker_s')}, "
        f"local {_cell(rst, 'local_worker_s')} (the difference to the wall time: the "
        f"download and the RPC); replica catch-up after a refit without it (untimed) "
        f"{_cell(ref, 'catchup_s')} s",
        "bit-exact: replica digest after every refit and catch-up, engine digest after every "
        "restore: yes",
        "cross-cluster bytes with 1/2/4 engines: dcr bench fanout",
    ]
    return "\n".join(out)


def main(json_path: str | None, size: str, repeats: int = 5, pin: bool = False) -> int:
    res = run(size=size, repeats=repeats, pin=pin)
    print(render(res))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=2))
        print(f"\nwrote {json_path}")
    return 0
