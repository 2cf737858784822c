"""POST /v1/rerank and /v2/rerank (vLLM's, Cohere's and Jina's shape) and /score and /v1/score
(vLLM's) over a reranker (a cross-encoder: tgis.pooling).

/v1/rerank: `query`, `documents` (strings, or Cohere's `{"text": ...}` objects), `top_n` (0 or
absent: all), `return_documents` (default true, as vLLM and Jina answer); the answer's
`results` are `{"index", "relevance_score", "document"?: {"text"}}`, best first, with `id`,
`model` and `usage.total_tokens`. /score: `text_1` and `text_2`, each a string or strings (one
against many, or pair by pair); the answer's `data` are `{"index", "object": "score",
"score"}` in order. Scores are the cross-encoder's logit through a sigmoid, as vLLM gives them.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tgis.server.http.errors import ApiError, invalid
from tgis.server.http.fields import Fields, read_json
from tgis.server.http.pooling import answered, get_pooling, run_pooling

# The most documents (or pairs) of one request.
MAX_DOCUMENTS = 1000


@dataclass(frozen=True)
class RerankBody:
    model: str | None
    query: str
    documents: tuple[str, ...]
    top_n: int
    return_documents: bool


def parse_rerank_body(body: Any) -> RerankBody:
    f = Fields(body)
    query = f.required_string("query")
    value = f.data.get("documents")
    if not isinstance(value, list) or not value:
        raise invalid('`documents` must be a non-empty array of strings or {"text": ...} objects')
    if len(value) > MAX_DOCUMENTS:
        raise invalid(f"`documents` holds {len(value)}, more than {MAX_DOCUMENTS}; split it")
    documents = []
    for i, item in enumerate(value):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise invalid(f"`documents[{i}]` must be a string or an object with a `text` string")
        documents.append(text)
    top_n = f.integer("top_n", unsigned=True) or 0
    keep = f.boolean("return_documents")
    return RerankBody(
        f.string("model"), query, tuple(documents), top_n, True if keep is None else keep
    )


def parse_score_body(body: Any) -> tuple[str | None, list[tuple[str, str]]]:
    """The model named and the pairs to score: one `text_1` against each `text_2`, or the
    two arrays pair by pair."""
    f = Fields(body)
    first = f.strings("text_1", allow_single=True)
    second = f.strings("text_2", allow_single=True)
    if not first or not second:
        missing = "text_1" if not first else "text_2"
        raise invalid(f"missing field `{missing}` (a string or a non-empty array of strings)")
    if len(first) == 1:
        pairs = [(first[0], text) for text in second]
    elif len(first) == len(second):
        pairs = list(zip(first, second, strict=True))
    else:
        raise invalid(
            f"`text_1` holds {len(first)} texts and `text_2` {len(second)}: give one `text_1` "
            "or as many as `text_2`"
        )
    if len(pairs) > MAX_DOCUMENTS:
        raise invalid(f"{len(pairs)} pairs, more than {MAX_DOCUMENTS}; split them")
    return f.string("model"), pairs


def _sigmoid(logit: float) -> float:
    return 1.0 / (1.0 + math.exp(-logit))


def _reranker(request: Request, route: str) -> None:
    task = get_pooling(request).model.spec.task
    if task != "rerank":
        raise ApiError(404, f"{route}: this server's model serves {task}, not rerank", "not_found")


async def rerank(request: Request) -> Response:
    """POST /v1/rerank, /v2/rerank."""

    async def work() -> Response:
        _reranker(request, request.url.path)
        state = get_pooling(request)
        body = parse_rerank_body(await read_json(request))
        pairs = [(body.query, text) for text in body.documents]
        pooled = await run_pooling(request, "rerank", pairs, "documents", truncate=None)
        scores = [_sigmoid(float(out[0])) for out in pooled.outputs]
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        results = []
        for index in order[: body.top_n or None]:
            result: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
            if body.return_documents:
                result["document"] = {"text": body.documents[index]}
            results.append(result)
        return JSONResponse({
            "id": f"rerank-{secrets.token_hex(12)}",
            "model": body.model or state.model_id,
            "usage": {"total_tokens": pooled.tokens},
            "results": results,
        })  # fmt: skip

    return await answered(request, work, "openai")


async def score(request: Request) -> Response:
    """POST /score, /v1/score."""

    async def work() -> Response:
        _reranker(request, request.url.path)
        state = get_pooling(request)
        model, pairs = parse_score_body(await read_json(request))
        pooled = await run_pooling(request, "rerank", pairs, "text_2", truncate=None)
        data = [
            {"index": i, "object": "score", "score": _sigmoid(float(out[0]))}
            for i, out in enumerate(pooled.outputs)
        ]
        return JSONResponse({
            "id": f"score-{secrets.token_hex(12)}",
            "object": "list",
            "created": int(time.time()),
            "model": model or state.model_id,
            "data": data,
            "usage": {"prompt_tokens": pooled.tokens, "total_tokens": pooled.tokens},
        })  # fmt: skip

    return await answered(request, work, "openai")


ROUTES = [
    Route("/v1/rerank", rerank, methods=["POST"]),
    Route("/v2/rerank", rerank, methods=["POST"]),
    Route("/score", score, methods=["POST"]),
    Route("/v1/score", score, methods=["POST"]),
]
