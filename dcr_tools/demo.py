"""``dcr demo`` / ``make demo``: an RL loop refit by DCR after every step, checked bit for bit.

On one machine, with embedded defaults: the tiny Qwen3 fixture; a trainer job of 2 Megatron
ranks (TP=2, gloo) serving the DCR owner service (`dcr_tools.trainers.rl_job`); a rollout
engine (``vllm serve`` with the DCR worker extension) and a reference engine that is
dense-loaded with the trainer's export after every step; a store for payloads, manifests, attempt
and commit records (see Transports below).

Each step: the rollout engine samples completions of fixed prompts (seeded per request); the
reward is the share of even token ids in a completion (something a policy can learn quickly);
advantages are rewards minus the batch mean; the trainer takes one policy-gradient optimizer
step; the coordinator refits the rollout engine (owners build and upload, the engine fetches and
applies, the commit record is compare-and-set); the reference engine dense-loads the export of
the same version and the two digests must be equal (``bit_exact``). ``--refit dense`` runs the
same loop with dense loads instead of DCR (the baseline the tests compare against);
``--kill-every K`` kills the rollout engine mid-apply every K steps (the coordinator fences the
attempt, restarts the engine, dense-loads the committed version and retries with overwrites).

Prints a live table (one line per step) and writes ``OUT/report.json`` (every step: rewards,
element change rate, payload bytes and % of the checkpoint, construction / transport+apply /
commit seconds, attempts, bit_exact), ``report.png`` (refit timeline per stage and bytes per
step) and a standalone ``report.html`` (verdict, settings, per-step table, summary, plots
inline); see `dcr_tools.demo_report`.

Transports: ``relay`` (default): trainer ranks stream payloads to the root of a ZeroMQ relay tree
(root -> node ``rollout0``); the node spools them on local disk and, once the tree acknowledged
the attempt complete, the engine's workers read them from there (``dcr_fetch`` with a spool
spec); ``dir``: a local directory store; ``s3``: S3 (a local ``moto_server`` without
``--endpoint``).

Replica (default; ``--no-replica`` turns it off): the rollout cluster keeps its canonical
replica (shared_codec/replica), bootstrapped from the initial checkpoint the engines serve and
served by ``dcr replica serve`` reading the same payload source as the rollout engine. It is a
required receiver of every transition, and the rollout engine restores from it (a dense load of
its checkpoint URL, downloaded with range reads) - a killed engine never needs the trainer. The
trainer's per-step export is only the oracle: the reference engine loads it, and each step also
checks the replica's checkpoint against it (``replica_exact``, part of ``bit_exact``). With
``dir`` or ``s3`` the replica is also the cluster's one reader of the store (``--fetch
replica``, default): it forwards every payload down a local relay tree (root -> ``rollout0``)
whose spool the rollout engine reads; ``--fetch engines``: the engine reads the store itself.

Quantized rollout (``--quantization FMT``, e.g. ``int8-channel`` or ``fp8-channel``; issue 32):
both engines serve the library quantizer's checkpoint in that format (`write_quantized_model`
of the BF16 fixture, as the rollout cluster would hold it), the trainer job sends quantized
deltas (``rl_job --quantization``, the scales overwrite-only), the replica keeps the quantized
checkpoint, and the oracle is the quantized checkpoint of each BF16 export (``ckpt``).

Limitations:
1. One rollout engine and one tree node (plus the root); the reference engine is dense-loaded.
2. ``--refit dense`` reuses the reference engine's digest check (it is trivially exact).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from dcr_tools import faults
from dcr_tools.demo_report import TABLE_NOTE, table_header, table_row, verdict, write_report
from dcr_tools.procs import (
    ServeProcess,
    base_env,
    free_port,
    python_version,
    start_rl_job,
    trainer_python,
)
from shared_codec.checkpoint import combined_digest, load_checkpoint, state_digests, tensor_table
from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig, RefitFailed
from shared_codec.coordination.engines import HttpEngine
from shared_codec.coordination.owners import RemoteOwners
from shared_codec.errors import DCRError
from shared_codec.replica import ReplicaStore
from shared_codec.replica.client import HttpReplica
from shared_codec.transport.spec import open_store

PROMPTS = [
    "The policy update",
    "Rollout engines keep",
    "Only the changed bits",
    "A refit is exact when",
]


def reward_of(tokens: list[int]) -> float:
    """Share of even token ids in a completion (0 for an empty one)."""
    return sum(1 for t in tokens if t % 2 == 0) / len(tokens) if tokens else 0.0


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def generate(
    url: str, step: int, samples_per_prompt: int, max_tokens: int
) -> tuple[list[dict], list[list[dict]]]:
    """Sample completions one request at a time (fixed batch composition: reproducible) through
    vLLM's token-in/token-out ``/inference/v1/generate``; returns the samples and each one's
    ``weight_versions`` (which weights produced which of its tokens)."""
    out, spans = [], []
    for i, prompt in enumerate(PROMPTS):
        ids = list(_post(url + "/tokenize", {"model": "policy", "prompt": prompt})["tokens"])
        for j in range(samples_per_prompt):
            body = {
                "token_ids": ids,
                "sampling_params": {
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "seed": 1000 * step + 10 * i + j,
                },
            }
            (choice,) = _post(url + "/inference/v1/generate", body)["choices"]
            out.append({"prompt": ids, "completion": list(choice["token_ids"])})
            spans.append(list(choice.get("weight_versions") or []))
    return out, spans


class Demo:
    """Processes and state of one demo run (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.work = self.out / "work"
        self.fault_plan = self.work / "faults-rollout.json"  # armed by --kill-every
        self.procs: list[subprocess.Popen[bytes]] = []
        self.servers: list[ServeProcess] = []
        self.owners: RemoteOwners | None = None
        self.replica: HttpReplica | None = None

    def log(self, msg: str) -> None:
        # every line tagged, also those of a multi-line message (an error with a traceback)
        print("\n".join(f"[demo] {line}" for line in str(msg).splitlines() or [""]), flush=True)

    # -- set-up ----------------------------------------------------------------------------------
    def _store_spec(self) -> dict[str, Any]:
        a = self.args
        if a.transport == "dir":
            return {"kind": "dir", "root": str(self.work / "store")}
        endpoint = a.endpoint
        if not endpoint:
            port = free_port()
            log = open(self.work / "moto.log", "wb")  # noqa: SIM115
            exe = Path(sys.executable).with_name("moto_server")
            self.procs.append(
                subprocess.Popen(
                    [str(exe), "-H", "127.0.0.1", "-p", str(port)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            endpoint = f"http://127.0.0.1:{port}"
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "demo")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "demo")
            for _ in range(100):
                try:
                    urllib.request.urlopen(endpoint, timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            self.log(f"started moto_server at {endpoint}")
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=a.bucket
        )
        return {"kind": "s3", "bucket": a.bucket, "endpoint_url": endpoint, "prefix": "demo"}

    def _start_relay_tree(self) -> str:
        """A root relay node (the rollout cluster's entry) and one child node on the rollout
        engine's host that spools payloads for it; returns the root's address."""
        child_addr = f"tcp://127.0.0.1:{free_port()}"
        root_addr = f"tcp://127.0.0.1:{free_port()}"
        nodes = [
            ("rollout0", child_addr, []),
            ("root", root_addr, [["rollout0", child_addr, None]]),
        ]
        for name, addr, children in nodes:
            cfg = {
                "name": name,
                "bind": addr,
                "children": children,
                "deliver_dir": str(self.work / f"spool-{name}"),
                "child_timeout_s": 30.0,
            }
            log = open(self.work / f"relay-{name}.log", "wb")  # noqa: SIM115
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "shared_codec.transport.relay", json.dumps(cfg)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        self.log(f"started a relay tree: root {root_addr} -> rollout0 {child_addr}")
        return root_addr

    def start(self) -> None:
        from dcr_tools.fixtures import write_tiny_model

        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        bf16 = write_tiny_model("qwen3", self.work / "model", seed=self.args.seed)
        self.model = model = self._served(bf16)
        quantized = self._quantized_args(bf16)
        if self.args.transport == "relay":
            # the control records live in a local directory; payloads travel over the tree:
            # trainer ranks -> root -> node "rollout0", which spools them for its engine
            self.store = open_store({"kind": "dir", "root": str(self.work / "control")})
            root = self._start_relay_tree()
            self.spec = {"kind": "spool", "root": str(self.work / "spool-rollout0")}
            self.sink_spec: dict[str, Any] = {"kind": "relay", "root": root}
            transport_args = ["--relay", root]
        else:
            self.spec = self._store_spec()  # may set AWS_* for a local moto: before copying env
            self.store = open_store(self.spec)
            self.sink_spec = self.spec
            transport_args = ["--store", json.dumps(self.spec)]
        self.fetch_spec = self.spec  # what the replica reads
        fanout = None
        if self.args.replica and self.args.transport != "relay" and self.read_once:
            # read once per cluster: the replica reads the store and forwards down a local tree
            # (root -> node "rollout0"), whose spool the engine reads
            fanout = {"kind": "relay", "root": self._start_relay_tree()}
            self.spec = {"kind": "spool", "root": str(self.work / "spool-rollout0")}
        env = base_env(VLLM_SERVER_DEV_MODE="1")
        if self.args.replica:
            self.replica = self._start_replica(model, fanout)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        trainer_py = trainer_python()
        self.log(
            f"starting the trainer job (2 Megatron ranks, TP=2, Python "
            f"{python_version(trainer_py)}: {trainer_py}) and two vLLM engines (Python "
            f"{python_version(sys.executable)}: {sys.executable})"
        )
        self.procs.append(
            start_rl_job(
                bf16,
                endpoint,
                transport_args,
                *quantized,
                "--lr",
                str(self.args.lr),
                log=self.work / "trainer.log",
                env=env,
            )
        )
        # --kill-every arms a test-only fault plan (dcr_tools.faults) the rollout names
        plan = faults.environment(self.fault_plan)
        self.servers = [
            ServeProcess(
                model,
                free_port(),
                log=self.work / f"{name}.log",
                env={**env, **plan} if name == "rollout" else env,
                # the rollouts use vLLM's /inference/v1/generate, for weight_versions
                extra_args=["--enable-scale-out"] if name == "rollout" else [],
            )
            for name in ("rollout", "reference")
        ]
        urls = [s.start(timeout_s=600) for s in self.servers]
        self.owners = RemoteOwners(endpoint, timeout_s=600)
        self.owners.call("status", timeout_s=600)
        self.export(0)  # the oracle (reference engine) only
        table = tensor_table(self.ckpt(0))
        # the rollout engine restores from the rollout cluster's replica (its checkpoint URL,
        # downloaded with range reads), the reference engine from the trainer's exports
        restore_from = self.ckpt if self.replica is None else self.replica.checkpoint_for
        self.rollout, self.reference = (
            HttpEngine(
                name,
                url,
                store=self.spec,
                checkpoint_for=restore_from if name == "rollout" else self.ckpt,
                tensors=table,
                launcher=server.start,
            )
            for name, url, server in zip(("rollout", "reference"), urls, self.servers, strict=True)
        )
        for r in (self.rollout, self.reference):
            r.restore(0)
        self.checkpoint_bytes = sum(
            f.stat().st_size for f in Path(self.ckpt(0)).glob("*.safetensors")
        )
        self.coord = Coordinator(
            self.store,
            self.owners,
            self.members,
            CoordinatorConfig(max_attempts=3, ack_timeout_s=300),
            log=lambda m: self.log(f"coordinator: {m}"),
            # pipelined: the engine fetches (object stores) or reads the node's spool (relay) and
            # applies each payload while the trainer still builds; an attempt whose build
            # failed is abandoned through the store or down the tree
            transport=self.sink_spec,
        )
        self.coord.initialize("export-v0")
        self.log("ready: every engine holds v0, commit record v0 written")

    @property
    def read_once(self) -> bool:
        """Object storage: the replica is the cluster's one reader (``--fetch replica``)."""
        return getattr(self.args, "fetch", "replica") == "replica"

    def _start_replica(self, model: Path, fanout: dict[str, Any] | None) -> HttpReplica:
        """The rollout cluster's canonical replica: bootstrapped from the initial checkpoint
        the engines serve (never from the trainer), served by ``dcr replica serve`` reading the
        same payload source as the engine."""
        root = self.work / "replica"
        with ReplicaStore(root) as store:
            store.bootstrap(model)
        log = open(self.work / "replica.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("dcr")), "replica", "serve", str(root),
             "--source", json.dumps(self.fetch_spec),
             *(["--fanout", json.dumps(fanout)] if fanout else [])],
            stdout=subprocess.PIPE, stderr=log, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise DCRError(f"dcr replica serve exited ({self.work / 'replica.log'})")
        url = json.loads(line)["url"]
        self.log(f"started the replica at {url} (root {root})")
        return HttpReplica(url)

    @property
    def members(self) -> list[Any]:
        """The coordinator's receivers: the replica (a required one) and the rollout engine."""
        return ([self.replica] if self.replica is not None else []) + [self.rollout]

    @property
    def quantization(self) -> str:
        return str(getattr(self.args, "quantization", "") or "")

    def _served(self, bf16: Path) -> Path:
        """The checkpoint the engines serve at v0: the BF16 fixture, or its quantized one."""
        if not self.quantization:
            return bf16
        from dcr_tools.fixtures import write_quantized_model

        return write_quantized_model(bf16, self.work / "model-q", self.quantization)

    def _quantized_args(self, bf16: Path) -> list[str]:
        """The trainer job's quantized-delta arguments (none for BF16 engines): the format,
        and the scales overwrite-only (engines take no XOR for them)."""
        if not self.quantization:
            return []
        from shared_codec.quantized import quantizes, scale_name

        scales = sorted(scale_name(n) for n, _, _ in tensor_table(bf16) if quantizes(n))
        return ["--quantization", self.quantization, "--overwrite-only", ",".join(scales)]

    def ckpt(self, version: int) -> str:
        """The oracle checkpoint of `version` the engines would dense-load (quantized: the
        library quantizer's checkpoint of the trainer's export)."""
        return str(self.work / "ckpts" / f"{'q' if self.quantization else 'v'}{version}")

    def export(self, version: int) -> str:
        """The trainer's export of `version` (and its quantized checkpoint); `ckpt(version)`."""
        assert self.owners is not None
        bf16 = self.work / "ckpts" / f"v{version}"
        self.owners.call("export", path=str(bf16))
        if self.quantization:
            from dcr_tools.fixtures import write_quantized_model

            write_quantized_model(bf16, self.ckpt(version), self.quantization)
        return self.ckpt(version)

    def drop(self, version: int) -> None:
        """Remove the oracle checkpoints of `version` (the BF16 export and its quantized one)."""
        for path in {Path(self.ckpt(version)), self.work / "ckpts" / f"v{version}"}:
            if path.exists():
                shutil.rmtree(path)

    # -- the loop --------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, Any]:
        a = self.args
        assert self.owners is not None
        t0 = time.perf_counter()
        samples, spans = generate(self.rollout.base_url, step, a.samples, a.max_tokens)
        gen_s = time.perf_counter() - t0
        rewards = [reward_of(s["completion"]) for s in samples]
        mean = sum(rewards) / len(rewards)
        for s, r in zip(samples, rewards, strict=True):
            s["advantage"] = r - mean
        t1 = time.perf_counter()
        train = self.owners.call("pg_step", samples=samples)
        train_s = time.perf_counter() - t1
        row: dict[str, Any] = {
            "step": step,
            "version": step,
            "reward_mean": mean,
            "rewards": rewards,
            "pg_loss": train["pg_loss"],
            "generate_s": gen_s,
            # the weights each rollout token came from (vLLM's weight_versions): one version
            # per step in this synchronous loop, the one committed before it
            "rollout_versions": sorted({x["version"] for sp in spans for x in sp}),
            "rollout_spans_whole": all(
                len(sp) == 1 and sp[0]["start"] == 0 and sp[0]["end"] == len(x["completion"])
                for sp, x in zip(spans, samples, strict=True)
            ),
            "train_s": train_s,
        }
        killed = bool(a.kill_every and step % a.kill_every == 0)
        if a.refit == "dcr":
            if killed:
                faults.arm(self.fault_plan, kill_after_items=2)
            res = self.coord.refit()
            self.coord.wait_retention()  # (background after the commit; the report counts it)
            last = res.attempts[-1]
            built, ack = last.owners, last.acks.get("rollout")
            assert built is not None  # a committed attempt was built
            row.update(
                {
                    "attempts": len(res.attempts),
                    "killed": killed,
                    "element_change_rate": built.element_change_rate,
                    "payloads": built.payloads,
                    "payload_bytes": built.payload_bytes,
                    "construct_s": built.build_s,
                    "publish_s": last.seconds.get("build", 0.0) - built.build_s,
                    "transport_apply_s": last.seconds.get("apply", 0.0),
                    "fetch_s": ack.fetch_s if ack is not None else 0.0,
                    "apply_s": ack.apply_s if ack is not None else 0.0,
                    "commit_s": last.seconds.get("commit", 0.0),
                    "failed_attempts": [a.failed for a in res.attempts[:-1]],
                }
            )
            self.export(step)
        else:
            t2 = time.perf_counter()
            self.export(step)
            self.rollout.rpc("dcr_dense_load", self.ckpt(step), step)
            self.rollout.reset_prefix_cache()
            row.update({"attempts": 0, "killed": False, "dense_s": time.perf_counter() - t2})
        row["payload_pct"] = 100.0 * row.get("payload_bytes", 0) / self.checkpoint_bytes
        self.reference.rpc("dcr_dense_load", self.ckpt(step), step)
        row["digest"] = self.rollout.digest()
        row["bit_exact"] = row["digest"] == self.reference.digest()
        if self.replica is not None and a.refit == "dcr":
            row["replica_exact"] = self.replica_exact(step)
            row["bit_exact"] = row["bit_exact"] and row["replica_exact"]
        return row

    def replica_exact(self, version: int) -> bool:
        """The replica holds committed `version` with exactly the bits of the trainer's export
        of it (the oracle, at ``ckpt(version)``)."""
        assert self.replica is not None
        oracle = combined_digest(state_digests(load_checkpoint(self.ckpt(version))))
        status = self.replica.status()
        return bool(status["committed"] == version and self.replica.digest() == oracle)

    def run(self) -> dict[str, Any]:
        a = self.args
        self.start()
        rows = []
        print(TABLE_NOTE, flush=True)
        print(table_header(), flush=True)
        for step in range(1, a.steps + 1):
            row = self.step(step)
            rows.append(row)
            print(table_row(row), flush=True)
        report = {
            "demo": "dcr-rl",
            "refit": a.refit,
            "transport": a.transport,
            "steps": a.steps,
            "kill_every": a.kill_every,
            "quantization": self.quantization or None,
            "replica": self.replica is not None,
            # what restores read from the replica's service (leases opened, bytes sent)
            "replica_served": self.replica.status()["served"] if self.replica else None,
            "checkpoint_bytes": self.checkpoint_bytes,
            "all_bit_exact": all(r["bit_exact"] for r in rows),
            "final_digest": rows[-1]["digest"] if rows else None,
            "samples_per_prompt": a.samples,
            "max_tokens": a.max_tokens,
            "lr": a.lr,
            "seed": a.seed,
            "rows": rows,
        }
        page = write_report(report, self.out)
        self.log(
            f"wrote {self.out / 'report.json'}, report.png and {page.name} (open in a browser)"
        )
        self.log(verdict(report)[1])
        return report

    def stop(self) -> None:
        if self.owners is not None:
            try:
                self.owners.stop(timeout_s=30)
            except DCRError:
                pass
        for s in self.servers:
            s.stop()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass


def add_quantization_argument(ap: argparse.ArgumentParser) -> None:
    """``--quantization FMT`` (`dcr demo`, `dcr soak`)."""
    from shared_codec.quantized import FORMATS

    ap.add_argument(
        "--quantization",
        choices=sorted(FORMATS),
        default="",
        help="engines serve this quantized format, refit by quantized deltas (default: BF16)",
    )


def add_replica_arguments(ap: argparse.ArgumentParser) -> None:
    """``--no-replica`` and ``--fetch`` (`dcr demo`, `dcr soak`)."""
    ap.add_argument(
        "--no-replica", dest="replica", action="store_false",
        help="no canonical replica: the rollout engine restores from the trainer's exports",
    )  # fmt: skip
    ap.add_argument(
        "--fetch", choices=["replica", "engines"], default="replica",
        help="dir/s3 with a replica: the replica reads the store once for the cluster and "
        "forwards down a local relay tree (default), or every engine reads the store",
    )  # fmt: skip


def build_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(prog="dcr demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="RL steps (default 8)")
    ap.add_argument("--out", default="out/demo", help="report directory (default out/demo)")
    ap.add_argument(
        "--transport",
        choices=["relay", "dir", "s3"],
        default="relay",
        help="relay: a ZeroMQ relay tree (default); dir: a local directory store; s3: S3",
    )
    ap.add_argument("--endpoint", default="", help="S3 endpoint URL (default: a local moto)")
    ap.add_argument("--bucket", default="dcr-demo")
    ap.add_argument("--refit", choices=["dcr", "dense"], default="dcr")
    ap.add_argument("--kill-every", type=int, default=0, help="kill the engine mid-apply")
    add_replica_arguments(ap)
    add_quantization_argument(ap)
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-6, help="Adam learning rate")
    ap.add_argument("--seed", type=int, default=0, help="fixture seed")
    return ap


def run_demo(args: argparse.Namespace) -> int:
    demo = Demo(args)
    try:
        report = demo.run()
    except (DCRError, RefitFailed) as e:
        print(f"[demo] failed: {e}", file=sys.stderr)
        return 1
    finally:
        demo.stop()
    return 0 if report["all_bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(run_demo(build_parser().parse_args()))
