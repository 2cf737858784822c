"""TEI's operations in a pooling server's OpenAPI document: /embed, /embed_all, /rerank and
/predict, their request and response schemas."""

from __future__ import annotations

from typing import Any

from tgis.server.http.openapi_schemas import (
    BOOL,
    ERROR_RESPONSE,
    INT,
    NUM,
    STR,
    array,
    content,
    integer,
    null,
    obj,
    pooling_input,
    post,
    ref,
)
from tgis.server.tei.requests import MAX_CLIENT_BATCH

TAG = "TEI"
TAGS = ({"name": TAG, "description": "text-embeddings-inference's API"},)
_INPUTS = pooling_input(MAX_CLIENT_BATCH)
_DIRECTION = {"type": "string", "enum": ["right", "left", "Right", "Left"]}
_PAIR = array(STR, minItems=2, maxItems=2)


def requests() -> dict[str, Any]:
    truncation = {"truncate": BOOL, "truncation_direction": _DIRECTION}
    prompt = {"prompt_name": null(STR)}
    return {
        "EmbedRequest": obj(
            ["inputs"],
            inputs=_INPUTS,
            normalize=BOOL,
            dimensions=integer(1),
            **truncation,
            **prompt,
        ),
        "EmbedAllRequest": obj(["inputs"], inputs=_INPUTS, **truncation, **prompt),
        "RerankRequest": obj(
            ["query", "texts"],
            query=STR,
            texts=array(STR, minItems=1, maxItems=MAX_CLIENT_BATCH),
            raw_scores=BOOL,
            return_text=BOOL,
            **truncation,
        ),
        "PredictRequest": obj(
            ["inputs"],
            inputs={
                "anyOf": [
                    STR,
                    _PAIR,
                    array({"anyOf": [STR, _PAIR]}, minItems=1, maxItems=MAX_CLIENT_BATCH),
                ]
            },
            raw_scores=BOOL,
            **truncation,
        ),
    }


_LABELLED = array(obj(["score", "label"], score=NUM, label=STR))
RESPONSES: dict[str, Any] = {
    "EmbedResponse": array(array(NUM)),
    "EmbedAllResponse": array(array(array(NUM))),
    "RerankResponse": array(obj(["index", "score"], index=INT, score=NUM, text=STR)),
    "PredictResponse": {"anyOf": [_LABELLED, array(_LABELLED)]},
    "ErrorResponse": ERROR_RESPONSE,
}


def paths() -> dict[str, Any]:
    return {
        "/embed": post(
            "Embeddings of the inputs (TEI)", "EmbedRequest", content(ref("EmbedResponse")), TAG
        ),
        "/embed_all": post(
            "Each input's hidden state per token (TEI)",
            "EmbedAllRequest",
            content(ref("EmbedAllResponse")),
            TAG,
        ),
        "/rerank": post(
            "The texts scored against the query, best first (TEI)",
            "RerankRequest",
            content(ref("RerankResponse")),
            TAG,
        ),
        "/predict": post(
            "Each input's labels and scores (TEI)",
            "PredictRequest",
            content(ref("PredictResponse")),
            TAG,
        ),
    }
