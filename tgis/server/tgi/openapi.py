"""TGI's request and response schemas (router/src/lib.rs), built from the server's limits."""

from __future__ import annotations

from typing import Any

from tgis.params import MAX_TIME_LIMIT_MS
from tgis.server.http.openapi_schemas import (
    BOOL,
    ERROR_RESPONSE,
    FACTOR,
    FINISH_REASON,
    FRACTION,
    IGNORE_EOS,
    INT,
    MAX_INT,
    NULL,
    NUM,
    PENALTY,
    SCHEMA_VALUE,
    SEED,
    STR,
    RequestSchemas,
    array,
    content,
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

GRAMMAR: dict[str, Any] = {
    "description": "TGI's grammar: the output matches a JSON schema or a regex",
    "anyOf": [
        obj(
            ["type", "value"],
            type={"enum": ["json", "json_object", "json_schema"]},
            value={"anyOf": [SCHEMA_VALUE, {**STR, "description": "the schema as JSON text"}]},
        ),
        obj(
            ["type", "value"],
            type={"const": "regex"},
            value={**STR, "description": "Rust regex syntax: no lookaround, no backreferences"},
        ),
    ],
}
GRAMMAR_ENDS = (
    "`grammar` cannot be combined with `ignore_eos` or `min_new_tokens`: a complete grammar "
    "ends with EOS"
)
STREAMED = "a streamed request takes neither `best_of` > 1 nor `decoder_input_details`"


def parameters(s: RequestSchemas) -> dict[str, Any]:
    """TGI's `parameters` object, and the rules between its fields."""
    lim = s.limits
    new_tokens = integer(1, s.max_new_tokens)
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
        min_new_tokens=null(integer(0, s.max_new_tokens, description="TGIS: at least this many")),
        stop=null(array(STR, maxItems=lim.max_stop_sequences, example=["photographer"])),
        include_stop_sequence=null({**BOOL, "description": "TGIS: keep the stop text"}),
        ignore_eos=null({**BOOL, "description": IGNORE_EOS}),
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
            if s.no_prompt_logprobs is None
            else {"const": False, "x-rule": s.no_prompt_logprobs}
        ),
        top_n_tokens=null(integer(0, lim.max_top_n_tokens, example=5)),
        best_of=null(integer(1, lim.max_best_of, example=2)),
        skip_special_tokens=null(BOOL),
        prefix_id=s.prefix_id(),
        watermark=null({"const": False, "description": "not supported"}),
        grammar=null({"anyOf": [{"const": ""}, GRAMMAR]}),
        adapter_id=s.adapters.schema(),
    )
    several = given("best_of", {"type": "integer", "minimum": 2})
    schema["allOf"] = [
        # best_of > 1 samples (do_sample, or any warper given) and takes no seed.
        when(
            several,
            {
                "anyOf": [
                    given("do_sample", {"const": True}),
                    given("temperature"),
                    given("top_k"),
                    given("top_p"),
                    given("typical_p"),
                ],
                "properties": {"seed": NULL},
            },
            "`best_of` > 1 needs sampling (`do_sample` or a warper such as `temperature`) "
            "and no `seed`",
        ),
        when(
            given("grammar", {"type": "object"}),
            {
                "properties": {
                    "ignore_eos": null({"const": False}),
                    "min_new_tokens": null({"const": 0}),
                }
            },
            GRAMMAR_ENDS,
        ),
    ]
    return schema


def streamed_parameters(s: RequestSchemas) -> dict[str, Any]:
    """`parameters` of a streamed request: one sequence, no prompt details."""
    properties = {
        "best_of": null({"const": 1}),
        "decoder_input_details": null({"const": False}),
    }
    return ruled({"properties": properties}, STREAMED)


def requests(s: RequestSchemas) -> dict[str, Any]:
    inputs = {**s.prompt_text(), "example": "My name is Olivier and INT"}
    params = null(ref("GenerateParameters"))
    streamed = {"allOf": [ref("GenerateParameters"), streamed_parameters(s)]}
    return {
        "GenerateParameters": parameters(s),
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
                when(
                    given("stream", {"const": True}),
                    {"properties": {"parameters": null(streamed)}},
                    STREAMED,
                )
            ],
        },
    }


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

RESPONSES: dict[str, Any] = {
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
    "ErrorResponse": ERROR_RESPONSE,
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


TAG = "Text Generation Inference"
TAGS = ({"name": TAG, "description": "Hugging Face Text Generation Inference API"},)


def paths() -> dict[str, Any]:
    """TGI's operations."""
    gen, stream = ref("GenerateResponse"), ref("StreamResponse")
    unhealthy = {"503": {"description": "Unhealthy", "content": content(ref("ErrorResponse"))}}
    return {
        "/": post(
            "Generate; `stream` chooses JSON (a one-element list) or server-sent events",
            "CompatGenerateRequest",
            {**content({"type": "array", "items": gen}), **events(stream, "ErrorResponse")},
            TAG,
        )
        | get(
            "Health check (as /health); a browser (Accept: text/html) gets the playground "
            "instead, unless --no-playground",
            {},
            TAG,
            **unhealthy,
        ),
        "/generate": post("Generate text", "GenerateRequest", content(gen), TAG),
        "/generate_stream": post(
            "Generate a stream of tokens (server-sent events, one StreamResponse each)",
            "GenerateStreamRequest",
            events(stream, "ErrorResponse"),
            TAG,
        ),
        "/tokenize": post(
            "Tokenize inputs", "GenerateRequest", content(ref("TokenizeResponse")), TAG
        ),
        "/info": get("Served model info", content(ref("Info")), TAG),
        "/health": get("Health check", {}, TAG, **unhealthy),
        "/metrics": get("Prometheus metrics", content({"type": "string"}, "text/plain"), TAG),
    }
