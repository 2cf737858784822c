"""tgis.server.chat.tool_calls: `tools` / `tool_choice` parsing and its errors, the grammar of each
mode (what it lets a model write, token by token through llguidance), the prompt the chat
template gets, and the scanner that turns output into OpenAI's tool calls and stream deltas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance as llg
import llguidance.hf
import pytest
from openai.lib.streaming._deltas import accumulate_delta
from transformers import AutoTokenizer

from tgis.server.chat.prompt import ChatFormat, render_chat
from tgis.server.chat.tool_calls import (
    ToolCallScanner,
    ToolChoice,
    parse_tools,
    prompt_messages,
    strict_arguments,
    template_takes_tools,
)
from tgis.server.chat.tool_formats import HERMES, tool_grammar
from tgis.server.http.errors import ApiError
from tgis.server.http.fields import Fields

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
CALL = '{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}'


def tools_of(**body: Any) -> ToolChoice | None:
    return parse_tools(Fields(body))


def refused(**body: Any) -> str:
    with pytest.raises(ApiError) as info:
        tools_of(**body)
    assert info.value.status == 422
    return info.value.message


def test_tool_choice_modes() -> None:
    auto = tools_of(tools=TOOLS)
    assert auto is not None and auto.mode == "auto" and auto.parallel
    assert [t.name for t in auto.tools] == ["get_weather", "now"]
    assert tools_of(tools=TOOLS, tool_choice="auto") == auto
    assert tools_of(tools=TOOLS, tool_choice="none") is None
    assert tools_of() is None and tools_of(tools=[]) is None
    required = tools_of(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required is not None and required.mode == "required" and not required.parallel
    named = tools_of(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert named is not None and named.mode == "named" and named.name == "now"
    assert [t.name for t in named.callable()] == ["now"]
    # No parameters: an object with none.
    assert named.tools[1].parameters == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "auto"}, "`tool_choice` is only allowed when `tools` are given"),
        ({"tools": TOOLS, "tool_choice": "always"}, '`tool_choice` must be "none", "auto"'),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "`tool_choice.function.name` must be one of the `tools` (get_weather, now), got 'x'",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "`tool_choice.function`"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "`tools[0].type` must be"),
        ({"tools": [{"type": "function"}]}, "missing field `tools[0].function`"),
        ({"tools": [{"type": "function", "function": {}}]}, "`tools[0].function.name`"),
        (
            {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
            "`tools[0].function.name` must be 1 to 64 letters, digits, `_` or `-`",
        ),
        ({"tools": [NOW, NOW]}, "`tools[1].function.name`: 'now' is given twice"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "`tools[0].function.parameters` must be a JSON schema of an object",
        ),
        ({"tools": {"name": "f"}}, "`tools` must be an array of tools"),
    ],
)
def test_bad_tools_are_refused_by_field(body: dict[str, Any], message: str) -> None:
    assert message in refused(**body)


@pytest.fixture(scope="module")
def ll_tokenizer(demo_model_dir: Path) -> tuple[Any, Any]:
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])


def accepts(ll_tokenizer: tuple[Any, Any], choice: ToolChoice, text: str) -> bool:
    """Whether the grammar lets a model write `text` and then end."""
    tok, ll = ll_tokenizer
    matcher = llg.LLMatcher(ll, choice.grammar().grammar(), log_level=0)
    ids = tok.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_each_mode_lets_a_model_write_what_it_may(ll_tokenizer: tuple[Any, Any]) -> None:
    auto = ToolChoice(tools_of(tools=TOOLS).tools, "auto")  # type: ignore[union-attr]
    for choice in (
        auto,
        ToolChoice(auto.tools, "required"),
        ToolChoice(auto.tools, "named", "now"),
    ):
        assert choice.grammar().problem() is None
    two = f'[{CALL},{{"name":"now","arguments":{{}}}}]'
    assert accepts(ll_tokenizer, auto, f"[{CALL}]")
    assert accepts(ll_tokenizer, auto, two)
    assert accepts(ll_tokenizer, auto, "It is sunny [really] {ok}")
    assert accepts(ll_tokenizer, auto, "")
    assert not accepts(ll_tokenizer, auto, '{"a":1}')  # JSON that is not calls
    assert not accepts(ll_tokenizer, auto, '[{"name":"rain","arguments":{}}]')  # no such tool
    assert not accepts(ll_tokenizer, auto, '[{"name":"get_weather","arguments":{"city":"P"}}]')
    assert not accepts(ll_tokenizer, auto, f"[{CALL.replace(':', ': ')}]")  # compact only
    required = ToolChoice(auto.tools, "required")
    assert accepts(ll_tokenizer, required, two)
    assert not accepts(ll_tokenizer, required, "It is sunny")
    assert not accepts(ll_tokenizer, required, "[]")
    single = ToolChoice(auto.tools, "required", parallel=False)
    assert accepts(ll_tokenizer, single, f"[{CALL}]")
    assert not accepts(ll_tokenizer, single, two)
    named = ToolChoice(auto.tools, "named", "now")
    assert accepts(ll_tokenizer, named, '[{"name":"now","arguments":{}}]')
    assert not accepts(ll_tokenizer, named, f"[{CALL}]")


def test_calls_schema_matches_the_calls_it_allows() -> None:
    choice = tools_of(tools=TOOLS, tool_choice="required")
    assert choice is not None
    schema = choice.calls_schema()
    jsonschema.validate(json.loads(f"[{CALL}]"), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "P"}}], schema)


def whole(text: str, step: int) -> tuple[ToolCallScanner, dict[str, Any]]:
    """Feed `text` in pieces of `step` characters; the deltas accumulated as the openai client
    does it."""
    scanner = ToolCallScanner()
    message: dict[Any, Any] = {}
    for i in range(0, len(text), step):
        for delta in scanner.feed(text[i : i + step]):
            message = accumulate_delta(message, delta)  # type: ignore[arg-type]
    return scanner, message


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_the_stream_adds_up_to_the_message_however_the_text_is_cut(step: int) -> None:
    tricky = (
        '{"name":"get_weather","arguments":{"city":"P\\"a}]r\\\\is","unit":"c","n":[1,{"a":[]}]}}'
    )
    text = f'[{tricky},{{"name":"now","arguments":{{}}}}]'
    scanner, streamed = whole(text, step)
    assert scanner.called and scanner.complete
    message = scanner.message()
    assert message["content"] is None
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == json.loads(tricky)["arguments"]
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # id, type and name come once per call, so accumulating gives them back whole.
    assert streamed["tool_calls"] == [{"index": i, **c} for i, c in enumerate(calls)]
    assert scanner.finish_reason("stop") == "tool_calls"
    assert scanner.finish_reason("length") == "length"


def test_text_is_content_and_unfinished_calls_keep_the_finish_reason() -> None:
    scanner, streamed = whole("Sunny, [22] degrees", 3)
    assert not scanner.called
    assert scanner.message() == {"content": "Sunny, [22] degrees"}
    assert streamed == {"content": "Sunny, [22] degrees"}
    assert scanner.finish_reason("stop") == "stop"
    cut, _ = whole('[{"name":"get_weather","arguments":{"ci', 4)
    assert cut.called and not cut.complete
    # A call cut by max_tokens is not a call: the message has none.
    assert cut.message() == {"content": None}
    assert cut.finish_reason("length") == "length"
    assert cut.finish_reason("stop") == "stop"
    # One that ended before the cut is kept.
    after, _ = whole(f'[{CALL},{{"name":"get_weather","arguments":{{"ci', 5)
    (kept,) = after.message()["tool_calls"]
    assert json.loads(kept["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert after.finish_reason("length") == "length"


def test_strict_arguments_close_the_objects_that_name_their_properties() -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "tags": {"type": "array", "items": {"properties": {"k": {"type": "string"}}}},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
            "free": {"type": "object"},
            "either": {"anyOf": [{"properties": {"a": {"const": 1}}}, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/point"},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "code": {"type": ["string", "null"], "pattern": "^[A-Z]+$"},
            "note": {"type": ["string", "null"]},
        },
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    strict = strict_arguments(schema, 40)
    props = strict["properties"]
    assert strict["additionalProperties"] is False
    assert props["where"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert strict["$defs"]["point"]["additionalProperties"] is False
    assert props["extra"] == schema["properties"]["extra"]  # allows others, as it says
    assert props["free"] == {"type": "object"}  # names none: free-form
    assert props["city"] == {"type": "string", "maxLength": 40}
    assert props["note"]["maxLength"] == 40
    assert props["tags"]["items"]["properties"]["k"]["maxLength"] == 40
    assert "maxLength" not in props["unit"] and "maxLength" not in props["code"]
    assert strict_arguments(schema)["properties"]["city"] == {"type": "string"}
    assert "additionalProperties" not in schema  # the tool's own schema is left as it was
    # What the strict schema refuses that the tool's own allowed.
    invented = {"city": "Paris", "thon))LEtle be": 85}
    jsonschema.validate(invented, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(invented, strict)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "P" * 41}, strict)


CITY_ONLY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}


def test_the_grammar_lets_no_argument_be_invented(ll_tokenizer: tuple[Any, Any]) -> None:
    """The schema does not say additionalProperties: false, and the grammar holds to it as if
    it did, in tgis's compact format and in a model's own."""
    choice = tools_of(tools=[CITY_ONLY], tool_choice="required")
    assert choice is not None
    assert accepts(ll_tokenizer, choice, '[{"name":"get_weather","arguments":{"city":"Rome"}}]')
    invented = '[{"name":"get_weather","arguments":{"city":"Paris","thon":85}}]'
    assert not accepts(ll_tokenizer, choice, invented)
    tok, ll = ll_tokenizer
    hermes = tool_grammar(choice, HERMES, tok, 50)
    for text, allowed in (
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', True),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": 1}}\n</tool_call>', False),
    ):  # fmt: skip
        matcher = llg.LLMatcher(ll, hermes.grammar(), log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        ok = all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
        assert ok is allowed, text


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}:"
    "{{ c.function.arguments.city }}</call>{% endfor %}{% endfor %}<assistant>"
)
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'},
            }
        ],
    },
    {"role": "tool", "content": "22", "tool_call_id": "call_1"},
    {"role": "user", "content": "And in Rome?"},
]


def test_a_template_that_takes_tools_gets_them_and_calls_as_objects() -> None:
    assert template_takes_tools(TOOL_TEMPLATE)
    assert not template_takes_tools(PLAIN_TEMPLATE)
    assert template_takes_tools({"default": PLAIN_TEMPLATE, "tool_use": TOOL_TEMPLATE})
    choice = tools_of(tools=TOOLS)
    kept = json.dumps(CONVERSATION)
    messages = prompt_messages(CONVERSATION, choice, takes_tools=True)
    assert json.dumps(CONVERSATION) == kept  # the request's messages are not changed
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}
    # The instruction (the call format, not the definitions) ends the last user message.
    assert messages[3]["content"].startswith("And in Rome?\n\nTo call tools, reply with only")
    assert "Tools:" not in messages[3]["content"]
    assert messages[:1] == CONVERSATION[:1]


def test_a_template_without_tools_sees_them_in_the_instruction_and_calls_as_content() -> None:
    choice = tools_of(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    messages = prompt_messages(CONVERSATION, choice, takes_tools=False)
    assert "tool_calls" not in messages[1]
    assert (
        messages[1]["content"] == '[{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}]'
    )
    last = messages[3]["content"]
    assert "one call of now" in last
    no_parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    now = {"type": "function", "function": {"name": "now", "parameters": no_parameters}}
    assert json.loads(last.split("Tools:\n", 1)[1]) == [WEATHER, now]
    # tool_choice none: no instruction, calls still shown.
    assert prompt_messages(CONVERSATION, None, takes_tools=False)[3] == CONVERSATION[3]


class Tok:
    """apply_chat_template's contract, rendered with transformers' own template machinery."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.tokenizer = AutoTokenizer.from_pretrained("tgis/assets/demo-model")

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, **kwargs
        )


def test_render_chat_passes_tools_to_a_template_that_uses_them() -> None:
    choice = tools_of(tools=TOOLS)
    tok = Tok(TOOL_TEMPLATE)
    text = render_chat(tok, ChatFormat.of(tok), CONVERSATION, choice)
    assert text.startswith("<tools>[")
    assert "get_weather" in text.split("</tools>")[0]
    assert "<call>get_weather:Paris</call>" in text
    tok = Tok(PLAIN_TEMPLATE)
    plain = render_chat(tok, ChatFormat.of(tok), CONVERSATION, choice)
    assert "<tools>" not in plain and "Tools:\n" in plain
    assert '[{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}]' in plain
