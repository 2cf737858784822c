"""`tgis serve --num-shard 2` on cpu: the HTTP and gRPC APIs give one shard's greedy answers;
SIGTERM stops the server and its other shard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
import pytest

from tests.shards import PARAMETERS, PROMPTS, one_shard_answers
from tgis.benchmark.engine_mode import free_port
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas import generation_pb2_grpc as pb_grpc


def shards(pid: int) -> list[int]:
    """The shard processes `pid` spawned (not multiprocessing's resource tracker)."""
    found = []
    for child in children(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in command:
            found.append(child)
    return found


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def one_shard(demo_model_dir: Path) -> list[str]:
    """The answers of the same server settings on one device, in process."""
    return one_shard_answers(demo_model_dir)


@contextmanager
def sharded_server(model_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, int]]:
    """`tgis serve --num-shard 2` on the bundled model; (process, HTTP URL, gRPC port)."""
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "WARMUP_ENABLED": "false", "MASTER_PORT": str(free_port())}
    command = [
        sys.executable, "-m", "tgis", "serve", "--model-id", str(model_dir),
        "--backend", "cpu", "--dtype", "float32", "--num-shard", "2",
        "--max-total-tokens", "256", "--hostname", "127.0.0.1",
        "--port", str(port), "--grpc-port", str(grpc_port),
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tgis serve exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the sharded server did not start"
            time.sleep(0.5)
        yield proc, url, grpc_port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def sharded(demo_model_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, int]]:
    with sharded_server(demo_model_dir) as server:
        yield server


def test_http_and_grpc_answer_as_one_shard(
    sharded: tuple[subprocess.Popen[bytes], str, int], one_shard: list[str]
) -> None:
    proc, url, grpc_port = sharded
    assert len(shards(proc.pid)) == 1  # the other shard runs beside the server
    answers = [
        httpx.post(
            f"{url}/generate", json={"inputs": p, "parameters": PARAMETERS}, timeout=60
        ).json()["generated_text"]
        for p in PROMPTS
    ]
    assert answers == one_shard
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text=p) for p in PROMPTS],
            params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=12)),
        )
        texts = [r.text for r in stub.Generate(request, timeout=60).responses]
    # gRPC stops at EOS (the HTTP requests above ignore it): the same text up to there.
    assert all(one.startswith(text) for one, text in zip(one_shard, texts, strict=True))
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert info["backend"] == "cpu"


def test_sigterm_stops_every_shard(demo_model_dir: Path) -> None:
    with sharded_server(demo_model_dir) as (proc, _, _):
        spawned = shards(proc.pid)
        assert spawned
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() for pid in spawned):
        assert time.monotonic() < deadline, "a shard outlived the server"
        time.sleep(0.2)


def test_a_killed_shard_ends_the_server_with_its_name(demo_model_dir: Path) -> None:
    with sharded_server(demo_model_dir) as (proc, _, _):
        (shard,) = shards(proc.pid)
        os.kill(shard, signal.SIGKILL)
        code = proc.wait(60)
        assert code != 0
        assert "shard 1 exited with code -9" in proc.stderr.read().decode()  # type: ignore[union-attr]
