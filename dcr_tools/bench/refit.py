"""``dcr bench refit``: end-to-end DCR refits vs the transport-only full-checkpoint reference,
through the same object-storage transport and the same bandwidth limit, in one run, repeated.

Set-up (one machine): a Qwen3-shaped model (default ``medium``, ~166M parameters, BF16); a
trainer job of Megatron ranks (default TP=2; `trainer_tp`) serving the DCR owner service
(`rl_trainer`); `nodes` ``vllm serve`` rollout engines with the DCR worker extension; a
directory store behind a `ThrottledStore` of the link's bandwidth in every process that moves
payload bytes (each trainer rank and each rollout worker has its own emulated link; the
orchestrator's link for the reference). Several bandwidths (`gbits`) run one after the other in
the same run, each with a fresh trainer job (the owners' link is fixed when the job starts), a
fresh store and the engines dense-loaded back to v0; the engines stay up.

Two-cluster emulation (`pin`): the trainer job (launcher and ranks) runs on one half of this
process's CPUs and every engine process (API server, EngineCore, workers; vLLM's OpenMP binding
set to the same CPUs) on the other half (``taskset``; on 2 cores: CPU 0 / CPU 1); the affinity
of every process and thread is read back after the warm-up and at the end of each bandwidth,
recorded in the JSON, and a process outside its half fails the run. The reference's upload runs
on the trainer half and its download on the engine half (the orchestrator thread's affinity).

Method (per bandwidth): one warm-up per mode (a refit of the first rate and its reference,
checked, not counted); then for each change rate (1%, 3%, 5%: a uniform share of every
parameter's elements changed by relative amplitude 1e-2 on the trainer) `repeats` rounds, each
a ``pipelined`` and a ``sequential`` refit (their order alternating from round to round), every
refit on a fresh change of that rate and followed by its reference, so all three are measured
interleaved in the same run. ``pipelined``: engines fetch each payload as its object appears and
apply it at once, while the owners still build and upload (the paper's Figure 8);
``sequential``: build and upload everything, then fetch everything, then apply; compare-and-set
commit, digests not recorded. Every figure of a (bandwidth, rate, mode) row is the median over
the rounds, with its min and max (a ratio is the median of the per-round ratios); the per-round
figures are kept under ``runs``.

Latency breakdown: construction (slowest rank's ``hook.build``, uploads overlap it), upload
tail + manifest, then the tails on the engines: fetch still running after the build, apply
still running after the last payload arrived (sequential: the whole fetch and apply), both
measured from the owners' build returning to the last ACK; the owners' candidate guard
(``verify_s``, run by the coordinator right after the build, overlapping those tails; the
owner service holds it without a scan here, ``guard`` "held": docs/protocol.md); commit
(compare-and-set ``cas_s``, then engines and owners are told: ``commit_engines_s``,
``commit_owners_s``); ``other_s`` is what the refit's wall time holds beyond the build, the
longer of (tails, guard) and the commit (``prepare_s``: records read and the attempt reserved;
RPC round trips); ``retain_s``: the retention pass the commit starts in the background
(waited for after the refit, not part of its latency);
``apply_work_s`` is the engine's total apply time, overlapped or not (wall time), and
``apply_work_cpu_s`` the applying thread's CPU time over the same spans (the work itself);
``apply_parts`` how many parts the engine applied (pipelined: what had arrived, together).
``fleet_critical_s``: the slowest engine's ACK, from the start of the refit (with `nodes` > 1).
The reference moves the whole checkpoint of the same version: upload once over the trainer's
link, download on every rollout node (in parallel, one link each: timed once), then a dense
load on the engine (``dcr_dense_load``); it does not include exporting the checkpoint. The
engine's digest after the reference's dense load must equal its digest after the DCR refit
(checked: the benchmark also verifies bit-exactness).

Derived per round (`derive`): lower bound = max(construction, V_payload / bandwidth), with
construction the faster of the round's two builds (an unpinned pipelined build shares the cores
with the engine's applies, which would flatter a bound taken from it); latency / lower bound;
speedup = reference / DCR latency; ideal speedup = min(checkpoint bytes / V_payload,
reference / construction) (the speedup if the refit moved only its payload at the link's
speed, or took only its construction); speedup / ideal. Goals (issue 18): latency <= 1.2x the
lower bound in the two-cluster emulation, speedup >= 85% of the ideal.

Limitations:
1. Without `pin` everything shares this machine's cores: an engine applying while the trainer
   ranks build slows the build (the overlap hides transfer time, not compute). With `pin` the
   orchestrator (coordinator, HTTP calls) stays unpinned, and the two halves still share memory
   bandwidth and caches.
2. One machine: the links are emulated by token buckets, not a network namespace.
3. With several engines, the reference dense-loads on the first one only (the others keep the
   DCR version, which the digests showed to be the same bits).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dcr_tools.bench.apply import MEDIUM, SMALL
from dcr_tools.bench.stats import aggregate
from dcr_tools.procs import (
    ServeProcess,
    base_env,
    free_port,
    start_rl_job,
    tree_affinity,
)
from shared_codec.checkpoint import tensor_table
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.coordination.engines import HttpEngine
from shared_codec.coordination.owners import RemoteOwners
from shared_codec.transport.store import DirectoryStore, ThrottledStore

MODES = ("pipelined", "sequential")

#: per-round figures aggregated into median / min / max (docs/benchmarks.md)
FIGURES = (
    "dcr_s",
    "construct_s",
    "upload_tail_s",
    "fetch_tail_s",
    "apply_tail_s",
    "apply_work_s",
    "apply_work_cpu_s",
    "apply_parts",
    "verify_s",
    "commit_s",
    "other_s",
    "prepare_s",
    "cas_s",
    "retain_s",
    "commit_owners_s",
    "commit_engines_s",
    "fleet_critical_s",
    "transport_share",
    "v_payload_bytes",
    "v_cross_bytes",
    "element_change_rate",
    "reference_s",
    "reference_upload_s",
    "reference_download_s",
    "reference_dense_load_s",
    "speedup",
    "bound_construct_s",
    "lower_bound_s",
    "latency_vs_lower_bound",
    "ideal_speedup",
    "speedup_vs_ideal",
)


# --- pure arithmetic (unit-tested on synthetic numbers: tests/unit/test_bench_refit_units.py) ---


def lower_bound(construct_s: float, payload_bytes: float, bytes_per_s: float) -> float:
    """max(construction, V_payload / bandwidth): no refit can be faster than building its delta
    or than moving its payload once over the link."""
    if bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bytes_per_s} B/s")
    return max(construct_s, payload_bytes / bytes_per_s)


def ideal_speedup(
    checkpoint_bytes: float, payload_bytes: float, reference_s: float, construct_s: float
) -> float:
    """min(checkpoint bytes / V_payload, reference / construction): the speedup over the
    full-checkpoint reference if the refit were bound only by its bytes (the reference moves
    the checkpoint) or only by its construction."""
    by_bytes = checkpoint_bytes / payload_bytes if payload_bytes > 0 else float("inf")
    by_compute = reference_s / construct_s if construct_s > 0 else float("inf")
    return min(by_bytes, by_compute)


def fleet_critical(ack_s: Sequence[float]) -> float:
    """The slowest engine's latency (the fleet waits for it before the joint commit)."""
    if not ack_s:
        raise ValueError("no engine latencies")
    return max(ack_s)


