"""OpenAI's /v1/embeddings in a pooling server's OpenAPI document (its request and response
schemas, its operation): the embeddings route lives on pooling servers only, so it is not in
openapi.py, which a generation server publishes."""

from __future__ import annotations

from typing import Any

from tgis.server.http.openapi_schemas import (
    INT,
    NUM,
    OPENAI_ERROR,
    STR,
    array,
    content,
    integer,
    obj,
    pooling_input,
    post,
    ref,
)
from tgis.server.openai.embeddings import MAX_INPUTS

TAG = "Embeddings"
TAGS = ({"name": TAG, "description": "OpenAI's embeddings API"},)


def requests() -> dict[str, Any]:
    return {
        "EmbeddingsRequest": obj(
            ["input"],
            input=pooling_input(MAX_INPUTS),
            model=STR,
            encoding_format={"type": "string", "enum": ["float", "base64"]},
            dimensions=integer(1),
            user=STR,
        )
    }


RESPONSES: dict[str, Any] = {
    "EmbeddingsResponse": obj(
        ["object", "data", "model", "usage"],
        object={"const": "list"},
        data=array(
            obj(
                ["object", "index", "embedding"],
                object={"const": "embedding"},
                index=INT,
                embedding={"anyOf": [array(NUM), STR]},
            )
        ),
        model=STR,
        usage=obj(["prompt_tokens", "total_tokens"], prompt_tokens=INT, total_tokens=INT),
    ),
    "OpenAIError": OPENAI_ERROR,
}


def paths() -> dict[str, Any]:
    return {
        "/v1/embeddings": post(
            "Embeddings of the inputs (OpenAI)",
            "EmbeddingsRequest",
            content(ref("EmbeddingsResponse")),
            TAG,
            openai=True,
        )
    }
