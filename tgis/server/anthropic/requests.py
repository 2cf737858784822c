"""Anthropic's Messages API: request bodies -> chat turns, output -> message objects.

Supported:
- `model` (the served model, "tgi", or a LoRA adapter), `max_tokens`, `stop_sequences`,
  `temperature` (0 to 1; 0 is greedy), `top_p`, `top_k`, `stream`, `metadata.user_id`,
  `service_tier`, `speed: "standard"`.
- `messages`: user and assistant turns; content as a string or blocks: `text`, `image` and
  `tool_result` in user turns, `tool_use`, `thinking` and `redacted_thinking` in assistant
  turns. A last assistant turn of text is a prefill the answer continues. An image block's
  `source` is `base64` (`media_type` image/jpeg, png, gif or webp, and `data`: read as a data
  URL) or `url` (fetched only under the server's URL policy); it becomes an image part of the
  turn, read as the chat route reads `image_url` parts (tgis.server.http.images).
- `system`: a string or text blocks.
- `tools` (custom tools: `name`, `description`, `input_schema`) and `tool_choice` (`auto`,
  `any`, `tool` with a `name`, `none`; `disable_parallel_tool_use`).
- `thinking`: `enabled` with `budget_tokens` (which caps the reasoning block), `adaptive` (the
  model decides) or `disabled`, given to the chat template as `enable_thinking`; `display:
  "omitted"` leaves the thinking blocks out.
- `output_config`: `format` (a JSON schema the answer follows) and `effort` (low, medium, high:
  the template's `reasoning_effort`).
- `cache_control`, on blocks or the request: every prompt is in the prefix cache here.
Refused with a 400 naming the field: `document` blocks, images in `tool_result` or assistant
turns, image sources of type `file`, server tools (web search, code execution, ...),
`container`, `mcp_servers`, `context_management`, thinking between tool calls, `speed:
"fast"`, `max_tokens: 0`. A text model refuses images (check_images).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tgis.engine.types import Completion, FinishReason
from tgis.params import GenerateParameters, GrammarSpec
from tgis.server.chat.options import temperature_top_p
from tgis.server.chat.prompt import IMAGE_MEDIA_TYPES, ChatOutput
from tgis.server.chat.tool_calls import NAME_PATTERN, parse_tools
from tgis.server.chat.turn import Segment, TurnRequest
from tgis.server.http.errors import invalid
from tgis.server.http.fields import Fields

REFUSED = {
    "container": "containers run Anthropic's code execution tool; nothing here runs code",
    "mcp_servers": "MCP servers are not called from here: run the tools in the client and "
    "send them as `tools`",
    "context_management": "context editing is not supported: send the messages to keep",
}
THINKING_TYPES = ("enabled", "adaptive", "disabled")
SERVICE_TIERS = ("auto", "standard_only")
# `output_config.effort` values a chat template's `reasoning_effort` takes.
EFFORTS = ("low", "medium", "high")
# Text blocks of one turn are joined as paragraphs (a template takes one string a message).
BLOCK_SEPARATOR = "\n\n"
_NAME = re.compile(NAME_PATTERN)


@dataclass(frozen=True)
class MessagesRequest:
    """A parsed /v1/messages (or count_tokens) request."""

    turn: TurnRequest
    stream: bool


def parse_messages_request(body: Any, count_only: bool = False) -> MessagesRequest:
    """POST /v1/messages (`count_only`: /v1/messages/count_tokens, which takes no
    `max_tokens` and generates nothing)."""
    f = Fields(body)
    for name, reason in REFUSED.items():
        if f.data.get(name) not in (None, [], {}):
            raise invalid(f"`{name}`: {reason}")
    model = f.required_string("model")
    max_tokens = f.integer("max_tokens", unsigned=True)
    if not count_only:
        if max_tokens is None:
            raise invalid("missing field `max_tokens`: the most tokens the answer may have")
        if max_tokens < 1:
            raise invalid(
                f"`max_tokens` must be >= 1. Given: {max_tokens} (a request that only fills the "
                "cache is not needed here: every prompt enters the prefix cache)"
            )
    speed = f.string("speed")
    if speed not in (None, "standard"):
        raise invalid(f'`speed` must be "standard" (one speed is served here), got {speed!r}')
    messages, prefill = _messages(f)
    system = _system(f)
    if system:
        messages.insert(0, {"role": "system", "content": system})
    tools = parse_tools(Fields(_chat_tools(f), ""))
    temperature = f.number("temperature")
    if temperature is not None and not 0.0 <= temperature <= 1.0:
        raise invalid(f"`temperature` must be >= 0 and <= 1. Given: {temperature:g}")
    top_k = f.integer("top_k")
    if top_k is not None and top_k < 1:
        raise invalid(f"`top_k` must be >= 1. Given: {top_k}")
    stops = f.strings("stop_sequences")
    budget, template_kwargs, shown = _thinking(f, max_tokens)
    grammar = _output_config(f, template_kwargs)
    if grammar is not None and tools is not None:
        raise invalid(
            "`output_config.format` cannot be combined with `tools`: both constrain the output"
        )
    _metadata(f)
    tier = f.string("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise invalid(f"`service_tier` must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}")
    params = GenerateParameters(
        **temperature_top_p(f),
        top_k=top_k,
        max_new_tokens=max_tokens,
        stop=stops,
        include_stop_sequence=False,
        grammar=grammar,
    )
    turn = TurnRequest(
        messages=tuple(messages),
        params=params,
        tools=tools,
        template_kwargs=template_kwargs,
        model=model,
        prefill=prefill,
        thinking_budget=budget,
        include_reasoning=shown,
    )
    return MessagesRequest(turn, stream=bool(f.boolean("stream")))


def _system(f: Fields) -> str:
    value = f.data.get("system")
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise invalid("`system` must be a string or an array of text blocks")
    return BLOCK_SEPARATOR.join(_text_block(raw, f"system[{j}]") for j, raw in enumerate(value))


def _text_block(raw: Any, path: str) -> str:
    block = Fields(raw, path)
    kind = block.string("type")
    if kind != "text":
        raise invalid(f"`{path}.type` {kind!r} is not served here: only text blocks")
    return block.required_string("text")


def _messages(f: Fields) -> tuple[list[dict[str, Any]], bool]:
    """`messages` as chat messages, and whether the last one is a prefill (an assistant turn
    of text, which the answer continues)."""
    value = f.data.get("messages")
    if not isinstance(value, list) or not value:
        raise invalid("`messages` must be a non-empty array of messages")
    out: list[dict[str, Any]] = []
    prefill = False
    for i, raw in enumerate(value):
        m = Fields(raw, f"messages[{i}]")
        role = m.required_string("role")
        if role not in ("user", "assistant"):
            raise invalid(
                f"`messages[{i}].role` must be user or assistant, got {role!r} "
                "(the system prompt goes in `system`)"
            )
        content = m.data.get("content")
        path = f"messages[{i}].content"
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise invalid(f"`{path}` must be a string or a non-empty array of content blocks")
        out += _user_turn(content, path) if role == "user" else [_assistant_turn(content, path)]
    last = out[-1]
    # A last assistant turn of text is the answer's start; one with tool calls or no text is
    # a finished turn, answered by a new one.
    prefill = last["role"] == "assistant" and bool(last["content"]) and "tool_calls" not in last
    return out, prefill


def _user_turn(blocks: list[Any], path: str) -> list[dict[str, Any]]:
    """A user turn's blocks: tool results (tool messages, first), then its text, or its text
    and image parts in order when it has images (adjacent text blocks joined either way)."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, str]] = []
    for j, raw in enumerate(blocks):
        block = Fields(raw, f"{path}[{j}]")
        kind = block.string("type")
        if kind == "text":
            text = block.required_string("text")
            if parts and parts[-1]["type"] == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + BLOCK_SEPARATOR + text}
            else:
                parts.append({"type": "text", "text": text})
        elif kind == "image":
            parts.append(_image(block))
        elif kind == "tool_result":
            text = _result_text(block.data.get("content"), f"{path}[{j}].content")
            if block.boolean("is_error"):
                text = f"Error: {text}"
            tool_use_id = block.required_string("tool_use_id")
            results.append({"role": "tool", "tool_call_id": tool_use_id, "content": text})
        elif kind == "document":
            raise invalid(
                f"`{path}[{j}].type` 'document' is not served here: documents are not read; "
                "send their text in text blocks"
            )
        else:
            raise _unserved(f"{path}[{j}]", kind, "text, image and tool_result blocks")
    if not parts:
        return results
    images = any(p["type"] == "image" for p in parts)
    return [*results, {"role": "user", "content": parts if images else parts[0]["text"]}]


