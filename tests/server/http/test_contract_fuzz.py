"""Schemathesis against a running `tgis serve`: every check it has (server errors, status codes,
content types, response and SSE schemas, schema-valid requests accepted, schema-violating ones
refused, Allow headers, ...) over every operation of /openapi.json, 0 failures of any kind.

Valid cases are kept within the token rules no schema can state (tests/server/http/contract_hooks.py);
the server caps new tokens at 4 so that the run stays short.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.fmaas.test_yaml_cases import log_tail
from tests.server.conftest import demo_serve

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = 25  # per operation and phase
SEED = 20261123


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> object:
    log = tmp_path_factory.mktemp("contract") / "serve.log"
    with demo_serve(log, "--max-new-tokens", "4", "--max-concurrent-requests", "16") as url:
        yield url, log


def test_schemathesis_finds_nothing(server_url: tuple[str, Path], tmp_path: Path) -> None:
    url, log = server_url
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.http.contract_hooks"}
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
