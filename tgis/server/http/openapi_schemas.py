"""The API's JSON Schemas (OpenAPI 3.1, JSON Schema 2020-12): TGI's (router/src/lib.rs) and the
OpenAI subset served here.

The request schemas are the server's contract, built from its limits (`RequestSchemas`): they go
into /openapi.json and `tgis.server.http.contract` checks every request body against the same
objects, so the document never allows what the server refuses to check. What a schema cannot
state is a rule over token counts (the prompt's tokens and `max_new_tokens` within
`max_total_tokens`, `min_new_tokens` within `max_new_tokens`): those stay tgis.params's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tgis.params import (
    MAX_FACTOR,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_SEED,
    MAX_TIME_LIMIT_MS,
    MIN_POSITIVE,
    RequestLimits,
)
from tgis.server.chat.prompt import (
    IMAGE_DETAILS,
    IMAGE_MEDIA_TYPES,
    REASONING_EFFORTS,
    RESERVED_TEMPLATE_KWARGS,
)
from tgis.server.chat.tool_calls import NAME_PATTERN
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

_SCHEMA_VALUE = {
    "type": "object",
    "description": "a JSON schema (llguidance's subset: no `not`); the output is compact JSON",
}
GRAMMAR: dict[str, Any] = {
    "description": "TGI's grammar: the output matches a JSON schema or a regex",
    "anyOf": [
        obj(
            ["type", "value"],
            type={"enum": ["json", "json_object", "json_schema"]},
            value={"anyOf": [_SCHEMA_VALUE, {**STR, "description": "the schema as JSON text"}]},
        ),
        obj(
            ["type", "value"],
            type={"const": "regex"},
            value={**STR, "description": "Rust regex syntax: no lookaround, no backreferences"},
        ),
    ],
}
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
                schema=_SCHEMA_VALUE,
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
_GRAMMAR_ENDS = (
    "`grammar` cannot be combined with `ignore_eos` or `min_new_tokens`: a complete grammar "
    "ends with EOS"
)
_IGNORE_EOS = (
    "vLLM's extension: EOS ends nothing (it is sampled as any token), so the output runs to its "
    "token limit, a stop sequence or the time limit; not with a grammar"
)
_STREAMED = "a streamed request takes neither `best_of` > 1 nor `decoder_input_details`"
_IMAGE_URL = (
    "a data URL (`data:image/png;base64,...`: PNG, JPEG, WebP or GIF), or an http(s) URL the "
    "server fetches only with --allow-image-urls"
)
_IMAGE_DETAIL = "changes nothing here: the model's image processor decides the resolution"
_PREFIX_ID = (
    "TGIS: a tuned prompt prefix of the server's --prefix-store-path, whose virtual tokens go "
    "before the input (and count toward the token limits)"
)


def _given(name: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """The object has `name`, not null (and matching `schema`)."""
    return {"required": [name], "properties": {name: schema or {"not": NULL}}}


def _chat_constraints() -> dict[str, Any]:
    """What a chat request's response_format and tools allow, as one choice of five (rules
    stated apart would multiply into more branches than schema tools such as schemathesis
    expand): no tools or tool_choice "none", with a free output or a response_format; or tools
    to call, without a response_format. A constrained output ends with EOS: no ignore_eos, no
    min_tokens."""
    nonempty = {"type": "array", "minItems": 1}
    no_tools = {"properties": {"tool_choice": NULL, "tools": null(array({}, maxItems=0))}}
    tools_unused = {
        "required": ["tools", "tool_choice"],
        "properties": {"tools": nonempty, "tool_choice": {"const": "none"}},
    }
    calls = {
        "required": ["tools"],
        "properties": {
            "tools": nonempty,
            "tool_choice": {"anyOf": [NULL, {"enum": ["auto", "required"]}, {"type": "object"}]},
        },
    }
    free = {"properties": {"response_format": null(obj([], type=null({"const": "text"})))}}
    formatted = _given(
        "response_format",
        {"required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}},
    )
    ends = {"properties": {"ignore_eos": null({"const": False}), "min_tokens": null({"const": 0})}}
    return {
        "anyOf": [
            {
                "allOf": [
                    {"anyOf": [no_tools, tools_unused]},
                    {"anyOf": [free, {"allOf": [formatted, ends]}]},
                ]
            },
            {"allOf": [calls, free, ends]},
        ]
    }


def _constrained_turn(format_field: str) -> dict[str, Any]:
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


_TURN_RULE = (
    '`tool_choice` needs `tools`; `text.format` and `tools` (unless `tool_choice` is "none") '
    "both constrain the output, so not both"
)
_CONSTRAINED_CHAT = _chat_constraints()
_CONSTRAINED_CHAT_RULE = (
    '`tool_choice` needs `tools`; `response_format` and `tools` (unless `tool_choice` is "none") '
    "both constrain the output, so not both; and a constrained output ends with EOS, so neither "
    "takes `ignore_eos` or `min_tokens`"
)


def _when(condition: dict[str, Any], then: dict[str, Any], rule: str) -> dict[str, Any]:
    """`then` applies when `condition` holds; `rule` says so in words (`x-rule`: the message a
    request that breaks it gets, wherever in `then` it fails)."""
    return {"if": condition, "then": _ruled(then, rule)}


def _ruled(schema: dict[str, Any], rule: str) -> dict[str, Any]:
    """`schema` and each subschema under it carry `rule` as their x-rule."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if isinstance(value, dict):
            value = (
                _ruled(value, rule)
                if key != "properties"
                else {name: _ruled(sub, rule) for name, sub in value.items()}
            )
        elif isinstance(value, list):
            value = [_ruled(v, rule) if isinstance(v, dict) else v for v in value]
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


