"""POST /v1/responses with the `openai` client's `responses.create`, unary and streamed, against
a live server over a scripted engine: plain text, reasoning and a Hermes tool call read from a
Qwen3-style template's output, the event sequence, `previous_response_id` over the bounded
store (and its 404s), `text.format`, and the refusals by field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from tests.server.chat.test_reasoning_routes import CITY, SCRIPT, THOUGHT, scripted
from tests.server.conftest import live_server, make_config
from tests.server.fakes import FakeEngine
from tgis.server import ModelInfo, create_app

TOOL: Any = {"type": "function", "name": "get_weather", "parameters": CITY}


@contextmanager
def serving(
    tokenizer: Any, script: str, **config: Any
) -> Iterator[tuple[openai.OpenAI, FakeEngine, TestClient]]:
    engine = scripted(tokenizer, script)
    limits = {"max_input_tokens": 400, "max_total_tokens": 600, "max_batch_prefill_tokens": 600}
    settings = make_config(**{**limits, **config})
    app = create_app(engine, tokenizer, settings, ModelInfo.from_config(settings))
    with live_server(app) as (base, _), TestClient(app) as test_client:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=30, max_retries=0)
        yield client, engine, test_client


@pytest.fixture
def qwen3(qwen3_tokenizer: Any) -> Iterator[tuple[openai.OpenAI, FakeEngine, TestClient]]:
    with serving(qwen3_tokenizer, SCRIPT) as served:
        yield served


def prompt_of(tokenizer: Any, engine: FakeEngine) -> str:
    return str(tokenizer.decode(engine.requests[-1].input_ids))


def test_reasoning_and_a_tool_call_are_output_items(
    qwen3: tuple[openai.OpenAI, FakeEngine, TestClient], qwen3_tokenizer: Any
) -> None:
    client, engine, _ = qwen3
    response = client.responses.create(
        model="tgi", input="Weather in Paris?", instructions="Be brief.", tools=[TOOL]
    )
    assert response.status == "completed" and response.object == "response"
    reasoning, call = response.output
    assert reasoning.type == "reasoning"
    assert reasoning.content is not None and reasoning.content[0].text == THOUGHT
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_")
    assert (
        response.usage is not None and response.usage.output_tokens == len(engine.script_ids) + 1
    )  # and EOS
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    prompt = prompt_of(qwen3_tokenizer, engine)
    assert prompt.startswith("<|im_start|>system\n# Tools") and "Be brief." in prompt
    assert response.instructions == "Be brief."


def test_the_stream_is_the_responses_event_sequence(
    qwen3: tuple[openai.OpenAI, FakeEngine, TestClient],
) -> None:
    client = qwen3[0]
    events = list(client.responses.create(input="Weather in Paris?", tools=[TOOL], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert reasoning == THOUGHT and json.loads(arguments) == {"city": "Paris"}
    done = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final.output]
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [i.id for i in final.output]
    # The client's stream helper gets the same final response.
    with client.responses.stream(model="tgi", input="Weather in Paris?", tools=[TOOL]) as stream:
        for _ in stream:
            pass
        helped = stream.get_final_response()
    assert [i.type for i in helped.output] == ["reasoning", "function_call"]


def test_previous_response_id_continues_the_conversation(
    qwen3: tuple[openai.OpenAI, FakeEngine, TestClient], qwen3_tokenizer: Any
) -> None:
    client, engine, _ = qwen3
    first = client.responses.create(input="Weather in Paris?", tools=[TOOL])
    call = first.output[1]
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}
    second = client.responses.create(previous_response_id=first.id, input=[result], tools=[TOOL])
    prompt = prompt_of(qwen3_tokenizer, engine)
    assert "Weather in Paris?" in prompt  # the first request's input
    assert '"arguments": {"city": "Paris"}' in prompt  # the call it made
    assert "<|im_start|>tool\n22 C" in prompt  # and this request's result
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).id == second.id


def test_an_unknown_or_dropped_id_is_a_404(demo_tokenizer: Any) -> None:
    with serving(demo_tokenizer, "Sunny.", max_stored_responses=1) as (client, _, _):
        first = client.responses.create(input="a")
        second = client.responses.create(input="b", previous_response_id=first.id)
        assert second.output_text == "Sunny."
        client.responses.create(input="c")  # the store keeps one: `first` and `second` go
        for missing in (first.id, "resp_unknown"):
            with pytest.raises(openai.NotFoundError, match="--max-stored-responses"):
                client.responses.create(input="d", previous_response_id=missing)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(second.id)
    with serving(demo_tokenizer, "Sunny.", max_stored_responses=0) as (client, _, test):
        assert client.responses.create(input="a").store is False
        refused = test.post("/v1/responses", json={"input": "a", "store": True})
        assert refused.status_code == 422 and "--max-stored-responses 0" in refused.text


def test_plain_text_and_max_output_tokens(demo_tokenizer: Any) -> None:
    with serving(demo_tokenizer, "It is sunny in Paris today.") as (client, engine, _):
        whole = client.responses.create(input="Weather?", temperature=0)
        assert whole.output_text == "It is sunny in Paris today." and whole.status == "completed"
        assert whole.output[0].type == "message"
        cut = client.responses.create(input="Weather?", max_output_tokens=2)
        assert cut.status == "incomplete"
        assert cut.incomplete_details is not None
        assert cut.incomplete_details.reason == "max_output_tokens"
        assert engine.requests[-1].params.max_new_tokens == 2
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        client.responses.create(
            input="JSON please",
            text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
        )
        grammar = engine.requests[-1].params.grammar
        assert grammar is not None and grammar.source == "text.format"
        assert json.loads(grammar.value) == schema


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": "a", "tools": [{"type": "web_search"}]}, "`tools[0].type` 'web_search'"),
        ({"input": "a", "background": True}, "`background`"),
        ({"input": [{"type": "input_image"}]}, "`input[0].type` 'input_image'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "content[0].type"),
        ({"input": [{"type": "reasoning"}]}, "`input` has no message to answer"),
        ({"input": "a", "reasoning": {"summary": "auto"}}, "`reasoning.summary`"),
        ({"input": "a", "text": {"format": {"type": "json_schema"}}}, "`text.format.schema`"),
        ({"input": "a", "tools": [TOOL], "text": {"format": {"type": "json_object"}}}, "both"),
        ({}, "`input` must be a string"),
    ],
)
def test_bad_fields_are_refused_by_name(
    demo_tokenizer: Any, body: dict[str, Any], message: str
) -> None:
    with serving(demo_tokenizer, "x") as (_, _, test):
        response = test.post("/v1/responses", json=body)
    assert response.status_code == 422, response.text
    assert message in response.json()["error"]["message"]


def test_the_api_key_guards_the_route_and_metrics_count_it(demo_tokenizer: Any) -> None:
    engine = scripted(demo_tokenizer, "Sunny.")
    settings = make_config()
    app = create_app(engine, demo_tokenizer, settings, ModelInfo.from_config(settings), api_key="k")
    with live_server(app) as (base, _):
        wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=30, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.responses.create(model="tgi", input="a")
        right = openai.OpenAI(base_url=f"{base}/v1", api_key="k", timeout=30, max_retries=0)
        assert right.responses.create(model="tgi", input="a").output_text == "Sunny."
        metrics = TestClient(app).get("/metrics").text
    assert 'tgi_request_success{stop_reason="EOS_TOKEN",kind="single"} 1.0' in metrics
