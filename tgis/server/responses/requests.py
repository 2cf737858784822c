"""OpenAI's Responses API: request bodies -> chat turns, output -> response objects, and the
bounded store that `previous_response_id` reads.

Supported: `input` (a string, or items: messages with text and `input_image` parts,
`function_call`, `function_call_output`; `reasoning` items are accepted and left out of the
prompt, as chat templates drop earlier reasoning), `instructions`, `tools` (functions),
`tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
`max_output_tokens`, `temperature`, `top_p`, `reasoning.effort` (given to the chat template as
`reasoning_effort`), `stream`, `store`, `previous_response_id`, `metadata`, `user`, `model`.
An `input_image` part's `image_url` (a data URL, or an http(s) URL the server's policy decides
on) becomes an image part of its message, read as the chat route reads `image_url` parts
(tgis.server.http.images); its `detail` (auto, low, high, original) is checked and changes nothing:
the model's own image processor decides the resolution.
Refused with a 422 naming the field: tools other than functions, `input_image` by `file_id`,
`input_file`, images in `function_call_output`, `background`, `conversation`, `prompt`,
`truncation: auto`, `top_logprobs`, `include`. A text model refuses images (check_images).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from tgis.params import GenerateParameters
from tgis.server.chat.options import response_format, temperature_top_p, template_kwargs
from tgis.server.chat.prompt import IMAGE_DETAILS
from tgis.server.chat.tool_calls import parse_tools
from tgis.server.chat.turn import Segment, TurnRequest, new_id
from tgis.server.http.errors import invalid
from tgis.server.http.fields import Fields

MAX_METADATA_KEYS = 16
REFUSED = {
    "background": "background responses are not supported: send the request and wait for it",
    "conversation": "`conversation` objects are not stored here: use `previous_response_id`",
    "prompt": "stored prompt templates are not supported: send `input` and `instructions`",
    "top_logprobs": "`top_logprobs` is not supported on /v1/responses: use /v1/chat/completions",
    "include": "`include` is not supported: outputs are returned whole",
}
# Text content parts (input messages', and the output messages' a client sends back).
TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class ResponsesRequest:
    """A parsed /v1/responses request."""

    turn: TurnRequest
    # The messages this request adds (its input; instructions are not carried over).
    input_messages: tuple[dict[str, Any], ...]
    instructions: str | None
    previous_response_id: str | None
    stream: bool
    store: bool
    # Fields echoed in the response object.
    echo: dict[str, Any] = field(default_factory=dict)

    def turn_after(self, history: tuple[dict[str, Any], ...]) -> TurnRequest:
        """The turn with `history` (the conversation a stored response ends) before this
        request's input, after its instructions."""
        if not history:
            return self.turn
        earlier = tuple(_earlier(m) for m in history)
        messages = _conversation(self.instructions, (*earlier, *self.input_messages))
        return replace(self.turn, messages=messages)


def _earlier(message: dict[str, Any]) -> dict[str, Any]:
    """A message of a stored conversation, its images' fields saying where they came from."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [
        {**p, "field": f"{p['field']} (of previous_response_id's conversation)"}
        if p["type"] == "image"
        else p
        for p in content
    ]
    return {**message, "content": parts}


def _conversation(
    instructions: str | None, messages: tuple[dict[str, Any], ...]
) -> tuple[dict[str, Any], ...]:
    """`messages` after the instructions' system message."""
    system = ({"role": "system", "content": instructions},) if instructions else ()
    return (*system, *messages)