@dataclass(frozen=True)
class RequestSchemas:
    """The request bodies this server takes, from its limits and its model."""

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

    def _prompt_text(self) -> dict[str, Any]:
        longest = self.limits.max_prompt_chars
        if self.images is not None:  # markdown images' data URLs, base64 of their bytes
            per_image = 4 * -(-self.images.max_bytes // 3) + len("![](data:image/jpeg;base64,)")
            longest += self.images.max_images * per_image
        return {**STR, "minLength": 1, "maxLength": longest}

    def _prefix_id(self) -> dict[str, Any]:
        if self.prefixes:
            return null({**STR, "pattern": r"^[\w\-/]+$", "description": _PREFIX_ID})
        return {**NULL, "description": _PREFIX_ID + " (this server has none)"}

    def parameters(self) -> dict[str, Any]:
        """TGI's `parameters` object, and the rules between its fields."""
        lim = self.limits
        new_tokens = integer(1, self.max_new_tokens)
        schema = obj(
            [],
            do_sample=null({**BOOL, "default": False}),
            temperature=null({**FACTOR, "example": 0.5}),
            top_k=null(integer(1, MAX_INT, example=10)),
            top_p=null({**FRACTION, "example": 0.95}),
            typical_p=null(FRACTION),
            repetition_penalty=null({**FACTOR, "example": 1.03}),
            frequency_penalty=null(PENALTY),
            presence_penalty=null(PENALTY),
            seed=null(SEED),
            max_new_tokens=null({**new_tokens, "example": 20}),
            min_new_tokens=null(
                integer(0, self.max_new_tokens, description="TGIS: at least this many")
            ),
            stop=null(array(STR, maxItems=lim.max_stop_sequences, example=["photographer"])),
            include_stop_sequence=null({**BOOL, "description": "TGIS: keep the stop text"}),
            ignore_eos=null({**BOOL, "description": _IGNORE_EOS}),
            time_limit_ms=null(
                integer(1, MAX_TIME_LIMIT_MS, description="TGIS: stop this long after arrival")
            ),
            length_penalty=null(
                {
                    **obj(
                        ["start_index", "decay_factor"],
                        start_index=INT,
                        decay_factor={**NUM, "minimum": 1.0, "maximum": 10.0},
                    ),
                    "description": "TGIS: after start_index new tokens, EOS logits grow by "
                    "|logit| * (decay_factor ^ (generated - start_index) - 1)",
                }
            ),
            truncate=null(
                integer(1, lim.max_input_tokens, description="keep the last N prompt tokens")
            ),
            return_full_text=null({**BOOL, "description": "prepend the prompt"}),
            details=null(BOOL),
            decoder_input_details=null(
                BOOL
                if self.no_prompt_logprobs is None
                else {"const": False, "x-rule": self.no_prompt_logprobs}
            ),
            top_n_tokens=null(integer(0, lim.max_top_n_tokens, example=5)),
            best_of=null(integer(1, lim.max_best_of, example=2)),
            skip_special_tokens=null(BOOL),
            prefix_id=self._prefix_id(),
            watermark=null({"const": False, "description": "not supported"}),
            grammar=null({"anyOf": [{"const": ""}, GRAMMAR]}),
            adapter_id=self.adapters.schema(),
        )
        several = _given("best_of", {"type": "integer", "minimum": 2})
        schema["allOf"] = [
            # best_of > 1 samples (do_sample, or any warper given) and takes no seed.
            _when(
                several,
                {
                    "anyOf": [
                        _given("do_sample", {"const": True}),
                        _given("temperature"),
                        _given("top_k"),
                        _given("top_p"),
                        _given("typical_p"),
                    ],
                    "properties": {"seed": NULL},
                },
                "`best_of` > 1 needs sampling (`do_sample` or a warper such as `temperature`) "
                "and no `seed`",
            ),
            _when(
                _given("grammar", {"type": "object"}),
                {
                    "properties": {
                        "ignore_eos": null({"const": False}),
                        "min_new_tokens": null({"const": 0}),
                    }
                },
                _GRAMMAR_ENDS,
            ),
        ]
        return schema

    def streamed_parameters(self) -> dict[str, Any]:
        """`parameters` of a streamed request: one sequence, no prompt details."""
        properties = {
            "best_of": null({"const": 1}),
            "decoder_input_details": null({"const": False}),
        }
        return _ruled({"properties": properties}, _STREAMED)

    def tgi(self) -> dict[str, Any]:
        inputs = {**self._prompt_text(), "example": "My name is Olivier and INT"}
        params = null(ref("GenerateParameters"))
        streamed = {"allOf": [ref("GenerateParameters"), self.streamed_parameters()]}
        return {
            "GenerateParameters": self.parameters(),
            "GenerateRequest": obj(["inputs"], inputs=inputs, parameters=params),
            "GenerateStreamRequest": obj(["inputs"], inputs=inputs, parameters=null(streamed)),
            "CompatGenerateRequest": {
                **obj(
                    ["inputs"],
                    inputs=inputs,
                    parameters=params,
                    stream=null({**BOOL, "default": False}),
                ),
                "allOf": [
                    _when(
                        _given("stream", {"const": True}),
                        {"properties": {"parameters": null(streamed)}},
                        _STREAMED,
                    )
                ],
            },
        }

    def _sampling(self) -> dict[str, Any]:
        """The fields both OpenAI routes take."""
        new_tokens = null(integer(1, self.max_new_tokens))
        return {
            "model": null(STR),
            "max_tokens": new_tokens,
            "temperature": null(
                {"anyOf": [{"const": 0}, FACTOR], "description": "0: greedy decoding"}
            ),
            "top_p": null({**NUM, "minimum": MIN_POSITIVE, "maximum": 1}),
            "n": null(integer(1, self.limits.max_best_of, description="n sampled sequences")),
            "stream": null({**BOOL, "default": False}),
            "stream_options": null(obj([], include_usage=null(BOOL))),
            "stop": null(
                {
                    "anyOf": [
                        STR,
                        array(STR, maxItems=self.limits.max_stop_sequences),
                    ]
                }
            ),
            "seed": null(SEED),
            "frequency_penalty": null(PENALTY),
            "presence_penalty": null(PENALTY),
            "top_k": null(integer(1)),
            "repetition_penalty": null(FACTOR),
            "min_tokens": null(integer(0, self.max_new_tokens)),
            "ignore_eos": null({**BOOL, "description": _IGNORE_EOS}),
            "logit_bias": null(
                {
                    "type": "object",
                    "maxProperties": MAX_LOGIT_BIAS_TOKENS,
                    "propertyNames": {"pattern": decimal_below(self.vocab_size)},
                    "additionalProperties": {
                        "type": "number",
                        "minimum": -MAX_LOGIT_BIAS,
                        "maximum": MAX_LOGIT_BIAS,
                    },
                }
            ),
            "prefix_id": self._prefix_id(),
        }

    def _openai_rules(self) -> list[dict[str, Any]]:
        several = _given("n", {"type": "integer", "minimum": 2})
        return [
            _when(
                several,
                {"properties": {"temperature": {"not": {"const": 0}}, "seed": NULL}},
                "`n` > 1 needs sampling (`temperature` above 0) and no `seed`",
            ),
            _when(
                _given("stream_options"),
                _given("stream", {"const": True}),
                "`stream_options` is only allowed when `stream` is true",
            ),
        ]

    def openai(self) -> dict[str, Any]:
        lim = self.limits
        token = integer(0, self.vocab_size - 1)
        ids = array(token, minItems=1)
        batch = {"minItems": 1, "maxItems": self.max_client_batch_size}
        prompt = {
            "anyOf": [
                self._prompt_text(),
                array(self._prompt_text(), **batch),
                ids,
                array(ids, **batch),
            ]
        }
        completion = obj(
            ["prompt"],
            prompt=prompt,
            logprobs=null(integer(0, lim.max_top_n_tokens)),
            echo=null(BOOL),
            best_of=null(integer(1, lim.max_best_of, description="equal to n")),
            suffix=NULL,
            **self._sampling(),
        )
        # best_of, when given, equals n (1 when n is not given).
        same = [
            _when(
                _given("best_of", {"const": k}),
                _given("n", {"const": k}) if k > 1 else {"properties": {"n": null({"const": 1})}},
                "`best_of` is only supported equal to `n`",
            )
            for k in range(1, lim.max_best_of + 1)
        ]
        echoed = _when(
            {"allOf": [_given("echo", {"const": True}), _given("logprobs")]},
            {"properties": {"stream": null({"const": False})}}
            if self.no_prompt_logprobs is None
            else {"not": {}},
            "`echo` with `logprobs` is not supported when streaming"
            if self.no_prompt_logprobs is None
            else self.no_prompt_logprobs,
        )
        completion["allOf"] = [*self._openai_rules(), *same, echoed]
        text_part: dict[str, Any] = obj(["type", "text"], type={"const": "text"}, text=STR)
        if self.images is not None:
            image_url = obj(["url"], url=STR, detail=null({**STR, "enum": ["auto", "low", "high"]}))
            image_part = obj(
                ["type", "image_url"],
                type={"const": "image_url"},
                image_url={"anyOf": [STR, image_url]},
            )
            text_part = {"anyOf": [text_part, image_part]}
        called = obj(
            ["function"],
            id=null(STR),
            type=null({"const": "function"}),
            function=obj(
                ["name"],
                name=STR,
                arguments=null({"anyOf": [STR, {"type": "object"}], "description": "JSON"}),
            ),
        )
        message = obj(
            ["role"],
            role=STR,
            content=null({"anyOf": [STR, array(text_part)]}),
            name=null(STR),
            tool_calls=null(array(called)),
            tool_call_id=null(STR),
        )
        chat = obj(
            ["messages"],
            messages=array(ref("ChatMessageInput"), minItems=1),
            max_completion_tokens=null(integer(1, self.max_new_tokens)),
            logprobs=null(BOOL),
            top_logprobs=null(integer(0, lim.max_top_n_tokens)),
            tools=null(array(TOOL)),
            tool_choice=null(TOOL_CHOICE),
            parallel_tool_calls=null(BOOL),
            response_format=null(RESPONSE_FORMAT),
            **CHAT_TEMPLATE_FIELDS,
            **self._sampling(),
        )
        chat["allOf"] = [
            *self._openai_rules(),
            # top_logprobs > 0 needs logprobs.
            _when(
                _given("top_logprobs", {"type": "integer", "minimum": 1}),
                _given("logprobs", {"const": True}),
                "`top_logprobs` needs `logprobs` set to true",
            ),
            _ruled(_CONSTRAINED_CHAT, _CONSTRAINED_CHAT_RULE),
        ]
        return {
            "CompletionRequest": completion,
            "ChatMessageInput": message,
            "ChatRequest": chat,
        }

    def responses(self) -> dict[str, Any]:
        """OpenAI's Responses API request (tgis.server.responses.requests)."""
        text_part = obj(
            ["type", "text"], type={"enum": ["input_text", "output_text", "text"]}, text=STR
        )
        content = {"anyOf": [STR, array(text_part)]}
        message_content = content
        if self.images is not None:
            image_part = obj(
                ["type", "image_url"],
                type={"const": "input_image"},
                image_url={**STR, "minLength": 1, "description": _IMAGE_URL},
                detail=null({"enum": list(IMAGE_DETAILS), "description": _IMAGE_DETAIL}),
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
                    schema=_SCHEMA_VALUE,
                    strict=null(BOOL),
                ),
            ]
        }
        request = obj(
            ["input"],
            model=null(STR),
            input={"anyOf": [self._prompt_text(), {**items, "contains": answered}]},
            instructions=null(STR),
            tools=null(array(tool)),
            tool_choice=null(choice),
            parallel_tool_calls=null(BOOL),
            text=null(obj([], format=null(fmt))),
            max_output_tokens=null(integer(1, self.max_new_tokens)),
            temperature=null({"anyOf": [{"const": 0}, FACTOR], "description": "0: greedy"}),
            top_p=null({**NUM, "minimum": MIN_POSITIVE, "maximum": 1}),
            reasoning=null(obj([], effort=null({"enum": list(REASONING_EFFORTS)}), summary=NULL)),
            stream=null({**BOOL, "default": False}),
            store=null(BOOL if self.stored_responses else {"const": False}),
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
        request["allOf"] = [_ruled(_constrained_turn("text"), _TURN_RULE)]
        return {"ResponsesRequest": request}

    def messages(self) -> dict[str, Any]:
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
        if self.images is not None:
            base64 = obj(
                ["type", "media_type", "data"],
                type={"const": "base64"},
                media_type={"enum": list(IMAGE_MEDIA_TYPES)},
                data={**STR, "description": "the image's bytes in base64"},
            )
            url = obj(
                ["type", "url"], type={"const": "url"}, url={**STR, "description": _IMAGE_URL}
            )
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
                        1, self.max_new_tokens - 1, description="less than `max_tokens`"
                    ),
                    **display,
                ),
            ]
        }
        fmt = obj(["type", "schema"], type={"const": "json_schema"}, schema=_SCHEMA_VALUE)
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
            max_tokens=integer(1, self.max_new_tokens),
            stop_sequences=null(array(STR, maxItems=self.limits.max_stop_sequences)),
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
        rule = _ruled(
            {"anyOf": [free, declined, calls]},
            "`tool_choice` needs `tools`; `output_config.format` and `tools` (unless "
            '`tool_choice` is "none") both constrain the output, so not both',
        )
        request["allOf"] = [rule]
        count = obj(["model", "messages"], **turn)
        count["allOf"] = [rule]
        return {"MessagesRequest": request, "CountTokensRequest": count}

    def components(self) -> dict[str, Any]:
        """Every request schema, by component name."""
        return {**self.tgi(), **self.openai(), **self.responses(), **self.messages()}


