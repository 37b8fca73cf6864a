"""Process helpers for integration tests: free loopback ports and bounded subprocess runs.

Every program is started in its own session (process group) and the whole group is killed on
timeout or when the test ends, so no engine or rank outlives its test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(**extra: str) -> dict[str, str]:
    """The environment for child programs: offline hub, repo on PYTHONPATH, small KV cache."""
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
        if log:
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


def run_torchrun(
    script: Path, args: list[str], *, tmp: Path, timeout: float = 420, nproc: int = 2
) -> subprocess.CompletedProcess:
    """Run `script` as an `nproc`-rank gloo job (torch.distributed.run) on loopback."""
    cmd = [
        PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *args,
    ]  # fmt: skip
    return run_program(
        cmd, timeout=timeout, env=base_env(OMP_NUM_THREADS="1"), log=tmp / "ranks.log"
    )