def _image(block: Fields) -> dict[str, str]:
    """An image block as an image part (its URL is read with the request's images): a base64
    source as a data URL, a url source as it is."""
    source = block.obj("source")
    if source is None:
        raise invalid(
            f"missing field `{block.name('source')}`: "
            '{"type": "base64", "media_type": "image/png", "data": "..."} or '
            '{"type": "url", "url": "..."}'
        )
    kind = source.string("type")
    if kind == "base64":
        media_type = source.required_string("media_type")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise invalid(
                f"`{source.name('media_type')}` must be one of {', '.join(IMAGE_MEDIA_TYPES)}, "
                f"got {media_type!r}"
            )
        data = source.required_string("data")
        url = f"data:{media_type};base64,{data}"
        return {"type": "image", "url": url, "field": source.name("data")}
    if kind == "url":
        return {"type": "image", "url": source.required_string("url"), "field": source.name("url")}
    if kind == "file":
        raise invalid(
            f"`{source.name('type')}` 'file' is not served here: uploaded files are not stored; "
            'send the image as a "base64" or "url" source'
        )
    raise invalid(f'`{source.name("type")}` must be "base64" or "url", got {kind!r}')


def _assistant_turn(blocks: list[Any], path: str) -> dict[str, Any]:
    """An assistant turn's blocks as one message: text, tool calls and the reasoning (as
    `reasoning_content`, which templates that show past reasoning read)."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, raw in enumerate(blocks):
        block = Fields(raw, f"{path}[{j}]")
        kind = block.string("type")
        if kind == "text":
            texts.append(block.required_string("text"))
        elif kind == "thinking":
            thoughts.append(block.required_string("thinking"))
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing a template can show
        elif kind == "tool_use":
            arguments = block.obj("input")
            calls.append(
                {
                    "id": block.required_string("id"),
                    "type": "function",
                    "function": {
                        "name": block.required_string("name"),
                        "arguments": json.dumps(
                            arguments.data if arguments is not None else {}, ensure_ascii=False
                        ),
                    },
                }
            )
        else:
            raise _unserved(f"{path}[{j}]", kind, "text, tool_use and thinking blocks")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = BLOCK_SEPARATOR.join(thoughts)
    return message


def _result_text(content: Any, path: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(f"`{path}` must be a string or an array of text blocks")
    for j, raw in enumerate(content):
        if isinstance(raw, dict) and raw.get("type") == "image":
            raise invalid(
                f"`{path}[{j}].type` 'image' is not served here: a tool result takes text "
                "blocks only; send the image in an image block of the user turn"
            )
    return BLOCK_SEPARATOR.join(_text_block(raw, f"{path}[{j}]") for j, raw in enumerate(content))


def _unserved(path: str, kind: str | None, served: str) -> Exception:
    return invalid(f"`{path}.type` {kind!r} is not served here: {served} are")


def _chat_tools(f: Fields) -> dict[str, Any]:
    """`tools` and `tool_choice` in the chat API's shapes, for its parser."""
    out: dict[str, Any] = {}
    tools = f.data.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("`tools` must be an array of tools")
        out["tools"] = [_tool(raw, i) for i, raw in enumerate(tools)]
    choice = f.obj("tool_choice")
    if choice is None:
        return out
    kind = choice.string("type")
    if not out.get("tools") and kind != "none":
        raise invalid("`tool_choice` is only allowed when `tools` are given")
    if kind == "tool":
        name = choice.required_string("name")
        known = [t["function"]["name"] for t in out["tools"]]
        if name not in known:
            raise invalid(
                f"`tool_choice.name` must be one of the `tools` ({', '.join(known)}), got {name!r}"
            )
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind in ("auto", "any", "none"):
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise invalid(f'`tool_choice.type` must be "auto", "any", "tool" or "none", got {kind!r}')
    if choice.boolean("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    if kind == "none":
        out.pop("tools", None)
        out.pop("tool_choice")
    return out


def _tool(raw: Any, i: int) -> dict[str, Any]:
    t = Fields(raw, f"tools[{i}]")
    kind = t.string("type")
    if kind not in (None, "custom"):
        raise invalid(
            f"`tools[{i}].type` {kind!r} is a server tool, which is not run here: only custom "
            "tools (`name`, `description`, `input_schema`), which the client runs"
        )
    name = t.required_string("name")
    if not _NAME.match(name):
        raise invalid(
            f"`tools[{i}].name` must be 1 to 64 letters, digits, `_` or `-`, got {name!r}"
        )
    schema = t.obj("input_schema")
    if schema is None:
        raise invalid(f"missing field `tools[{i}].input_schema` (a JSON schema of an object)")
    function: dict[str, Any] = {"name": name, "parameters": schema.data}
    if t.has("description"):
        function["description"] = t.required_string("description")
    return {"type": "function", "function": function}


def _thinking(f: Fields, max_tokens: int | None) -> tuple[int | None, dict[str, Any], bool]:
    """`thinking`: the reasoning budget, the template variable that turns reasoning on or off,
    and whether the reasoning is shown (`display: "omitted"` leaves its blocks out)."""
    thinking = f.obj("thinking")
    if thinking is None:
        return None, {}, True
    kind = thinking.string("type")
    display = thinking.string("display")
    if display not in (None, "summarized", "omitted"):
        raise invalid(f'`thinking.display` must be "summarized" or "omitted", got {display!r}')
    shown = display != "omitted"
    if kind == "disabled":
        return None, {"enable_thinking": False}, shown
    if kind == "adaptive":
        return None, {"enable_thinking": True}, shown
    if kind != "enabled":
        raise invalid(
            f"`thinking.type` must be one of {', '.join(THINKING_TYPES)}, got {kind!r} "
            "(a model here thinks before its answer, not between tool calls)"
        )
    budget = thinking.integer("budget_tokens", unsigned=True)
    if budget is None:
        raise invalid("missing field `thinking.budget_tokens`: the most tokens of reasoning")
    if budget < 1 or (max_tokens is not None and budget >= max_tokens):
        raise invalid(
            f"`thinking.budget_tokens` must be >= 1 and less than `max_tokens` ({max_tokens}), "
            f"which leaves room for the answer. Given: {budget}"
        )
    return budget, {"enable_thinking": True}, shown


def _output_config(f: Fields, template_kwargs: dict[str, Any]) -> GrammarSpec | None:
    """`output_config`: `effort` (given to the template as `reasoning_effort`, added to
    `template_kwargs`) and `format` (a JSON schema the answer follows)."""
    config = f.obj("output_config")
    if config is None:
        return None
    effort = config.string("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise invalid(
                f"`output_config.effort` must be one of {', '.join(EFFORTS)} (the levels chat "
                f"templates take as `reasoning_effort`), got {effort!r}"
            )
        template_kwargs["reasoning_effort"] = effort
    fmt = config.obj("format")
    if fmt is None:
        return None
    kind = fmt.string("type")
    if kind != "json_schema":
        raise invalid(f'`output_config.format.type` must be "json_schema", got {kind!r}')
    schema = fmt.obj("schema")
    if schema is None:
        raise invalid("missing field `output_config.format.schema` (a JSON schema)")
    return GrammarSpec.json_schema(schema.data, source="output_config.format")


def _metadata(f: Fields) -> None:
    metadata = f.obj("metadata")
    if metadata is None:
        return
    metadata.string("user_id")
    other = sorted(set(metadata.data) - {"user_id"})
    if other:
        raise invalid(f"`metadata.{other[0]}` is not a metadata field: only `user_id` is")


# --- output -------------------------------------------------------------------------------


def block_of(segment: Segment, done: bool) -> dict[str, Any]:
    """A part of the output as a content block (`done`: whole, else as it opens)."""
    if segment.kind == "reasoning":
        return {"type": "thinking", "thinking": segment.text if done else "", "signature": ""}
    if segment.kind == "text":
        return {"type": "text", "text": segment.text if done else ""}
    return {
        "type": "tool_use",
        "id": segment.call_id,
        "name": segment.name,
        "input": tool_input(segment.text) if done else {},
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its `input` object ({} for arguments cut off before they were
    whole: the stream's `input_json_delta`s carry what was written)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(output: ChatOutput, completion: Completion) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence`: tool_use when calls ended the output,
    max_tokens when the limit (or the server's time limit) cut it, stop_sequence when one of
    the request's `stop_sequences` matched, else end_turn."""
    reason = completion.finish_reason
    if output.finish_reason(reason.openai()) == "tool_calls":
        return "tool_use", None
    if reason in (FinishReason.LENGTH, FinishReason.TIME_LIMIT):
        return "max_tokens", None
    if reason is FinishReason.STOP_SEQUENCE:
        return "stop_sequence", completion.stop_sequence
    return "end_turn", None


def usage(
    input_tokens: int, output_tokens: int, thinking_tokens: int | None = None
) -> dict[str, Any]:
    """Anthropic's usage (`thinking_tokens`: the reasoning's, once the output is whole)."""
    out: dict[str, Any] = {"input_tokens": input_tokens, "output_tokens": output_tokens}
    if thinking_tokens is not None:
        out["output_tokens_details"] = {"thinking_tokens": thinking_tokens}
    return out


def message_body(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    tokens: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": tokens,
    }
