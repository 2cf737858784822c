"""Stream parsing of BenchmarkClient on canned answers (httpx.MockTransport, no server), and
the bodies it sends: images as TGI's markdown images or OpenAI chat's image_url parts."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from tests.benchmark.conftest import open_data_url
from tgis.benchmark.client import BenchmarkClient, RequestRecord
from tgis.benchmark.images import data_url, make_image
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


IMAGES = (
    data_url(make_image(40, 20, seed=0, index=0), "png"),
    data_url(make_image(12, 30, seed=0, index=1), "jpeg"),
)
TGI_TOKEN = {"id": 1, "text": "ok", "special": False}
TGI_DETAILS = {"finish_reason": "length", "generated_tokens": 1, "input_length": 97}
USAGE = {"prompt_tokens": 95, "completion_tokens": 1}
# One-token answers whose final event gives the prompt's length: 97 (TGI), 95 (OpenAI).
FINAL: dict[str, list[Any]] = {
    "tgi": [{"token": TGI_TOKEN, "generated_text": "ok", "details": TGI_DETAILS}],
    "openai-chat": [chat("ok"), {"choices": [], "usage": USAGE}, "[DONE]"],
}


def sent(
    api: str, turn: Turn, history: list[tuple[Turn, RequestRecord]] | None = None
) -> tuple[dict[str, Any], RequestRecord]:
    """The JSON body one request sent over the wire, and its record."""
    bodies: list[dict[str, Any]] = []
    stream = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in FINAL[api])

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=stream.encode())

    async def go() -> RequestRecord:
        transport = httpx.MockTransport(answer)
        client = BenchmarkClient("http://test", api=api, transport=transport)  # type: ignore[arg-type]
        try:
            return await client.send(turn, history or [])
        finally:
            await client.aclose()

    record = asyncio.run(go())
    assert len(bodies) == 1
    return bodies[0], record


def check_images(urls: list[str]) -> None:
    """The URLs are the turn's images: a 40x20 PNG, then a 12x30 JPEG."""
    assert urls == list(IMAGES)
    assert [open_data_url(u)[0] for u in urls] == ["image/png", "image/jpeg"]
    assert [open_data_url(u)[1].format for u in urls] == ["PNG", "JPEG"]
    assert [open_data_url(u)[1].size for u in urls] == [(40, 20), (12, 30)]


def test_tgi_sends_markdown_images_before_the_text_and_reads_the_prompts_length() -> None:
    body, record = sent("tgi", Turn("What is it?", 4, 8, IMAGES))
    inputs = body["inputs"]
    assert inputs.endswith(")What is it?")
    found = re.findall(r"!\[\]\((data:[^)]+)\)", inputs)
    check_images(found)
    assert inputs == "".join(f"![]({u})" for u in found) + "What is it?"
    assert body["parameters"] == {"max_new_tokens": 8, "details": True}
    assert record.ok and record.prompt_tokens == 97  # the server's count: image tokens too


def test_openai_chat_sends_image_url_parts_then_the_text() -> None:
    body, record = sent("openai-chat", Turn("What is it?", 4, 8, IMAGES))
    (message,) = body["messages"]
    assert message["role"] == "user"
    *images, text = message["content"]
    assert text == {"type": "text", "text": "What is it?"}
    assert all(
        part["type"] == "image_url" and set(part) == {"type", "image_url"} for part in images
    )
    check_images([part["image_url"]["url"] for part in images])
    assert record.ok and record.prompt_tokens == 95  # usage.prompt_tokens


def test_later_turns_resend_the_first_turns_images_as_history() -> None:
    first, second = Turn("Look.", 2, 4, IMAGES), Turn(" And now?", 3, 4)
    answer = RequestRecord(0.0, 2, 4, output_tokens=1, text=" A dog.")
    history = [(first, answer)]
    body, record = sent("tgi", second, history)
    markdown = "".join(f"![]({u})" for u in IMAGES)
    assert body["inputs"] == markdown + "Look. A dog. And now?"
    assert body["parameters"]["details"] is True and record.prompt_tokens == 97
    body, _ = sent("openai-chat", second, history)
    user, assistant, last = body["messages"]
    check_images([p["image_url"]["url"] for p in user["content"][:-1]])
    assert user["content"][-1] == {"type": "text", "text": "Look."}
    assert assistant == {"role": "assistant", "content": " A dog."}
    assert last == {"role": "user", "content": " And now?"}


def test_text_turns_keep_their_plain_bodies() -> None:
    body, record = sent("tgi", Turn("hi", 1, 8))
    assert body == {"inputs": "hi", "parameters": {"max_new_tokens": 8}}
    assert record.prompt_tokens == 97  # a final event's input_length is used when sent
    body, _ = sent("openai-chat", Turn("hi", 1, 8))
    assert body["messages"] == [{"role": "user", "content": "hi"}]


def test_the_completions_api_cannot_carry_images() -> None:
    client = BenchmarkClient("http://test", api="openai-completions")
    try:
        with pytest.raises(ValueError, match="completions API takes text only"):
            client.body(Turn("hi", 1, 8, IMAGES), ())
        with pytest.raises(ValueError, match="completions API takes text only"):
            client.body(Turn("more", 1, 8), [(Turn("hi", 1, 8, IMAGES), RequestRecord(0, 1, 8))])
        assert client.body(Turn("hi", 1, 8), ())["prompt"] == "hi"
    finally:
        asyncio.run(client.aclose())
