"""Every request body against the API's own schema (the objects /openapi.json is built from).

The routes check a body's types and values with messages of TGI's and OpenAI's wording first;
then `RequestContract.check` holds it to the published schema, so the server never takes a
request its document forbids. A body that breaks it is a 422 naming the field, the limit and the
rule.
"""

from __future__ import annotations

import json
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from tgis.server.http.errors import ApiError, invalid


class RequestContract:
    """What a server's APIs publish (the app gathers it from each API's `openapi` module):
    their operations (`paths`, under `tags`), and their request and response schemas by
    component name, the requests compiled into validators every request body is held to."""

    def __init__(
        self,
        requests: dict[str, Any],
        responses: dict[str, Any],
        paths: dict[str, Any] | None = None,
        tags: tuple[dict[str, str], ...] = (),
    ) -> None:
        self.paths = paths or {}
        self.tags = tags
        self.components: dict[str, Any] = {**requests, **responses}
        root = {"components": {"schemas": self.components}}
        self._validators = {
            name: Draft202012Validator({**root, "$ref": f"#/components/schemas/{name}"})
            for name in requests
        }

    def check(self, name: str, body: Any) -> None:
        """Raise a 422 when `body` does not match the request schema `name`."""
        error = best_match(self._validators[name].iter_errors(body))
        if error is not None:
            raise _refusal(error)


def _field(error: ValidationError) -> str:
    path = ""
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _refusal(error: ValidationError) -> ApiError:
    field = _field(error)
    schema = error.schema if isinstance(error.schema, dict) else {}
    rule = schema.get("x-rule")
    if rule:
        return invalid(rule)
    where = f"`{field}`" if field else "the request body"
    value, bound = error.instance, error.validator_value
    given = f". Given: {json.dumps(value)[:80]}"
    messages = {
        "maximum": f"{where} must be <= {bound}{given}",
        "minimum": f"{where} must be >= {bound}{given}",
        "exclusiveMaximum": f"{where} must be < {bound}{given}",
        "exclusiveMinimum": f"{where} must be > {bound}{given}",
        "maxLength": f"{where} must have at most {bound} characters",
        "minLength": f"{where} must not be empty",
        "maxItems": f"{where} takes at most {bound} items",
        "minItems": f"{where} must have at least {bound} item(s)",
        "maxProperties": f"{where} must be empty",
        "const": f"{where} must be {json.dumps(bound)}{given}",
        "enum": f"{where} must be one of {json.dumps(bound)}{given}",
        "pattern": f"{where} must match {bound}{given}",
    }
    message = messages.get(str(error.validator), f"{where}: {error.message[:200]}")
    note = schema.get("description")
    constant = error.validator in ("const", "enum")
    return invalid(f"{message} ({note})" if note and constant else message)
