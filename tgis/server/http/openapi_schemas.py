"""The APIs' JSON Schemas (OpenAPI 3.1, JSON Schema 2020-12): the pieces every API's schemas
are made of, and `RequestSchemas`, the server's limits and model they are built from.

Each API's request and response schemas live beside its routes (`tgis.server.tgi.openapi`,
`tgis.server.openai.openapi`, `tgis.server.responses.openapi`, `tgis.server.anthropic.openapi`;
what the chat APIs share, `tgis.server.chat.openapi`). The request schemas are the server's
contract: they go into /openapi.json and `tgis.server.http.contract` checks every request body
against the same objects, so the document never allows what the server refuses to check. What a
schema cannot state is a rule over token counts (the prompt's tokens and `max_new_tokens` within
`max_total_tokens`, `min_new_tokens` within `max_new_tokens`): those stay tgis.params's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tgis.params import MAX_FACTOR, MAX_SEED, MIN_POSITIVE, RequestLimits
from tgis.server.http.images import ImageLimits

# The widest integer a field takes where no other limit applies (a signed 64-bit value).
MAX_INT = 2**63 - 1


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: list[str], **props: Any) -> dict[str, Any]:
    """An object schema with `props` (other properties are allowed: clients send extras)."""
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema


def null(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or null (null reads as "not given")."""
    kind = schema.get("type")
    if isinstance(kind, str) and "enum" not in schema and "const" not in schema:
        return {**schema, "type": [kind, "null"]}
    if "const" in schema and len(schema) == 1 + ("x-rule" in schema) + ("description" in schema):
        rest = {k: v for k, v in schema.items() if k != "const"}
        return {**rest, "enum": [schema["const"], None]}
    return {"anyOf": [schema, {"type": "null"}]}


def array(items: dict[str, Any], **bounds: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, **bounds}


def integer(minimum: int = 0, maximum: int = MAX_INT, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum, **extra}


STR: dict[str, Any] = {"type": "string"}
NUM: dict[str, Any] = {"type": "number"}
BOOL: dict[str, Any] = {"type": "boolean"}
NULL: dict[str, Any] = {"type": "null"}
INT = integer()
FINISH_REASON = {"type": "string", "enum": ["length", "eos_token", "stop_sequence", "time_limit"]}
# Positive floats that stay non-zero in a float32 computation (tgis.params.MIN_POSITIVE).
POSITIVE: dict[str, Any] = {"type": "number", "minimum": MIN_POSITIVE}
# A temperature or a repetition penalty (tgis.params.MAX_FACTOR).
FACTOR: dict[str, Any] = {**POSITIVE, "maximum": MAX_FACTOR}
# Strictly between 0 and 1, and usable in float32.
FRACTION: dict[str, Any] = {"type": "number", "minimum": MIN_POSITIVE, "exclusiveMaximum": 1}
PENALTY: dict[str, Any] = {"type": "number", "minimum": -2.0, "maximum": 2.0}
SEED = integer(0, MAX_SEED)


def pooling_input(max_inputs: int) -> dict[str, Any]:
    """The inputs of an embeddings request (http/fields.pooling_inputs): a string, strings,
    token ids or arrays of token ids, at most `max_inputs`."""
    ids = array(integer(), minItems=1)
    text = {"type": "string", "minLength": 1}
    return {
        "anyOf": [
            text,
            array(text, minItems=1, maxItems=max_inputs),
            ids,
            array(ids, minItems=1, maxItems=max_inputs),
        ]
    }


# The error bodies: TGI's (and TEI's) and OpenAI's.
ERROR_RESPONSE = obj(["error", "error_type"], error=STR, error_type=STR)
OPENAI_ERROR = obj(
    ["error"],
    error=obj(["message", "type"], message=STR, type=STR, param=null(STR), code=null(INT)),
)

SCHEMA_VALUE = {
    "type": "object",
    "description": "a JSON schema (llguidance's subset: no `not`); the output is compact JSON",
}
IGNORE_EOS = (
    "vLLM's extension: EOS ends nothing (it is sampled as any token), so the output runs to its "
    "token limit, a stop sequence or the time limit; not with a grammar"
)
PREFIX_ID = (
    "TGIS: a tuned prompt prefix of the server's --prefix-store-path, whose virtual tokens go "
    "before the input (and count toward the token limits)"
)


