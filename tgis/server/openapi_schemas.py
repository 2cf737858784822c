"""OpenAPI component schemas: TGI's (router/src/lib.rs) and the OpenAI subset served here."""

from __future__ import annotations

from typing import Any


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    """An object schema (OpenAPI 3.0 wants `required` non-empty, or absent)."""
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema


def _null(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


STR: dict[str, Any] = {"type": "string"}
INT: dict[str, Any] = {"type": "integer", "minimum": 0}
NUM: dict[str, Any] = {"type": "number"}
BOOL: dict[str, Any] = {"type": "boolean"}


def _array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


FINISH_REASON = {"type": "string", "enum": ["length", "eos_token", "stop_sequence", "time_limit"]}

_PREFIX_ID = (
    "TGIS: a tuned prompt prefix of the server's --prefix-store-path, whose virtual tokens go "
    "before the input (and count toward the token limits)"
)
_BELOW_ONE: dict[str, Any] = {"maximum": 1, "exclusiveMaximum": True}
_PARAMETERS = _obj(
    [],
    do_sample={**BOOL, "default": False},
    # OpenAPI 3.0's bounds (a boolean exclusiveMinimum beside minimum), as the server checks
    # them: tgis.params (0.0001 is the least a float32 computation keeps usable).
    temperature=_null({**NUM, "minimum": 0.0001, "example": 0.5}),
    top_k=_null({"type": "integer", "minimum": 1, "example": 10}),
    top_p=_null({**NUM, "minimum": 0.0001, **_BELOW_ONE, "example": 0.95}),
    typical_p=_null({**NUM, "minimum": 0.0001, **_BELOW_ONE}),
    repetition_penalty=_null({**NUM, "minimum": 0.0001, "example": 1.03}),
    frequency_penalty=_null(NUM),
    presence_penalty=_null(NUM),
    seed=_null(INT),
    max_new_tokens=_null({**INT, "example": 20}),
    min_new_tokens={**INT, "default": 0, "description": "TGIS: generate at least this many"},
    stop={**_array(STR), "example": ["photographer"]},
    include_stop_sequence={**BOOL, "default": True, "description": "TGIS: keep the stop text"},
    ignore_eos={**BOOL, "default": False},
    time_limit_ms=_null(
        {
            **INT,
            "minimum": 1,
            "maximum": 2147483647,
            "description": "TGIS: stop this long after arrival (time_limit)",
        }
    ),
    length_penalty=_null(
        {
            **_obj(["start_index", "decay_factor"], start_index=INT, decay_factor=NUM),
            "description": "TGIS: after start_index new tokens, EOS logits grow by "
            "|logit| * (decay_factor ^ (generated - start_index) - 1)",
        }
    ),
    truncate=_null({**INT, "description": "keep only the last N prompt tokens"}),
    return_full_text=_null({**BOOL, "description": "prepend the prompt to generated_text"}),
    details={**BOOL, "default": False},
    decoder_input_details={**BOOL, "default": False},
    top_n_tokens=_null({**INT, "example": 5}),
    best_of=_null({**INT, "example": 2}),
    skip_special_tokens={**BOOL, "default": True},
    prefix_id=_null({**STR, "description": _PREFIX_ID}),
    watermark={**BOOL, "default": False, "description": "not supported: must be false"},
)

_TOKEN = _obj(
    ["id", "text", "logprob", "special"], id=INT, text=STR, logprob=_null(NUM), special=BOOL
)
_PREFILL = _obj(["id", "text", "logprob"], id=INT, text=STR, logprob=_null(NUM))
_SEQUENCE = {
    "finish_reason": FINISH_REASON,
    "generated_tokens": INT,
    "seed": _null(INT),
    "prefill": _array(ref("PrefillToken")),
    "tokens": _array(ref("Token")),
    "top_tokens": _array(_array(ref("Token"))),
}
_SEQ_REQUIRED = ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]

