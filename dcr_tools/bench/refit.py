"""``dcr bench refit``: end-to-end DCR refits vs the transport-only full-checkpoint reference,
through the same object-storage transport and the same bandwidth limit, in one run.

Set-up (one machine): a Qwen3-shaped model (default ``medium``, ~166M parameters, BF16); a
trainer job of 2 Megatron ranks (TP=2) serving the DCR owner service (`rl_trainer`); `nodes`
``vllm serve`` rollout engines with the DCR worker extension; a directory store behind a
`ThrottledStore` of `gbit` Gbit/s in every process that moves payload bytes (each trainer rank
and each rollout worker has its own emulated link; the orchestrator's link for the reference).

For each change rate (1%, 3%, 5%: a uniform share of every parameter's elements changed by
relative amplitude 1e-2 on the trainer) two DCR refits run through the coordinator, each on a
fresh change of that rate: ``pipelined`` (engines fetch each payload as its object appears and
apply it at once, while the owners still build and upload: the paper's Figure 8) and
``sequential`` (build and upload everything, then fetch everything, then apply); compare-and-set
commit, digests not recorded. Latency breakdown: construction (slowest rank's ``hook.build``,
uploads overlap it), upload tail + manifest, then the tails on the engines: fetch still running
after the build, apply still running after the last payload arrived (sequential: the whole fetch
and apply), commit; ``apply_work_s`` is the engine's total apply time, overlapped or not
(wall time: in a pipelined refit it includes the waits for a core the build causes), and
``apply_work_cpu_s`` the applying thread's CPU time over the same spans (the work itself);
``apply_parts`` how many parts the engine applied (pipelined: what had arrived, together).
The reference moves the whole checkpoint of the same version: upload once over the trainer's
link, download on every rollout node (in parallel, one link each), then a dense load on the
engine (``dcr_dense_load``); the reference time does not include exporting the checkpoint. The
engine's digest after the reference's dense load must equal its digest after the DCR refit
(checked: the benchmark also verifies bit-exactness).

Reported per rate: DCR seconds and breakdown, reference seconds, speedup, transport share of the
DCR latency, V_payload (unique payload bytes) and V_cross (bytes over the trainer/rollout
boundary: one upload plus one download per node), and the ratio of the DCR latency to the lower
bound max(construction, V_payload / bandwidth), construction taken from the rate's sequential
refit (uncontended).

Limitations:
1. Everything shares 2 CPU cores here: an engine applying while the trainer ranks build slows
   the build (the overlap hides transfer time, not compute).
2. One machine: the links are emulated by token buckets, not a network namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from dcr_tools.bench.apply import MEDIUM, SMALL
from dcr_tools.procs import ServeProcess, base_env, free_port, start_rl_job
from shared_codec.checkpoint import tensor_table
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
from shared_codec.coordination.engines import HttpEngine
from shared_codec.coordination.owners import RemoteOwners
from shared_codec.transport.store import DirectoryStore, ThrottledStore


def run(
    size: str = "medium",
    rates: tuple[float, ...] = (0.01, 0.03, 0.05),
    gbit: float = 1.0,
    nodes: int = 1,
    bucket_mib: float = 2.0,
) -> dict[str, Any]:
    from dcr_tools.fixtures import write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="dcr-bench-refit-"))
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[ServeProcess] = []
    owners: RemoteOwners | None = None
    bw = gbit * 1e9 / 8
    try:
        dims = MEDIUM if size == "medium" else SMALL
        model = write_tiny_model("qwen3", work / "model", seed=0, **dims)
        spec = {"kind": "dir", "root": str(work / "store"), "bandwidth_bytes_per_s": bw}
        env = base_env(VLLM_SERVER_DEV_MODE="1")
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        print(f"[bench refit] {size} model; links of {gbit} Gbit/s; starting processes", flush=True)
        procs.append(
            start_rl_job(
                model,
                endpoint,
                ["--store", json.dumps(spec)],
                "--bucket-bytes",
                str(int(bucket_mib * (1 << 20))),
                log=work / "trainer.log",
                env=env,
            )
        )
        servers = [
            ServeProcess(model, free_port(), log=work / f"engine{i}.log", env=env)
            for i in range(nodes)
        ]
        urls = [s.start(timeout_s=900) for s in servers]
        owners = RemoteOwners(endpoint, timeout_s=900)
        owners.call("status", timeout_s=900)
        ckpts = work / "ckpts"
        owners.call("export", path=str(ckpts / "v0"))
        v0 = ckpts / "v0"
        ckpt_bytes = sum(f.stat().st_size for f in v0.glob("*.safetensors"))
        table = tensor_table(v0)
        receivers = [
            HttpEngine(
                f"engine{i}",
                url,
                store=spec,
                checkpoint_for=lambda v: str(ckpts / f"v{v}"),
                tensors=table,
            )
            for i, url in enumerate(urls)
        ]
        for r in receivers:
            r.restore(0)
        coords = {
            mode: Coordinator(
                DirectoryStore(work / "store"),
                owners,
                receivers,  # type: ignore[arg-type]
                CoordinatorConfig(
                    record_digests=False, ack_timeout_s=900, pipeline=mode == "pipelined"
                ),
                transport={"kind": "dir", "root": str(work / "store")},  # the abandon marker only
            )
            for mode in MODES
        }
        coords["pipelined"].initialize("v0")
        rows = []
        seed = 0
        for rate in rates:
            for mode in MODES:
                seed += 1
                for r in receivers:
                    r.pipelined = mode == "pipelined"
                owners.call("inject", rate=rate, seed=seed)
                # flush the previous round's checkpoint export and reference files: otherwise
                # the next small fsync (attempt / commit records) waits for ~700 MB of writeback
                os.sync()
                rows.append(_one(coords[mode], mode, rate, owners, receivers, ckpts, work, bw))
                row = rows[-1]
                print(
                    f"[bench refit] {row['rate']} {mode}: DCR {row['dcr_s']:.2f}s vs reference "
                    f"{row['reference_s']:.2f}s = {row['speedup']:.1f}x; payload "
                    f"{row['v_payload_bytes'] / 1e6:.2f} MB",
                    flush=True,
                )
            _bound(rows[-len(MODES) :], bw)
        return {
            "benchmark": "refit",
            "size": size,
            "model": dims,
            "checkpoint_bytes": ckpt_bytes,
            "bandwidth_gbit_per_s": gbit,
            "nodes": nodes,
            "bucket_bytes": int(bucket_mib * (1 << 20)),
            "reference_v_cross_bytes": ckpt_bytes * (1 + nodes),
            "rows": rows,
        }
    finally:
        if owners is not None:
            try:
                owners.stop(timeout_s=30)
            except Exception:
                pass
        for s in servers:
            s.stop()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
        shutil.rmtree(work, ignore_errors=True)


MODES = ("pipelined", "sequential")


def _one(
    coord: Coordinator,
    mode: str,
    rate: float,
    owners: RemoteOwners,
    receivers: list[HttpEngine],
    ckpts: Path,
    work: Path,
    bw: float,
) -> dict[str, Any]:
    """One refit through `coord`, its breakdown, and the reference for the same version."""
    nodes = len(receivers)
    t0 = time.perf_counter()
    res = coord.refit()
    total = time.perf_counter() - t0
    last = res.attempts[-1]
    acks = list(last.acks.values())
    construct = float(last.owners["build_s"])
    build = last.seconds["build"]
    upload_tail = build - construct
    tail = last.seconds["apply"]  # from the end of the build to the last ACK
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
    commit = last.seconds.get("commit", 0.0)
    payload = int(last.owners["payload_bytes"])
    # the reference moves this version's checkpoint; its dense load must not change a bit of
    # what DCR applied (checked), and leaves the engine at the committed version
    vpath = ckpts / f"v{res.version}"
    owners.call("export", path=str(vpath))
    digest = receivers[0].digest()
    ref = reference(work, vpath, receivers[0], bw, nodes, res.version)
    if receivers[0].digest() != digest:
        raise RuntimeError(f"version {res.version}: DCR refit != dense load (digest)")
    transport = upload_tail + fetch_tail
    return {
        "rate": f"{round(rate * 100)}%",
        "mode": mode,
        "version": res.version,
        "element_change_rate": last.owners.get("element_change_rate", 0.0),
        "dcr_s": total,
        "construct_s": construct,
        "upload_tail_s": upload_tail,
        "fetch_tail_s": fetch_tail,
        "apply_tail_s": apply_tail,
        "apply_work_s": apply_work,
        "apply_work_cpu_s": apply_cpu,
        "apply_parts": parts,
        "commit_s": commit,
        "transport_share": transport / total,
        "v_payload_bytes": payload,
        "v_cross_bytes": payload * (1 + nodes),
        "reference_s": ref["total_s"],
        "reference": ref,
        "speedup": ref["total_s"] / total,
    }


def _bound(rows: list[dict[str, Any]], bw: float) -> None:
    """Lower bound of one rate: max(construction, V_payload / bandwidth), construction being the
    fastest of the rate's refits (the sequential one: a pipelined build shares the 2 cores with
    the engine's applies, which would flatter a bound taken from it)."""
    construct = min(r["construct_s"] for r in rows)
    for r in rows:
        r["lower_bound_s"] = max(construct, r["v_payload_bytes"] / bw)
        r["latency_vs_lower_bound"] = r["dcr_s"] / r["lower_bound_s"]