def given(name: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """The object has `name`, not null (and matching `schema`)."""
    return {"required": [name], "properties": {name: schema or {"not": NULL}}}


def when(condition: dict[str, Any], then: dict[str, Any], rule: str) -> dict[str, Any]:
    """`then` applies when `condition` holds; `rule` says so in words (`x-rule`: the message a
    request that breaks it gets, wherever in `then` it fails)."""
    return {"if": condition, "then": ruled(then, rule)}


def ruled(schema: dict[str, Any], rule: str) -> dict[str, Any]:
    """`schema` and each subschema under it carry `rule` as their x-rule."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if isinstance(value, dict):
            value = (
                ruled(value, rule)
                if key != "properties"
                else {name: ruled(sub, rule) for name, sub in value.items()}
            )
        elif isinstance(value, list):
            value = [ruled(v, rule) if isinstance(v, dict) else v for v in value]
        out[key] = value
    return {**out, "x-rule": rule}


_ADAPTER_ID = (
    'a LoRA adapter of the server\'s --lora-adapters or --lora-adapter-dir (null or "": the '
    "base model)"
)


def decimal_below(n: int) -> str:
    """A regex of the decimal integers 0 .. n-1 (no leading zeros): the token ids a JSON
    object's keys may name (`logit_bias`)."""
    top = str(n - 1)
    options = ["0"] if n > 0 else []
    for length in range(1, len(top)):
        options.append("[1-9]" + (f"[0-9]{{{length - 1}}}" if length > 1 else ""))
    if n > 10:
        for i, digit in enumerate(top):
            low = 1 if i == 0 else 0
            if int(digit) > low:
                rest = len(top) - i - 1
                tail = f"[0-9]{{{rest}}}" if rest else ""
                options.append(f"{top[:i]}[{low}-{int(digit) - 1}]{tail}")
        options.append(top)
    elif n > 1:
        options.append(f"[1-{n - 1}]")
    return "^(" + "|".join(dict.fromkeys(options)) + ")$"


@dataclass(frozen=True)
class AdapterChoice:
    """What `adapter_id` may be: the adapters named at start-up, and whether a directory
    serves others on demand (any name then, checked when asked for)."""

    names: tuple[str, ...] = ()
    on_demand: bool = False

    @staticmethod
    def of(store: Any) -> AdapterChoice:
        """The choice a tgis.adapter_store.AdapterStore (or None) offers."""
        if store is None:
            return AdapterChoice()
        return AdapterChoice(tuple(store.named), store.directory is not None)

    def schema(self) -> dict[str, Any]:
        if self.on_demand:
            return null({**STR, "pattern": r"^[/\w\-.]*$", "description": _ADAPTER_ID})
        if self.names:
            return null({"enum": ["", *self.names], "description": _ADAPTER_ID})
        return null({"const": "", "description": "this server has no LoRA adapters"})


@dataclass(frozen=True)
class RequestSchemas:
    """What the request schemas of every API are built from: the server's limits and model,
    and the fields several APIs share (each API's `openapi.requests` builds its own)."""

    limits: RequestLimits
    max_client_batch_size: int
    vocab_size: int
    prefixes: bool  # a prompt prefix store is configured
    # The LoRA adapters `adapter_id` may name.
    adapters: AdapterChoice = AdapterChoice()
    # Why the server cannot return prompt logprobs (`decoder_input_details`), or None: it can.
    no_prompt_logprobs: str | None = None
    # Responses /v1/responses keeps (0: none, and `store` must be false).
    stored_responses: int = 1000
    # What a request may send of images (a vision-language model), or None: it takes none.
    images: ImageLimits | None = None

    @property
    def max_new_tokens(self) -> int:
        """The most new tokens any request can get: --max-new-tokens, and the context less
        one prompt token."""
        room = self.limits.max_total_tokens - 1
        cap = self.limits.max_new_tokens
        return room if cap is None else min(cap, room)

    def prompt_text(self) -> dict[str, Any]:
        longest = self.limits.max_prompt_chars
        if self.images is not None:  # markdown images' data URLs, base64 of their bytes
            per_image = 4 * -(-self.images.max_bytes // 3) + len("![](data:image/jpeg;base64,)")
            longest += self.images.max_images * per_image
        return {**STR, "minLength": 1, "maxLength": longest}

    def prefix_id(self) -> dict[str, Any]:
        if self.prefixes:
            return null({**STR, "pattern": r"^[\w\-/]+$", "description": PREFIX_ID})
        return {**NULL, "description": PREFIX_ID + " (this server has none)"}


# --- operations: the pieces of each API's paths ----------------------------------------

JSON = "application/json"
SSE = "text/event-stream"

ERRORS = {
    "401": ("Missing or wrong API key (when the server has one)", "authentication"),
    "422": ("Input validation error", "validation"),
    "424": ("Generation error", "generation"),
    "429": ("Model is overloaded", "overloaded"),
    "500": ("Incomplete generation or internal error", "internal"),
    "503": ("Server is shutting down", "unavailable"),
}


def content(schema: dict[str, Any], media: str = JSON) -> dict[str, Any]:
    return {media: {"schema": schema}}


def events(schema: dict[str, Any], error: str, done: bool = False) -> dict[str, Any]:
    """Server-sent events whose `data` is `schema` as JSON (or `error`'s, for a failure in
    the stream; OpenAI's streams end with `data: [DONE]`). Before OpenAPI 3.2 a stream's
    schema describes one event."""
    data: dict[str, Any] = {
        "type": "string",
        "contentMediaType": JSON,
        "contentSchema": {"anyOf": [schema, ref(error)]},
    }
    if done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {SSE: {"schema": event}}


def errors(openai: bool = False) -> dict[str, Any]:
    schema = ref("OpenAIError") if openai else ref("ErrorResponse")
    return {
        code: {"description": text, "content": content(schema)}
        for code, (text, _) in ERRORS.items()
    }


def post(
    summary: str, request: str, ok: dict[str, Any], tag: str, openai: bool = False
) -> dict[str, Any]:
    return {
        "post": {
            "tags": [tag],
            "summary": summary,
            "requestBody": {"required": True, "content": content(ref(request))},
            "responses": {"200": {"description": "OK", "content": ok}, **errors(openai)},
            "security": [{"bearer": []}, {}],
        }
    }


def get(summary: str, ok: dict[str, Any], tag: str, **extra: Any) -> dict[str, Any]:
    responses = {"200": {"description": "OK", "content": ok}, **extra}
    return {"get": {"tags": [tag], "summary": summary, "responses": responses}}


def typed_events(schema: dict[str, Any]) -> dict[str, Any]:
    """Server-sent events that name their type (`event: TYPE`), whose `data` is `schema`."""
    data = {"type": "string", "contentMediaType": JSON, "contentSchema": schema}
    event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": data},
    }
    return {SSE: {"schema": event}}
