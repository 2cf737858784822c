"""The rerank APIs' operations in a pooling server's OpenAPI document: /v1/rerank and
/v2/rerank (vLLM's, Cohere's, Jina's) and /score and /v1/score (vLLM's)."""

from __future__ import annotations

from typing import Any

from tgis.server.http.openapi_schemas import (
    BOOL,
    INT,
    NUM,
    OPENAI_ERROR,
    STR,
    array,
    content,
    integer,
    obj,
    post,
    ref,
)
from tgis.server.rerank.routes import MAX_DOCUMENTS

TAG = "Rerank"
TAGS = ({"name": TAG, "description": "vLLM's, Cohere's and Jina's rerank and score APIs"},)
_TEXTS = {"anyOf": [STR, array(STR, minItems=1, maxItems=MAX_DOCUMENTS)]}


def requests() -> dict[str, Any]:
    return {
        "RerankDocumentsRequest": obj(
            ["query", "documents"],
            model=STR,
            query=STR,
            documents=array(
                {"anyOf": [STR, obj(["text"], text=STR)]}, minItems=1, maxItems=MAX_DOCUMENTS
            ),
            top_n=integer(),
            return_documents=BOOL,
        ),
        "ScoreRequest": obj(["text_1", "text_2"], model=STR, text_1=_TEXTS, text_2=_TEXTS),
    }


RESPONSES: dict[str, Any] = {
    "RerankDocumentsResponse": obj(
        ["id", "model", "usage", "results"],
        id=STR,
        model=STR,
        usage=obj(["total_tokens"], total_tokens=INT),
        results=array(
            obj(
                ["index", "relevance_score"],
                index=INT,
                relevance_score=NUM,
                document=obj(["text"], text=STR),
            )
        ),
    ),
    "ScoreResponse": obj(
        ["id", "object", "created", "model", "data", "usage"],
        id=STR,
        object={"const": "list"},
        created=INT,
        model=STR,
        data=array(
            obj(["index", "object", "score"], index=INT, object={"const": "score"}, score=NUM)
        ),
        usage=obj(["prompt_tokens", "total_tokens"], prompt_tokens=INT, total_tokens=INT),
    ),
    "OpenAIError": OPENAI_ERROR,
}


def paths() -> dict[str, Any]:
    ranked = content(ref("RerankDocumentsResponse"))
    rerank = post("Documents ranked against the query", "RerankDocumentsRequest", ranked, TAG, True)
    score = post("Scores of text pairs", "ScoreRequest", content(ref("ScoreResponse")), TAG, True)
    return {"/v1/rerank": rerank, "/v2/rerank": rerank, "/score": score, "/v1/score": score}
