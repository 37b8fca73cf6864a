"""``dcr soak``: many refits of the tiny model, every one checked bit for bit, with receiver
kills sprinkled in, while the resources of every DCR process are sampled for growth.

For each transport in ``--transports`` (default ``relay,s3``) the soak starts the demo's
cluster (`dcr_tools.demo.Demo`: the tiny Qwen3 fixture, a 2-rank Megatron trainer job serving
the owner service, a rollout ``vllm serve`` refit by DCR and a reference ``vllm serve``; for
``relay`` a ZeroMQ relay tree root -> node ``rollout0`` with a local control directory, for
``s3`` a local ``moto_server`` holding payloads and control records) and runs ``--refits`` N
refits. Each refit: one real optimizer step on the trainer (``train``, a next-token step on a
deterministic batch), ``Coordinator.refit`` (pipelined, retention with the coordinator's
default ``keep_versions``), the trainer's HF export of the new version, a dense load of that
export on the reference engine, and the rollout engine's digest compared with the reference's
(``bit_exact``). Every ``--kill-every`` K refits (at refits K/2, K/2 + K, ...) the rollout
engine is armed to die mid-apply (the test-only fault plan `dcr_tools.faults`, as
``dcr demo --kill-every``): the coordinator fences the attempt, restarts the engine, which
dense-loads the committed version from the rollout cluster's replica (as in ``dcr demo``; the
replica is a required receiver, checked against the export after every refit and sampled as
row ``replica``; ``--no-replica``: from the trainer's export), and retries with overwrites;
that refit must take exactly two attempts. ``--quantization FMT``: the engines serve that
quantized format and the oracle is the library's quantized checkpoint of each export
(``dcr demo --quantization``).

At refit 0 (after start) and every ``--sample-every`` refits the soak records, through
``/proc`` (psutil), the resident set size, open file descriptors and threads of every process
of the cluster - the coordinator (this process), the trainer launcher and ranks, every process
of both engines, the relay nodes or ``moto_server`` - and the disk each one owns: a relay
node's spool directory, the coordinator's control store directory (relay), the S3 bucket's
object bytes (s3, on the ``moto_server`` row). Rows are named by role, so an engine restarted
after a kill keeps its rows. Growth of a row's metric = last sample vs the first sample at or
after ``--warmup`` refits, in %; a row passes when every metric grew by at most
``--max-growth`` % (a metric at 0 at both points grew 0 %). The ``moto`` rows are the test
S3 endpoint, not a DCR process: their memory, descriptors and threads are reported (marked
``*``) but not judged; the bucket's bytes on the ``moto`` row are judged. The soak prints a table and writes
``OUT/soak.json`` (settings, per refit: version, attempts, killed, bit_exact, seconds; per
row and metric: the value at each sample, growth and pass); the file is rewritten after every
sample (``partial: true`` until the transport is done), so a soak cut short keeps its samples.

Exit status: 1 when a refit was not bit-exact, a kill did not take exactly two attempts or a
refit failed; with ``--assert-flat`` also when a row grew beyond ``--max-growth``; else 0.

Limitations:
1. The exported checkpoints the reference loads (``work/ckpts``) are the soak's own oracle
   data: it keeps the newest two (the committed version's and the one before) and is not a
   row.
2. RSS counts shared pages in every process that maps them; growth, not the sum, is the figure.
3. One rollout engine and one tree node (the demo's cluster); kills hit only the rollout engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcr_tools import faults
from dcr_tools.demo import Demo, add_quantization_argument, add_replica_arguments
from shared_codec.coordination.commit import PREFIX as COMMITS
from shared_codec.coordination.coordinator import RefitFailed
from shared_codec.errors import DCRError

METRICS = ("rss_mib", "fds", "threads", "disk_kib")
# rows of the test S3 endpoint (``moto_server`` and its children): not a DCR process, so its own
# memory, descriptors and threads are reported but not judged; the bytes it stores (disk_kib,
# which DCR's retention controls) are judged like every other row's
ENDPOINT_ROWS = re.compile(r"moto(/.*)?")
ENDPOINT_JUDGED = ("disk_kib",)
TRANSPORTS = ("relay", "s3", "dir")
ROUTINE = re.compile(r"coordinator: version \d+ (attempt 0|committed \(attempt 0\))")


def dir_bytes(path: Path) -> tuple[int, int]:
    """(bytes, commit-history bytes) of the regular files under `path` ((0, 0) when it does not
    exist); the second counts files under a ``commits/`` directory (the commit record history,
    which retention keeps by design). Files that vanish while walking are skipped."""
    total = history = 0
    for root, _dirs, files in os.walk(path):
        in_history = f"{os.sep}{COMMITS}" in f"{root}{os.sep}"
        for f in files:
            try:
                size = os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                continue
            total += size
            history += size if in_history else 0
    return total, history


def bucket_bytes(spec: dict[str, Any]) -> tuple[int, int]:
    """(bytes, commit-history bytes) of every object in the S3 spec's bucket."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=spec.get("endpoint_url"), region_name="us-east-1")
    total = history = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=spec["bucket"]):
        for o in page.get("Contents", []):
            total += int(o["Size"])
            history += int(o["Size"]) if f"/{COMMITS}" in f"/{o['Key']}" else 0
    return total, history


