"""OpenAI tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

A model calls tools by writing a JSON array of calls, compact, keys in this order:

    [{"name":"get_weather","arguments":{"city":"Paris"}}]

and a grammar (tgis.engine.grammar) holds it to that form and to each tool's `parameters`:
- `required`: one call or more (one when `parallel_tool_calls` is false);
- a named function: one call of that function;
- `auto` (the default when tools are given): plain text that does not start with `[` or `{`,
  or calls;
- `none`: free text; the tools are not shown to the model.

The tools reach the model through the chat template when the template uses them (its source
names `tools`: Llama 3.1, Qwen, Hermes, Mistral templates do); otherwise their definitions go in
the instruction that describes the call format, which is appended to the last user message.
Earlier calls in the conversation (assistant `tool_calls`) are given to a tool-aware template
with their arguments as objects, as Hugging Face's templates expect; a template without tool
support sees them as that message's content, in the call format above.

`ToolCallScanner` reads the output as it streams: tool-call deltas as the `openai` client
accumulates them (id, type and name once, in the first delta of a call, then fragments of the
arguments' JSON text), or content when `auto` chose text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from tgis.params import JSON_OPTIONS, GrammarSpec
from tgis.server.chat.reasoning import partial_length
from tgis.server.http.errors import invalid
from tgis.server.http.fields import Fields

# OpenAI's rule for function names (which also keeps them free of JSON escapes).
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_NAME = re.compile(NAME_PATTERN)
# A call's opening up to its arguments, however its JSON is spaced.
_HEADERS = {
    key: re.compile(r'\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"' + key + r'"\s*:\s*')
    for key in ("arguments", "parameters")
}
_TEMPLATE_TOOLS = re.compile(r"\btools\b")

ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class Tool:
    """One function a request offers."""

    name: str
    description: str | None
    # A JSON schema of the arguments: an object.
    parameters: dict[str, Any]

    def definition(self) -> dict[str, Any]:
        """The tool as OpenAI's API and chat templates write it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def call_schema(self, max_tokens: int | None = None, key: str = "arguments") -> dict[str, Any]:
        """A call of this tool as the grammar holds it: its arguments strict
        (`strict_arguments`), under a key of the call format's (`arguments` or `parameters`)."""
        return {
            "type": "object",
            "properties": {
                "name": {"const": self.name},
                key: strict_arguments(self.parameters, max_tokens),
            },
            "required": ["name", key],
            "additionalProperties": False,
        }


@dataclass(frozen=True)
class ToolChoice:
    """The tools a request offers and how the model may use them (`none` is no ToolChoice)."""

    tools: tuple[Tool, ...]
    mode: ToolMode
    name: str | None = None
    parallel: bool = True

    def callable(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.name is None or t.name == self.name)

    def calls_schema(self, max_tokens: int | None = None) -> dict[str, Any]:
        """The JSON schema of the output when the model calls tools."""
        calls = [t.call_schema(max_tokens) for t in self.callable()]
        schema: dict[str, Any] = {
            "type": "array",
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            "minItems": 1,
        }
        if not self.parallel or self.mode == "named":
            schema["maxItems"] = 1
        return schema

    def grammar(self, max_tokens: int | None = None) -> GrammarSpec:
        """The grammar of the output in tgis's compact format; `max_tokens`: the request's
        budget, which bounds free strings of the arguments (`strict_arguments`)."""
        schema = self.calls_schema(max_tokens)
        if self.mode != "auto":
            return GrammarSpec.json_schema(schema, source="tools")
        lark_schema = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
        text = "start: calls | TEXT?\nTEXT: /[^\\[\\{][\\s\\S]*/\ncalls: %json " + lark_schema
        return GrammarSpec.lark(text, source="tools")

    def definitions(self) -> list[dict[str, Any]]:
        return [t.definition() for t in self.tools]

    def instruction(self, with_definitions: bool) -> str:
        """What the model is told about calling the tools (appended to the last user message)."""
        form = '[{"name": <tool name>, "arguments": <object of its parameters>}]'
        if self.mode == "auto":
            text = (
                f"To call tools, reply with only a JSON array of calls: {form}. "
                "Otherwise reply in plain text."
            )
        elif self.mode == "required":
            text = f"Reply with only a JSON array of tool calls: {form}."
        else:
            text = f"Reply with only a JSON array of one call of {self.name}: {form}."
        if with_definitions:
            text += "\nTools:\n" + json.dumps(self.definitions(), ensure_ascii=False)
        return text


