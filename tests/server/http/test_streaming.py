"""Server-sent events: TGI's stream format, errors mid-stream, clients that leave, shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tests.factories import tiny_tokenizer
from tests.server.conftest import live_server, make_config
from tests.server.fakes import FakeEngine
from tgis.server import ModelInfo, create_app, serve
from tgis.server.http.lifecycle import ServerThread

ROOT = Path(__file__).resolve().parents[3]
PROMPT = "Hello world"


def events(text: str) -> list[dict[str, Any]]:
    """The JSON of each `data:` event of a TGI stream."""
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


def stream(client: TestClient, **parameters: Any) -> httpx.Response:
    return client.post("/generate_stream", json={"inputs": PROMPT, "parameters": parameters})


def test_stream_events_have_tgi_shape(client: TestClient) -> None:
    response = stream(client, max_new_tokens=4, details=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "data:{" in response.text  # TGI writes `data:` without a space
    got = events(response.text)
    assert [e["index"] for e in got] == [1, 2, 3, 4]
    for event in got[:-1]:
        assert event["generated_text"] is None and event["details"] is None
        assert set(event) == {"index", "token", "generated_text", "details"}
        assert set(event["token"]) == {"id", "text", "logprob", "special"}
    last = got[-1]
    assert last["details"] == {
        "finish_reason": "length",
        "generated_tokens": 4,
        "seed": None,
        "input_length": 6,
    }


def test_stream_texts_add_up_to_generate(client: TestClient) -> None:
    parameters = {"max_new_tokens": 12, "stop": ["lazy"], "include_stop_sequence": False}
    got = events(stream(client, **parameters).text)
    whole = client.post("/generate", json={"inputs": PROMPT, "parameters": parameters}).json()
    assert "".join(e["token"]["text"] for e in got) == got[-1]["generated_text"]
    assert got[-1]["generated_text"] == whole["generated_text"]


def expected_text(engine: FakeEngine, tokens: int) -> str:
    return engine.tokenizer.decode(engine.sequence_ids(0, tokens), skip_special_tokens=True)


def test_stream_details_only_when_asked_and_top_tokens(
    client: TestClient, engine: FakeEngine
) -> None:
    got = events(stream(client, max_new_tokens=2, top_n_tokens=3).text)
    assert got[-1]["details"] is None
    assert got[-1]["generated_text"] == expected_text(engine, 2)
    assert all(len(e["top_tokens"]) == 3 for e in got)


def test_stream_return_full_text(client: TestClient, engine: FakeEngine) -> None:
    got = events(stream(client, max_new_tokens=2, return_full_text=True).text)
    assert got[-1]["generated_text"] == PROMPT + expected_text(engine, 2)


def test_stream_refuses_best_of_with_a_status(client: TestClient) -> None:
    response = stream(client, max_new_tokens=2, best_of=2, do_sample=True)
    assert response.status_code == 422
    assert response.json() == {
        "error": "Input validation error: `best_of` != 1 is not supported when streaming tokens",
        "error_type": "validation",
    }


def test_error_after_the_start_is_an_event(client: TestClient, engine: FakeEngine) -> None:
    engine.fail_after = 2
    response = stream(client, max_new_tokens=5)
    assert response.status_code == 200
    got = events(response.text)
    assert len(got) == 3
    assert got[-1] == {
        "error": "Request failed during generation: the fake backend failed",
        "error_type": "generation",
    }


def test_errors_before_the_first_token_keep_their_status(
    client: TestClient, engine: FakeEngine
) -> None:
    engine.fail_after = 0
    assert stream(client, max_new_tokens=5).status_code == 424
    engine.fail_after, engine.overloaded = None, True
    response = stream(client, max_new_tokens=5)
    assert response.status_code == 429
    assert response.json() == {"error": "Model is overloaded", "error_type": "overloaded"}


class EventReader:
    """Reads `data:` lines from a live response, a few at a time.

    One line iterator for the whole response: abandoning an httpx line iterator closes the
    connection, which is what the disconnect tests do on purpose and the others must not.
    """

    def __init__(self, response: httpx.Response) -> None:
        self.lines = response.iter_lines()

    def take(self, count: int) -> list[str]:
        got: list[str] = []
        for line in self.lines:
            if line.startswith("data:"):
                got.append(line)
                if len(got) == count:
                    break
        return got


def test_client_leaving_a_stream_closes_the_engine_iterator(
    make_app: Callable[..., Starlette], engine: FakeEngine
) -> None:
    engine.delay = 0.02
    with live_server(make_app()) as (url, _), httpx.Client(base_url=url, timeout=5) as http:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 100}}
        with http.stream("POST", "/generate_stream", json=body) as response:
            assert len(EventReader(response).take(2)) == 2
        # The response is closed: the engine must see the cancellation within a few steps.
        assert engine.cancel_seen.wait(timeout=5)
        assert engine.cancelled == [engine.requests[-1].request_id]
        assert engine.in_flight == 0
        metrics = http.get("/metrics").text
        assert 'tgi_request_failure{err="cancelled"} 1.0' in metrics


def test_client_leaving_a_json_request_cancels_it(
    make_app: Callable[..., Starlette], engine: FakeEngine
) -> None:
    engine.delay = 0.02
    with live_server(make_app()) as (url, _):
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 100}}
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(
                f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 100}, timeout=0.3
            )
        assert engine.cancel_seen.wait(timeout=5)
        engine.cancel_seen.clear()
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{url}/generate", json=body, timeout=0.3)
        assert engine.cancel_seen.wait(timeout=5)
        assert len(engine.cancelled) == 2


def test_shutdown_lets_streams_finish_and_refuses_new_requests(
    make_app: Callable[..., Starlette], engine: FakeEngine
) -> None:
    engine.delay = 0.02
    with live_server(make_app(), shutdown_grace_s=10) as (url, server):
        with httpx.Client(base_url=url, timeout=5) as http:
            body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 60}}
            with http.stream("POST", "/generate_stream", json=body) as response:
                reader = EventReader(response)
                first = reader.take(1)
                server.request_shutdown()
                # A new connection is still accepted while draining, and refused politely.
                refused = httpx.post(f"{url}/generate", json=body, timeout=5)
                health = httpx.get(f"{url}/health", timeout=5)
                rest = reader.take(100)
        assert refused.status_code == 503
        assert refused.json() == {"error": "Server is shutting down", "error_type": "unavailable"}
        assert health.status_code == 503
        last = json.loads(rest[-1][5:])
        assert len(first) + len(rest) == 60
        assert last["generated_text"] == expected_text(engine, 60)  # finished, not cut
        assert engine.cancelled == []


def test_shutdown_cancels_streams_after_the_grace_period(
    make_app: Callable[..., Starlette], engine: FakeEngine
) -> None:
    engine.delay = 0.02
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 120}}
    with (
        live_server(make_app(), shutdown_grace_s=0.3) as (url, server),
        httpx.Client(base_url=url, timeout=5) as http,
        http.stream("POST", "/generate_stream", json=body) as response,
    ):
        reader = EventReader(response)
        reader.take(1)
        server.request_shutdown()
        rest = reader.take(200)
    assert json.loads(rest[-1][5:]) == {
        "error": "Server is shutting down",
        "error_type": "unavailable",
    }
    assert engine.cancel_seen.wait(timeout=5)


SERVER_SCRIPT = """
import asyncio, sys
from tests.factories import tiny_tokenizer
from tests.server.conftest import make_config
from tests.server.fakes import FakeEngine
from tgis.server import ModelInfo, create_app, serve