TGI_SCHEMAS: dict[str, Any] = {
    "GenerateParameters": _PARAMETERS,
    "GenerateRequest": _obj(
        ["inputs"],
        inputs={**STR, "example": "My name is Olivier and INT"},
        parameters=ref("GenerateParameters"),
    ),
    "CompatGenerateRequest": _obj(
        ["inputs"],
        inputs=STR,
        parameters=ref("GenerateParameters"),
        stream={**BOOL, "default": False},
    ),
    "Token": _TOKEN,
    "PrefillToken": _PREFILL,
    "BestOfSequence": _obj(["generated_text", *_SEQ_REQUIRED], generated_text=STR, **_SEQUENCE),
    "Details": _obj(_SEQ_REQUIRED, **_SEQUENCE, best_of_sequences=_array(ref("BestOfSequence"))),
    "GenerateResponse": _obj(["generated_text"], generated_text=STR, details=ref("Details")),
    "StreamDetails": _obj(
        ["finish_reason", "generated_tokens", "seed", "input_length"],
        finish_reason=FINISH_REASON,
        generated_tokens=INT,
        seed=_null(INT),
        input_length=INT,
    ),
    "StreamResponse": _obj(
        ["index", "token", "generated_text", "details"],
        index=INT,
        token=ref("Token"),
        top_tokens=_array(ref("Token")),
        generated_text=_null(STR),
        details=_null(ref("StreamDetails")),
    ),
    "SimpleToken": _obj(["id", "text", "start", "stop"], id=INT, text=STR, start=INT, stop=INT),
    "TokenizeResponse": _array(ref("SimpleToken")),
    "ErrorResponse": _obj(["error", "error_type"], error=STR, error_type=STR),
    "Info": _obj(
        ["model_id", "max_input_tokens", "max_total_tokens", "version"],
        model_id=STR,
        model_sha=_null(STR),
        model_dtype=STR,
        model_device_type=STR,
        model_pipeline_tag=_null(STR),
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
        max_batch_total_tokens=_null(INT),
        max_batch_size=_null(INT),
        max_waiting_tokens=INT,
        waiting_served_ratio=NUM,
        max_client_batch_size=INT,
        validation_workers=INT,
        router=STR,
        version=STR,
        sha=_null(STR),
        docker_label=_null(STR),
    ),
}

_SAMPLING = {
    "model": STR,
    "max_tokens": _null(INT),
    "temperature": _null({**NUM, "minimum": 0, "description": "0: greedy decoding"}),
    "top_p": _null(NUM),
    "n": {**INT, "default": 1, "description": "n > 1: n sampled sequences (<= --max-best-of)"},
    "stream": {**BOOL, "default": False},
    "stream_options": _obj([], include_usage=BOOL),
    "stop": {"oneOf": [STR, _array(STR)]},
    "seed": _null(INT),
    "frequency_penalty": _null(NUM),
    "presence_penalty": _null(NUM),
    "prefix_id": _null({**STR, "description": _PREFIX_ID}),
}
_USAGE = _obj(
    ["prompt_tokens", "completion_tokens", "total_tokens"],
    prompt_tokens=INT,
    completion_tokens=INT,
    total_tokens=INT,
)
_ENVELOPE = {"id": STR, "object": STR, "created": INT, "model": STR, "system_fingerprint": STR}
_ENV_REQUIRED = ["id", "object", "created", "model", "choices"]
_FINISH = _null({"type": "string", "enum": ["stop", "length"]})

OPENAI_SCHEMAS: dict[str, Any] = {
    "CompletionRequest": _obj(
        ["prompt"],
        prompt={"oneOf": [STR, _array(STR), _array(INT), _array(_array(INT))]},
        logprobs=_null(INT),
        echo=BOOL,
        **_SAMPLING,
    ),
    "CompletionChoice": _obj(
        ["index", "text", "finish_reason"],
        index=INT,
        text=STR,
        logprobs=_null({"type": "object"}),
        finish_reason=_FINISH,
    ),
    "Completion": _obj(
        _ENV_REQUIRED, **_ENVELOPE, choices=_array(ref("CompletionChoice")), usage=ref("Usage")
    ),
    "ChatMessage": _obj(
        ["role", "content"],
        role=STR,
        content={"oneOf": [STR, _array({"type": "object"})]},
        name=STR,
    ),
    "ChatRequest": _obj(
        ["messages"],
        messages=_array(ref("ChatMessage")),
        max_completion_tokens=_null(INT),
        logprobs=BOOL,
        top_logprobs=_null(INT),
        **_SAMPLING,
    ),
    "ChatChoice": _obj(
        ["index", "message", "finish_reason"],
        index=INT,
        message=ref("ChatMessage"),
        logprobs=_null({"type": "object"}),
        finish_reason=_FINISH,
    ),
    "ChatCompletion": _obj(
        _ENV_REQUIRED, **_ENVELOPE, choices=_array(ref("ChatChoice")), usage=ref("Usage")
    ),
    "ChatCompletionChunk": _obj(
        _ENV_REQUIRED,
        **_ENVELOPE,
        choices=_array(
            _obj(["index", "delta"], index=INT, delta=ref("ChatMessage"), finish_reason=_FINISH)
        ),
        usage=_null(ref("Usage")),
    ),
    "Usage": _USAGE,
    "ModelList": _obj(
        ["object", "data"],
        object=STR,
        data=_array(_obj(["id", "object"], id=STR, object=STR, created=INT, owned_by=STR)),
    ),
    "OpenAIError": _obj(
        ["error"],
        error=_obj(["message", "type"], message=STR, type=STR, param=_null(STR), code=INT),
    ),
}
