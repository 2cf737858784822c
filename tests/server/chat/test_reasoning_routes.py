"""Reasoning and model-native tool calls on /v1/chat/completions, with the `openai` client
against a live server: a Qwen3-style template that opens a `<think>` block and renders tools
in Hermes's `<tool_call>` format, over a scripted engine (what the model writes is known, and
the grammar the route gave the engine must accept it), then over the demo model's real engine
(the grammar holds it to Hermes's format)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance as llg
import llguidance.hf
import openai
import pytest
from openai.lib.streaming._deltas import accumulate_delta
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from tests.server.conftest import QWEN3_STYLE, demo_app, live_server, make_config
from tests.server.fakes import FakeEngine
from tgis.server import ModelInfo, create_app

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
}
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "The user asks about Paris.\nI should call get_weather."
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SCRIPT = f"{THOUGHT}\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>"


def scripted(tokenizer: Any, script: str) -> FakeEngine:
    engine = FakeEngine(tokenizer, script=script)
    engine.eos_after = len(engine.script_ids)
    return engine


@pytest.fixture
def served(qwen3_tokenizer: Any) -> Iterator[tuple[openai.OpenAI, FakeEngine, TestClient]]:
    engine = scripted(qwen3_tokenizer, SCRIPT)
    config = make_config(max_input_tokens=400, max_total_tokens=600, max_batch_prefill_tokens=600)
    app = create_app(engine, qwen3_tokenizer, config, ModelInfo.from_config(config))
    with live_server(app) as (base, _), TestClient(app) as test_client:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=30, max_retries=0)
        yield client, engine, test_client


def grammar_accepts(tokenizer: Any, engine: FakeEngine, text: str) -> bool:
    """Whether the grammar the route gave the engine lets a model write `text`, then end."""
    spec = engine.requests[-1].params.grammar
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[2])
    matcher = llg.LLMatcher(ll, spec.grammar(), log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_reasoning_and_a_native_tool_call_come_back_apart(
    served: tuple[openai.OpenAI, FakeEngine, TestClient], qwen3_tokenizer: Any
) -> None:
    client, engine, _ = served
    reply = client.chat.completions.create(
        model="tgi", messages=ASK, tools=[WEATHER], max_tokens=200
    )
    choice = reply.choices[0]
    message: Any = choice.message
    assert message.reasoning_content == THOUGHT and message.reasoning == THOUGHT
    assert message.content is None
    assert choice.finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The template got the tools and opened the block; no instruction of tgis's was added.
    prompt = qwen3_tokenizer.decode(engine.requests[-1].input_ids)
    assert '"name": "get_weather"' in prompt and prompt.endswith("<think>\n")
    assert "To call tools" not in prompt
    # The grammar the engine got lets the model write exactly this, and not a bare call.
    assert grammar_accepts(qwen3_tokenizer, engine, SCRIPT)
    assert not grammar_accepts(qwen3_tokenizer, engine, f"<tool_call>\n{CALL}\n</tool_call>")
    assert not grammar_accepts(qwen3_tokenizer, engine, SCRIPT.replace("Paris", "Paris, France!"))


def test_the_stream_sends_reasoning_first_and_adds_up_to_the_message(
    served: tuple[openai.OpenAI, FakeEngine, TestClient],
) -> None:
    client = served[0]
    stream = client.chat.completions.create(
        model="tgi", messages=ASK, tools=[WEATHER], max_tokens=200, stream=True
    )
    message: dict[Any, Any] = {}
    order = []
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta.model_dump(exclude_none=True)
        message = accumulate_delta(message, delta)  # type: ignore[arg-type]
        order += [k for k in ("reasoning_content", "tool_calls") if k in delta]
        finish = chunk.choices[0].finish_reason or finish
    assert message["reasoning_content"] == THOUGHT == message["reasoning"]
    first_call = order.index("tool_calls")
    assert first_call > 0 and "reasoning_content" not in order[first_call:]  # reasoning first
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert finish == "tool_calls"
    # The client's own stream helper gets the same calls.
    with client.chat.completions.stream(
        model="tgi", messages=ASK, tools=[WEATHER], max_tokens=200
    ) as helper:
        for _ in helper:
            pass
        final = helper.get_final_completion().choices[0].message
    assert final.tool_calls is not None
    assert final.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_include_reasoning_false_leaves_it_out(
    served: tuple[openai.OpenAI, FakeEngine, TestClient],
) -> None:
    client = served[0]
    reply = client.chat.completions.create(
        model="tgi",
        messages=ASK,
        tools=[WEATHER],
        max_tokens=200,
        extra_body={"include_reasoning": False},
    )
    message: Any = reply.choices[0].message
    assert message.reasoning_content is None and message.reasoning is None
    assert message.tool_calls[0].function.name == "get_weather"
    stream = client.chat.completions.create(
        model="tgi",
        messages=ASK,
        max_tokens=200,
        stream=True,
        extra_body={"include_reasoning": False},
    )
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in stream if c.choices]
    assert not any("reasoning_content" in d for d in deltas)
    # Without tools, what follows the block is the content.
    content = "".join(d.get("content", "") for d in deltas)
    assert content == f"<tool_call>\n{CALL}\n</tool_call>"


def test_chat_template_kwargs_reach_the_template(
    qwen3_tokenizer: Any, served: tuple[openai.OpenAI, FakeEngine, TestClient]
) -> None:
    client, engine, _ = served
    engine.script_ids = list(qwen3_tokenizer.encode("It is sunny.", add_special_tokens=False))
    engine.eos_after = len(engine.script_ids)
    reply = client.chat.completions.create(
        model="tgi",
        messages=ASK,
        max_tokens=50,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    prompt = qwen3_tokenizer.decode(engine.requests[-1].input_ids)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    message: Any = reply.choices[0].message
    assert message.content == "It is sunny." and message.reasoning_content is None
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"chat_template_kwargs": {"tools": []}}, "`chat_template_kwargs.tools` is set by the"),
        ({"chat_template_kwargs": [1]}, "`chat_template_kwargs` must be an object"),
        ({"reasoning_effort": "max"}, "`reasoning_effort` must be one of minimal, low, medium"),
        ({"include_reasoning": "yes"}, "include_reasoning"),
    ],
)
def test_bad_reasoning_fields_are_refused_by_name(
    served: tuple[openai.OpenAI, FakeEngine, TestClient], extra: Any, message: str
) -> None:
    response = served[2].post("/v1/chat/completions", json={"messages": ASK, **extra})
    assert response.status_code == 422, response.text
    assert message in response.json()["error"]["message"]


def test_the_model_without_markers_is_untouched(demo_model_dir: Path) -> None:
    """The demo model's template has no reasoning: no reasoning fields, text as generated."""
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    engine = scripted(tok, "<think>x</think>y")
    config = make_config()
    app = create_app(engine, tok, config, ModelInfo.from_config(config))
    with TestClient(app) as test_client:
        body = test_client.post(
            "/v1/chat/completions", json={"messages": ASK, "max_tokens": 40}
        ).json()
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>x</think>y"}


@pytest.fixture(scope="module")
def qwen3_model(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with the Qwen3-style template."""
    directory = tmp_path_factory.mktemp("qwen3-style")
    shutil.copytree(demo_model_dir, directory, dirs_exist_ok=True)
    (directory / "chat_template.jinja").write_text(QWEN3_STYLE)
    return directory


def test_the_real_engine_calls_in_hermes_format(qwen3_model: Path) -> None:
    """The grammar holds a random model to `<tool_call>` JSON that the parser reads back."""
    with demo_app(qwen3_model, 1024) as app, live_server(app) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60, max_retries=0)
        request: Any = {
            "model": "tgi",
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 80,
            "temperature": 0,
            "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
        }
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), CITY)  # type: ignore[union-attr]
        stream = client.chat.completions.create(**request, stream=True)
        message: dict[Any, Any] = {}
        for chunk in stream:
            delta = chunk.choices[0].delta.model_dump(exclude_none=True)
            message = accumulate_delta(message, delta)  # type: ignore[arg-type]
        assert message["tool_calls"][0]["function"] == call.function.model_dump()
