"""OpenAI's request and response schemas (chat completions, completions, models), built from
the server's limits."""

from __future__ import annotations

from typing import Any

from tgis.params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MIN_POSITIVE
from tgis.server.chat.openapi import CHAT_TEMPLATE_FIELDS, RESPONSE_FORMAT, TOOL, TOOL_CHOICE
from tgis.server.http.openapi_schemas import (
    BOOL,
    FACTOR,
    IGNORE_EOS,
    INT,
    NULL,
    NUM,
    OPENAI_ERROR,
    PENALTY,
    SEED,
    STR,
    RequestSchemas,
    array,
    content,
    decimal_below,
    events,
    get,
    given,
    integer,
    null,
    obj,
    post,
    ref,
    ruled,
    when,
)


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
    formatted = given(
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


_CONSTRAINED_CHAT = _chat_constraints()
_CONSTRAINED_CHAT_RULE = (
    '`tool_choice` needs `tools`; `response_format` and `tools` (unless `tool_choice` is "none") '
    "both constrain the output, so not both; and a constrained output ends with EOS, so neither "
    "takes `ignore_eos` or `min_tokens`"
)


def sampling(s: RequestSchemas) -> dict[str, Any]:
    """The fields both OpenAI routes take."""
    new_tokens = null(integer(1, s.max_new_tokens))
    return {
        "model": null(STR),
        "max_tokens": new_tokens,
        "temperature": null({"anyOf": [{"const": 0}, FACTOR], "description": "0: greedy decoding"}),
        "top_p": null({**NUM, "minimum": MIN_POSITIVE, "maximum": 1}),
        "n": null(integer(1, s.limits.max_best_of, description="n sampled sequences")),
        "stream": null({**BOOL, "default": False}),
        "stream_options": null(obj([], include_usage=null(BOOL))),
        "stop": null(
            {
                "anyOf": [
                    STR,
                    array(STR, maxItems=s.limits.max_stop_sequences),
                ]
            }
        ),
        "seed": null(SEED),
        "frequency_penalty": null(PENALTY),
        "presence_penalty": null(PENALTY),
        "top_k": null(integer(1)),
        "repetition_penalty": null(FACTOR),
        "min_tokens": null(integer(0, s.max_new_tokens)),
        "ignore_eos": null({**BOOL, "description": IGNORE_EOS}),
        "logit_bias": null(
            {
                "type": "object",
                "maxProperties": MAX_LOGIT_BIAS_TOKENS,
                "propertyNames": {"pattern": decimal_below(s.vocab_size)},
                "additionalProperties": {
                    "type": "number",
                    "minimum": -MAX_LOGIT_BIAS,
                    "maximum": MAX_LOGIT_BIAS,
                },
            }
        ),
        "prefix_id": s.prefix_id(),
    }


def rules() -> list[dict[str, Any]]:
    several = given("n", {"type": "integer", "minimum": 2})
    return [
        when(
            several,
            {"properties": {"temperature": {"not": {"const": 0}}, "seed": NULL}},
            "`n` > 1 needs sampling (`temperature` above 0) and no `seed`",
        ),
        when(
            given("stream_options"),
            given("stream", {"const": True}),
            "`stream_options` is only allowed when `stream` is true",
        ),
    ]


def requests(s: RequestSchemas) -> dict[str, Any]:
    lim = s.limits
    token = integer(0, s.vocab_size - 1)
    ids = array(token, minItems=1)
    batch = {"minItems": 1, "maxItems": s.max_client_batch_size}
    prompt = {
        "anyOf": [
            s.prompt_text(),
            array(s.prompt_text(), **batch),
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
        **sampling(s),
    )
    # best_of, when given, equals n (1 when n is not given).
    same = [
        when(
            given("best_of", {"const": k}),
            given("n", {"const": k}) if k > 1 else {"properties": {"n": null({"const": 1})}},
            "`best_of` is only supported equal to `n`",
        )
        for k in range(1, lim.max_best_of + 1)
    ]
    echoed = when(
        {"allOf": [given("echo", {"const": True}), given("logprobs")]},
        {"properties": {"stream": null({"const": False})}}
        if s.no_prompt_logprobs is None
        else {"not": {}},
        "`echo` with `logprobs` is not supported when streaming"
        if s.no_prompt_logprobs is None
        else s.no_prompt_logprobs,
    )
    completion["allOf"] = [*rules(), *same, echoed]
    text_part: dict[str, Any] = obj(["type", "text"], type={"const": "text"}, text=STR)
    if s.images is not None:
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
        max_completion_tokens=null(integer(1, s.max_new_tokens)),
        logprobs=null(BOOL),
        top_logprobs=null(integer(0, lim.max_top_n_tokens)),
        tools=null(array(TOOL)),
        tool_choice=null(TOOL_CHOICE),
        parallel_tool_calls=null(BOOL),
        response_format=null(RESPONSE_FORMAT),
        **CHAT_TEMPLATE_FIELDS,
        **sampling(s),
    )
    chat["allOf"] = [
        *rules(),
        # top_logprobs > 0 needs logprobs.
        when(
            given("top_logprobs", {"type": "integer", "minimum": 1}),
            given("logprobs", {"const": True}),
            "`top_logprobs` needs `logprobs` set to true",
        ),
        ruled(_CONSTRAINED_CHAT, _CONSTRAINED_CHAT_RULE),
    ]
    return {
        "CompletionRequest": completion,
        "ChatMessageInput": message,
        "ChatRequest": chat,
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

RESPONSES: dict[str, Any] = {
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
    "OpenAIError": OPENAI_ERROR,
}


TAG = "OpenAI"
TAGS = ({"name": TAG, "description": "OpenAI-compatible API"},)


def paths() -> dict[str, Any]:
    """OpenAI's operations."""
    return {
        "/v1/completions": post(
            "OpenAI completions",
            "CompletionRequest",
            {**content(ref("Completion")), **events(ref("Completion"), "OpenAIError", True)},
            TAG,
            openai=True,
        ),
        "/v1/chat/completions": post(
            "OpenAI chat completions (the model's chat template)",
            "ChatRequest",
            {
                **content(ref("ChatCompletion")),
                **events(ref("ChatCompletionChunk"), "OpenAIError", True),
            },
            TAG,
            openai=True,
        ),
        "/v1/models": get("The served model", content(ref("ModelList")), TAG),
    }