def reference(
    work: Path, ckpt: Path, receiver: HttpEngine, bw: float, nodes: int, version: int
) -> dict[str, float]:
    """Move the whole checkpoint over the same links, then dense-load it on one engine."""
    files = sorted(ckpt.glob("*.safetensors"))
    up = ThrottledStore(DirectoryStore(work / "ref-store"), bw)
    t0 = time.perf_counter()
    for f in files:
        up.put(f"ref/{f.name}", f.read_bytes())
    upload = time.perf_counter() - t0
    # every node downloads over its own link, in parallel: the time of one download
    down = ThrottledStore(DirectoryStore(work / "ref-store"), bw)
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


def render(res: dict[str, Any]) -> str:
    out = [
        f"Refit vs full-checkpoint transfer ({res['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, "
        f"{res['bandwidth_gbit_per_s']} Gbit/s links, {res['nodes']} rollout node(s), buckets of "
        f"{res['bucket_bytes'] / (1 << 20):g} MiB raw records); tails = "
        "what remained after the build (pipelined) or the whole stage (sequential)",
        f"{'rate':>4} {'mode':>10} | {'DCR s':>6} | {'constr':>6} | {'upload':>6} | "
        f"{'fetch':>6} | {'apply':>6} | {'commit':>6} | {'ref s':>6} | {'speedup':>7} | "
        f"{'transport':>9} | {'payload MB':>10} | {'vs bound':>8}",
    ]
    for r in res["rows"]:
        out.append(
            f"{r['rate']:>4} {r['mode']:>10} | {r['dcr_s']:6.2f} | {r['construct_s']:6.2f} | "
            f"{r['upload_tail_s']:6.2f} | {r['fetch_tail_s']:6.2f} | {r['apply_tail_s']:6.2f} | "
            f"{r['commit_s']:6.2f} | {r['reference_s']:6.2f} | {r['speedup']:6.1f}x | "
            f"{100 * r['transport_share']:8.0f}% | {r['v_payload_bytes'] / 1e6:10.2f} | "
            f"{r['latency_vs_lower_bound']:7.2f}x"
        )
    by = {(r["rate"], r["mode"]): r for r in res["rows"]}
    for rate in dict.fromkeys(r["rate"] for r in res["rows"]):
        p, q = by.get((rate, "pipelined")), by.get((rate, "sequential"))
        if p and q:
            out.append(
                f"{rate}: pipelining makes the refit {q['dcr_s'] / p['dcr_s']:.2f}x faster; "
                f"apply work pipelined / sequential: wall {p['apply_work_s'] * 1e3:.0f} / "
                f"{q['apply_work_s'] * 1e3:.0f} ms ({p['apply_work_s'] / q['apply_work_s']:.2f}x), "
                f"CPU {p['apply_work_cpu_s'] * 1e3:.0f} / {q['apply_work_cpu_s'] * 1e3:.0f} ms "
                f"({p['apply_work_cpu_s'] / max(q['apply_work_cpu_s'], 1e-9):.2f}x), "
                f"{p['apply_parts']} parts"
            )
    return "\n".join(out)


def main(json_path: str | None, size: str, gbit: float, nodes: int, bucket_mib: float = 2.0) -> int:
    res = run(size=size, gbit=gbit, nodes=nodes, bucket_mib=bucket_mib)
    print(render(res))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=2))
        print(f"\nwrote {json_path}")
    return 0
