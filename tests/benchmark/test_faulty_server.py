"""A deliberately faulty server: every fault becomes an error record, and no step hangs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.server.conftest import live_server
from tgis.benchmark.client import BenchmarkClient
from tgis.benchmark.load import StepWindow, run_rate, run_throughput
from tgis.benchmark.metrics import summarize
from tgis.benchmark.prompts import Session, Turn

TOKEN = {"id": 5, "text": "a", "logprob": -0.1, "special": False}
SESSIONS = [Session((Turn("hello", 1, 4), Turn(" again", 1, 4)))]


def tgi_event(final: bool = False) -> str:
    return (
        "data:" + json.dumps({"token": TOKEN, "generated_text": "aa" if final else None}) + "\n\n"
    )


def chunk(path: str) -> str:
    """One token event of the API at `path`."""
    if path == "/generate_stream":
        return tgi_event()
    choice: dict[str, Any] = {"index": 0, "finish_reason": None}
    if path == "/v1/completions":
        choice["text"] = "a"
    else:
        choice["delta"] = {"content": "a"}
    return "data: " + json.dumps({"choices": [choice]}) + "\n\n"


async def stall(request: Request) -> None:
    """Send nothing for 30 s, or until the client leaves (so the server can stop at once)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not await request.is_disconnected():
        await asyncio.sleep(0.05)


async def faulty_stream(mode: str, request: Request) -> AsyncIterator[str]:
    openai = request.url.path.startswith("/v1/")
    yield chunk(request.url.path)
    if mode == "stall":
        await stall(request)
    elif mode == "trickle":  # a token every 0.1 s, never finishing
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)
            yield chunk(request.url.path)
    elif mode == "malformed":
        yield "data: {not json\n\n"
    elif mode == "error_event":
        yield 'data: {"error": "out of memory", "error_type": "generation"}\n\n'
    elif mode == "abort":
        raise RuntimeError("the server dies mid-stream")  # uvicorn drops the connection
    elif mode == "ok":
        yield "data: [DONE]\n\n" if openai else tgi_event(final=True)
    elif mode == "finish_no_done":  # transformers serve 5.x: a finish reason, then the end
        choice = {"index": 0, "finish_reason": "length", "delta": {}}
        yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
    # "close": the stream ends without its final event


def faulty_app(mode: dict[str, str]) -> Starlette:
    """TGI and OpenAI streaming routes whose behaviour `mode["value"]` picks."""

    async def handle(request: Request) -> Response:
        value = mode["value"]
        if value == "500":
            return JSONResponse({"error": "boom", "error_type": "internal"}, status_code=500)
        if value == "slow_headers":
            await stall(request)
        return StreamingResponse(faulty_stream(value, request), media_type="text/event-stream")

    routes = [
        Route(path, handle, methods=["POST"])
        for path in ("/generate_stream", "/v1/chat/completions", "/v1/completions")
    ]
    return Starlette(routes=routes)


@pytest.fixture(scope="module")
def faulty() -> Iterator[tuple[str, dict[str, str]]]:
    mode = {"value": "ok"}
    with live_server(faulty_app(mode), shutdown_grace_s=0.2) as (url, _):
        yield url, mode


def one_request(url: str, api: str) -> Any:
    async def go() -> Any:
        # Generous enough for a loaded machine to connect and answer (a stall is 1 s of
        # silence), short enough that every case ends within a few seconds.
        client = BenchmarkClient(url, api=api, request_timeout=2.0, stall_timeout=1.0)  # type: ignore[arg-type]
        try:
            return await client.send(Turn("hello", 1, 4))
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize("api", ["tgi", "openai-chat"])
@pytest.mark.parametrize(
    ("mode", "error", "tokens"),
    [
        ("ok", None, 2),
        ("500", "http_500", 0),
        ("stall", "timeout", 1),
        ("slow_headers", "timeout", 0),
        ("close", "stream_closed", 1),
        ("abort", "stream_closed", 1),
        ("malformed", "malformed", 1),
        ("error_event", "server_error", 1),
    ],
)
def test_each_fault_is_one_error_kind(
    faulty: tuple[str, dict[str, str]], api: str, mode: str, error: str | None, tokens: int
) -> None:
    url, state = faulty
    state["value"] = mode
    record = one_request(url, api)  # a stall of 30 s ends as `timeout` only by stall_timeout
    assert record.error == error, record.error_message
    expected = 1 if api == "openai-chat" and mode == "ok" else tokens  # [DONE] carries no token
    assert len(record.token_times) == expected
    assert record.end >= record.start
    if mode == "500":
        assert "boom" in record.error_message


