"""Request bodies -> typed values: JSON type checks that name the offending field.

Value ranges (temperature > 0, max_new_tokens within the limits, ...) are tgis.params.validate's
job; here only JSON types are checked, so a wrong type is a 422 that names the field
(`parameters.temperature` must be a number, got a string) instead of a 500.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from tgis.params import GenerateParameters, GrammarSpec
from tgis.server.http.errors import ApiError, invalid

# TGI's default payload limit (its --payload-limit).
DEFAULT_MAX_BODY_BYTES = 2_000_000
# Python reads no longer integer literal (its int/str conversion limit, 4300 digits); no
# field takes one past 64 bits, which the API's schema says field by field.
_MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300
# Deeper JSON than any request needs; Python's parser would hit its recursion limit.
_MAX_DEPTH = 64


async def read_json(request: Request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Any:
    """The request's JSON body. A body over `max_bytes` is a 413 (read no further); malformed
    JSON, huge integers, nesting deeper than 64 levels and strings that are not text (lone
    UTF-16 surrogates) are 422s that say what is wrong."""
    kind = request.headers.get("content-type")
    if kind is not None and not _is_json(kind):
        raise ApiError(
            415,
            f"the request body must be JSON (Content-Type: application/json), not {kind}",
            "validation",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # gone (or cut off by --body-timeout-s) before the body came
        raise ApiError(
            499, "the client closed the connection before its body arrived", "cancelled"
        ) from None
    try:
        value = json.loads(
            b"".join(chunks),
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid(f"the request body nests deeper than {_MAX_DEPTH} levels") from None
    _check_values(value, 0)
    return value


def _is_json(content_type: str) -> bool:
    """application/json, or a +json type (application/vnd.x+json), with any parameters."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size} bytes or more; this server takes at most {limit} "
        "(--max-request-body-bytes)",
        "validation",
    )


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise invalid(
            f"the request body has a {len(text)}-digit integer; the longest a JSON reader here "
            f"takes has {_MAX_INT_DIGITS} digits (and no field takes one past 64 bits)"
        )
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise invalid(f"the request body has the number {text[:40]}, too large for a float")
    return value


def _parse_constant(name: str) -> float:
    raise invalid(f"the request body has {name}, which is not JSON: numbers must be finite")