def parse_tools(f: Fields) -> ToolChoice | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request (None: no tools to
    call)."""
    tools = _tools(f)
    choice = f.data.get("tool_choice")
    parallel = f.boolean("parallel_tool_calls")
    if choice is not None and not tools:
        raise invalid("`tool_choice` is only allowed when `tools` are given")
    if not tools:
        return None
    parallel = True if parallel is None else parallel
    if choice is None or choice == "auto":
        return ToolChoice(tools, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolChoice(tools, "required", parallel=parallel)
    if isinstance(choice, dict):
        named = Fields(choice, "tool_choice")
        if named.string("type") != "function":
            raise invalid('`tool_choice.type` must be "function"')
        function = named.obj("function")
        if function is None:
            raise invalid("missing field `tool_choice.function`")
        name = function.required_string("name")
        known = [t.name for t in tools]
        if name not in known:
            raise invalid(
                f"`tool_choice.function.name` must be one of the `tools` ({', '.join(known)}), "
                f"got {name!r}"
            )
        return ToolChoice(tools, "named", name=name, parallel=parallel)
    raise invalid(
        '`tool_choice` must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )


def _tools(f: Fields) -> tuple[Tool, ...]:
    value = f.data.get("tools")
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid("`tools` must be an array of tools")
    tools: list[Tool] = []
    for i, raw in enumerate(value):
        t = Fields(raw, f"tools[{i}]")
        if t.string("type") != "function":
            raise invalid(f'`tools[{i}].type` must be "function"')
        function = t.obj("function")
        if function is None:
            raise invalid(f"missing field `tools[{i}].function`")
        name = function.required_string("name")
        if not _NAME.match(name):
            raise invalid(
                f"`tools[{i}].function.name` must be 1 to 64 letters, digits, `_` or `-`, "
                f"got {name!r}"
            )
        if any(other.name == name for other in tools):
            raise invalid(f"`tools[{i}].function.name`: {name!r} is given twice")
        parameters = function.obj("parameters")
        tools.append(Tool(name, function.string("description"), _arguments_schema(parameters, i)))
    return tuple(tools)


def _arguments_schema(parameters: Fields | None, i: int) -> dict[str, Any]:
    """A function's arguments are an object: no parameters means `{}`."""
    if parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    schema = dict(parameters.data)
    kind = schema.get("type", "object")
    if kind != "object":
        raise invalid(
            f"`tools[{i}].function.parameters` must be a JSON schema of an object "
            f'("type": "object"), got type {kind!r}'
        )
    return {**schema, "type": "object"}


# Keywords whose value is a map of names to schemas, a list of schemas, or one schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
# A string with any of these is not free: its values are bounded already.
_BOUNDED_STRING = ("maxLength", "enum", "const", "pattern", "format")


def strict_arguments(schema: Any, max_tokens: int | None = None) -> Any:
    """A tool's arguments schema as the grammar enforces it, strict as OpenAI's strict mode
    and xgrammar's are: every object that names its properties allows no others unless it
    says so (`additionalProperties` or `patternProperties`), so that a model cannot invent
    keys; an object that names none (`{"type": "object"}`) stays free-form. Free strings (no
    maxLength, enum, const, pattern or format) are at most `max_tokens` characters: a token
    writes at least one, so no single string outruns the budget by itself."""
    if not isinstance(schema, dict):
        return schema  # true / false
    strict: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: strict_arguments(sub, max_tokens) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [strict_arguments(sub, max_tokens) for sub in value]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            value = strict_arguments(value, max_tokens)
        strict[key] = value
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind or ())
    open_ = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in schema and not any(k in schema for k in open_):
        strict["additionalProperties"] = False
    free = not any(k in schema for k in _BOUNDED_STRING)
    if max_tokens is not None and "string" in kinds and free:
        strict["maxLength"] = max(1, max_tokens)
    return strict


