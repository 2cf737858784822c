"""OpenAI tool calling on /v1/chat/completions: with the `openai` client against `tgis serve`'s
app on the demo model (named and required choices, unary and streamed through the client's
stream helper, its Pydantic `parse`, a conversation that returns tool results), and at the
route level over a scripted engine (a model that chooses to call in `auto`, one that writes
text, the chunks of a stream, the 422s)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from tests.server.chat.test_tool_calls import CITY_ONLY
from tests.server.conftest import demo_app, live_server, make_config
from tests.server.fakes import FakeEngine
from tests.server.openai.test_openai_routes import chunks, post
from tgis.server import ModelInfo

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
}
TIME: Any = {"type": "function", "function": {"name": "local_time"}}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(demo_model_dir: Path) -> Iterator[openai.OpenAI]:
    with demo_app(demo_model_dir, 1024) as app, live_server(app) as (base, _):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60, max_retries=0)


def named(name: str) -> Any:
    return {"type": "function", "function": {"name": name}}


def test_a_named_tool_is_called_with_arguments_matching_its_schema(
    client: openai.OpenAI,
) -> None:
    request: Any = {
        "model": "demo",
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "tool_choice": named("get_weather"),
        "max_tokens": 60,
        "temperature": 0,
    }
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, CITY)
    # The stream helper accumulates the deltas into the same message.
    with client.chat.completions.stream(**request) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.role == "assistant"
    assert streamed.message.tool_calls is not None
    (again,) = streamed.message.tool_calls
    assert again.function.name == "get_weather"
    assert json.loads(again.function.arguments) == arguments


def test_required_calls_one_tool_without_parallel_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="demo",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    function = choice.message.tool_calls[0].function  # type: ignore[union-attr]
    assert function.name in ("get_weather", "local_time")
    jsonschema.validate(
        json.loads(function.arguments), CITY if function.name == "get_weather" else {}
    )


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


def test_the_clients_pydantic_tools_parse(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(GetWeather)
    reply = client.chat.completions.parse(
        model="demo",
        messages=ASK,
        tools=[tool],
        tool_choice=named("GetWeather"),
        max_tokens=60,
        temperature=0,
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert call.function.parsed_arguments.unit in ("celsius", "fahrenheit")


def test_tool_results_go_back_to_the_model(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="demo",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls or []
    conversation: Any = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"},
    ]
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(
            model="demo",
            messages=conversation,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=12,
            temperature=0,
        )
        answer = reply.choices[0]
        # The demo model writes code, not calls: in auto it chooses text.
        assert answer.message.tool_calls is None
        assert answer.message.content
        assert answer.finish_reason in ("stop", "length")


# --- the routes, over a scripted engine ----------------------------------------------------

CALLS = '[{"name":"get_weather","arguments":{"city":"Rome","unit":"celsius"}}]'


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Any:
    """The demo model's tokenizer (the HTTP tests' tiny one has no brackets)."""
    return AutoTokenizer.from_pretrained(demo_model_dir)


def roomy(make_app: Any, tokenizer: Any, **kwargs: Any) -> Any:
    """An app whose limits fit the tool definitions."""
    config = make_config(
        max_input_tokens=1000, max_total_tokens=1100, max_batch_prefill_tokens=1100
    )
    info = ModelInfo.from_config(config)
    return make_app(config=config, model_info=info, tokenizer=tokenizer, **kwargs)


def scripted(tokenizer: Any, script: str) -> FakeEngine:
    """An engine that writes `script` and then ends with EOS."""
    engine = FakeEngine(tokenizer, script=script)
    engine.eos_after = len(engine.script_ids)
    return engine


def test_auto_returns_the_calls_a_model_writes(make_app: Any, tokenizer: Any) -> None:
    engine = scripted(tokenizer, CALLS)
    with TestClient(roomy(make_app, tokenizer, engine=engine)) as http:
        body = post(http, "/v1/chat/completions", messages=ASK, tools=[WEATHER], max_tokens=200)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {
            "name": "get_weather",
            "arguments": '{"city":"Rome","unit":"celsius"}',
        }
        response = http.post(
            "/v1/chat/completions",
            json={"messages": ASK, "tools": [WEATHER], "max_tokens": 200, "stream": True},
        )
    got = [c["choices"][0] for c in chunks(response.text)]
    assert got[0]["delta"] == {"role": "assistant", "content": None}
    assert all("role" not in c["delta"] for c in got[1:])
    head = got[1]["delta"]["tool_calls"][0]
    assert head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [c["delta"]["tool_calls"][0] for c in got[2:] if c["delta"]]
    assert all(set(f) == {"index", "function"} for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == call["function"]["arguments"]
    assert [c["finish_reason"] for c in got] == [None] * (len(got) - 1) + ["tool_calls"]
    # The grammar the engine was given allows text or calls of the offered tools.
    grammar = engine.requests[-1].params.grammar
    assert grammar is not None and grammar.kind == "lark" and "get_weather" in grammar.value


def test_auto_text_stays_content(make_app: Any, tokenizer: Any) -> None:
    engine = scripted(tokenizer, "sunny, 22 degrees [celsius]")
    text = tokenizer.decode(engine.script_ids)
    with TestClient(roomy(make_app, tokenizer, engine=engine)) as http:
        body = post(http, "/v1/chat/completions", messages=ASK, tools=[WEATHER], max_tokens=200)
        response = http.post(
            "/v1/chat/completions",
            json={"messages": ASK, "tools": [WEATHER], "max_tokens": 200, "stream": True},
        )
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == "stop"
    got = [c["choices"][0] for c in chunks(response.text)]
    assert "".join(c["delta"].get("content") or "" for c in got) == text
    assert got[-1]["finish_reason"] == "stop"


def test_tool_choice_none_leaves_the_output_free(make_app: Any, tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with TestClient(roomy(make_app, tokenizer, engine=engine)) as http:
        body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4}
        post(http, "/v1/chat/completions", **body)
    assert engine.requests[-1].params.grammar is None


@pytest.fixture
def client_app(make_app: Any, tokenizer: Any, engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(roomy(make_app, tokenizer, engine=FakeEngine(tokenizer))) as http:
        yield http


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "required"}, "`tool_choice` is only allowed when `tools` are given"),
        (
            {"tools": [WEATHER], "response_format": {"type": "json_object"}},
            "`response_format` cannot be combined with `tools`",
        ),
        ({"tools": [WEATHER], "min_tokens": 2}, "cannot be combined with `ignore_eos`"),
        (
            {"tools": [WEATHER], "tool_choice": named("local_time")},
            "`tool_choice.function.name` must be one of the `tools` (get_weather)",
        ),
        (
            {"tools": [{**TIME, "function": {"name": "t", "parameters": {"type": "strng"}}}]},
            "`tools[0].function.parameters` must be a JSON schema of an object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "t", "parameters": {"minProperties": "x"}},
                    }
                ]
            },
            "`tools` is not a usable",
        ),
    ],
)
def test_unusable_tool_requests_are_422s(
    client_app: TestClient, body: dict[str, Any], message: str
) -> None:
    error = post(client_app, "/v1/chat/completions", 422, messages=ASK, max_tokens=4, **body)
    assert message in error["error"]["message"]


def test_sampled_arguments_hold_to_the_schema_that_does_not_forbid_other_keys(
    client: openai.OpenAI,
) -> None:
    """The schema does not say additionalProperties: false; 20 sampled calls still name no
    key of their own (strict, as OpenAI's strict mode and xgrammar's): each is Paris or Rome."""
    for seed in range(20):
        reply = client.chat.completions.create(
            model="demo",
            messages=ASK,
            tools=[CITY_ONLY],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            max_tokens=300,
            seed=seed,
        )
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
        assert arguments in ({"city": "Paris"}, {"city": "Rome"})
