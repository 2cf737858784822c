"""The request fields every chat API reads the same way (OpenAI's chat completions and
Responses, Anthropic's Messages): sampling, the chat template's variables, a response format."""

from __future__ import annotations

from typing import Any

from tgis.params import GrammarSpec
from tgis.server.chat.prompt import REASONING_EFFORTS, RESERVED_TEMPLATE_KWARGS
from tgis.server.http.errors import invalid
from tgis.server.http.fields import Fields


def temperature_top_p(f: Fields) -> dict[str, Any]:
    """`temperature` (0: greedy; absent or 1, the APIs' default, samples as is) and `top_p`
    (1: off) as GenerateParameters fields, for every chat API."""
    temperature = f.number("temperature")
    top_p = f.number("top_p")
    return {
        "do_sample": temperature != 0.0,
        "temperature": None if temperature in (None, 0.0, 1.0) else temperature,
        "top_p": None if top_p == 1.0 else top_p,
    }


def template_kwargs(f: Fields, effort: str | None = None) -> dict[str, Any]:
    """`chat_template_kwargs` (variables the chat template reads, such as Qwen3's
    `enable_thinking`) and `reasoning_effort` (given to the template under that name, as
    gpt-oss's reads it). `effort`: the effort another field of the request named."""
    given = f.data.get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        raise invalid("`chat_template_kwargs` must be an object of template variables")
    values = dict(given or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(values))
    if reserved:
        raise invalid(
            f"`chat_template_kwargs.{reserved[0]}` is set by the server itself; leave it out "
            "(send `messages` and `tools` as request fields)"
        )
    effort = f.string("reasoning_effort") if effort is None else effort
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise invalid(
                f"`reasoning_effort` must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}"
            )
        values.setdefault("reasoning_effort", effort)
    return values


def response_format(f: Fields, name: str = "response_format") -> GrammarSpec | None:
    """OpenAI's `response_format`: text (none), json_object (any JSON object) or json_schema
    (`json_schema.schema`). `name`: the field as the client wrote it (Responses' `text.format`),
    for messages and the grammar's source."""
    given = f.obj("response_format")
    if given is None:
        return None
    kind = given.string("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"}, source=name)
    if kind == "json_schema":
        spec = given.obj("json_schema")
        schema = spec.obj("schema") if spec is not None else None
        if schema is None:
            raise invalid(f"`{name}.json_schema.schema` is required (a JSON schema)")
        return GrammarSpec.json_schema(schema.data, source=name)
    raise invalid(f"`{name}.type` must be text, json_object or json_schema, got {kind!r}")
