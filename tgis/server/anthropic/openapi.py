"""Anthropic Messages' request and response schemas, built from the server's limits."""

from __future__ import annotations

from typing import Any

from tgis.params import MIN_POSITIVE
from tgis.server.chat.openapi import IMAGE_URL
from tgis.server.chat.prompt import IMAGE_MEDIA_TYPES
from tgis.server.chat.tool_calls import NAME_PATTERN
from tgis.server.http.openapi_schemas import (
    BOOL,
    INT,
    NULL,
    NUM,
    POSITIVE,
    SCHEMA_VALUE,
    STR,
    RequestSchemas,
    array,
    content,
    integer,
    null,
    obj,
    ref,
    ruled,
    typed_events,
)


def requests(s: RequestSchemas) -> dict[str, Any]:
    """Anthropic's Messages API requests (tgis.server.anthropic.requests)."""
    cache = {"cache_control": null({"type": "object"})}
    text = obj(["type", "text"], type={"const": "text"}, text=STR, **cache)
    texts = {"anyOf": [STR, array(text)]}
    result = obj(
        ["type", "tool_use_id"],
        type={"const": "tool_result"},
        tool_use_id=STR,
        content=null(texts),
        is_error=null(BOOL),
        **cache,
    )
    use = obj(
        ["type", "id", "name", "input"],
        type={"const": "tool_use"},
        id=STR,
        name=STR,
        input={"type": "object"},
        **cache,
    )
    thought = obj(
        ["type", "thinking"], type={"const": "thinking"}, thinking=STR, signature=null(STR)
    )
    redacted = obj(["type"], type={"const": "redacted_thinking"}, data=null(STR))
    blocks = [text, result]
    if s.images is not None:
        base64 = obj(
            ["type", "media_type", "data"],
            type={"const": "base64"},
            media_type={"enum": list(IMAGE_MEDIA_TYPES)},
            data={**STR, "description": "the image's bytes in base64"},
        )
        url = obj(["type", "url"], type={"const": "url"}, url={**STR, "description": IMAGE_URL})
        image = obj(
            ["type", "source"],
            type={"const": "image"},
            source={"anyOf": [base64, url]},
            **cache,
        )
        blocks.insert(1, image)
    user = obj(
        ["role", "content"],
        role={"const": "user"},
        content={"anyOf": [STR, array({"anyOf": blocks}, minItems=1)]},
    )
    assistant = obj(
        ["role", "content"],
        role={"const": "assistant"},
        content={"anyOf": [STR, array({"anyOf": [text, use, thought, redacted]}, minItems=1)]},
    )
    tool = obj(
        ["name", "input_schema"],
        type=null({"const": "custom"}),
        name={**STR, "pattern": NAME_PATTERN},
        description=null(STR),
        input_schema={
            "type": "object",
            "properties": {"type": {"const": "object"}},
            "description": "a JSON schema of the input, an object (llguidance's subset)",
        },
        **cache,
    )
    parallel = {"disable_parallel_tool_use": null(BOOL)}
    choice = {
        "anyOf": [
            obj(["type"], type={"enum": ["auto", "any"]}, **parallel),
            obj(["type"], type={"const": "none"}),
            obj(["type", "name"], type={"const": "tool"}, name=STR, **parallel),
        ],
        "description": "`tool` names one of `tools`",
    }
    display = {"display": null({"enum": ["summarized", "omitted"]})}
    thinking = {
        "anyOf": [
            obj(["type"], type={"enum": ["disabled", "adaptive"]}, **display),
            obj(
                ["type", "budget_tokens"],
                type={"const": "enabled"},
                budget_tokens=integer(
                    1, s.max_new_tokens - 1, description="less than `max_tokens`"
                ),
                **display,
            ),
        ]
    }
    fmt = obj(["type", "schema"], type={"const": "json_schema"}, schema=SCHEMA_VALUE)
    output = obj([], effort=null({"enum": ["low", "medium", "high"]}), format=null(fmt))
    turn = {
        "model": STR,
        "messages": array({"anyOf": [user, assistant]}, minItems=1),
        "system": null(texts),
        "tools": null(array(tool)),
        "tool_choice": null(choice),
        "thinking": null(thinking),
        "output_config": null(output),
        "cache_control": null({"type": "object"}),
        "metadata": null({**obj([], user_id=null(STR)), "additionalProperties": False}),
        "container": NULL,
        "mcp_servers": null(array({}, maxItems=0)),
        "context_management": NULL,
    }
    request = obj(
        ["model", "max_tokens", "messages"],
        max_tokens=integer(1, s.max_new_tokens),
        stop_sequences=null(array(STR, maxItems=s.limits.max_stop_sequences)),
        temperature=null(
            {"anyOf": [{"const": 0}, {**POSITIVE, "maximum": 1}], "description": "0: greedy"}
        ),
        top_p=null({**NUM, "minimum": MIN_POSITIVE, "maximum": 1}),
        top_k=null(integer(1)),
        stream=null({**BOOL, "default": False}),
        service_tier=null({"enum": ["auto", "standard_only"]}),
        speed=null({"const": "standard"}),
        **turn,
    )
    unused = obj(["type"], type={"const": "none"})
    free = {"properties": {"tool_choice": null(unused), "tools": null(array({}, maxItems=0))}}
    declined = {"required": ["tool_choice"], "properties": {"tool_choice": unused}}
    calls = {
        "required": ["tools"],
        "properties": {
            "tools": {"type": "array", "minItems": 1},
            "output_config": null(obj([], format=NULL)),
        },
    }
    rule = ruled(
        {"anyOf": [free, declined, calls]},
        "`tool_choice` needs `tools`; `output_config.format` and `tools` (unless "
        '`tool_choice` is "none") both constrain the output, so not both',
    )
    request["allOf"] = [rule]
    count = obj(["model", "messages"], **turn)
    count["allOf"] = [rule]
    return {"MessagesRequest": request, "CountTokensRequest": count}


