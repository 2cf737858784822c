"""`tgis serve` for real: the bundled model on the cpu backend behind the HTTP server, driven by
curl-like requests and the three Python clients people use (text-generation,
huggingface_hub.InferenceClient, openai)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import run_tgis
from tests.server.conftest import live_server
from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.engine.paged_scheduler import PagedScheduler
from tgis.hub import read_model_config
from tgis.launch import Service, build_service
from tgis.server import Metrics, ModelInfo, create_app

SEED_REQUEST = {"inputs": "What is Deep Learning?", "parameters": {"max_new_tokens": 20}}
FIBONACCI = "def fibonacci(n):"


@pytest.fixture(scope="module")
def service(demo_model_dir: Path) -> Iterator[tuple[Service, Metrics]]:
    facts = ModelFacts.from_config(*read_model_config(demo_model_dir))
    # float32 everywhere (not bf16 where the CPU has it): greedy answers are the model card's.
    args = LauncherArgs(
        max_total_tokens=512,
        max_batch_size=8,
        max_concurrent_requests=16,
        backend="cpu",
        dtype="float32",
    )
    config = build_serve_config(args, facts, {"WARMUP_ENABLED": "false"})
    metrics = Metrics(config.max_total_tokens, 8)
    svc = build_service(config, demo_model_dir, observer=metrics)
    yield svc, metrics
    svc.engine.stop()


@pytest.fixture(scope="module")
def base_url(service: tuple[Service, Metrics]) -> Iterator[str]:
    svc, metrics = service
    info = ModelInfo.from_config(svc.config, max_batch_total_tokens=svc.kv_tokens)
    app = create_app(svc.engine, svc.tokenizer, svc.config, info, metrics=metrics)
    with live_server(app) as (url, _):
        yield url


def test_seed_curl_examples(base_url: str) -> None:
    generated = httpx.post(f"{base_url}/generate", json=SEED_REQUEST, timeout=60).json()
    assert isinstance(generated["generated_text"], str) and generated["generated_text"]
    events = []
    with httpx.stream("POST", f"{base_url}/generate_stream", json=SEED_REQUEST, timeout=60) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:")]
    assert (
        events[-1]["generated_text"] == generated["generated_text"]
    )  # same path, same greedy text
    assert "".join(e["token"]["text"] for e in events) == generated["generated_text"]
    assert all(e["generated_text"] is None for e in events[:-1])


def greedy_fibonacci(demo_model_dir: Path) -> str:
    """What transformers' greedy generate continues FIBONACCI with (48 tokens, no EOS), as the
    model card records it."""
    record = json.loads((demo_model_dir / "training.json").read_text())["greedy_fibonacci"]
    assert record.startswith(FIBONACCI)
    return record[len(FIBONACCI) :]


def test_text_generation_client(base_url: str, demo_model_dir: Path) -> None:
    from text_generation import Client

    client = Client(base_url, timeout=60)
    response = client.generate(
        FIBONACCI, max_new_tokens=8, decoder_input_details=True, top_n_tokens=2
    )
    # Greedy: the first 8 of the 48 tokens the model card shows, none of them the EOS.
    assert response.details.finish_reason.value == "length"
    assert response.details.generated_tokens == len(response.details.tokens) == 8
    assert response.generated_text
    assert greedy_fibonacci(demo_model_dir).startswith(response.generated_text)
    assert [len(top) for top in response.details.top_tokens] == [2] * 8
    assert response.details.prefill[0].logprob is None
    assert all(t.logprob is not None for t in response.details.prefill[1:])
    streamed = [r for r in client.generate_stream(FIBONACCI, max_new_tokens=8)]
    assert len(streamed) == 8
    assert streamed[-1].generated_text == response.generated_text


def test_inference_client(base_url: str) -> None:
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=base_url, timeout=60)
    text = client.text_generation("import os\n", max_new_tokens=6)
    pieces = list(client.text_generation("import os\n", max_new_tokens=6, stream=True))
    # TGI's compat route returns the full text for text-generation models; streams do not.
    assert text == "import os\n" + "".join(pieces)
    assert len(pieces) == 6
    chat = client.chat_completion(
        [{"role": "user", "content": "hello"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.content


def test_openai_client(base_url: str, service: tuple[Service, Metrics]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=60)
    assert [m.id for m in client.models.list().data] == [service[0].config.model_id]
    completion = client.completions.create(
        model="tgis", prompt="class Foo:", max_tokens=6, temperature=0
    )
    streamed = client.completions.create(
        model="tgis", prompt="class Foo:", max_tokens=6, temperature=0, stream=True
    )
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
    chat = client.chat.completions.create(
        model="tgis",
        messages=[{"role": "user", "content": "x = "}],
        max_tokens=4,
        temperature=0,
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 4


def test_disconnect_frees_the_slot(base_url: str, service: tuple[Service, Metrics]) -> None:
    svc, _ = service
    body = {"inputs": "for i in range(", "parameters": {"max_new_tokens": 400}}
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data:")
    deadline = time.monotonic() + 20
    while svc.engine.in_flight or svc.engine.scheduler.running:
        assert time.monotonic() < deadline, "the abandoned request kept its slot"
        time.sleep(0.05)
    scheduler = svc.engine.scheduler
    assert isinstance(scheduler, PagedScheduler)  # the demo model runs the paged engine
    assert scheduler.blocks.used_blocks == 0  # every block of the abandoned request is back


def test_validation_error_is_tgi_422(base_url: str) -> None:
    resp = httpx.post(
        f"{base_url}/generate",
        json={"inputs": "x", "parameters": {"max_new_tokens": 600}},
        timeout=30,
    )
    assert resp.status_code == 422
    body = resp.json()
    assert body["error_type"] == "validation" and "`max_new_tokens` must be <= 512" in body["error"]


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_after_traffic(base_url: str) -> None:
    """Two requests of exactly 3 tokens move the request and batch metrics by exactly that
    much: per request one prefill step and two decode steps (the engine is otherwise idle)."""
    before = scrape(base_url)
    body = {"inputs": "import os", "parameters": {"max_new_tokens": 3, "ignore_eos": True}}
    for _ in range(2):
        resp = httpx.post(f"{base_url}/generate", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
    expected = {
        ("tgi_request_count_total", (("kind", "single"),)): 2,
        ("tgi_request_success_total", (("kind", "single"), ("stop_reason", "MAX_TOKENS"))): 2,
        ("tgi_request_generated_tokens_sum", ()): 6,
        ("tgi_request_duration_count", ()): 2,
        ("tgi_batch_inference_count_total", (("method", "prefill"),)): 2,
        ("tgi_batch_inference_count_total", (("method", "next_token"),)): 4,
        ("tgi_batch_inference_success_total", (("method", "next_token"),)): 4,
    }

    def moved() -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], float]:
        after = scrape(base_url)
        delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in expected}
        return delta, after[("tgi_batch_current_size", ())]

    # The engine thread reports a step (then the batch after it) just after it hands out the
    # step's tokens: the last report may come a moment after the response.
    deadline = time.monotonic() + 10
    while moved() != (expected, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert moved() == (expected, 0)  # and both requests have left the batch


def serve_and_ask(*flags: str) -> dict[str, Any]:
    """`tgis serve FLAGS` as users run it, a subprocess on a port: the seed's curl request
    answered, then SIGTERM ends it cleanly. Returns /info's `runtime`."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tgis", "serve", "--port", str(port), "--hostname", "127.0.0.1",
         "--max-batch-size", "4", "--max-total-tokens", "256", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "tgis serve did not become healthy"
            time.sleep(0.5)
        resp = httpx.post(f"http://127.0.0.1:{port}/generate", json=SEED_REQUEST, timeout=60)
        assert resp.status_code == 200 and resp.json()["generated_text"]
        return httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()["runtime"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM: graceful shutdown, clean exit


def test_serve_binary_starts_and_answers() -> None:
    runtime = serve_and_ask()
    # /info says how the model runs: the paged engine, plain-torch attention on a CPU.
    assert runtime["engine"] == "paged" and runtime["cuda_graphs"] == []
    assert runtime["attention"].startswith("plain torch") and runtime["kv_blocks"] > 0


def test_serve_with_the_triton_kernels_starts_and_answers() -> None:
    """--attention-backend triton on a CPU: tgis's Triton kernels through Triton's interpreter
    (TRITON_INTERPRET=1, which the suite's conftest sets where there is no GPU, reaches the
    server's process), /info saying so."""
    from tgis.backends.paged.triton_attention import triton_available

    if triton_available() is not None:
        pytest.skip(f"the Triton kernels cannot run: {triton_available()}")
    runtime = serve_and_ask("--attention-backend", "triton", "--max-total-tokens", "64")
    assert runtime["attention_backend"] == "triton"
    assert runtime["attention"].startswith("tgis's Triton kernels over KV pages")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_serve_on_cuda_starts_and_answers() -> None:
    """On a GPU in bfloat16: the paged engine with tgis's Triton kernels where Triton is
    installed, else flash attention where this torch has it, CUDA-graph decode over either,
    and /info saying which."""
    from tgis.backends.paged.attention import flash_paged_available
    from tgis.backends.paged.triton_attention import triton_available

    runtime = serve_and_ask("--backend", "cuda", "--dtype", "bfloat16")
    cuda = torch.device("cuda")
    if triton_available(cuda) is None:
        expected = "triton"
    else:
        expected = "flash" if flash_paged_available(cuda, torch.bfloat16) else "torch"
    assert runtime["engine"] == "paged" and runtime["dtype"] == "bfloat16"
    assert runtime["attention_backend"] == expected
    assert bool(runtime["cuda_graphs"]) == (expected != "torch")


def test_serve_check_still_validates_only() -> None:
    result = run_tgis("serve", "--check", "--max-total-tokens", "256")
    assert result.returncode == 0, result.stderr  # it returned: nothing was served
    # The resolved limits: the flag, and the input limit derived from it.
    assert re.search(r"max_total_tokens\W+256\b", result.stdout), result.stdout
    assert re.search(r"max_input_tokens\W+255\b", result.stdout), result.stdout


def test_serve_of_an_embedding_model_answers_its_routes_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    """`tgis serve` reads that the model pools (sentence-transformers' modules), serves its
    routes, and stops cleanly; `--check` says what it read."""
    from sentence_transformers import SentenceTransformer

    from tests.pooling.models import TEXTS, bert_embedder
    from tests.server.conftest import demo_serve

    model = bert_embedder(tmp_path / "embedder", ("cls", "mean"), normalize=True)
    checked = run_tgis("serve", "--model-id", str(model), "--check")
    assert checked.returncode == 0, checked.stderr
    assert "serves embed (cls+mean pooling), as its sentence-transformers says" in " ".join(
        checked.stdout.split()
    )
    expected = SentenceTransformer(str(model), device="cpu").encode(TEXTS, convert_to_tensor=True)
    with demo_serve(tmp_path / "serve.log", "--model-id", str(model)) as url:
        got = httpx.post(f"{url}/embed", json={"inputs": TEXTS}, timeout=60)
        assert got.status_code == 200, got.text
        torch.testing.assert_close(torch.tensor(got.json()), expected.float(), atol=1e-5, rtol=0)
        assert httpx.get(f"{url}/info", timeout=30).json()["task"] == "embed"
    assert "Serving" in (tmp_path / "serve.log").read_text()
