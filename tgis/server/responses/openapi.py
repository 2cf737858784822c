"""OpenAI Responses' request and response schemas, built from the server's limits."""

from __future__ import annotations

from typing import Any

from tgis.params import MIN_POSITIVE
from tgis.server.chat.openapi import IMAGE_DETAIL, IMAGE_URL, TOOL, TURN_RULE, constrained_turn
from tgis.server.chat.prompt import IMAGE_DETAILS, REASONING_EFFORTS
from tgis.server.http.openapi_schemas import (
    BOOL,
    FACTOR,
    INT,
    NULL,
    NUM,
    SCHEMA_VALUE,
    STR,
    RequestSchemas,
    array,
    content,
    get,
    integer,
    null,
    obj,
    post,
    ref,
    ruled,
    typed_events,
)


def requests(s: RequestSchemas) -> dict[str, Any]:
    """OpenAI's Responses API request (tgis.server.responses.requests)."""
    text_part = obj(
        ["type", "text"], type={"enum": ["input_text", "output_text", "text"]}, text=STR
    )
    content = {"anyOf": [STR, array(text_part)]}
    message_content = content
    if s.images is not None:
        image_part = obj(
            ["type", "image_url"],
            type={"const": "input_image"},
            image_url={**STR, "minLength": 1, "description": IMAGE_URL},
            detail=null({"enum": list(IMAGE_DETAILS), "description": IMAGE_DETAIL}),
            file_id=NULL,
        )
        message_content = {"anyOf": [STR, array({"anyOf": [text_part, image_part]})]}
    message = obj(
        ["role", "content"],
        type=null({"const": "message"}),
        role={"enum": ["user", "assistant", "system", "developer"]},
        content=message_content,
    )
    call = obj(
        ["type", "call_id", "name", "arguments"],
        type={"const": "function_call"},
        call_id=STR,
        name=STR,
        arguments={**STR, "description": "JSON"},
    )
    result = obj(
        ["type", "call_id", "output"],
        type={"const": "function_call_output"},
        call_id=STR,
        output=content,
    )
    reasoning = obj(["type"], type={"const": "reasoning"})
    answered = {"not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}
    items = array({"anyOf": [message, call, result, reasoning]}, minItems=1)
    tool = obj(
        ["type", "name"],
        type={"const": "function"},
        name=TOOL["properties"]["function"]["properties"]["name"],
        description=null(STR),
        parameters=TOOL["properties"]["function"]["properties"]["parameters"],
        strict=null(BOOL),
    )
    choice = {
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            obj(["type", "name"], type={"const": "function"}, name=STR),
        ],
        "description": "names one of `tools`",
    }
    fmt = {
        "anyOf": [
            obj(["type"], type={"enum": ["text", "json_object"]}),
            obj(
                ["type", "schema"],
                type={"const": "json_schema"},
                name=null(STR),
                description=null(STR),
                schema=SCHEMA_VALUE,
                strict=null(BOOL),
            ),
        ]
    }
    request = obj(
        ["input"],
        model=null(STR),
        input={"anyOf": [s.prompt_text(), {**items, "contains": answered}]},
        instructions=null(STR),
        tools=null(array(tool)),
        tool_choice=null(choice),
        parallel_tool_calls=null(BOOL),
        text=null(obj([], format=null(fmt))),
        max_output_tokens=null(integer(1, s.max_new_tokens)),
        temperature=null({"anyOf": [{"const": 0}, FACTOR], "description": "0: greedy"}),
        top_p=null({**NUM, "minimum": MIN_POSITIVE, "maximum": 1}),
        reasoning=null(obj([], effort=null({"enum": list(REASONING_EFFORTS)}), summary=NULL)),
        stream=null({**BOOL, "default": False}),
        store=null(BOOL if s.stored_responses else {"const": False}),
        previous_response_id=null(STR),
        metadata=null({"type": "object", "maxProperties": 16, "additionalProperties": STR}),
        user=null(STR),
        truncation=null({"const": "disabled"}),
        background=null({"const": False}),
        conversation=NULL,
        prompt=NULL,
        top_logprobs=null({"const": 0}),
        include=null(array({}, maxItems=0)),
    )
    request["allOf"] = [ruled(constrained_turn("text"), TURN_RULE)]
    return {"ResponsesRequest": request}


_ITEM_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
_OUTPUT_ITEM = {
    "anyOf": [
        obj(
            ["type", "id", "summary"],
            type={"const": "reasoning"},
            id=STR,
            summary=array({}),
            content=array(obj(["type", "text"], type={"const": "reasoning_text"}, text=STR)),
        ),
        obj(
            ["type", "id", "status", "role", "content"],
            type={"const": "message"},
            id=STR,
            status=_ITEM_STATUS,
            role={"const": "assistant"},
            content=array(
                obj(
                    ["type", "text", "annotations"],
                    type={"const": "output_text"},
                    text=STR,
                    annotations=array({}),
                )
            ),
        ),
        obj(
            ["type", "id", "call_id", "name", "arguments"],
            type={"const": "function_call"},
            id=STR,
            call_id=STR,
            name=STR,
            arguments={**STR, "description": "JSON"},
            status=_ITEM_STATUS,
        ),
    ]
}
RESPONSES: dict[str, Any] = {
    "Response": obj(
        ["id", "object", "created_at", "status", "model", "output", "tools", "tool_choice"],
        id=STR,
        object={"const": "response"},
        created_at=INT,
        status={"enum": ["in_progress", "completed", "incomplete", "failed"]},
        model=STR,
        output=array(_OUTPUT_ITEM),
        incomplete_details=null(obj(["reason"], reason=STR)),
        previous_response_id=null(STR),
        usage=null(
            obj(
                ["input_tokens", "output_tokens", "total_tokens"],
                input_tokens=INT,
                output_tokens=INT,
                total_tokens=INT,
                input_tokens_details=obj([], cached_tokens=INT),
                output_tokens_details=obj([], reasoning_tokens=INT),
            )
        ),
        tools=array({"type": "object"}),
        tool_choice={"anyOf": [STR, {"type": "object"}]},
    ),
    "ResponseStreamEvent": obj(
        ["type", "sequence_number"],
        type={"type": "string", "description": "response.created ... response.completed"},
        sequence_number=INT,
        response=ref("Response"),
        item=_OUTPUT_ITEM,
        output_index=INT,
        content_index=INT,
        item_id=STR,
        delta=STR,
        text=STR,
        arguments=STR,
    ),
}


# Tagged as OpenAI's, whose package describes the tag.
TAG = "OpenAI"
TAGS: tuple[dict[str, str], ...] = ()

_NOT_STORED = {
    "404": {
        "description": "No such stored response (unknown, or dropped: --max-stored-responses)",
        "content": content(ref("OpenAIError")),
    }
}


def _responses_post() -> dict[str, Any]:
    """POST /v1/responses: a Response, or Responses' stream of typed events."""
    path = post(
        "OpenAI Responses (one chat turn; `previous_response_id` continues a stored one)",
        "ResponsesRequest",
        {**content(ref("Response")), **typed_events(ref("ResponseStreamEvent"))},
        TAG,
        openai=True,
    )
    path["post"]["responses"].update(_NOT_STORED)
    return path


def _stored_response() -> dict[str, Any]:
    path = get("A stored response", content(ref("Response")), TAG, **_NOT_STORED)
    path["get"]["parameters"] = [
        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    return path


def paths() -> dict[str, Any]:
    """The Responses API's operations."""
    return {
        "/v1/responses": _responses_post(),
        "/v1/responses/{response_id}": _stored_response(),
    }
