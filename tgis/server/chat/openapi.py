"""The schema pieces the chat APIs share: tools, a tool choice, a response format, the chat
template's variables, images by URL, and what a turn allows of tools and an output format."""

from __future__ import annotations

from typing import Any

from tgis.server.chat.prompt import REASONING_EFFORTS, RESERVED_TEMPLATE_KWARGS
from tgis.server.chat.tool_calls import NAME_PATTERN
from tgis.server.http.openapi_schemas import (
    BOOL,
    NULL,
    SCHEMA_VALUE,
    STR,
    array,
    null,
    obj,
)

RESPONSE_FORMAT: dict[str, Any] = {
    "anyOf": [
        obj([], type=null({"enum": ["text", "json_object"]})),
        obj(
            ["type", "json_schema"],
            type={"const": "json_schema"},
            json_schema=obj(
                ["schema"],
                name=null(STR),
                description=null(STR),
                schema=SCHEMA_VALUE,
                strict=null(BOOL),
            ),
        ),
    ]
}
TOOL: dict[str, Any] = obj(
    ["type", "function"],
    type={"const": "function"},
    function=obj(
        ["name"],
        name={**STR, "pattern": NAME_PATTERN},
        description=null(STR),
        parameters=null(
            {
                "type": "object",
                "properties": {"type": {"const": "object"}},
                "description": "a JSON schema of the arguments, an object (llguidance's subset)",
            }
        ),
        strict=null(BOOL),
    ),
)
TOOL_CHOICE: dict[str, Any] = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        obj(["type", "function"], type={"const": "function"}, function=obj(["name"], name=STR)),
    ],
    "description": "names one of `tools`",
}
IMAGE_URL = (
    "a data URL (`data:image/png;base64,...`: PNG, JPEG, WebP or GIF), or an http(s) URL the "
    "server fetches only with --allow-image-urls"
)
IMAGE_DETAIL = "changes nothing here: the model's image processor decides the resolution"


def constrained_turn(format_field: str) -> dict[str, Any]:
    """What the Responses and Messages APIs allow of tools and an output format (the field
    that holds it: `text` with its `format`; None: none): tools to call and no format, or no
    tools (or tool_choice "none") and any format."""
    nonempty = {"type": "array", "minItems": 1}
    no_tools = {"properties": {"tool_choice": NULL, "tools": null(array({}, maxItems=0))}}
    unused = {
        "required": ["tools", "tool_choice"],
        "properties": {"tools": nonempty, "tool_choice": {"enum": ["none"]}},
    }
    calls = {"required": ["tools"], "properties": {"tools": nonempty}}
    free = {
        "properties": {format_field: null(obj([], format=null(obj([], type={"const": "text"}))))}
    }
    return {"anyOf": [no_tools, unused, {"allOf": [calls, free]}]}


TURN_RULE = (
    '`tool_choice` needs `tools`; `text.format` and `tools` (unless `tool_choice` is "none") '
    "both constrain the output, so not both"
)
# The chat template's variables a chat request may set, and whether its reasoning comes back.
CHAT_TEMPLATE_FIELDS: dict[str, Any] = {
    "chat_template_kwargs": null(
        {
            "type": "object",
            "description": "variables of the chat template (e.g. Qwen3's enable_thinking)",
            "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}},
        }
    ),
    "reasoning_effort": null({"type": "string", "enum": list(REASONING_EFFORTS)}),
    "include_reasoning": null({**BOOL, "default": True}),
}