# --- responses ----------------------------------------------------------------------------

_TOKEN = obj(
    ["id", "text", "logprob", "special"], id=INT, text=STR, logprob=null(NUM), special=BOOL
)
_PREFILL = obj(["id", "text", "logprob"], id=INT, text=STR, logprob=null(NUM))
_SEQUENCE = {
    "finish_reason": FINISH_REASON,
    "generated_tokens": INT,
    "seed": null(SEED),
    "prefill": array(ref("PrefillToken")),
    "tokens": array(ref("Token")),
    "top_tokens": array(array(ref("Token"))),
}
_SEQ_REQUIRED = ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]

TGI_RESPONSES: dict[str, Any] = {
    "Token": _TOKEN,
    "PrefillToken": _PREFILL,
    "BestOfSequence": obj(["generated_text", *_SEQ_REQUIRED], generated_text=STR, **_SEQUENCE),
    "Details": obj(_SEQ_REQUIRED, **_SEQUENCE, best_of_sequences=array(ref("BestOfSequence"))),
    "GenerateResponse": obj(["generated_text"], generated_text=STR, details=ref("Details")),
    "StreamDetails": obj(
        ["finish_reason", "generated_tokens", "seed", "input_length"],
        finish_reason=FINISH_REASON,
        generated_tokens=INT,
        seed=null(SEED),
        input_length=INT,
    ),
    "StreamResponse": obj(
        ["index", "token", "generated_text", "details"],
        index=INT,
        token=ref("Token"),
        top_tokens=array(ref("Token")),
        generated_text=null(STR),
        details=null(ref("StreamDetails")),
    ),
    "SimpleToken": obj(["id", "text", "start", "stop"], id=INT, text=STR, start=INT, stop=INT),
    "TokenizeResponse": array(ref("SimpleToken")),
    "ErrorResponse": obj(["error", "error_type"], error=STR, error_type=STR),
    "Info": obj(
        ["model_id", "max_input_tokens", "max_total_tokens", "version"],
        model_id=STR,
        model_sha=null(STR),
        model_dtype=STR,
        model_device_type=STR,
        model_pipeline_tag=null(STR),
        model_kind={"type": "string", "enum": ["decoder_only", "encoder_decoder"]},
        backend=STR,
        max_concurrent_requests=INT,
        max_best_of=INT,
        max_stop_sequences=INT,
        max_top_n_tokens=INT,
        max_input_tokens=INT,
        max_input_length=INT,
        max_total_tokens=INT,
        max_batch_prefill_tokens=INT,
        max_batch_total_tokens=null(INT),
        max_batch_size=null(INT),
        max_waiting_tokens=INT,
        waiting_served_ratio=NUM,
        max_client_batch_size=INT,
        validation_workers=INT,
        router=STR,
        version=STR,
        sha=null(STR),
        docker_label=null(STR),
        runtime=null(
            obj(
                ["engine"],
                engine={"type": "string", "enum": ["paged", "slot", "static"]},
                attention=STR,
                cuda_graphs={"type": "array", "items": INT},
                compiled_decode={"type": "array", "items": STR},
                weights=STR,
                quantization=null(STR),
                weight_bytes=INT,
                kv_blocks=INT,
                kv_block_size=INT,
                kv_tokens=INT,
                kv_cache_dtype=STR,
                dtype=STR,
            )
        ),
    ),
}

