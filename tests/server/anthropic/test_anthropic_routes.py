"""POST /v1/messages with the `anthropic` client's `messages.create` and `messages.stream`,
against a live server over a scripted engine (a Qwen3-style template: an opened `<think>`,
Hermes tool calls) and over the demo model's real engine: thinking and tool_use blocks, the
event sequence, stop reasons, tool results and prefills in the prompt, `thinking` reaching the
template and the engine's budget, count_tokens, `x-api-key`, and Anthropic's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest
from starlette.testclient import TestClient

from tests.server.chat.test_reasoning_routes import (
    CITY,
    SCRIPT,
    THOUGHT,
    grammar_accepts,
    qwen3_model,
    scripted,
)
from tests.server.conftest import demo_app, live_server, make_config
from tests.server.fakes import FakeEngine
from tgis.params import ThinkingBudget
from tgis.server import ModelInfo, create_app

__all__ = ["qwen3_model"]

TOOL: Any = {"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]
Served = tuple[anthropic.Anthropic, FakeEngine, TestClient]


@contextmanager
def serving(tokenizer: Any, script: str, api_key: str | None = None) -> Iterator[Served]:
    engine = scripted(tokenizer, script)
    settings = make_config(max_input_tokens=400, max_total_tokens=600, max_batch_prefill_tokens=600)
    app = create_app(engine, tokenizer, settings, ModelInfo.from_config(settings), api_key=api_key)
    with live_server(app) as (base, _), TestClient(app) as test_client:
        client = anthropic.Anthropic(
            base_url=base, api_key=api_key or "none", timeout=30, max_retries=0
        )
        yield client, engine, test_client


@pytest.fixture
def qwen3(qwen3_tokenizer: Any) -> Iterator[Served]:
    with serving(qwen3_tokenizer, SCRIPT) as served:
        yield served


def prompt_of(tokenizer: Any, engine: FakeEngine) -> str:
    return str(tokenizer.decode(engine.requests[-1].input_ids))


def test_thinking_and_a_tool_call_are_content_blocks(qwen3: Served, qwen3_tokenizer: Any) -> None:
    client, engine, _ = qwen3
    message = client.messages.create(
        model="tgi", max_tokens=200, system="Be brief.", messages=ASK, tools=[TOOL]
    )
    assert message.type == "message" and message.role == "assistant"
    thinking, call = message.content
    assert thinking.type == "thinking" and thinking.thinking == THOUGHT
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.input == {"city": "Paris"}
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert message.usage.output_tokens == len(engine.script_ids) + 1  # and EOS
    prompt = prompt_of(qwen3_tokenizer, engine)
    assert message.usage.input_tokens == len(engine.requests[-1].input_ids)
    assert prompt.startswith("<|im_start|>system\n# Tools") and "Be brief." in prompt
    assert '"name": "get_weather"' in prompt


def test_the_stream_is_anthropics_event_sequence(qwen3: Served) -> None:
    client = qwen3[0]
    whole = client.messages.create(model="tgi", max_tokens=200, messages=ASK, tools=[TOOL])
    with client.messages.stream(model="tgi", max_tokens=200, messages=ASK, tools=[TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    raw = [e for e in events if e.type.startswith("content_block_") or e.type.startswith("message")]
    starts = [e.index for e in raw if e.type == "content_block_start"]
    stops = [e.index for e in raw if e.type == "content_block_stop"]
    assert starts == stops == [0, 1]
    deltas = {e.delta.type for e in raw if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "input_json_delta"}
    # The client's accumulated message equals the unary one, ids aside.
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [
        b.model_dump(exclude={"id"}) for b in whole.content
    ]
    assert (
        final.stop_reason == "tool_use" and final.usage.output_tokens == whole.usage.output_tokens
    )
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_text_stop_sequences_and_max_tokens(demo_tokenizer: Any) -> None:
    with serving(demo_tokenizer, "Hello there, friend. Bye now.") as (client, _, _):
        plain = client.messages.create(model="tgi", max_tokens=100, messages=ASK)
        assert [b.type for b in plain.content] == ["text"]
        assert plain.content[0].text == "Hello there, friend. Bye now."  # type: ignore[union-attr]
        assert plain.stop_reason == "end_turn"
        stopped = client.messages.create(
            model="tgi", max_tokens=100, messages=ASK, stop_sequences=["friend"]
        )
        assert stopped.content[0].text == "Hello there, "  # type: ignore[union-attr]
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "friend")
        cut = client.messages.create(model="tgi", max_tokens=2, messages=ASK)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
        with client.messages.stream(
            model="tgi", max_tokens=100, messages=ASK, stop_sequences=["friend"]
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == "Hello there, "
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "friend")


def test_tool_results_and_past_turns_reach_the_prompt(qwen3: Served, qwen3_tokenizer: Any) -> None:
    client, engine, _ = qwen3
    messages: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I need the tool.", "signature": ""},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]  # fmt: skip
    client.messages.create(model="tgi", max_tokens=200, messages=messages, tools=[TOOL])
    prompt = prompt_of(qwen3_tokenizer, engine)
    assert "<|im_start|>assistant\nLet me look.<tool_call>" in prompt
    assert '"arguments": "{\\"city\\": \\"Paris\\"}"' in prompt or '"city": "Paris"' in prompt
    assert "<|im_start|>tool\nSunny, 21 C<|im_end|>\n<|im_start|>user\nAnd tomorrow?" in prompt


def test_a_last_assistant_turn_is_a_prefill(demo_tokenizer: Any) -> None:
    with serving(demo_tokenizer, "Paris.") as (client, engine, _):
        prefill: Any = [*ASK, {"role": "assistant", "content": "The answer is"}]
        message = client.messages.create(model="tgi", max_tokens=50, messages=prefill)
        prompt = prompt_of(demo_tokenizer, engine)
        assert prompt.rstrip().endswith("The answer is")
        assert message.content[0].text == "Paris."  # type: ignore[union-attr]


def test_thinking_reaches_the_template_and_the_budget_the_engine(
    qwen3: Served, qwen3_tokenizer: Any
) -> None:
    client, engine, _ = qwen3
    client.messages.create(model="tgi", max_tokens=100, messages=ASK, thinking={"type": "disabled"})
    assert prompt_of(qwen3_tokenizer, engine).endswith("<think>\n\n</think>\n\n")
    assert engine.requests[-1].params.thinking_budget is None
    client.messages.create(
        model="tgi", max_tokens=100, messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 30},
    )  # fmt: skip
    assert prompt_of(qwen3_tokenizer, engine).endswith("<think>\n")

    def ids(text: str) -> tuple[int, ...]:
        return tuple(qwen3_tokenizer.encode(text, add_special_tokens=False))

    expected = ThinkingBudget(30, ids("<think>"), ids("</think>"), opened=True)
    assert engine.requests[-1].params.thinking_budget == expected


def test_output_config_format_holds_the_answer_after_the_thinking(
    qwen3_tokenizer: Any,
) -> None:
    answer = '{"city":"Paris"}'  # JSON as the grammar writes it: compact
    with serving(qwen3_tokenizer, f"{THOUGHT}\n</think>\n\n{answer}") as (client, engine, _):
        schema = {"type": "object", "properties": {"city": {"type": "string"}}}
        message = client.messages.create(
            model="tgi", max_tokens=100, messages=ASK,
            output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
        )  # fmt: skip
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert json.loads(message.content[1].text) == {"city": "Paris"}  # type: ignore[union-attr]
        grammar = engine.requests[-1].params.grammar
        assert grammar is not None and grammar.source == "output_config.format"
        assert grammar_accepts(qwen3_tokenizer, engine, f"{THOUGHT}\n</think>\n\n{answer}")
        assert not grammar_accepts(qwen3_tokenizer, engine, f"{THOUGHT}\n</think>\n\nParis")
        assert message.usage.output_tokens_details is not None
        assert message.usage.output_tokens_details.thinking_tokens > 0


def test_omitted_thinking_leaves_the_blocks_out(qwen3: Served) -> None:
    client = qwen3[0]
    message = client.messages.create(
        model="tgi", max_tokens=200, messages=ASK, tools=[TOOL],
        thinking={"type": "adaptive", "display": "omitted"},
    )  # fmt: skip
    assert [b.type for b in message.content] == ["tool_use"]
    assert message.usage.output_tokens_details is not None
    assert message.usage.output_tokens_details.thinking_tokens > 0


def test_count_tokens_counts_the_prompt_messages_would_make(
    qwen3: Served, qwen3_tokenizer: Any
) -> None:
    client, engine, _ = qwen3
    counted = client.messages.count_tokens(
        model="tgi", system="Be brief.", messages=ASK, tools=[TOOL]
    )
    client.messages.create(
        model="tgi", max_tokens=20, system="Be brief.", messages=ASK, tools=[TOOL]
    )
    assert counted.input_tokens == len(engine.requests[-1].input_ids) > 0


ASKED = ("model", "max_tokens", "messages")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"temperature": 1.5}, "`temperature` must be >= 0 and <= 1"),
        ({"thinking": {"type": "between_tools"}}, "`thinking.type`"),
        ({"output_config": {"effort": "max"}}, "`output_config.effort`"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
          "tools": [TOOL]}, "`output_config.format` cannot be combined with `tools`"),
        ({"speed": "fast"}, "`speed`"),
        ({"max_tokens": 0}, "`max_tokens` must be >= 1"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "`thinking.budget_tokens`"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "`tools[0].type`"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, "`tool_choice.name`"),
        ({"tool_choice": {"type": "any"}}, "`tool_choice` is only allowed when `tools`"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "`mcp_servers`"),
        (
            {"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "iVBORw0KGgo="}}]}]},
            "`messages[0].content[0].source.data` is an image, and this model takes none",
        ),
        (
            {"messages": [{"role": "user", "content": [
                {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                "data": "x"}}]}]},
            "`messages[0].content[0].type` 'document' is not served here",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "`messages[0].role`"),
        ({"top_k": 0}, "`top_k`"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_in_anthropics_shape_naming_the_field(
    qwen3: Served, change: dict[str, Any], message: str
) -> None:
    client, _, test_client = qwen3
    body: Any = {"model": "tgi", "max_tokens": 100, "messages": ASK, **change}
    with pytest.raises(anthropic.BadRequestError) as caught:
        # Sampling fields and others this client does not name go as extra body fields.
        client.messages.create(extra_body=body, **{k: body[k] for k in ASKED})
    assert caught.value.status_code == 400
    error = caught.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and message in error["message"]
    raw = test_client.post("/v1/messages", json=body)
    assert raw.status_code == 400 and raw.json()["type"] == "error"


def test_required_fields_and_unknown_routes_answer_in_anthropics_shape(qwen3: Served) -> None:
    test_client = qwen3[2]
    missing = test_client.post("/v1/messages", json={"model": "tgi", "messages": ASK})
    assert missing.status_code == 400
    assert "missing field `max_tokens`" in missing.json()["error"]["message"]
    assert test_client.post("/v1/messages", content=b"{").json()["type"] == "error"
    wrong = test_client.get("/v1/messages")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


def test_a_full_queue_is_a_529_and_a_failure_mid_stream_an_error_event(
    qwen3: Served,
) -> None:
    client, engine, _ = qwen3
    engine.overloaded = True
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.messages.create(model="tgi", max_tokens=50, messages=ASK)
    assert caught.value.status_code == 529
    assert caught.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    engine.overloaded, engine.fail_after = False, 3
    with (
        pytest.raises(anthropic.APIStatusError) as failed,
        client.messages.stream(model="tgi", max_tokens=50, messages=ASK) as stream,
    ):
        for _ in stream:
            pass
    assert "Request failed during generation" in str(failed.value)


def test_x_api_key_is_accepted_like_the_bearer_key(qwen3_tokenizer: Any) -> None:
    with serving(qwen3_tokenizer, SCRIPT, api_key="s3cret") as (client, _, test_client):
        assert client.messages.create(model="tgi", max_tokens=50, messages=ASK).content
        wrong = client.with_options(api_key="nope")
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong.messages.create(model="tgi", max_tokens=50, messages=ASK)
        assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        bearer = {"Authorization": "Bearer s3cret"}
        body = {"model": "tgi", "max_tokens": 5, "messages": ASK}
        assert test_client.post("/v1/messages", json=body, headers=bearer).status_code == 200


def test_requests_count_in_the_metrics(qwen3: Served) -> None:
    client, _, test_client = qwen3
    client.messages.create(model="tgi", max_tokens=200, messages=ASK)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(
            model="tgi", max_tokens=50, messages=ASK, extra_body={"temperature": 3}
        )
    metrics = test_client.get("/metrics").text
    assert 'tgi_request_success{stop_reason="EOS_TOKEN",kind="single"} 1.0' in metrics
    assert 'tgi_request_count{kind="single"} 2.0' in metrics
    assert 'tgi_request_failure{err="validation"} 1.0' in metrics
    client.messages.count_tokens(model="tgi", messages=ASK)
    assert "tgi_tokenize_request_count 1.0" in test_client.get("/metrics").text


def test_the_real_engine_thinks_within_the_budget_then_calls(qwen3_model: Path) -> None:
    """A random model never closes its reasoning: the budget does, and the grammar then holds
    it to a Hermes call whose input the client reads as an object."""
    with demo_app(qwen3_model, 1024) as app, live_server(app) as (base, _):
        client = anthropic.Anthropic(base_url=base, api_key="none", timeout=60, max_retries=0)
        request: Any = {
            "model": "tgi",
            "max_tokens": 120,
            "messages": ASK,
            "tools": [TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "extra_body": {"temperature": 0},
            "thinking": {"type": "enabled", "budget_tokens": 6},
        }
        message = client.messages.create(**request)
        thinking, call = message.content
        assert thinking.type == "thinking" and call.type == "tool_use"
        assert message.stop_reason == "tool_use"
        assert message.usage.output_tokens_details is not None
        # The budget's 6 tokens, re-tokenized from the text (a token may split in two).
        assert 0 < message.usage.output_tokens_details.thinking_tokens <= 8
        jsonschema.validate(call.input, CITY)
        with client.messages.stream(**request) as stream:
            final = stream.get_final_message()
        assert [b.model_dump(exclude={"id"}) for b in final.content] == [
            b.model_dump(exclude={"id"}) for b in message.content
        ]