def _check_values(value: Any, depth: int) -> None:
    """Depth and text of every value of a parsed body."""
    if depth > _MAX_DEPTH:
        raise invalid(f"the request body nests deeper than {_MAX_DEPTH} levels")
    if isinstance(value, str):
        _check_text(value)
    elif isinstance(value, list):
        for item in value:
            _check_values(item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_values(item, depth + 1)


def _check_text(text: str) -> None:
    """Refuse lone UTF-16 surrogates: JSON's \\ud800 escapes decode to them, but they are
    not characters, and no tokenizer can encode them."""
    if any("\ud800" <= c <= "\udfff" for c in text):
        at = next(i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff")
        raise invalid(
            f"the request has a lone UTF-16 surrogate (U+{ord(text[at]):04X}) at character "
            f"{at} of a string: it is not text"
        )


def _kind(value: Any) -> str:
    """A JSON value's type, as a person would name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


class Fields:
    """Typed reads from one JSON object. A null value reads as "not given"."""

    def __init__(self, data: Any, path: str = "") -> None:
        if not isinstance(data, dict):
            where = f"`{path}`" if path else "the request body"
            raise invalid(f"{where} must be a JSON object, got {_kind(data)}")
        self.data: dict[str, Any] = data
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _fail(self, key: str, expected: str) -> ApiError:
        return invalid(f"`{self.name(key)}` must be {expected}, got {_kind(self.data[key])}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def string(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, str):
            raise self._fail(key, "a string")
        return value

    def required_string(self, key: str) -> str:
        value = self.string(key)
        if value is None:
            raise invalid(f"missing field `{self.name(key)}`")
        return value

    def boolean(self, key: str) -> bool | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, bool):
            raise self._fail(key, "a boolean")
        return value

    def integer(self, key: str, unsigned: bool = False) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        # JSON has one number type: 20.0 is accepted as 20, 20.5 is not an integer.
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, "a non-negative integer" if unsigned else "an integer")
        if unsigned and value < 0:
            raise invalid(f"`{self.name(key)}` must be a non-negative integer, got {value}")
        return value

    def number(self, key: str) -> float | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._fail(key, "a number")
        return float(value)

    def strings(self, key: str, allow_single: bool = False) -> tuple[str, ...]:
        """A list of strings (or one string when `allow_single`); absent means empty."""
        value = self.data.get(key)
        if value is None:
            return ()
        if allow_single and isinstance(value, str):
            return (value,)
        expected = "a string or an array of strings" if allow_single else "an array of strings"
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._fail(key, expected)
        return tuple(value)

    def obj(self, key: str) -> Fields | None:
        value = self.data.get(key)
        return None if value is None else Fields(value, self.name(key))


# One input of a pooling request (embeddings, scores): text, or token ids.
PoolingInput = str | tuple[int, ...]


def pooling_inputs(
    value: Any, name: str, vocab_size: int, max_inputs: int
) -> tuple[PoolingInput, ...]:
    """The inputs of an embeddings request's field `name` as OpenAI and TEI take them: a
    string, an array of strings, an array of token ids (one input) or an array of arrays of
    token ids; at most `max_inputs`, none empty, ids within the vocabulary; else a 422 naming
    the field (and the input's index)."""
    expected = (
        f"`{name}` must be a string, an array of strings, an array of token ids or an array "
        "of arrays of token ids"
    )
    if value is None:
        raise invalid(f"missing field `{name}`")
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_token_id(v) for v in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise invalid(expected)
    if not items:
        raise invalid(f"`{name}` must not be empty")
    if len(items) > max_inputs:
        raise invalid(f"`{name}` holds {len(items)} inputs, more than {max_inputs}; split it")
    single = items is not value  # one string or one list of ids, not an array of inputs
    out: list[PoolingInput] = []
    for i, item in enumerate(items):
        where = f"`{name}`" if single else f"`{name}[{i}]`"
        if isinstance(item, str):
            if not item:
                raise invalid(f"{where} must not be an empty string")
            out.append(item)
        elif isinstance(item, list) and item and all(_is_token_id(v) for v in item):
            beyond = [v for v in item if v >= vocab_size]
            if beyond:
                raise invalid(
                    f"{where} holds token id {beyond[0]}, beyond the vocabulary of "
                    f"{vocab_size} (ids 0 to {vocab_size - 1})"
                )
            out.append(tuple(item))
        else:
            raise invalid(expected)
    return tuple(out)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class TgiRequest:
    """A parsed TGI `GenerateRequest` / `CompatGenerateRequest`."""

    inputs: str
    params: GenerateParameters
    stream: bool = False
    # TGIS's tuned prompt prefix (`parameters.prefix_id`, an extension of TGI's API).
    prefix_id: str | None = None
    # TGI's `parameters.adapter_id`: a LoRA adapter (None or "": the base model).
    adapter_id: str | None = None


# TGI's optional parameters and TGIS's extras, by JSON type.
_FLOATS = (
    "temperature",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
_UNSIGNED = ("seed", "max_new_tokens", "min_new_tokens", "truncate", "top_n_tokens")
_UNSIGNED_EXTRA = ("best_of", "time_limit_ms")
_BOOLS = (
    "do_sample",
    "details",
    "decoder_input_details",
    "include_stop_sequence",
    "ignore_eos",
    "skip_special_tokens",
)


def parse_parameters(
    fields: Fields | None, default_return_full_text: bool = False
) -> GenerateParameters:
    """TGI's `parameters` object -> GenerateParameters (types checked, values not yet)."""
    if fields is None:
        return GenerateParameters(return_full_text=default_return_full_text)
    values: dict[str, Any] = {}
    for key in _FLOATS:
        values[key] = fields.number(key)
    for key in (*_UNSIGNED, *_UNSIGNED_EXTRA):
        values[key] = fields.integer(key, unsigned=True)
    values["top_k"] = fields.integer("top_k")
    for key in _BOOLS:
        values[key] = fields.boolean(key)
    values["stop"] = fields.strings("stop")
    penalty = fields.obj("length_penalty")  # TGIS's extension
    if penalty is not None:
        start_index = penalty.integer("start_index", unsigned=True)
        decay_factor = penalty.number("decay_factor")
        if start_index is None or decay_factor is None:
            raise invalid(
                "`parameters.length_penalty` needs `start_index` (generated tokens before the "
                "EOS boost) and `decay_factor` (1.0 to 10.0)"
            )
        values["length_penalty"] = (start_index, decay_factor)
    full_text = fields.boolean("return_full_text")
    values["return_full_text"] = default_return_full_text if full_text is None else full_text
    if fields.boolean("watermark"):
        raise invalid("`parameters.watermark` is not supported by this server")
    values["grammar"] = parse_grammar(fields)
    return GenerateParameters(**{k: v for k, v in values.items() if v is not None})


def parse_grammar(fields: Fields) -> GrammarSpec | None:
    """TGI's `grammar`: {"type": "json", "value": <JSON schema>} or {"type": "regex",
    "value": <regex>} (null, or "" as some clients send, for none)."""
    if not fields.has("grammar") or fields.data["grammar"] == "":
        return None
    grammar = fields.obj("grammar")
    assert grammar is not None
    kind = grammar.required_string("type")
    if kind == "regex":
        return GrammarSpec.regex(grammar.required_string("value"))
    if kind in ("json", "json_object", "json_schema"):
        value = grammar.data.get("value")
        if isinstance(value, str):  # a schema sent as JSON text
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(f"`{grammar.name('value')}` is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise invalid(f"`{grammar.name('value')}` must be a JSON schema (an object)")
        return GrammarSpec.json_schema(value)
    raise invalid(f'`{grammar.name("type")}` must be "json" or "regex", got {kind!r}')


def parse_tgi_request(
    body: Any, *, compat: bool = False, default_return_full_text: bool = False
) -> TgiRequest:
    """The body of `/generate`, `/generate_stream`, `/tokenize` or (compat) `/`.

    On `/` TGI defaults `return_full_text` from the model's pipeline tag and reads `stream`.
    """
    fields = Fields(body)
    inputs = fields.required_string("inputs")
    parameters = fields.obj("parameters")
    params = parse_parameters(parameters, default_return_full_text)
    stream = bool(fields.boolean("stream")) if compat else False
    prefix_id = parameters.string("prefix_id") if parameters is not None else None
    adapter_id = parameters.string("adapter_id") if parameters is not None else None
    return TgiRequest(inputs, params, stream, prefix_id, adapter_id)
