"""Structured output through the real clients against `tgis serve`'s app on the demo model:
TGI's `grammar` with the `text-generation` client, OpenAI's `response_format` (json_object and
json_schema, streamed and not) with the `openai` client, including its Pydantic `parse`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
from text_generation import Client
from text_generation.types import Grammar, GrammarType

from tests.server.conftest import demo_app, live_server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def url(demo_model_dir: Path) -> Iterator[str]:
    with demo_app(demo_model_dir, 256) as app, live_server(app) as (base, _):
        yield base


def test_tgi_grammar_with_the_text_generation_client(url: str) -> None:
    client = Client(url, timeout=60)
    grammar = Grammar(type=GrammarType.Json, value=PERSON)
    answer = client.generate("def main():", max_new_tokens=40, grammar=grammar)
    assert answer.details.finish_reason.value == "eos_token"
    jsonschema.validate(json.loads(answer.generated_text), PERSON)
    streamed = "".join(
        r.token.text
        for r in client.generate_stream("def main():", max_new_tokens=40, grammar=grammar)
        if not r.token.special
    )
    assert streamed == answer.generated_text
    code = Grammar(type=GrammarType.Regex, value=r"[0-9]{3}-[a-z]{2,5}")
    text = client.generate("import os", max_new_tokens=20, grammar=code).generated_text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text)


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)


MESSAGES: Any = [{"role": "user", "content": "Who is it?"}]


def test_response_format_json_schema_with_the_openai_client(url: str) -> None:
    client = openai_client(url)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = client.chat.completions.create(
        model="demo", messages=MESSAGES, response_format=fmt, max_tokens=40, temperature=0
    )
    assert reply.choices[0].finish_reason == "stop"
    content = reply.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), PERSON)
    assert list(json.loads(content)) == ["name", "age"]  # in the schema's order
    chunks = client.chat.completions.create(
        model="demo", messages=MESSAGES, response_format=fmt, max_tokens=40, stream=True,
        temperature=0,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    any_object = client.chat.completions.create(
        model="demo", messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=60,
        temperature=0.8, seed=4,
    )  # fmt: skip
    # Any object may run past max_tokens (then it ends with length, cut); one that ends is whole.
    choice = any_object.choices[0]
    assert (choice.message.content or "").startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:
        assert choice.finish_reason == "length"


def test_the_openai_clients_pydantic_parse(url: str) -> None:
    parsed = openai_client(url).chat.completions.parse(
        model="demo", messages=MESSAGES, response_format=Person, max_tokens=40
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_an_unusable_schema_is_a_422_naming_it(url: str) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}
    with pytest.raises(openai.UnprocessableEntityError, match="Invalid type: strng"):
        openai_client(url).chat.completions.create(
            model="demo", messages=MESSAGES, response_format=fmt, max_tokens=10
        )