def derive(rounds: Sequence[dict[str, Any]], checkpoint_bytes: float, bytes_per_s: float) -> None:
    """Add the bound and ideal figures to the rows of one round (one refit per mode, same rate,
    each with ``dcr_s``, ``construct_s``, ``v_payload_bytes``, ``reference_s``): construction
    for the bound is the faster of the round's builds (module docstring)."""
    construct = min(float(r["construct_s"]) for r in rounds)
    for r in rounds:
        bound = lower_bound(construct, float(r["v_payload_bytes"]), bytes_per_s)
        speedup = float(r["reference_s"]) / float(r["dcr_s"])
        ideal = ideal_speedup(
            checkpoint_bytes, float(r["v_payload_bytes"]), float(r["reference_s"]), construct
        )
        r.update(
            {
                "speedup": speedup,
                "bound_construct_s": construct,
                "lower_bound_s": bound,
                "latency_vs_lower_bound": float(r["dcr_s"]) / bound,
                "ideal_speedup": ideal,
                "speedup_vs_ideal": speedup / ideal,
            }
        )


def summarize_rows(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One table row from the rounds of a (bandwidth, rate, mode): every `FIGURES` key as median,
    ``_min`` and ``_max``; the rounds themselves under ``runs``."""
    first = runs[0]
    row: dict[str, Any] = {
        "gbit": first["gbit"],
        "rate": first["rate"],
        "mode": first["mode"],
        "repeats": len(runs),
    }
    row.update(aggregate(runs, FIGURES))
    row["runs"] = list(runs)
    return row


def split_cpus(allowed: set[int]) -> tuple[set[int], set[int]]:
    """(trainer CPUs, engine CPUs): the lower half of `allowed` and the upper half."""
    cpus = sorted(allowed)
    if len(cpus) < 2:
        raise ValueError(f"--pin needs at least 2 CPUs, this process may use {cpus}")
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


class _Stamped:
    """Coordinator handle around `inner` (an `HttpEngine` or `RemoteOwners`) that notes in
    ``at`` when a call of its `method` last returned (an engine's ACK: `fleet_critical_s`; the
    owners' build: where the engines' tails start); everything else is `inner`'s own."""

    def __init__(self, inner: Any, method: str) -> None:
        self.inner, self._method, self.at = inner, method, 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self._method:
            return attr

        def stamped(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self.at = time.perf_counter()

        return stamped


@contextmanager
def _on_cpus(cpus: set[int] | None) -> Iterator[None]:
    """Run the calling thread on `cpus` for the block (None: leave it)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # 0: the calling thread (Linux)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def run(
    size: str = "medium",
    rates: tuple[float, ...] = (0.01, 0.03, 0.05),
    gbits: tuple[float, ...] = (1.0,),
    nodes: int = 1,
    bucket_mib: float = 2.0,
    repeats: int = 5,
    pin: bool = False,
    trainer_tp: int | None = None,
    min_bucket_kib: float = 256.0,
) -> dict[str, Any]:
    """The whole benchmark (module docstring); `trainer_tp` defaults to 1 with `pin` (the
    trainer's half may be one core), else 2."""
    from dcr_tools.fixtures import write_tiny_model

    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if not rates or not gbits or min(gbits) <= 0:
        raise ValueError(f"need rates and positive bandwidths, got {rates} / {gbits}")
    tp = trainer_tp if trainer_tp is not None else (1 if pin else 2)
    cpus = split_cpus(os.sched_getaffinity(0)) if pin else None
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-refit-"))
    servers: list[ServeProcess] = []
    try:
        dims = MEDIUM if size == "medium" else SMALL
        model = write_tiny_model("qwen3", work / "model", seed=0, **dims)
        env = base_env(VLLM_SERVER_DEV_MODE="1")
        engine_env = dict(env)
        if cpus is not None:  # vLLM's OpenMP binding on the engine half, nothing reserved
            engine_env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(cpus[1]))
            engine_env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        print(
            f"[bench refit] {size} model; links of {', '.join(f'{g:g}' for g in gbits)} Gbit/s; "
            f"trainer TP={tp}; "
            + (
                f"pinned: trainer CPUs {sorted(cpus[0])}, engines {sorted(cpus[1])}"
                if cpus
                else "not pinned"
            )
            + "; starting engines",
            flush=True,
        )
        servers = [
            ServeProcess(
                model,
                free_port(),
                log=work / f"engine{i}.log",
                env=engine_env,
                cpus=cpus[1] if cpus else None,
            )
            for i in range(nodes)
        ]
        urls = [s.start(timeout_s=900) for s in servers]
        links = []
        rows: list[dict[str, Any]] = []
        for i, gbit in enumerate(gbits):
            link = _link(
                i, gbit, str(model), work, env, tp, cpus, urls, servers, rates, repeats,
                int(bucket_mib * (1 << 20)), int(min_bucket_kib * 1024),
            )  # fmt: skip
            rows += link.pop("rows")
            links.append(link)
        return {
            "benchmark": "refit",
            "size": size,
            "model": dims,
            "checkpoint_bytes": links[0]["checkpoint_bytes"],
            "bandwidths_gbit_per_s": list(gbits),
            "nodes": nodes,
            "bucket_bytes": int(bucket_mib * (1 << 20)),
            "min_bucket_bytes": int(min_bucket_kib * 1024),
            "repeats": repeats,
            "trainer_tp": tp,
            "pinned": pin,
            "reference_v_cross_bytes": links[0]["checkpoint_bytes"] * (1 + nodes),
            "links": links,
            "rows": rows,
        }
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(work, ignore_errors=True)


def _link(
    index: int,
    gbit: float,
    model: str,
    work: Path,
    env: dict[str, str],
    tp: int,
    cpus: tuple[set[int], set[int]] | None,
    urls: list[str],
    servers: list[ServeProcess],
    rates: tuple[float, ...],
    repeats: int,
    bucket_bytes: int,
    min_bucket_bytes: int,
) -> dict[str, Any]:
    """Every round at one bandwidth: a fresh trainer job and store, the engines back at v0."""
    bw = gbit * 1e9 / 8
    root, ckpts = work / f"store{index}", work / f"ckpts{index}"
    spec = {"kind": "dir", "root": str(root), "bandwidth_bytes_per_s": bw}
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    print(f"[bench refit] {gbit:g} Gbit/s: starting the trainer job", flush=True)
    proc = start_rl_job(
        model,
        endpoint,
        ["--store", json.dumps(spec)],
        "--bucket-bytes",
        str(bucket_bytes),
        "--min-bucket-bytes",
        str(min_bucket_bytes),
        log=work / f"trainer{index}.log",
        env=env,
        tp=tp,
        cpus=cpus[0] if cpus else None,
    )
    owners: RemoteOwners | None = None
    try:
        owners = RemoteOwners(endpoint, timeout_s=900)
        owners.call("status", timeout_s=900)
        v0 = ckpts / "v0"
        owners.call("export", path=str(v0))
        ckpt_bytes = sum(f.stat().st_size for f in v0.glob("*.safetensors"))
        table = tensor_table(v0)
        receivers = [
            _Stamped(
                HttpEngine(
                    f"engine{i}",
                    url,
                    store=spec,
                    checkpoint_for=lambda v: str(ckpts / f"v{v}"),
                    tensors=table,
                ),
                "apply",
            )
            for i, url in enumerate(urls)
        ]
        for r in receivers:
            r.restore(0)
        clock = _Stamped(owners, "build")
        coords = {
            mode: Coordinator(
                DirectoryStore(root),
                clock,  # type: ignore[arg-type]
                receivers,  # type: ignore[arg-type]
                CoordinatorConfig(
                    record_digests=False, ack_timeout_s=900, pipeline=mode == "pipelined"
                ),
                transport={"kind": "dir", "root": str(root)},  # the abandon marker only
            )
            for mode in MODES
        }
        coords["pipelined"].initialize("v0")
        seed = 100_000 * index  # a fresh change for every refit of the run
        assert owners is not None

        def refit(mode: str, rate: float) -> dict[str, Any]:
            nonlocal seed
            seed += 1
            for r in receivers:
                r.inner.pipelined = mode == "pipelined"
            owners.call("inject", rate=rate, seed=seed)
            # flush the previous round's checkpoint export and reference files: otherwise
            # the next small fsync (attempt / commit records) waits for ~700 MB of writeback
            os.sync()
            row = _one(coords[mode], mode, rate, clock, receivers, ckpts, work, bw, cpus)
            row["gbit"] = gbit
            return row

        warmup = [refit(mode, rates[0]) for mode in MODES]
        derive(warmup, ckpt_bytes, bw)
        affinity = {"after_warmup": _affinity(proc.pid, servers, cpus)} if cpus else {}
        rows = []
        for rate in rates:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for k in range(repeats):
                done = [refit(mode, rate) for mode in (MODES if k % 2 == 0 else MODES[::-1])]
                derive(done, ckpt_bytes, bw)
                for d in done:
                    runs[d["mode"]].append(d)
                    print(
                        f"[bench refit] {gbit:g} Gbit/s {d['rate']} {d['mode']} round {k + 1}/"
                        f"{repeats}: DCR {d['dcr_s']:.2f}s ({d['latency_vs_lower_bound']:.2f}x "
                        f"the bound) vs reference {d['reference_s']:.2f}s = {d['speedup']:.1f}x "
                        f"({100 * d['speedup_vs_ideal']:.0f}% of the ideal); payload "
                        f"{d['v_payload_bytes'] / 1e6:.2f} MB",
                        flush=True,
                    )
            rows += [summarize_rows(runs[m]) for m in MODES]
        if cpus:
            affinity["end"] = _affinity(proc.pid, servers, cpus)
        return {
            "gbit": gbit,
            "bandwidth_bytes_per_s": bw,
            "checkpoint_bytes": ckpt_bytes,
            "warmup": warmup,
            "affinity": affinity,
            "rows": rows,
        }
    finally:
        if owners is not None:
            try:
                owners.stop(timeout_s=30)
            except Exception:
                pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ckpts, ignore_errors=True)


def _affinity(
    trainer_pid: int, servers: list[ServeProcess], cpus: tuple[set[int], set[int]]
) -> dict[str, Any]:
    """Read back the affinity of the trainer job's and every engine's processes; raise when one
    runs outside its half."""
    trainer = tree_affinity(trainer_pid)
    engines = []
    for s in servers:
        assert s.proc is not None
        engines.append(tree_affinity(s.proc.pid))
    bad = [p for p in trainer if not set(p["cpus"]) <= cpus[0]]  # type: ignore[call-overload]
    bad += [p for e in engines for p in e if not set(p["cpus"]) <= cpus[1]]  # type: ignore[call-overload]
    if bad or not trainer or not all(engines):
        raise RuntimeError(f"--pin did not take (or no process found): {bad or (trainer, engines)}")
    return {
        "trainer_cpus": sorted(cpus[0]),
        "engine_cpus": sorted(cpus[1]),
        "trainer": trainer,
        "engines": engines,
    }


def _one(
    coord: Coordinator,
    mode: str,
    rate: float,
    owners: _Stamped,
    receivers: list[_Stamped],
    ckpts: Path,
    work: Path,
    bw: float,
    cpus: tuple[set[int], set[int]] | None,
) -> dict[str, Any]:
    """One refit through `coord`, its breakdown, and the reference for the same version."""
    nodes = len(receivers)
    t0 = time.perf_counter()
    res = coord.refit()
    total = time.perf_counter() - t0
    coord.wait_retention()  # (off the refit's critical path: reported, not counted)
    acked = [r.at - t0 for r in receivers]
    last = res.attempts[-1]
    acks = list(last.acks.values())
    built = last.owners
    assert built is not None  # a committed attempt was built
    construct = built.build_s
    build = last.seconds["build"]
    upload_tail = build - construct
    after_build = last.seconds["apply"]  # end of the build -> every ACK and the guard's answer
    tail = max(0.0, max(r.at for r in receivers) - owners.at)  # -> the last ACK
    fetch = max(float(a["fetch_s"]) for a in acks)
    if mode == "pipelined":  # receivers started with the build: only what outlasted it counts
        fetch_tail = min(tail, max(0.0, fetch - build))
    else:
        fetch_tail = fetch
    apply_tail = max(0.0, tail - fetch_tail)
    ranks = [rk for a in acks for rk in a["ranks"]]
    apply_work = max(float(rk["timings"]["apply_s"]) for rk in ranks)
    apply_cpu = max(float(rk["timings"].get("apply_cpu_s", 0.0)) for rk in ranks)
    parts = max(int(rk.get("pipelined_parts", 1)) for rk in ranks)
    verify = last.seconds.get("verify", 0.0)
    commit = last.seconds.get("commit", 0.0)
    payload = built.payload_bytes
    # the reference moves this version's checkpoint; its dense load must not change a bit of
    # what DCR applied (checked), and leaves the engine at the committed version
    vpath = ckpts / f"v{res.version}"
    owners.call("export", path=str(vpath))
    digest = receivers[0].digest()
    ref = reference(work, vpath, receivers[0].inner, bw, nodes, res.version, cpus)
    if receivers[0].digest() != digest:
        raise RuntimeError(f"version {res.version}: DCR refit != dense load (digest)")
    if res.version > 1:  # keep v0 and the committed version (restores) only: ~330 MB each
        shutil.rmtree(ckpts / f"v{res.version - 1}", ignore_errors=True)
    transport = upload_tail + fetch_tail
    return {
        "rate": f"{round(rate * 100)}%",
        "mode": mode,
        "version": res.version,
        "element_change_rate": built.element_change_rate,
        "dcr_s": total,
        "construct_s": construct,
        "upload_tail_s": upload_tail,
        "fetch_tail_s": fetch_tail,
        "apply_tail_s": apply_tail,
        "apply_work_s": apply_work,
        "apply_work_cpu_s": apply_cpu,
        "apply_parts": parts,
        "verify_s": verify,
        "commit_s": commit,
        "other_s": max(0.0, total - build - after_build - commit),
        "prepare_s": last.seconds.get("prepare", 0.0),
        "cas_s": last.seconds.get("cas", 0.0),
        "retain_s": coord.last_retention.get("seconds", 0.0),
        "commit_owners_s": last.seconds.get("commit_owners", 0.0),
        "commit_engines_s": last.seconds.get("commit_engines", 0.0),
        "guard": last.guard,
        "engine_ack_s": acked,
        "fleet_critical_s": fleet_critical(acked),
        "transport_share": transport / total,
        "v_payload_bytes": payload,
        "v_cross_bytes": payload * (1 + nodes),
        "reference_s": ref["total_s"],
        "reference_upload_s": ref["upload_s"],
        "reference_download_s": ref["download_s"],
        "reference_dense_load_s": ref["dense_load_s"],
    }


def reference(
    work: Path,
    ckpt: Path,
    receiver: HttpEngine,
    bw: float,
    nodes: int,
    version: int,
    cpus: tuple[set[int], set[int]] | None = None,
) -> dict[str, float]:
    """Move the whole checkpoint over the same links, then dense-load it on one engine; with
    `cpus` the upload runs on the trainer half and the download on the engine half."""
    files = sorted(ckpt.glob("*.safetensors"))
    up = ThrottledStore(DirectoryStore(work / "ref-store"), bw)
    with _on_cpus(cpus[0] if cpus else None):
        t0 = time.perf_counter()
        for f in files:
            up.put(f"ref/{f.name}", f.read_bytes())
        upload = time.perf_counter() - t0
    # every node downloads over its own link, in parallel: the time of one download
    down = ThrottledStore(DirectoryStore(work / "ref-store"), bw)
    with _on_cpus(cpus[1] if cpus else None):
        t1 = time.perf_counter()
        for f in files:
            down.get(f"ref/{f.name}")
        download = time.perf_counter() - t1
    (dense,) = receiver.rpc("dcr_dense_load", str(ckpt), version)
    receiver.reset_prefix_cache()
    shutil.rmtree(work / "ref-store", ignore_errors=True)
    return {
        "upload_s": upload,
        "download_s": download,
        "dense_load_s": float(dense["seconds"]),
        "total_s": upload + download + float(dense["seconds"]),
        "nodes": nodes,
    }


def _cell(row: dict[str, Any], key: str, fmt: str = ".2f", scale: float = 1.0) -> str:
    """``median [min-max]`` of one figure."""
    lo, mid, hi = (scale * row[k] for k in (f"{key}_min", key, f"{key}_max"))
    return f"{mid:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]"


def render(res: dict[str, Any]) -> str:
    nodes = res["nodes"]
    out = [
        f"Refit vs full-checkpoint transfer ({res['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, "
        f"{nodes} rollout node(s), trainer TP={res['trainer_tp']}, "
        + ("pinned: two-cluster emulation" if res["pinned"] else "not pinned: shared cores")
        + f", buckets of {res['bucket_bytes'] / (1 << 20):g} MiB raw records tapering to "
        f"{res.get('min_bucket_bytes', res['bucket_bytes']) / 1024:g} KiB); median [min-max] "
        f"of {res['repeats']} rounds after a warm-up per mode; bound = max(construction, "
        "V_payload / bandwidth), ideal = min(checkpoint / V_payload, reference / construction)",
        f"{'Gbit/s':>6} {'rate':>4} {'mode':>10} | {'DCR s':>17} | {'bound s':>17} | "
        f"{'DCR / bound':>17} | {'reference s':>17} | {'speedup':>17} | {'ideal':>17} | "
        f"{'speedup / ideal':>17} | {'payload MB':>10}"
        + (f" | {'fleet-critical s':>17}" if nodes > 1 else ""),
    ]
    for r in res["rows"]:
        out.append(
            f"{r['gbit']:>6g} {r['rate']:>4} {r['mode']:>10} | {_cell(r, 'dcr_s'):>17} | "
            f"{_cell(r, 'lower_bound_s'):>17} | {_cell(r, 'latency_vs_lower_bound'):>17} | "
            f"{_cell(r, 'reference_s'):>17} | {_cell(r, 'speedup', '.1f'):>17} | "
            f"{_cell(r, 'ideal_speedup', '.1f'):>17} | "
            f"{_cell(r, 'speedup_vs_ideal', '.0%'):>17} | {r['v_payload_bytes'] / 1e6:10.2f}"
            + (f" | {_cell(r, 'fleet_critical_s'):>17}" if nodes > 1 else "")
        )
    out += [
        "",
        "Breakdown (seconds; tails = what remained after the build (pipelined) or the whole "
        "stage (sequential))",
        f"{'Gbit/s':>6} {'rate':>4} {'mode':>10} | {'construct':>17} | {'upload tail':>17} | "
        f"{'fetch tail':>17} | {'apply tail':>17} | {'verify':>17} | {'commit':>17} | "
        f"{'other':>17} | {'transport share':>17}",
    ]
    for r in res["rows"]:
        out.append(
            f"{r['gbit']:>6g} {r['rate']:>4} {r['mode']:>10} | {_cell(r, 'construct_s'):>17} | "
            f"{_cell(r, 'upload_tail_s'):>17} | {_cell(r, 'fetch_tail_s'):>17} | "
            f"{_cell(r, 'apply_tail_s'):>17} | {_cell(r, 'verify_s'):>17} | "
            f"{_cell(r, 'commit_s'):>17} | {_cell(r, 'other_s'):>17} | "
            f"{_cell(r, 'transport_share', '.0%'):>17}"
        )
    out.append("")
    by = {(r["gbit"], r["rate"], r["mode"]): r for r in res["rows"]}
    for gbit, rate in dict.fromkeys((r["gbit"], r["rate"]) for r in res["rows"]):
        p, q = by.get((gbit, rate, "pipelined")), by.get((gbit, rate, "sequential"))
        if p and q:
            out.append(
                f"{gbit:g} Gbit/s {rate}: pipelining makes the refit {q['dcr_s'] / p['dcr_s']:.2f}x "
                f"faster (medians); apply work pipelined / sequential: wall "
                f"{p['apply_work_s'] * 1e3:.0f} / {q['apply_work_s'] * 1e3:.0f} ms, CPU "
                f"{p['apply_work_cpu_s'] * 1e3:.0f} / {q['apply_work_cpu_s'] * 1e3:.0f} ms, "
                f"{p['apply_parts']:.0f} parts; goals (pipelined, medians): DCR / bound "
                f"{p['latency_vs_lower_bound']:.2f}x (<= 1.2x: "
                f"{'met' if p['latency_vs_lower_bound'] <= 1.2 else 'not met'}), speedup / ideal "
                f"{p['speedup_vs_ideal']:.0%} (>= 85%: "
                f"{'met' if p['speedup_vs_ideal'] >= 0.85 else 'not met'})"
                + ("" if res["pinned"] else "; not pinned: not the two-cluster emulation")
            )
    return "\n".join(out)


def main(
    json_path: str | None,
    size: str,
    gbits: tuple[float, ...],
    nodes: int,
    bucket_mib: float = 2.0,
    *,
    repeats: int = 5,
    pin: bool = False,
    trainer_tp: int | None = None,
    rates: tuple[float, ...] = (0.01, 0.03, 0.05),
    min_bucket_kib: float = 256.0,
) -> int:
    res = run(
        size=size,
        rates=rates,
        gbits=gbits,
        nodes=nodes,
        bucket_mib=bucket_mib,
        repeats=repeats,
        pin=pin,
        trainer_tp=trainer_tp,
        min_bucket_kib=min_bucket_kib,
    )
    print(render(res))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=2))
        print(f"\nwrote {json_path}")
    return 0
