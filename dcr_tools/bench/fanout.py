"""``dcr bench fanout``: bytes across the rollout cluster's boundary per refit, with 1, 2 and 4
receivers per cluster, when every receiver reads the object store itself (``engines``) vs when
the cluster's replica reads it once and forwards down a relay tree (``replica``), in one run.

Set-up (one machine): a local ``moto_server`` is the object store. The trainer side (a labelled
stand-in owner group: the canonical delta between consecutive versions of a synthetic BF16
checkpoint, encoded by the codec and published through real sinks and a seal) uploads to it
directly. The rollout cluster reads it only through a counting HTTP proxy (`Boundary`): every
byte the store sends into the cluster crosses it, sorted into payload-object bodies and
everything else (listings, manifests, abandon checks: the polling of streaming readers).
Receivers are `ReplicaReceiver`s on their own roots (stand-ins for engines: a receiver of
canonical payloads, whose bits the run checks; a vLLM engine reads the same source the same
way, once per TP rank). ``replica`` mode adds the cluster's replica (`ReplicaReceiver` with
``fanout``) and a relay tree of one node per receiver (separate processes, root -> k-ary); the
receivers read their node's spool. A real `Coordinator` runs every refit, pipelined.

Method: each configuration (mode x receivers) keeps its own roots, control records and bucket
prefix; per round every configuration refits the same next version (identical payload sets)
in a rotated order; one warm-up round, then `repeats` rounds. Per refit: the boundary's bytes
(total, payload bodies, other) over the refit, the payload set's bytes (from the seal), the
ratios bytes / payload set, and the refit's seconds. Every version is checked bit-exact on every
member (combined digest against the synthetic lineage). Goal (issue 31): the ``replica`` mode's
payload bytes per refit are 1.0x one payload set whatever the number of receivers.

Limitations:
1. Receivers are canonical stand-ins, not vLLM engines (bytes do not depend on the receiver).
2. One machine: the boundary is a proxy on loopback, not a WAN link; seconds are not WAN times.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from dcr_tools.bench.stats import summarize
from dcr_tools.procs import RelayTree, free_port, kill_group

MODES = ("engines", "replica")


class Boundary:
    """A counting HTTP reverse proxy in front of the object store: what the store sends into
    the cluster, split into payload bodies (GETs of ``.dcrp`` objects) and everything else."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.lock = threading.Lock()
        self.payload_bytes = 0
        self.other_bytes = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                payload = self.command == "GET" and self.path.split("?")[0].endswith(".dcrp")
                with proxy.lock:
                    if payload:
                        proxy.payload_bytes += len(data)
                    else:
                        proxy.other_bytes += len(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward  # noqa: N815

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def read(self) -> tuple[int, int]:
        with self.lock:
            return self.payload_bytes, self.other_bytes

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def write_initial(path: Path, elements: int, tensors: int, seed: int) -> dict[str, Any]:
    """A synthetic BF16 checkpoint of `tensors` tensors of `elements` elements each, with a
    config.json; returns the tensors (torch)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    out = {
        f"model.layers.{i}.mlp.weight": (torch.randn(elements, generator=gen) * 0.02).to(
            torch.bfloat16
        )
        for i in range(tensors)
    }
    path.mkdir(parents=True)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"bench": "fanout"}))
    return out


def evolve(tensors: dict[str, Any], seed: int, rate: float) -> dict[str, Any]:
    """The next version: a uniform `rate` of every tensor's elements get new bits."""
    from shared_codec.dtypes import tensor_bits

    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(tensors):
        t = tensors[name].clone()
        bits = tensor_bits(t)
        pos = np.flatnonzero(rng.random(bits.shape[0]) < rate)
        bits[pos] ^= rng.integers(1, 1 << 15, size=pos.shape[0], dtype=bits.dtype)
        out[name] = t
    return out


class Owners:
    """Stand-in owner group (labelled): publishes lineage[v-1] -> lineage[v] as XOR items from
    one owner into the store (directly, not through the boundary) and seals it."""

    def __init__(self, lineage: list[dict[str, Any]], spec: dict[str, Any]) -> None:
        self.lineage, self.spec = lineage, spec

    def build(self, version: int, attempt: int, retry: bool) -> dict[str, Any]:
        from shared_codec.buckets import BucketConfig, encode_items
        from shared_codec.format import PayloadMeta
        from shared_codec.records import Kind, diff_tensors
        from shared_codec.transport.publish import publish_attempt

        old, new = self.lineage[version - 1], self.lineage[version]
        kind = Kind.OVERWRITE if retry else Kind.XOR
        items = [diff_tensors(n, old[n], new[n], kind=kind) for n in sorted(new)]
        meta = PayloadMeta(
            version=version, base_version=version - 1, attempt=attempt, owner=0, sequence=0
        )
        payloads = encode_items(
            [i for i in items if i.count], meta, BucketConfig(bucket_bytes=1 << 20, threads=0)
        )
        publish_attempt(
            self.spec, version=version, attempt=attempt, base_version=version - 1,
            payloads={0: payloads},
        )  # fmt: skip
        return {"baseline_id": f"v{version - 1}", "payloads": len(payloads)}

    def verify(self, version: int) -> None:
        pass

    def commit(self, version: int) -> None:
        pass

    def abort(self, version: int, attempt: int) -> None:
        pass


@contextmanager
def moto_server(work: Path) -> Iterator[str]:
    """A local S3 endpoint for the run (its credentials set in this process)."""
    import os

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(var, "bench")
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    with open(work / "moto.log", "wb") as log:
        proc = subprocess.Popen(
            [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        kill_group(proc)


class Config:
    """One configuration: `mode` with `n` receivers, its own prefix, roots and coordinator."""

    def __init__(
        self, mode: str, n: int, work: Path, initial: Path, lineage: list, s3: dict[str, Any],
        boundary: str,
    ) -> None:  # fmt: skip
        from shared_codec.coordination.coordinator import Coordinator, CoordinatorConfig
        from shared_codec.replica import ReplicaStore
        from shared_codec.replica.receiver import ReplicaReceiver
        from shared_codec.transport.spec import open_store

        self.mode, self.n = mode, n
        base = work / f"{mode}-{n}"
        prefix = f"{mode}-{n}"
        owners_spec = {**s3, "prefix": prefix}  # the trainer side: straight to the store
        inside = {**s3, "endpoint_url": boundary, "prefix": prefix}  # through the boundary
        names = [f"engine{i}" for i in range(n)] + (["replica"] if mode == "replica" else [])
        for name in names:
            with ReplicaStore(base / name) as s:
                s.bootstrap(initial)
        self.tree = RelayTree(base, n, child_timeout_s=10.0) if mode == "replica" else None
        self.members: list[Any] = []
        if self.tree is not None:
            fanout = {"kind": "relay", "root": self.tree.addrs[0], "timeout_s": 60.0}
            self.members.append(ReplicaReceiver(base / "replica", inside, fanout=fanout))
        for i in range(n):
            src = (
                inside if self.tree is None
                else {"kind": "spool", "root": str(self.tree.dirs[i])}
            )  # fmt: skip
            self.members.append(ReplicaReceiver(base / f"engine{i}", src, name=f"engine{i}"))
        self.store = open_store(owners_spec)
        self.coord = Coordinator(
            self.store, Owners(lineage, owners_spec), self.members,
            CoordinatorConfig(ack_timeout_s=120.0), log=lambda _m: None, transport=owners_spec,
        )  # fmt: skip
        self.coord.initialize()

    def close(self) -> None:
        for m in self.members:
            m.close()
        if self.tree is not None:
            self.tree.stop()


def run(
    receivers: list[int], repeats: int, elements: int, tensors: int, rate: float
) -> dict[str, Any]:
    import boto3

    from shared_codec.checkpoint import combined_digest, state_digests

    work = Path(tempfile.mkdtemp(prefix="dcr-bench-fanout-"))
    versions = repeats + 1
    lineage = [write_initial(work / "initial", elements, tensors, seed=7)]
    for v in range(1, versions + 1):
        lineage.append(evolve(lineage[-1], seed=v, rate=rate))
    digests = [combined_digest(state_digests(t)) for t in lineage]
    configs: list[Config] = []
    rows: dict[str, list[dict[str, Any]]] = {}
    try:
        with moto_server(work) as endpoint:
            bucket = f"fanout-{uuid.uuid4().hex[:8]}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
                Bucket=bucket
            )
            s3 = {"kind": "s3", "bucket": bucket, "endpoint_url": endpoint}
            boundary = Boundary(endpoint)
            try:
                configs = [
                    Config(m, n, work, work / "initial", lineage, s3, boundary.url)
                    for m in MODES for n in receivers
                ]  # fmt: skip
                for r in range(versions):  # round 0 is the warm-up
                    order = configs[r % len(configs) :] + configs[: r % len(configs)]
                    for c in order:
                        before = boundary.read()
                        t0 = time.perf_counter()
                        res = c.coord.refit()
                        seconds = time.perf_counter() - t0
                        after = boundary.read()
                        v = res.version
                        if set(res.record.digests.values()) != {digests[v]}:
                            raise RuntimeError(f"{c.mode}-{c.n}: version {v} is not bit-exact")
                        sealed = c.store.list(f"v{v:012d}/a{res.record.attempt:06d}/")
                        payload_set = sum(
                            len(c.store.get(k)) for k in sealed if k.endswith(".dcrp")
                        )
                        row = {
                            "round": r, "version": v, "seconds": seconds,
                            "payload_set_bytes": payload_set,
                            "payload_bytes": after[0] - before[0],
                            "other_bytes": after[1] - before[1],
                        }  # fmt: skip
                        row["payload_ratio"] = row["payload_bytes"] / payload_set
                        row["total_ratio"] = (row["payload_bytes"] + row["other_bytes"]) / (
                            payload_set
                        )
                        if r > 0:
                            rows.setdefault(f"{c.mode}-{c.n}", []).append(row)
            finally:
                for c in configs:
                    c.close()
                boundary.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for key, runs in rows.items():
        summary[key] = {
            k: summarize([float(x[k]) for x in runs])
            for k in (
                "payload_ratio",
                "total_ratio",
                "payload_bytes",
                "other_bytes",
                "payload_set_bytes",
                "seconds",
            )  # fmt: skip
        }
    goal = {
        f"replica-{n}": summary[f"replica-{n}"]["payload_ratio"]["max"] <= 1.0 for n in receivers
    }
    return {
        "bench": "fanout",
        "settings": {
            "receivers": receivers,
            "repeats": repeats,
            "elements": elements,
            "tensors": tensors,
            "rate": rate,
        },  # fmt: skip
        "rows": rows,
        "summary": summary,
        "goal_payload_ratio_1x": goal,
    }


def render(res: dict[str, Any]) -> str:
    lines = [
        "cross-cluster bytes per refit (median [min-max] over the repeats)",
        f"{'mode':<9} {'receivers':>9} {'payload set':>12} {'payload x':>16} "
        f"{'all bytes x':>16} {'refit s':>16}",
    ]

    def cell(s: dict[str, Any], k: str, fmt: str = ".2f") -> str:
        x = s[k]
        return f"{x['median']:{fmt}} [{x['min']:{fmt}}-{x['max']:{fmt}}]"

    for key in sorted(res["summary"], key=lambda k: (k.rsplit("-", 1)[0], int(k.rsplit("-")[1]))):
        s = res["summary"][key]
        mode, n = key.rsplit("-", 1)

        lines.append(
            f"{mode:<9} {n:>9} {s['payload_set_bytes']['median']:>12.0f} "
            f"{cell(s, 'payload_ratio'):>16} {cell(s, 'total_ratio'):>16} "
            f"{cell(s, 'seconds'):>16}"
        )
    ok = all(res["goal_payload_ratio_1x"].values())
    lines.append(
        f"goal: replica mode = 1.0x one payload set at every size: {'met' if ok else 'NOT met'}"
    )
    return "\n".join(lines)


def main(
    json_path: str | None, receivers: str = "1,2,4", repeats: int = 5,
    elements: int = 1 << 21, tensors: int = 8, rate: float = 0.01,
) -> int:  # fmt: skip
    counts = [int(x) for x in receivers.split(",") if x]
    res = run(counts, repeats, elements, tensors, rate)
    print(render(res), flush=True)
    path = Path(json_path or "out/bench/fanout.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0 if all(res["goal_payload_ratio_1x"].values()) else 1