def test_an_openai_stream_that_ends_after_its_finish_reason_is_complete(
    faulty: tuple[str, dict[str, str]],
) -> None:
    """No `[DONE]` after the chunk with the finish reason: complete, as the openai client
    reads it; a stream that ends before any finish reason stays `stream_closed` (above)."""
    url, state = faulty
    state["value"] = "finish_no_done"
    record = one_request(url, "openai-chat")
    assert record.error is None and record.finish_reason == "length"


@pytest.mark.parametrize("api", ["tgi", "openai-completions"])
def test_a_request_past_its_total_timeout(faulty: tuple[str, dict[str, str]], api: str) -> None:
    url, state = faulty
    state["value"] = "trickle"  # never stalls long enough for stall_timeout
    began = time.perf_counter()
    record = one_request(url, api)  # the trickle never ends: only the total timeout ends it
    assert time.perf_counter() - began >= 2.0
    assert record.error == "timeout"
    assert len(record.token_times) >= 10


def test_unreachable_server() -> None:
    record = one_request("http://127.0.0.1:9", "tgi")
    assert record.error == "connection"


def test_a_stalling_server_does_not_hang_a_step(faulty: tuple[str, dict[str, str]]) -> None:
    url, state = faulty
    state["value"] = "stall"

    async def go() -> Any:
        # The request timeout outlasts the server's 30 s stall: a stall the client missed
        # would end as `stream_closed`, not `timeout`.
        client = BenchmarkClient(url, api="tgi", request_timeout=60.0, stall_timeout=0.2)
        try:
            return await run_throughput(client, SESSIONS, 4, StepWindow(60, max_requests=4))
        finally:
            await client.aclose()

    step = asyncio.run(go())
    summary = summarize(step)
    assert summary["requests"]["ok"] == 0
    assert summary["errors"] == {"timeout": 4} and summary["requests"]["total"] == 4
    # A failed turn ends its conversation: the second turn was never sent.
    assert all(r.turn == 0 for r in step.records)


def test_errors_are_counted_by_kind(faulty: tuple[str, dict[str, str]]) -> None:
    url, state = faulty
    state["value"] = "500"

    async def go() -> Any:
        client = BenchmarkClient(url, api="tgi")
        try:
            return await run_rate(client, SESSIONS, 50.0, StepWindow(60, max_requests=8))
        finally:
            await client.aclose()

    summary = summarize(asyncio.run(go()), {"ttft": 1.0})
    assert summary["errors"] == {"http_500": 8} and summary["requests"]["total"] == 8
    assert summary["goodput"]["requests"] == 0 and summary["ttft_s"] is None


def test_cancelling_a_step_cancels_its_requests(faulty: tuple[str, dict[str, str]]) -> None:
    url, state = faulty
    state["value"] = "stall"

    async def go() -> None:
        client = BenchmarkClient(url, api="tgi", request_timeout=60, stall_timeout=60)
        try:
            task = asyncio.ensure_future(run_rate(client, SESSIONS, 50.0, StepWindow(10)))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Nothing the step started is left running.
            assert asyncio.all_tasks() == {asyncio.current_task()}
        finally:
            await client.aclose()

    asyncio.run(go())