_USAGE = obj(
    ["prompt_tokens", "completion_tokens", "total_tokens"],
    prompt_tokens=INT,
    completion_tokens=INT,
    total_tokens=INT,
)
_ENVELOPE = {"id": STR, "object": STR, "created": INT, "model": STR, "system_fingerprint": STR}
_ENV_REQUIRED = ["id", "object", "created", "model", "choices"]
_FINISH = null({"type": "string", "enum": ["stop", "length"]})
_CHAT_FINISH = null({"type": "string", "enum": ["stop", "length", "tool_calls"]})
_LOGPROBS = null({"type": "object"})
_FUNCTION_CALL = obj(["name", "arguments"], name=STR, arguments={**STR, "description": "JSON"})
_TOOL_CALL = obj(
    ["id", "type", "function"], id=STR, type={"const": "function"}, function=_FUNCTION_CALL
)
# A stream's tool-call delta: index, id, type and name in a call's first delta only; the
# arguments' JSON text in fragments.
_TOOL_CALL_DELTA = obj(
    ["index"],
    index=INT,
    id=STR,
    type={"const": "function"},
    function=obj([], name=STR, arguments=STR),
)

_REASONING = {
    "reasoning_content": null({**STR, "description": "the model's reasoning (SGLang's name)"}),
    "reasoning": null({**STR, "description": "the model's reasoning (vLLM's name)"}),
}