# --- the prompt ---------------------------------------------------------------------------


def template_takes_tools(template: Any) -> bool:
    """Whether a chat template (its text, or a dict of named templates) renders `tools`."""
    if isinstance(template, dict):
        return "tool_use" in template or any(template_takes_tools(t) for t in template.values())
    return isinstance(template, str) and bool(_TEMPLATE_TOOLS.search(template))


def with_text(content: str | list[dict[str, str]] | None, text: str) -> Any:
    """A message's content with `text` after it (a text part after an array's parts)."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return (content or "") + text


def prompt_messages(
    messages: list[dict[str, Any]], choice: ToolChoice | None, takes_tools: bool
) -> list[dict[str, Any]]:
    """`messages` as the chat template is given them (new dicts; the request's are kept)."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            if takes_tools:
                message["tool_calls"] = [_template_call(c) for c in calls]
            else:
                written = [
                    {"name": c["function"]["name"], "arguments": _arguments(c)} for c in calls
                ]
                text = json.dumps(written, ensure_ascii=False, separators=(",", ":"))
                message.pop("tool_calls")
                message["content"] = with_text(message.get("content"), text)
        out.append(message)
    if choice is not None:
        users = [i for i, m in enumerate(out) if m.get("role") == "user"]
        last = users[-1] if users else len(out) - 1
        instruction = choice.instruction(with_definitions=not takes_tools)
        content = out[last].get("content")
        out[last]["content"] = with_text(content, f"\n\n{instruction}" if content else instruction)
    return out


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object when they are JSON text of one (else the text)."""
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = {"name": call["function"]["name"], "arguments": _arguments(call)}
    out: dict[str, Any] = {"type": "function", "function": function}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def parse_message_tool_calls(value: Any, path: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`: [{id, type: function, function: {name,
    arguments}}]."""
    if not isinstance(value, list):
        raise invalid(f"`{path}` must be an array of tool calls")
    calls = []
    for j, raw in enumerate(value):
        c = Fields(raw, f"{path}[{j}]")
        function = c.obj("function")
        if function is None:
            raise invalid(f"missing field `{path}[{j}].function`")
        arguments = function.data.get("arguments")
        if arguments is not None and not isinstance(arguments, str | dict):
            raise invalid(f"`{path}[{j}].function.arguments` must be JSON text of an object")
        call = {
            "type": "function",
            "function": {"name": function.required_string("name"), "arguments": arguments or "{}"},
        }
        if c.string("id") is not None:
            call["id"] = c.string("id")
        calls.append(call)
    return calls


# --- the output ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its calls: each call is a JSON object whose keys are `name` then
    `key` (its arguments), in one JSON array (`array`) or one after another (`separator`
    between them), after a `trigger` text when the format has one (optional for some),
    each wrapped in `trigger` ... `call_end` when the format repeats the trigger."""

    name: str
    trigger: str | None = None
    trigger_optional: bool = False
    key: str = "arguments"
    array: bool = True
    separator: str = ""
    call_end: str = ""
    # JSON written as Python's json.dumps (and Jinja's tojson) writes it: ", " and ": ".
    spaced: bool = False

    @property
    def leads_with_text(self) -> bool:
        """Whether text may come before the calls (the trigger tells where they start)."""
        return self.trigger is not None and not self.trigger_optional


# tgis's own: a compact JSON array of calls, for templates that have no format of their own.
COMPACT = ToolFormat("json")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolCallScanner:
    """Reads one sequence's output as it is generated. `feed` returns the stream's message
    deltas (`{"content": ...}`, or `{"tool_calls": [...]}` as the `openai` client accumulates
    them); `calls` are the calls so far, their arguments possibly unfinished. Text before the
    calls (a format with a trigger) is content; so is an output that is no calls at all."""

    format: ToolFormat = COMPACT
    calls: list[ToolCall] = field(default_factory=list)
    text: str = ""
    # The content before the calls.
    content: str = ""
    # start (nothing yet), text (content), between (among the calls), head (a call's name),
    # arguments.
    state: str = "start"
    _held: str = ""
    _head: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    @property
    def called(self) -> bool:
        """Whether the output has turned to calls."""
        return self.state not in ("start", "text")

    @property
    def complete(self) -> bool:
        """Whether a call has ended and no other has begun."""
        return bool(self.calls) and self.state == "between"

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish_reason: `tool_calls` when the calls ended the output."""
        return "tool_calls" if self.complete and reason == "stop" else reason

    def message(self) -> dict[str, Any]:
        """The chat message of the output (without its role): its calls that ended. A call
        still open (the output was cut by max_tokens) is not a call: it is left out."""
        if not self.called:
            return {"content": self.content + self._held}
        content = self.content.strip() or None
        ended = self.calls[:-1] if self.state == "arguments" else self.calls
        if not ended:
            return {"content": content}
        return {"content": content, "tool_calls": [call.json() for call in ended]}

    def finish(self) -> list[dict[str, Any]]:
        """At the end of the output: text held back as the start of a trigger is content."""
        held, self._held = self._held, ""
        if not held or self.called:
            return []
        self.content += held
        return [{"content": held}]

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        deltas: list[dict[str, Any]] = []
        if self.state in ("start", "text"):
            text = self._before_calls(self._held + text, deltas)
        fragment: list[str] = []

        def flush() -> None:
            if fragment:
                delta = {"index": len(self.calls) - 1, "function": {"arguments": "".join(fragment)}}
                deltas.append({"tool_calls": [delta]})
                fragment.clear()

        for char in text:
            if self.state == "between":
                # A call opens with `{`; separators, brackets and markers are skipped.
                if char == "{":
                    self.state, self._head = "head", char
            elif self.state == "head":
                self._head += char
                match = self._header().fullmatch(self._head)
                if match:
                    call = ToolCall(f"call_{secrets.token_hex(12)}", match.group(1))
                    self.calls.append(call)
                    self.state, self._depth = "arguments", 0
                    head = {"index": len(self.calls) - 1, **call.json()}
                    head["function"]["arguments"] = ""
                    deltas.append({"tool_calls": [head]})
            elif self.state == "arguments":
                if not self.calls[-1].arguments and char.isspace():
                    continue
                self.calls[-1].arguments += char
                fragment.append(char)
                if self._ends_arguments(char):
                    flush()
                    self.state = "between"
        flush()
        return deltas

    def _before_calls(self, text: str, deltas: list[dict[str, Any]]) -> str:
        """Content up to where the calls start; returns the text from there ("" when none
        yet, and holds back what may still become the trigger)."""
        fmt = self.format
        self._held = ""
        if fmt.leads_with_text:
            assert fmt.trigger is not None
            at = text.find(fmt.trigger)
            if at < 0:
                keep = partial_length(text, fmt.trigger)
                shown, self._held = text[: len(text) - keep], text[len(text) - keep :]
                self._content(shown, deltas)
                return ""
            self._content(text[:at], deltas)
            self.state = "between"
            return text[at + len(fmt.trigger) :]
        if self.state == "text":
            self._content(text, deltas)
            return ""
        # No trigger (or an optional one): the output is calls when it opens with them.
        rest = text.lstrip()
        opener = "[" if fmt.array else "{"
        if fmt.trigger is not None and rest.startswith(fmt.trigger):
            self.state = "between"
            return rest[len(fmt.trigger) :]
        if rest.startswith(opener):
            self.state = "between"
            return rest
        if not rest or (fmt.trigger is not None and fmt.trigger.startswith(rest)):
            self._held = text
            return ""
        self.state = "text"
        self._content(text, deltas)
        return ""

    def _content(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if text:
            if self.state == "start":
                self.state = "text"
            self.content += text
            deltas.append({"content": text})

    def _header(self) -> re.Pattern[str]:
        return _HEADERS[self.format.key]

    def _ends_arguments(self, char: str) -> bool:
        """Track the arguments' JSON: True on the character that closes their object."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return False
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            return self._depth == 0
        return False