def growth_pct(base: float | None, last: float | None) -> float | None:
    """(last - base) / base in %; 0 when both are 0, +inf when only base is 0, None when a
    point is missing."""
    if base is None or last is None:
        return None
    if base == 0:
        return 0.0 if last == 0 else math.inf
    return 100.0 * (last - base) / base


class Soak(Demo):
    """One transport's soak on the demo's cluster (see the module docstring)."""

    def log(self, msg: str) -> None:
        # routine coordinator lines (every attempt 0 and its commit) go to work/coordinator.log
        if ROUTINE.fullmatch(str(msg)):
            with open(self.work / "coordinator.log", "a") as f:
                f.write(f"{msg}\n")
            return
        print("\n".join(f"[soak] {line}" for line in str(msg).splitlines() or [""]), flush=True)

    # -- sampling ----------------------------------------------------------------------------
    def _roots(self) -> list[tuple[str, int]]:
        """(role, pid) of every process tree of the cluster (this process included)."""
        roots: list[tuple[str, int]] = [("coordinator", os.getpid())]
        for p in self.procs:
            if p.poll() is not None:
                continue
            cmd = p.args if isinstance(p.args, list) else [str(p.args)]
            text = " ".join(map(str, cmd))
            if "moto_server" in text:
                roots.append(("moto", p.pid))
            elif "shared_codec.transport.relay" in text:
                roots.append((f"relay-{json.loads(str(cmd[-1]))['name']}", p.pid))
            elif "torch.distributed.run" in text:
                roots.append(("trainer", p.pid))
            elif "replica serve" in text:
                roots.append(("replica", p.pid))
        for name, s in zip(("rollout", "reference"), self.servers, strict=True):
            if s.proc is not None and s.proc.poll() is None:
                roots.append((name, s.proc.pid))
        return roots

    def _disk(self) -> dict[str, tuple[int, int]]:
        """(bytes, commit-history bytes) owned by each role (see the module docstring)."""
        out: dict[str, tuple[int, int]] = {}
        if self.args.transport == "relay":
            out["coordinator"] = dir_bytes(self.work / "control")
        elif self.args.transport == "s3":
            out["moto"] = bucket_bytes(self.fetch_spec)
        else:
            out["coordinator"] = dir_bytes(self.work / "store")
        for d in self.work.glob("spool-*"):  # the tree (relay; dir/s3 read once by the replica)
            out[f"relay-{d.name.removeprefix('spool-')}"] = dir_bytes(d)
        if self.replica is not None:  # two slots and at most three log records: flat
            out["replica"] = dir_bytes(self.work / "replica")
        return out

    def sample(self) -> dict[str, dict[str, float]]:
        """One sample: row name -> metric -> value, for every live process of the cluster."""
        import psutil

        rows: dict[str, dict[str, float]] = {}
        disk = self._disk()
        for role, pid in self._roots():
            try:
                top = psutil.Process(pid)
                tree = [top] if role == "coordinator" else [top, *top.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            seen: dict[str, int] = {}
            d = disk.get(role, (0, 0))
            for i, p in enumerate(tree):
                try:
                    with p.oneshot():
                        label = self._label(role, i, p)
                        n = seen.get(label, 0)
                        seen[label] = n + 1
                        name = label if n == 0 else f"{label}#{n}"
                        rows[name] = {
                            "rss_mib": p.memory_info().rss / 2**20,
                            "fds": float(p.num_fds()),
                            "threads": float(p.num_threads()),
                            # the commit history is kept by design: reported, not a metric
                            "disk_kib": (d[0] - d[1]) / 1024 if i == 0 else 0.0,
                            "history_kib": d[1] / 1024 if i == 0 else 0.0,
                        }
                except psutil.NoSuchProcess:
                    continue
        return rows

    @staticmethod
    def _label(role: str, i: int, p: Any) -> str:
        if i == 0:
            return role
        if role == "trainer":
            rank = p.environ().get("RANK")
            if rank is not None:
                return f"trainer/rank{rank}"
        return f"{role}/{p.name()}"

    # -- the loop ----------------------------------------------------------------------------
    def refit(self, i: int) -> dict[str, Any]:
        """Refit i: one optimizer step, a refit (killing the rollout engine when scheduled),
        the export, the reference's dense load and the digest comparison."""
        a = self.args
        assert self.owners is not None
        t0 = time.perf_counter()
        self.owners.call("train", step=i)
        killed = bool(a.kill_every) and i % a.kill_every == a.kill_every // 2
        if killed:
            faults.arm(self.fault_plan, kill_after_items=2)
        t1 = time.perf_counter()
        res = self.coord.refit()
        t2 = time.perf_counter()
        self.coord.wait_retention()  # the disk sampled after each refit is after retention
        v = res.version
        self.export(v)
        self.reference.rpc("dcr_dense_load", self.ckpt(v), v)
        digest = self.rollout.digest()
        exact = digest == self.reference.digest()
        if self.replica is not None:  # the replica's checkpoint is the export's bits too
            exact = exact and self.replica_exact(v)
        self.drop(v - 2)
        last = res.attempts[-1]
        return {
            "refit": i,
            "version": v,
            "attempts": len(res.attempts),
            "killed": killed,
            "bit_exact": exact,
            "digest": digest,
            "element_change_rate": last.owners.element_change_rate if last.owners else 0.0,
            "payload_bytes": last.owners.payload_bytes if last.owners else 0,
            "train_s": t1 - t0,
            "refit_s": t2 - t1,
            "check_s": time.perf_counter() - t2,
            "seconds": time.perf_counter() - t0,
        }

    def soak(self, progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run the refits; `progress` gets the partial run (``partial: True``) after each
        sample, so a soak cut short still leaves its samples behind."""
        a = self.args
        t_start = time.perf_counter()
        self.start()
        start_s = time.perf_counter() - t_start
        samples: list[dict[str, Any]] = [{"refit": 0, "rows": self.sample()}]
        self.log(f"refit 0: cluster up in {start_s:.0f}s, {len(samples[0]['rows'])} processes")
        refits: list[dict[str, Any]] = []
        error = ""
        t_loop = time.perf_counter()
        for i in range(1, a.refits + 1):
            try:
                row = self.refit(i)
            except (DCRError, RefitFailed) as e:
                error = f"refit {i} failed: {e}"
                self.log(error)
                break
            refits.append(row)
            if not row["bit_exact"]:
                self.log(f"refit {i}: rollout digest != dense load of version {row['version']}")
            if i % a.sample_every == 0 or i == a.refits:
                samples.append({"refit": i, "rows": self.sample()})
                if progress is not None:
                    progress({"transport": a.transport, "partial": True, "error": error,
                              "refits": refits, "samples": samples})  # fmt: skip
                done = refits[-a.sample_every :]
                self.log(
                    f"refit {i}/{a.refits}: {sum(r['bit_exact'] for r in refits)} bit-exact, "
                    f"{sum(r['killed'] for r in refits)} kills, "
                    f"{sum(r['seconds'] for r in done) / len(done):.2f}s/refit"
                )
        loop_s = time.perf_counter() - t_loop
        return {
            "transport": a.transport,
            "start_s": start_s,
            "loop_s": loop_s,
            "s_per_refit": loop_s / max(1, len(refits)),
            "error": error,
            "refits": refits,
            "samples": samples,
        }


def analyse(run: dict[str, Any], warmup: int, max_growth: float) -> dict[str, Any]:
    """Per row and metric: the value at each sample, growth after warm-up (last sample vs the
    first sample at or after `warmup` refits) and pass; plus the run's refit checks."""
    samples = run["samples"]
    post = [s for s in samples if s["refit"] >= warmup]
    base, last = (post[0], post[-1]) if len(post) >= 2 else (None, None)
    names = sorted({n for s in samples for n in s["rows"]})
    rows = {}
    for name in names:
        row: dict[str, Any] = {"metrics": {}, "pass": True}
        for m in METRICS:
            values = [s["rows"].get(name, {}).get(m) for s in samples]
            g = (
                growth_pct(base["rows"].get(name, {}).get(m), last["rows"].get(name, {}).get(m))
                if base and last
                else None
            )
            ok = g is not None and g <= max_growth
            judged = not ENDPOINT_ROWS.fullmatch(name) or m in ENDPOINT_JUDGED
            row["metrics"][m] = {"values": values, "growth_pct": g, "pass": ok, "judged": judged}
            row["pass"] &= ok or not judged
        hist = [s["rows"].get(name, {}).get("history_kib") for s in samples]
        if any(hist):  # the commit record history: kept by design, reported, not asserted
            row["history_kib"] = hist
        rows[name] = row
    refits = run["refits"]
    bad_kills = [r["refit"] for r in refits if r["killed"] and r["attempts"] != 2]
    extra = [r["refit"] for r in refits if not r["killed"] and r["attempts"] != 1]
    return {
        "sample_refits": [s["refit"] for s in samples],
        "growth_from_refit": base["refit"] if base else None,
        "growth_to_refit": last["refit"] if last else None,
        "rows": rows,
        "flat": bool(rows) and all(r["pass"] for r in rows.values()),
        "refits_done": len(refits),
        "all_bit_exact": bool(refits) and all(r["bit_exact"] for r in refits),
        "kills": sum(r["killed"] for r in refits),
        "kills_not_two_attempts": bad_kills,
        "unkilled_retries": extra,
    }


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v:.1f}" if abs(v) < 1e4 else f"{v:.3g}"


def table(transport: str, res: dict[str, Any]) -> str:
    """The printed table of one transport: a row per process, per metric the value at the
    growth base, at the last sample, and the growth in %."""
    head = f"{'process':34s}" + "".join(f" {m + ' base/last/%':>26s}" for m in METRICS) + "  ok"
    lines = [f"== {transport}: growth from refit {res['growth_from_refit']} to refit "
             f"{res['growth_to_refit']} (samples at {res['sample_refits']})", head]  # fmt: skip
    idx = res["sample_refits"]
    b = idx.index(res["growth_from_refit"]) if res["growth_from_refit"] is not None else None
    for name, row in res["rows"].items():
        cells = []
        for m in METRICS:
            mm = row["metrics"][m]
            vb = mm["values"][b] if b is not None else None
            cells.append(
                f" {_fmt(vb):>9s}/{_fmt(mm['values'][-1]):>8s}/{_fmt(mm['growth_pct']):>6s}"
                + ("%" if mm["judged"] else "*")
            )
        lines.append(f"{name[:34]:34s}" + "".join(cells) + f"  {'yes' if row['pass'] else 'NO'}")
    if any(ENDPOINT_ROWS.fullmatch(n) for n in res["rows"]):
        lines.append(
            "* reported, not judged: the test S3 endpoint's own memory, descriptors and threads "
            "(not a DCR process; the bytes it stores are judged)"
        )
    for name, row in res["rows"].items():
        if "history_kib" in row:
            h = row["history_kib"]
            lines.append(
                f"{name}: commit record history (kept by design, not in disk_kib) "
                f"{_fmt(h[b] if b is not None else None)} -> {_fmt(h[-1])} KiB"
            )
    return "\n".join(lines)


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="dcr soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--refits", type=int, default=500, help="refits per transport (500)")
    ap.add_argument(
        "--transports",
        default="relay,s3",
        help="comma-separated, run one after the other: relay, s3, dir (default relay,s3)",
    )
    ap.add_argument("--kill-every", type=int, default=50, help="kill the rollout engine "
                    "mid-apply at refits K/2, K/2+K, ... (0: never; default 50)")  # fmt: skip
    ap.add_argument("--sample-every", type=int, default=50, help="sample every N refits (50)")
    ap.add_argument("--warmup", type=int, default=100, help="growth from this refit on (100)")
    ap.add_argument("--max-growth", type=float, default=5.0, help="allowed growth, %% (5)")
    ap.add_argument("--assert-flat", action="store_true", help="exit 1 when a row grew more")
    ap.add_argument("--out", default="out/soak", help="output directory (default out/soak)")
    ap.add_argument("--endpoint", default="", help="S3 endpoint URL (default: a local moto)")
    ap.add_argument("--bucket", default="dcr-soak")
    ap.add_argument("--lr", type=float, default=1e-5, help="Adam learning rate (1e-5)")
    ap.add_argument("--seed", type=int, default=0, help="fixture seed")
    add_replica_arguments(ap)
    add_quantization_argument(ap)
    return ap


