"""Stream parsing of BenchmarkClient on canned answers (httpx.MockTransport, no server)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tgis.benchmark.client import BenchmarkClient, RequestRecord
from tgis.benchmark.prompts import Turn


def send(api: str, events: list[Any]) -> RequestRecord:
    """The record of one request answered with `events` (objects become `data:` JSON)."""
    lines = [e if isinstance(e, str) else json.dumps(e) for e in events]
    body = "".join(f"data: {line}\n\n" for line in lines).encode()

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestRecord:
        client = BenchmarkClient(
            "http://test",
            api=api,
            transport=httpx.MockTransport(answer),  # type: ignore[arg-type]
        )
        try:
            return await client.send(Turn("hi", 1, 8))
        finally:
            await client.aclose()

    return asyncio.run(go())


def chat(content: Any, usage: Any = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}}], "usage": usage}


def test_openai_usage_overrides_the_chunk_count() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    events = [chat(""), chat("ab"), chat("cd"), {"choices": [], "usage": usage}, "[DONE]"]
    record = send("openai-chat", events)
    assert record.ok and record.text == "abcd"
    assert len(record.token_times) == 2  # the empty role chunk is not a token
    assert record.output_tokens == 5 and record.prompt_tokens == 3


def test_tgi_special_tokens_count_but_add_no_text() -> None:
    token = {"id": 1, "text": "x", "logprob": 0.0, "special": False}
    eos = {"id": 2, "text": "</s>", "logprob": 0.0, "special": True}
    events = [
        {"token": token, "generated_text": None},
        {"token": eos, "generated_text": "x"},
        {"token": token, "generated_text": None},  # after the final event: never read
    ]
    record = send("tgi", events)
    assert record.ok and record.output_tokens == 2 and record.text == "x"
    assert record.special_tokens == 1


def test_openai_finish_reason_is_recorded_from_the_chunks() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    events = [chat("ab"), chat("cd"), last, {"choices": [], "usage": usage}, "[DONE]"]
    record = send("openai-chat", events)
    assert record.ok and record.finish_reason == "stop" and record.output_tokens == 3
    assert record.special_tokens == 0
    cut = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    completion = send("openai-completions", [{"choices": [{"text": "a"}]}, cut, "[DONE]"])
    assert completion.finish_reason == "length" and completion.output_tokens == 1


@pytest.mark.parametrize(
    ("api", "events"),
    [
        ("tgi", [{"token": "a"}]),
        ("tgi", [[1, 2]]),
        ("openai-chat", [chat(5)]),
        ("openai-chat", [chat("a", usage={"completion_tokens": "many"}), "[DONE]"]),
        ("openai-chat", [{"id": "no choices"}]),
        ("openai-completions", [{"choices": ["a"]}]),
    ],
)
def test_wrong_shapes_are_malformed(api: str, events: list[Any]) -> None:
    record = send(api, events)
    assert record.error == "malformed", record


def test_requests_go_through_the_adapters_in_turn() -> None:
    turn = Turn("hi", 1, 8)
    tgi = BenchmarkClient("http://test", api="tgi", adapters=("", "a", "b"))
    chat_client = BenchmarkClient("http://test", api="openai-chat", model="m", adapters=("a", ""))
    try:
        ids = [tgi.body(turn, ())["parameters"].get("adapter_id") for _ in range(4)]
        assert ids == [None, "a", "b", None]
        assert [chat_client.body(turn, ())["model"] for _ in range(3)] == ["a", "m", "a"]
        plain = BenchmarkClient("http://test", api="tgi")
        assert "adapter_id" not in plain.body(turn, ())["parameters"]
    finally:
        for client in (tgi, chat_client, plain):
            asyncio.run(client.aclose())
