"""Schemathesis against a running `tgis serve`: every check it has (server errors, status codes,
content types, response and SSE schemas, schema-valid requests accepted, schema-violating ones
refused, Allow headers, ...) over every operation of /openapi.json, 0 failures of any kind.

Valid cases are kept within the token rules no schema can state (tests/server/contract_hooks.py);
the server caps new tokens at 4 so that the run stays short.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.fmaas.test_yaml_cases import free_port, log_tail, server_env
from tgis.config.env import DEMO_MODEL

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 25  # per operation and phase
SEED = 20261123


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> object:
    log = tmp_path_factory.mktemp("contract") / "serve.log"
    port = free_port()
    command = [
        sys.executable, "-m", "tgis", "serve", "--model-id", str(DEMO_MODEL),
        "--backend", "cpu", "--hostname", "127.0.0.1", "--port", str(port), "--no-grpc",
        "--max-new-tokens", "4", "--max-concurrent-requests", "16",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=server_env(), cwd=ROOT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tgis serve exited with {proc.returncode}:\n{log_tail(log)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tgis serve did not start:\n{log_tail(log)}")
            time.sleep(0.5)
        yield url, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_schemathesis_finds_nothing(server_url: tuple[str, Path], tmp_path: Path) -> None:
    url, log = server_url
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.contract_hooks"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [
        str(Path(sys.executable).with_name("st")), "--no-color", "run", f"{url}/openapi.json",
        "--checks", "all", "--max-examples", str(EXAMPLES), "--seed", str(SEED),
        # One worker: hypothesis describes strategies with ast.parse, which CPython 3.11
        # can fail in deep recursion off the main thread (a SystemError, no finding).
        "--workers", "1", "--request-timeout", "60",
        "--report-dir", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=540)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-20000:] + "\n--- server log ---\n" + log_tail(log)
    assert "Test cases:" in output and "failure" not in output.split("Test cases:")[1], output
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # still serving