def parse_responses_request(body: Any, store_size: int) -> ResponsesRequest:
    """POST /v1/responses (the conversation before `previous_response_id` is the route's)."""
    f = Fields(body)
    for name, reason in REFUSED.items():
        value = f.data.get(name)
        if value not in (None, False, [], 0):
            raise invalid(f"`{name}`: {reason}")
    truncation = f.string("truncation")
    if truncation not in (None, "disabled"):
        raise invalid('`truncation` must be "disabled": prompts over the limit are refused')
    instructions = f.string("instructions")
    messages = _input(f)
    chat = _chat_fields(f)
    tools = parse_tools(Fields(chat, ""))
    grammar = response_format(Fields(chat, ""), "text.format")
    if tools is not None and grammar is not None:
        raise invalid("`text.format` cannot be combined with `tools`: both constrain the output")
    temperature = f.number("temperature")
    top_p = f.number("top_p")
    params = GenerateParameters(
        **temperature_top_p(f),
        max_new_tokens=f.integer("max_output_tokens", unsigned=True),
        grammar=grammar,
        include_stop_sequence=False,
    )
    reasoning = f.obj("reasoning")
    effort = reasoning.string("effort") if reasoning is not None else None
    if reasoning is not None and reasoning.has("summary"):
        raise invalid(
            "`reasoning.summary`: summaries are not written here; the reasoning comes whole "
            "in the output's reasoning item"
        )
    store = f.boolean("store")
    if store and store_size == 0:
        raise invalid("`store`: this server keeps no responses (--max-stored-responses 0)")
    metadata = f.obj("metadata")
    if metadata is not None:
        values = metadata.data
        if len(values) > MAX_METADATA_KEYS or not all(isinstance(v, str) for v in values.values()):
            raise invalid(f"`metadata` must be at most {MAX_METADATA_KEYS} strings by key")
    turn = TurnRequest(
        messages=_conversation(instructions, tuple(messages)),
        params=params,
        tools=tools,
        template_kwargs=template_kwargs(f, effort),
        model=f.string("model"),
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": params.max_new_tokens,
        "metadata": metadata.data if metadata is not None else {},
        "parallel_tool_calls": f.boolean("parallel_tool_calls") is not False,
        "reasoning": {"effort": effort, "summary": None},
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "text": {"format": _given_format(f) or {"type": "text"}},
        "tool_choice": f.data.get("tool_choice") or ("auto" if tools else "none"),
        "tools": f.data.get("tools") or [],
        "truncation": "disabled",
        "user": f.string("user"),
    }
    return ResponsesRequest(
        turn=turn,
        input_messages=tuple(messages),
        instructions=instructions,
        previous_response_id=f.string("previous_response_id"),
        stream=bool(f.boolean("stream")),
        store=store_size > 0 if store is None else store,
        echo=echo,
    )


