"""Schemathesis hooks of tests/server/test_contract_fuzz.py (SCHEMATHESIS_HOOKS names this module).

The API's schema states every rule of a request but those over token counts, which no JSON
Schema can: the prompt's tokens with `max_new_tokens` within `max_total_tokens`, and
`min_new_tokens` within `max_new_tokens` — and whether a grammar's own schema or regex is one
the grammar engine can use. Cases generated as valid are kept within them here (texts cut to
200 characters, a minimum lowered to the maximum given, a usable grammar), so that a valid case
the server refuses is a real disagreement. Cases generated as invalid go out unchanged. tgis.params
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
            if isinstance(message, dict) and "content" in message:
                message["content"] = _cut(message["content"])
    parameters = body.get("parameters")
    if isinstance(parameters, dict):
        _lower(parameters, "min_new_tokens", ("max_new_tokens",))
        if isinstance(parameters.get("grammar"), dict):
            parameters["grammar"] = GRAMMAR
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        response_format["json_schema"] = {"name": "any", "schema": {"type": "object"}}
    _lower(body, "min_tokens", ("max_completion_tokens", "max_tokens"))
