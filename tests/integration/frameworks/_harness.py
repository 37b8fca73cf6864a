"""What the framework tests share: a ``vllm serve`` with backend ``dcr`` (and a fault plan), a
two-rank trainer program on the framework's environment, and the restart a framework does for
a dead server: the program writes ``out/restart`` and waits for ``out/restarted``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from dcr_tools import faults
from dcr_tools.fixtures import write_tiny_model
from dcr_tools.procs import REPO, ServeProcess, base_env, free_port, run_program


def run_framework(
    tmp_path: Path,
    venv: str,
    program: str,
    *,
    chaos: bool = False,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Start the server, run `program` (tests/integration/frameworks/PROGRAM) on two ranks with
    the interpreter of `venv` (`chaos`: with ``--chaos``, the server killed mid-apply), restart
    the server when the program asks; return the program's ``result.json``. `env`: more
    variables for the ranks (``{root}`` in a value: the test's store directory). Skips (with the
    reason) where `make setup` did not build `venv`."""
    python = REPO / venv / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no framework environment ({venv}): `make setup` builds it")
    v0 = write_tiny_model("qwen3", tmp_path / "v0", seed=0)
    plan = tmp_path / "faults.json"
    server = ServeProcess(
        v0,
        free_port(),
        log=tmp_path / "serve.log",
        env=base_env(VLLM_SERVER_DEV_MODE="1", **{faults.ENV: str(plan)}),
        extension=False,
        extra_args=["--weight-transfer-config", json.dumps({"backend": "dcr"})],
    )
    url = server.start(timeout_s=420)
    out = tmp_path / "out"
    out.mkdir()
    done = threading.Event()

    def restarter() -> None:  # what the framework does for a dead server: start it again
        while not done.is_set():
            if (out / "restart").exists() and not (out / "restarted").exists():
                server.stop()
                server.start(timeout_s=420)
                (out / "restarted").write_text("ok")
            done.wait(0.5)

    watcher = threading.Thread(target=restarter, daemon=True)
    watcher.start()
    try:
        run_program(
            [
                str(python), "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                str(REPO / "tests/integration/frameworks" / program),
                "--ckpt", str(v0), "--url", url, "--store", str(tmp_path / "store"),
                "--out", str(out), "--fault-plan", str(plan),
                *(["--chaos"] if chaos else []),
            ],
            timeout=1500,
            env=base_env(
                OMP_NUM_THREADS="1",
                **{k: v.replace("{root}", str(tmp_path)) for k, v in (env or {}).items()},
            ),
            log=tmp_path / "ranks.log",
        )  # fmt: skip
    finally:
        done.set()
        watcher.join(timeout=600)
        server.stop()
    return json.loads((out / "result.json").read_text())