def _chat_fields(f: Fields) -> dict[str, Any]:
    """`tools`, `tool_choice`, `parallel_tool_calls` and `text.format` in the chat API's
    shapes, to be read by its parsers (their messages name the chat fields' paths)."""
    out: dict[str, Any] = {}
    tools = f.data.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("`tools` must be an array of tools")
        out["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    choice = f.data.get("tool_choice")
    if isinstance(choice, dict):
        named = Fields(choice, "tool_choice")
        if named.string("type") != "function":
            raise invalid('`tool_choice.type` must be "function" (the only tools served here)')
        choice = {"type": "function", "function": {"name": named.required_string("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    if f.has("parallel_tool_calls"):
        out["parallel_tool_calls"] = f.data["parallel_tool_calls"]
    text = f.obj("text")
    fmt = text.obj("format") if text is not None else None
    if fmt is not None:
        kind = fmt.string("type")
        schema = fmt.data.get("schema")
        if kind == "json_schema" and schema is None:
            raise invalid("`text.format.schema` is required (a JSON schema)")
        out["response_format"] = (
            {"type": kind, "json_schema": {"schema": schema}}
            if kind == "json_schema"
            else {"type": kind}
        )
    return out


def _given_format(f: Fields) -> Any:
    text = f.obj("text")
    return text.data.get("format") if text is not None else None


def _tool(raw: Any, i: int) -> dict[str, Any]:
    t = Fields(raw, f"tools[{i}]")
    kind = t.string("type")
    if kind != "function":
        raise invalid(
            f"`tools[{i}].type` {kind!r} is not served here: only function tools "
            '(`{"type": "function", "name": ..., "parameters": ...}`)'
        )
    function = {"name": t.required_string("name")}
    for key in ("description", "parameters"):
        if t.has(key):
            function[key] = t.data[key]
    return {"type": "function", "function": function}


def _input(f: Fields) -> list[dict[str, Any]]:
    """`input` as chat messages."""
    value = f.data.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("`input` must be a string or a non-empty array of input items")
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(value):
        item = Fields(raw, f"input[{i}]")
        kind = item.string("type") or "message"
        if kind == "message":
            role = item.required_string("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(
                    f"`input[{i}].role` must be user, assistant, system or developer, got {role!r}"
                )
            content = _content(item.data.get("content"), f"input[{i}].content")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {
                "id": item.required_string("call_id"),
                "type": "function",
                "function": {
                    "name": item.required_string("name"),
                    "arguments": item.required_string("arguments"),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _content(item.data.get("output"), f"input[{i}].output")
            if isinstance(output, list):
                field = next(p["field"] for p in output if p["type"] == "image")
                raise invalid(
                    f"`{field.removesuffix('.image_url')}`: images in a function_call_output "
                    "are not served here; send the image in an input_image part of a user "
                    "message after it"
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.required_string("call_id"),
                    "content": output,
                }
            )
        elif kind != "reasoning":
            part = kind in (*TEXT_PARTS, "input_image", "input_file")
            raise invalid(
                f"`input[{i}].type` {kind!r} is not served here: messages, function_call, "
                "function_call_output and reasoning items are"
                + (f" (a {kind} part goes in a message's `content`)" if part else "")
            )
    if not messages:
        raise invalid("`input` has no message to answer")
    return messages


def _content(content: Any, path: str) -> str | list[dict[str, str]]:
    """A message's content: its text, or, when it has input_image parts, its text and image
    parts in order (`{"type": "image", "url", "field"}`, read later: tgis.server.http.images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"`{path}` must be a string or an array of input_text and input_image parts")
    parts = [_part(raw, f"{path}[{j}]") for j, raw in enumerate(content)]
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _part(raw: Any, path: str) -> dict[str, str]:
    part = Fields(raw, path)
    kind = part.string("type")
    if kind in TEXT_PARTS:
        return {"type": "text", "text": part.required_string("text")}
    if kind == "input_image":
        return _image(part)
    if kind == "input_file":
        raise invalid(
            f"`{path}.type` 'input_file' is not served here: files are not read; send their "
            "text as input_text parts, images as input_image parts"
        )
    raise invalid(
        f"`{path}.type` {kind!r} is not served here: text parts (input_text) and images "
        "(input_image) are"
    )


def _image(part: Fields) -> dict[str, str]:
    """An input_image part as an image part (its URL is read with the request's images)."""
    if part.has("file_id"):
        raise invalid(
            f"`{part.name('file_id')}`: uploaded files are not stored here; send the image "
            "itself as `image_url` (a data URL, `data:image/png;base64,...`)"
        )
    detail = part.string("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise invalid(
            f"`{part.name('detail')}` must be one of {', '.join(IMAGE_DETAILS)}, got {detail!r} "
            "(it changes nothing here: the model's image processor decides the resolution)"
        )
    url = part.string("image_url")
    if not url:
        raise invalid(
            f"`{part.name('image_url')}` must be the image's URL: a data URL "
            "(`data:image/png;base64,...`), or an http(s) URL where the server fetches them"
        )
    return {"type": "image", "url": url, "field": part.name("image_url")}


# --- output -------------------------------------------------------------------------------


def item_of(segment: Segment, item_id: str, done: bool) -> dict[str, Any]:
    """A part of the output as a Responses output item (`done`: whole, else as it opens)."""
    status = "completed" if done else "in_progress"
    if segment.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": segment.text}] if done else []
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content}
    if segment.kind == "text":
        content = [text_part(segment.text)] if done else []
        return {
            "type": "message",
            "id": item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": segment.call_id,
        "name": segment.name,
        "arguments": segment.text if done else "",
        "status": status,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def item_id(segment: Segment) -> str:
    prefix = {"reasoning": "rs", "text": "msg", "call": "fc"}[segment.kind]
    return new_id(prefix)


def output_messages(parts: list[Segment]) -> list[dict[str, Any]]:
    """The output as chat messages, for the conversation a later response continues."""
    text = "".join(p.text for p in parts if p.kind == "text")
    calls = [
        {"id": p.call_id, "type": "function", "function": {"name": p.name, "arguments": p.text}}
        for p in parts
        if p.kind == "call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


@dataclass
class ResponseObject:
    """A response's fields, built once and written as each event needs it."""

    id: str
    model: str
    request: ResponsesRequest
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "model": self.model,
            "output": output,
            "previous_response_id": self.request.previous_response_id,
            "store": self.request.store,
            "usage": usage,
            **self.request.echo,
        }


def response_usage(prompt: int, generated: int, reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + generated,
    }