tokenizer = tiny_tokenizer()
config = make_config()
app = create_app(FakeEngine(tokenizer, delay=0.02), tokenizer, config, ModelInfo.from_config(config))
asyncio.run(serve(app, "127.0.0.1", int(sys.argv[1]), shutdown_grace_s=10, log_level="warning"))
"""


# As `tgis serve` runs: the servers on an event loop in a thread of their own, the main thread
# busy the whole time (there, the model's loop), SIGTERM forwarded to the servers.
THREADED_SERVER_SCRIPT = """
import sys, threading
from tests.factories import tiny_tokenizer
from tests.server.conftest import make_config
from tests.server.fakes import FakeEngine
from tgis.server import ModelInfo, create_app, serve
from tgis.server.http.lifecycle import ServerThread

tokenizer = tiny_tokenizer()
config = make_config()
app = create_app(FakeEngine(tokenizer, delay=0.02), tokenizer, config, ModelInfo.from_config(config))
stopped = threading.Event()

async def main(server_ready):
    await serve(app, "127.0.0.1", int(sys.argv[1]), shutdown_grace_s=10, log_level="warning",
                server_ready=server_ready)

http = ServerThread(main, on_exit=stopped.set)
http.start()
while not stopped.wait(0.05):
    pass
http.join()
sys.exit(1 if http.failure else 0)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    "script", [SERVER_SCRIPT, THREADED_SERVER_SCRIPT], ids=["main-thread", "server-thread"]
)
def test_sigterm_drains_in_flight_streams(script: str) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", script, str(port)], cwd=ROOT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 30}}
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=10) as response:
            reader = EventReader(response)
            first = reader.take(1)
            process.send_signal(signal.SIGTERM)
            rest = reader.take(100)
        assert len(first) + len(rest) == 30
        streamed = [json.loads(line[5:]) for line in first + rest]
        assert streamed[-1]["generated_text"] == "".join(e["token"]["text"] for e in streamed)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)


def test_a_server_thread_that_cannot_listen_says_so() -> None:
    tokenizer = tiny_tokenizer()
    config = make_config()
    app = create_app(FakeEngine(tokenizer), tokenizer, config, ModelInfo.from_config(config))
    stopped = threading.Event()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])

        async def main(server_ready: Any) -> None:
            await serve(app, "127.0.0.1", port, log_level="critical", server_ready=server_ready)

        http = ServerThread(main, on_exit=stopped.set)
        http.start()
        assert stopped.wait(30)  # on_exit ran: `tgis serve` stops its engine there
        http.join()
    assert isinstance(http.failure, SystemExit)
