"""Anthropic Messages bodies read into chat turns: blocks into chat messages, prefills, tool
choices, thinking and output_config into template variables, budgets and grammars; and the
output's stop reasons."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tgis.engine.types import Completion, FinishReason
from tgis.server.anthropic.requests import parse_messages_request, stop_reason, tool_input
from tgis.server.chat.prompt import ChatFormat, ChatPlan
from tgis.server.chat.tool_calls import COMPACT
from tgis.server.http.errors import ApiError

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"name": "get_weather", "input_schema": CITY}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tgi", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
            **fields}  # fmt: skip


def test_blocks_become_chat_messages_in_order() -> None:
    req = parse_messages_request(body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "x"},
                {"type": "redacted_thinking", "data": "zz"},
                {"type": "text", "text": "Let me see."},
                {"type": "tool_use", "id": "t1", "name": "get_weather",
                 "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "text", "text": "thanks"},
                {"type": "tool_result", "tool_use_id": "t1", "content": "22 C", "is_error": True},
            ]},
        ],
    ))  # fmt: skip
    system, user, assistant, tool, last = req.turn.messages
    assert system == {"role": "system", "content": "Be brief.\n\nBe kind."}
    assert user == {"role": "user", "content": "a\n\nb"}
    assert assistant["content"] == "Let me see." and assistant["reasoning_content"] == "hm"
    (call,) = assistant["tool_calls"]
    assert call["id"] == "t1" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # Tool results come first in their turn, as chat templates expect them after the call.
    assert tool == {"role": "tool", "tool_call_id": "t1", "content": "Error: 22 C"}
    assert last == {"role": "user", "content": "thanks"}
    assert not req.turn.prefill


@pytest.mark.parametrize(
    ("last", "prefill"),
    [
        ({"role": "assistant", "content": "The answer is"}, True),
        ({"role": "assistant", "content": [{"type": "text", "text": "{"}]}, True),
        ({"role": "assistant", "content": ""}, False),
        ({"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}, False),
        ({"role": "user", "content": "more"}, False),
    ],
)  # fmt: skip
def test_only_a_last_assistant_turn_of_text_is_a_prefill(last: Any, prefill: bool) -> None:
    messages = [{"role": "user", "content": "hi"}, last]
    assert parse_messages_request(body(messages=messages)).turn.prefill is prefill


def test_tool_choices_map_to_chat_modes() -> None:
    def mode(choice: Any) -> Any:
        tools = parse_messages_request(body(tools=[TOOL], tool_choice=choice)).turn.tools
        return None if tools is None else (tools.mode, tools.name, tools.parallel)

    assert mode({"type": "auto"}) == ("auto", None, True)
    assert mode({"type": "any", "disable_parallel_tool_use": True}) == ("required", None, False)
    assert mode({"type": "tool", "name": "get_weather"}) == ("named", "get_weather", True)
    assert mode({"type": "none"}) is None


def test_thinking_and_output_config_reach_the_template_budget_and_grammar() -> None:
    enabled = parse_messages_request(body(thinking={"type": "enabled", "budget_tokens": 10}))
    assert enabled.turn.thinking_budget == 10
    assert enabled.turn.template_kwargs == {"enable_thinking": True}
    adaptive = parse_messages_request(body(thinking={"type": "adaptive", "display": "omitted"}))
    assert adaptive.turn.thinking_budget is None and not adaptive.turn.include_reasoning
    disabled = parse_messages_request(body(thinking={"type": "disabled"}))
    assert disabled.turn.template_kwargs == {"enable_thinking": False}
    config = {"effort": "high", "format": {"type": "json_schema", "schema": CITY}}
    shaped = parse_messages_request(body(output_config=config))
    assert shaped.turn.template_kwargs == {"reasoning_effort": "high"}
    grammar = shaped.turn.params.grammar
    assert grammar is not None and json.loads(grammar.value) == CITY


def test_sampling_fields_and_count_only_bodies() -> None:
    params = parse_messages_request(body(temperature=0, top_k=5, stop_sequences=["x"])).turn.params
    assert not params.do_sample and params.top_k == 5 and params.stop == ("x",)
    assert not params.include_stop_sequence
    sampled = parse_messages_request(body(temperature=0.5, top_p=1)).turn.params
    assert sampled.do_sample and sampled.temperature == 0.5 and sampled.top_p is None
    counted = parse_messages_request(
        {"model": "tgi", "messages": [{"role": "user", "content": "hi"}]}, count_only=True
    )
    assert counted.turn.params.max_new_tokens is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_tokens": None}, "missing field `max_tokens`"),
        ({"model": None}, "missing field `model`"),
        ({"messages": [{"role": "user", "content": []}]}, "`messages[0].content`"),
        ({"system": [{"type": "image"}]}, "`system[0].type`"),
        ({"metadata": {"user_id": "u", "team": "x"}}, "`metadata.team`"),
        ({"thinking": {"type": "enabled"}}, "missing field `thinking.budget_tokens`"),
        ({"thinking": {"type": "enabled", "budget_tokens": 8}, "display": "x"}, None),
        ({"thinking": {"type": "adaptive", "display": "full"}}, "`thinking.display`"),
        ({"output_config": {"format": {"type": "regex"}}}, "`output_config.format.type`"),
        ({"tools": [{"name": "a b", "input_schema": CITY}]}, "`tools[0].name`"),
        ({"tools": [{"name": "a"}]}, "missing field `tools[0].input_schema`"),
        ({"tool_choice": {"type": "sometimes"}, "tools": [TOOL]}, "`tool_choice.type`"),
        ({"service_tier": "priority"}, "`service_tier`"),
        ({"container": "c1"}, "`container`"),
        ({"context_management": {"edits": []}}, "`context_management`"),
    ],
)
def test_refusals_name_the_field(fields: dict[str, Any], named: str | None) -> None:
    given = {k: v for k, v in body(**fields).items() if v is not None}
    if named is None:  # an unknown top-level field is left alone, as the API's clients send extras
        parse_messages_request(given)
        return
    with pytest.raises(ApiError) as caught:
        parse_messages_request(given)
    assert caught.value.status == 422 and named in caught.value.message


def completion(reason: FinishReason, stop: str | None = None) -> Completion:
    return Completion(reason, "", 1, 1, None, stop_sequence=stop)


def test_stop_reasons() -> None:
    fmt = ChatFormat(None, COMPACT, False, ())
    plan = ChatPlan(parse_messages_request(body()).turn.params, None, False, None, fmt.tools, True)
    output = plan.output()
    assert stop_reason(output, completion(FinishReason.EOS_TOKEN)) == ("end_turn", None)
    assert stop_reason(output, completion(FinishReason.LENGTH)) == ("max_tokens", None)
    assert stop_reason(output, completion(FinishReason.TIME_LIMIT)) == ("max_tokens", None)
    matched = completion(FinishReason.STOP_SEQUENCE, "x")
    assert stop_reason(output, matched) == ("stop_sequence", "x")


def test_tool_input_is_an_object_or_empty() -> None:
    assert tool_input('{"city": "Paris"}') == {"city": "Paris"}
    assert tool_input('{"city": "Par') == {} and tool_input("[1]") == {} and tool_input("") == {}