_CONTENT_BLOCK = {
    "anyOf": [
        obj(["type", "text"], type={"const": "text"}, text=STR),
        obj(
            ["type", "thinking", "signature"],
            type={"const": "thinking"},
            thinking=STR,
            signature=STR,
        ),
        obj(
            ["type", "id", "name", "input"],
            type={"const": "tool_use"},
            id=STR,
            name=STR,
            input={"type": "object"},
        ),
    ]
}
_MESSAGE_USAGE = obj(
    ["output_tokens"],
    input_tokens=INT,
    output_tokens=INT,
    output_tokens_details=obj(["thinking_tokens"], thinking_tokens=INT),
)
_STOP_REASON = null({"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]})
RESPONSES: dict[str, Any] = {
    "Message": obj(
        ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
        id=STR,
        type={"const": "message"},
        role={"const": "assistant"},
        model=STR,
        content=array(_CONTENT_BLOCK),
        stop_reason=_STOP_REASON,
        stop_sequence=null(STR),
        usage=_MESSAGE_USAGE,
    ),
    "MessageStreamEvent": obj(
        ["type"],
        type={
            "enum": [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        },
        message=ref("Message"),
        index=INT,
        content_block=_CONTENT_BLOCK,
        delta={
            "anyOf": [
                obj(["type", "text"], type={"const": "text_delta"}, text=STR),
                obj(["type", "thinking"], type={"const": "thinking_delta"}, thinking=STR),
                obj(
                    ["type", "partial_json"],
                    type={"const": "input_json_delta"},
                    partial_json=STR,
                ),
                obj(["stop_reason"], stop_reason=_STOP_REASON, stop_sequence=null(STR)),
            ]
        },
        usage=_MESSAGE_USAGE,
    ),
    "MessageTokensCount": obj(["input_tokens"], input_tokens=INT),
    "AnthropicError": obj(
        ["type", "error"],
        type={"const": "error"},
        error=obj(["type", "message"], type=STR, message=STR),
    ),
}


TAG = "Anthropic"
TAGS = ({"name": TAG, "description": "Anthropic-compatible Messages API"},)

# Anthropic's statuses: 400 for an invalid request, 529 when the queue is full.
_ANTHROPIC_ERRORS = {
    "400": "Invalid request",
    "401": "Missing or wrong API key (when the server has one)",
    "424": "Generation error",
    "500": "Incomplete generation or internal error",
    "503": "Server is shutting down",
    "529": "Model is overloaded",
}


def _anthropic_post(summary: str, request: str, ok: dict[str, Any]) -> dict[str, Any]:
    errors = {
        code: {"description": text, "content": content(ref("AnthropicError"))}
        for code, text in _ANTHROPIC_ERRORS.items()
    }
    return {
        "post": {
            "tags": [TAG],
            "summary": summary,
            "requestBody": {"required": True, "content": content(ref(request))},
            "responses": {"200": {"description": "OK", "content": ok}, **errors},
            "security": [{"bearer": []}, {"x-api-key": []}, {}],
        }
    }


def _messages_post() -> dict[str, Any]:
    """POST /v1/messages: a Message, or Anthropic's stream of typed events."""
    events = typed_events({"anyOf": [ref("MessageStreamEvent"), ref("AnthropicError")]})
    return _anthropic_post(
        "Anthropic Messages (one chat turn; `stream` chooses JSON or server-sent events)",
        "MessagesRequest",
        {**content(ref("Message")), **events},
    )


def paths() -> dict[str, Any]:
    """The Messages API's operations."""
    return {
        "/v1/messages": _messages_post(),
        "/v1/messages/count_tokens": _anthropic_post(
            "Anthropic Messages: the prompt's tokens, as /v1/messages would make it",
            "CountTokensRequest",
            content(ref("MessageTokensCount")),
        ),
    }