OPENAI_RESPONSES: dict[str, Any] = {
    "CompletionChoice": obj(
        ["index", "text", "finish_reason"],
        index=INT,
        text=STR,
        logprobs=_LOGPROBS,
        finish_reason=_FINISH,
    ),
    "Completion": obj(
        _ENV_REQUIRED,
        **_ENVELOPE,
        choices=array(ref("CompletionChoice")),
        usage=null(ref("Usage")),  # null in stream chunks before the last
    ),
    "ChatMessage": obj(
        ["role", "content"],
        role=STR,
        content=null(STR),
        tool_calls=array(_TOOL_CALL),
        **_REASONING,
    ),
    "ChatChoice": obj(
        ["index", "message", "finish_reason"],
        index=INT,
        message=ref("ChatMessage"),
        logprobs=_LOGPROBS,
        finish_reason=_CHAT_FINISH,
    ),
    "ChatCompletion": obj(
        _ENV_REQUIRED, **_ENVELOPE, choices=array(ref("ChatChoice")), usage=ref("Usage")
    ),
    "ChatDelta": obj(
        [],
        role=STR,
        content=null(STR),
        tool_calls=array(_TOOL_CALL_DELTA, minItems=1),
        **_REASONING,
    ),
    "ChatCompletionChunk": obj(
        _ENV_REQUIRED,
        **_ENVELOPE,
        choices=array(
            obj(
                ["index", "delta"],
                index=INT,
                delta=ref("ChatDelta"),
                logprobs=_LOGPROBS,
                finish_reason=_CHAT_FINISH,
            )
        ),
        usage=null(ref("Usage")),
    ),
    "Usage": _USAGE,
    "ModelList": obj(
        ["object", "data"],
        object=STR,
        data=array(
            obj(["id", "object"], id=STR, object=STR, created=INT, owned_by=STR, parent=STR)
        ),
    ),
    "OpenAIError": obj(
        ["error"],
        error=obj(["message", "type"], message=STR, type=STR, param=null(STR), code=null(INT)),
    ),
}

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
RESPONSES_API: dict[str, Any] = {
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
MESSAGES_API: dict[str, Any] = {
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

RESPONSE_SCHEMAS: dict[str, Any] = {
    **TGI_RESPONSES,
    **OPENAI_RESPONSES,
    **RESPONSES_API,
    **MESSAGES_API,
}
