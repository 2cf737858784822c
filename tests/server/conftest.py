"""Fixtures of the HTTP-layer tests: a tiny real tokenizer, the FakeEngine, apps, live servers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tests.factories import tiny_tokenizer
from tests.server.fakes import FakeEngine
from tgis.config import ServeConfig
from tgis.server import GracefulServer, ModelInfo, create_app, serve

ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A Qwen3-style template: a `<think>` block the prompt opens (closed with
# `enable_thinking: false`) and tools in Hermes's `<tool_call>` format.
QWEN3_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools>\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def make_config(**overrides: Any) -> ServeConfig:
    """A small, valid ServeConfig (what build_serve_config would produce for a tiny model)."""
    values: dict[str, Any] = {
        "model_id": "tiny-llama",
        "revision": None,
        "backend": "cpu",
        "dtype": None,
        "num_shard": 1,
        "port": 3000,
        "hostname": "127.0.0.1",
        "max_concurrent_requests": 8,
        "max_best_of": 2,
        "max_stop_sequences": 4,
        "max_top_n_tokens": 5,
        "max_input_tokens": 100,
        "max_total_tokens": 128,
        "max_batch_prefill_tokens": 150,
        "max_batch_total_tokens": None,
        "max_batch_size": None,
        # Not set: each engine's admission policy (ServeConfig.admission).
        "max_waiting_tokens": None,
        "waiting_served_ratio": None,
    }
    values.update(overrides)
    return ServeConfig(**values)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def plain_tokenizer() -> Any:
    """The same tokenizer without a chat template."""
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir: Any) -> Any:
    """The demo model's tokenizer (byte-level: any text round-trips)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="session")
def qwen3_tokenizer(demo_model_dir: Any) -> Any:
    """The demo tokenizer with a Qwen3-style template: a `<think>` block the prompt opens
    (closed with `enable_thinking: false`) and tools in Hermes's `<tool_call>` format."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    tok.chat_template = QWEN3_STYLE
    return tok


@pytest.fixture
def config() -> ServeConfig:
    return make_config()


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture
def make_app(engine: FakeEngine, tokenizer: Any, config: ServeConfig) -> Callable[..., Starlette]:
    """create_app over the fixtures; keyword arguments override create_app's."""

    def make(**kwargs: Any) -> Starlette:
        args: dict[str, Any] = {
            "engine": engine,
            "tokenizer": tokenizer,
            "config": config,
            "model_info": ModelInfo.from_config(config),
        }
        args.update(kwargs)
        return create_app(**args)

    return make


@pytest.fixture
def app(make_app: Callable[..., Starlette]) -> Starlette:
    return make_app()


@pytest.fixture
def client(app: Starlette) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@contextmanager
def live_server(
    app: Starlette,
    shutdown_grace_s: float = 5.0,
    companions: Sequence[Any] = (),
    **options: Any,
) -> Iterator[tuple[str, GracefulServer]]:
    """Serve `app` with tgis.server.serve on 127.0.0.1 (a free port) in a thread, with
    `companions` (a gRPC server) started before and stopped with it; `options` go to serve
    (its timeouts)."""
    servers: list[GracefulServer] = []
    thread = threading.Thread(
        target=lambda: asyncio.run(
            serve(
                app,
                "127.0.0.1",
                0,
                shutdown_grace_s,
                log_level="warning",
                server_ready=servers.append,
                companions=companions,
                **options,
            )
        ),
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + 10
    while not (servers and servers[0].started):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    server = servers[0]
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.request_shutdown()
        thread.join(timeout=15)


@contextmanager
def demo_app(model_dir: Any, max_total_tokens: int, **flags: Any) -> Iterator[Starlette]:
    """The app `tgis serve` builds for the demo model on cpu (float32, no warmup), with its
    real engine (stopped on exit); `flags` are more launcher flags (LauncherArgs' fields)."""
    from tgis.config import LauncherArgs, ModelFacts, build_serve_config
    from tgis.hub import read_model_config
    from tgis.launch import build_service, service_info
    from tgis.server import Metrics

    facts = ModelFacts.from_config(*read_model_config(model_dir))
    args = LauncherArgs(max_total_tokens=max_total_tokens, backend="cpu", dtype="float32", **flags)
    config = build_serve_config(args, facts, {"WARMUP_ENABLED": "false"})
    service = build_service(config, model_dir, observer=Metrics(max_total_tokens, 8))
    app = create_app(service.engine, service.tokenizer, config, service_info(service),
                     metrics=service.engine.observer,  # type: ignore[arg-type]
                     adapters=service.adapters, vision=service.vision)  # fmt: skip
    try:
        yield app
    finally:
        service.stop()


@contextmanager
def demo_serve(log: Path, *extra: str) -> Iterator[str]:
    """`tgis serve` on the demo model (cpu, HTTP only, 127.0.0.1, a free port) as a
    subprocess writing to `log`, with the `extra` flags; its base URL once /health answers."""
    import httpx

    from tests.fmaas.test_yaml_cases import free_port, log_tail, server_env
    from tgis.config.env import DEMO_MODEL

    port = free_port()
    command = [
        sys.executable, "-m", "tgis", "serve", "--model-id", str(DEMO_MODEL),
        "--backend", "cpu", "--hostname", "127.0.0.1", "--port", str(port), "--no-grpc", *extra,
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
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def pooling_server(directory: Path, **config: Any) -> Iterator[str]:
    """The URL of `tgis serve`'s app for the pooling model in `directory` (cpu, float32,
    `config`: ServeConfig fields over make_config's), live until the generator closes."""
    from tgis.hub import read_model_config
    from tgis.pooling.service import load_pooling_service
    from tgis.pooling.spec import read_pooling_spec
    from tgis.server.http.app import create_pooling_app

    settings = make_config(model_id=directory.name, **config)
    template = Path(settings.rerank_template) if settings.rerank_template else None
    spec = read_pooling_spec(
        directory, read_model_config(directory)[0], settings.rerank_tokens, template
    )
    assert spec is not None
    service = load_pooling_service(settings, directory, spec)
    app = create_pooling_app(service.model, service.runner, settings, api_key=settings.api_key)
    service.runner.start()
    try:
        with live_server(app) as (url, _):
            yield url
    finally:
        service.runner.stop()
