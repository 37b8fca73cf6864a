"""Fixtures for shared_codec tests: a real S3 endpoint (moto_server) on a free loopback port."""

from __future__ import annotations

import http.client
import subprocess
import time
from pathlib import Path

import pytest

from dcr_tools.procs import PYTHON, base_env, free_port, kill_group


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    # moto accepts any credentials; boto3 needs some to sign requests
    for var, value in (
        ("AWS_ACCESS_KEY_ID", "dcr-test"),
        ("AWS_SECRET_ACCESS_KEY", "dcr-test"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        mp.setenv(var, value)
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(Path(PYTHON).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=base_env(),
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/")
            conn.getresponse().read()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "moto_server did not start"
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    kill_group(proc)
    log.close()
    mp.undo()