def run_soak(args: argparse.Namespace) -> int:
    transports = [t for t in args.transports.split(",") if t]
    bad = sorted(set(transports) - set(TRANSPORTS))
    if bad or not transports:
        print(f"dcr soak: unknown transports {bad}; choose from {TRANSPORTS}", file=sys.stderr)
        return 2
    if args.refits < 1 or args.sample_every < 1 or not 0 <= args.warmup < args.refits:
        print("dcr soak: need --refits >= 1, --sample-every >= 1, 0 <= --warmup < --refits",
              file=sys.stderr)  # fmt: skip
        return 2
    # a SIGTERM (e.g. `timeout`) unwinds through the `finally` that stops the cluster
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "tool": "dcr-soak",
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "transports": {},
    }
    status = 0
    for t in transports:
        ns = argparse.Namespace(**vars(args))
        ns.transport, ns.out = t, str(out / t)
        soak = Soak(ns)

        def progress(partial: dict[str, Any], t: str = t) -> None:
            report["transports"][t] = partial
            (out / "soak.json").write_text(json.dumps(report, indent=1))

        try:
            run = soak.soak(progress)
        except (DCRError, RefitFailed) as e:
            print(f"[soak] {t}: failed to start: {e}", file=sys.stderr)
            run = {"transport": t, "error": f"start failed: {e}", "refits": [], "samples": []}
        finally:
            soak.stop()
        report["transports"][t] = run  # the raw samples first, whatever the analysis does
        (out / "soak.json").write_text(json.dumps(report, indent=1))
        res = analyse(run, args.warmup, args.max_growth) if run["samples"] else {}
        report["transports"][t] = {**run, "result": res}
        (out / "soak.json").write_text(json.dumps(report, indent=1))
        ok = (
            not run["error"]
            and bool(res)
            and res["refits_done"] == args.refits
            and res["all_bit_exact"]
            and not res["kills_not_two_attempts"]
            and not res["unkilled_retries"]
        )
        if res:
            print(table(t, res), flush=True)
            print(
                f"[soak] {t}: {res['refits_done']}/{args.refits} refits, "
                f"{'all bit-exact' if res['all_bit_exact'] else 'NOT ALL BIT-EXACT'}, "
                f"{res['kills']} kills (not two attempts: {res['kills_not_two_attempts']}), "
                f"{run.get('s_per_refit', 0):.2f} s/refit; "
                f"{'flat' if res['flat'] else 'NOT FLAT'} (<= {args.max_growth}% after "
                f"refit {res['growth_from_refit']})",
                flush=True,
            )
        if not ok:
            status = 1
        elif args.assert_flat and not res["flat"]:
            status = 1
    print(f"[soak] wrote {out / 'soak.json'}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(run_soak(build_parser().parse_args()))
