"""`tgis warmup` then `tgis serve --backend tpu` on XLA:CPU, end to end over HTTP: the
answers equal `tgis serve --backend cpu`, the static shape's limits are enforced with 422,
and no request compiles (serve's log would say so)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.factories import make_model_dir

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("Hello world!", "The quick brown fox", "Continuous batching keeps")
SHAPE = {"HF_BATCH_SIZE": "2", "HF_SEQUENCE_LENGTH": "64"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tgis_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("MAX_", "HF_", "TGIS_", "MODEL_"))
    }
    env.update(PJRT_DEVICE="CPU", HF_HUB_OFFLINE="1", **extra)
    return env


class Server:
    def __init__(self, model: Path, log: Path, *args: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.log = log
        command = [sys.executable, "-m", "tgis", "serve", "--model-id", str(model)]
        command += ["--hostname", "127.0.0.1", "--port", str(self.port), *args]
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("server not ready:\n" + log.read_text()[-3000:])

    def generate(self, prompt: str, **parameters: object) -> httpx.Response:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, **parameters}}
        return httpx.post(self.url + "/generate", json=body, timeout=120)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("m") / "llama", arch="llama")


@pytest.fixture(scope="module")
def cpu_answers(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict]]:
    log = tmp_path_factory.mktemp("cpu") / "serve.log"
    server = Server(model, log, "--backend", "cpu", "--dtype", "float32", env=tgis_env(**SHAPE))
    try:
        yield [server.generate(p, details=True).json() for p in PROMPTS]
    finally:
        server.stop()


def test_warmup_then_serve(model: Path, tmp_path: Path, cpu_answers: list[dict]) -> None:
    cache = tmp_path / "xla-cache"
    report = tmp_path / "warmup.json"
    warm = subprocess.run(
        [sys.executable, "-m", "tgis", "warmup", "--model-id", str(model), "--backend", "tpu",
         "--compile-cache", str(cache), "--output", str(report)],
        cwd=ROOT, env=tgis_env(**SHAPE), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert warm.returncode == 0, warm.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["backend"] == "tpu" and data["max_batch_total_tokens"] == 2 * 64
    assert data["compiled"] == len(data["shapes"]) > 0
    # Every program persisted (plus the one that materializes the loaded weights and cache).
    assert len(list(cache.iterdir())) >= data["compiled"]

    log = tmp_path / "serve.log"
    server = Server(
        model, log, "--compile-cache", str(cache), env=tgis_env(TGIS_BACKEND="tpu", **SHAPE)
    )
    try:
        info = httpx.get(server.url + "/info", timeout=10).json()
        assert info["max_batch_total_tokens"] == 128
        answers = [server.generate(p, details=True).json() for p in PROMPTS]
        for got, want in zip(answers, cpu_answers, strict=True):
            assert [t["id"] for t in got["details"]["tokens"]] == [
                t["id"] for t in want["details"]["tokens"]
            ]
            assert got["generated_text"] == want["generated_text"]
        # The static shape's limit: 64 positions per request, refused with 422, not truncated.
        too_long = server.generate(PROMPTS[0], max_new_tokens=200)
        assert too_long.status_code == 422
        assert "`inputs` tokens + `max_new_tokens` must be <= 64" in too_long.json()["error"]
        # Sampling works too (seeded, repeatable).
        sampled = [
            server.generate(PROMPTS[1], do_sample=True, seed=7, top_k=20, temperature=0.9).json()
            for _ in range(2)
        ]
        assert sampled[0]["generated_text"] == sampled[1]["generated_text"]
    finally:
        server.stop()
    text = log.read_text()
    assert "warmup: " in text and "graphs compiled" in text
    assert "after warmup" not in text, text[-3000:]
