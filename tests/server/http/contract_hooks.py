"""Schemathesis hooks of tests/server/http/test_contract_fuzz.py (SCHEMATHESIS_HOOKS names this module).

The API's schema states every rule of a request but those over token counts, which no JSON
Schema can: the prompt's tokens with `max_new_tokens` within `max_total_tokens`, and
`min_new_tokens` within `max_new_tokens`, Anthropic's `thinking.budget_tokens` below
`max_tokens` — and whether a grammar's own schema or regex is one
the grammar engine can use. Cases generated as valid are kept within them here (texts cut to
200 characters, a minimum lowered to the maximum given, a usable grammar), so that a valid case
the server refuses is a real disagreement. Tools get distinct names and small argument schemas
(a schema cannot say that names are unique, nor which schemas the grammar engine can use), and
a named `tool_choice` names one of them. Cases generated as invalid go out unchanged. tgis.params
is tested on the token rules directly (tests/test_params.py).
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.generation import GenerationMode

# Whether a schema or regex is one the grammar engine can use is not a JSON Schema rule either:
# valid cases get a usable one.
GRAMMAR = {"type": "regex", "value": "[a-z]{1,4}"}
TEXT = 200  # characters: a few hundred tokens at most, far below the server's input limit
MESSAGES = 8
TOOLS = 3
PARTS, PART = 4, 40  # text parts and tool calls of a message, characters of each
ARGUMENTS = {"type": "object", "properties": {"n": {"type": "integer"}}}


def _cut(value: Any) -> Any:
    if isinstance(value, str):
        return value[:TEXT]
    if isinstance(value, list):
        return [_cut(v) for v in value[:TEXT]]
    return value


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _lower(body: dict[str, Any], minimum: str, maxima: tuple[str, ...]) -> None:
    given = [body[m] for m in maxima if _number(body.get(m))]
    if given and _number(body.get(minimum)) and body[minimum] > given[0]:
        body[minimum] = given[0]


@schemathesis.hook
def before_call(ctx: Any, case: Any, **kwargs: Any) -> None:
    if case.meta is None or case.meta.generation.mode is not GenerationMode.POSITIVE:
        return
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("inputs"), str):
        body["inputs"] = _cut(body["inputs"])
    if "prompt" in body:
        body["prompt"] = _cut(body["prompt"])
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:MESSAGES]
        for message in body["messages"]:
            if isinstance(message, dict):
                _short_message(message)
    parameters = body.get("parameters")
    if isinstance(parameters, dict):
        _lower(parameters, "min_new_tokens", ("max_new_tokens",))
        if isinstance(parameters.get("grammar"), dict):
            parameters["grammar"] = GRAMMAR
    _usable_tools(body)
    _short_input(body)
    fmt = body["text"].get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt["schema"] = {"type": "object"}
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        response_format["json_schema"] = {"name": "any", "schema": {"type": "object"}}
    _lower(body, "min_tokens", ("max_completion_tokens", "max_tokens"))
    _within_budget(body)
    system = body.get("system")
    if isinstance(system, str | list):
        body["system"] = system[:TEXT] if isinstance(system, str) else system[:PARTS]
        for part in body["system"] if isinstance(system, list) else ():
            _short_block(part)
    config = body.get("output_config")
    if isinstance(config, dict) and isinstance(config.get("format"), dict):
        config["format"]["schema"] = {"type": "object"}


def _within_budget(body: dict[str, Any]) -> None:
    """Anthropic's `thinking.budget_tokens` below `max_tokens` (a rule between two fields)."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or not _number(thinking.get("budget_tokens")):
        return
    most = body.get("max_tokens")
    if _number(most) and thinking["budget_tokens"] >= most:
        if most > 1:
            thinking["budget_tokens"] = most - 1
        else:
            body["thinking"] = {"type": "disabled"}


def _short_message(message: dict[str, Any], key: str = "content") -> None:
    """A message's text (a string or text parts) and earlier tool calls, kept short."""
    content = message.get(key)
    if isinstance(content, str):
        message[key] = _cut(content)
    elif isinstance(content, list):
        message[key] = content = content[:PARTS]
        for part in content:
            _short_block(part)
    if isinstance(message.get("tool_calls"), list):
        message["tool_calls"] = calls = message["tool_calls"][:PARTS]
        for call in calls:
            call["function"]["name"] = call["function"]["name"][:PART]
            call["function"]["arguments"] = "{}"


def _short_block(part: dict[str, Any]) -> None:
    """A content part or block (text, Anthropic's tool_use, tool_result and thinking), short."""
    for key in ("text", "thinking"):
        if isinstance(part.get(key), str):
            part[key] = part[key][:PART]
    if part.get("type") == "tool_use":
        part["name"], part["input"] = part["name"][:PART], {}
    if part.get("type") == "tool_result":
        _short_message(part)


def _short_input(body: dict[str, Any]) -> None:
    """A Responses `input` (a string, or items), kept short."""
    value = body.get("input")
    if isinstance(value, str):
        body["input"] = _cut(value)
    elif isinstance(value, list):
        body["input"] = items = value[:MESSAGES]
        if all(item.get("type") == "reasoning" for item in items):
            items.append({"role": "user", "content": "hi"})
        for item in items:
            for key in ("content", "output"):
                if key in item:
                    _short_message(item, key)
            if item.get("type") == "function_call":
                item["name"], item["arguments"] = item["name"][:PART], "{}"


def _usable_tools(body: dict[str, Any]) -> None:
    """Chat tools (`{"function": {...}}`) and Responses tools (flat) alike."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return
    body["tools"] = tools = tools[:TOOLS]
    for i, tool in enumerate(tools):
        function = tool.get("function", tool)
        function["name"] = f"f{i}"
        function.pop("description", None)
        for key in ("parameters", "input_schema"):  # chat's and Responses', Anthropic's
            if function.get(key) is not None:
                function[key] = ARGUMENTS
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and tools:
        choice.get("function", choice)["name"] = "f0"
