"""TEI's routes over a pooling model: POST /embed, /embed_all, /rerank and /predict (bodies and answers:
tei/requests.py). A route the model's task does not serve is a 424 naming the task, as TEI
answers it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tgis.pooling.model import finish_embedding
from tgis.server.http.errors import ApiError
from tgis.server.http.fields import read_json
from tgis.server.http.pooling import PoolingState, answered, get_pooling, run_pooling
from tgis.server.tei.requests import (
    embed_all_answer,
    embed_answer,
    parse_embed,
    parse_embed_all,
    parse_predict,
    parse_rerank,
    predict_answer,
    rerank_answer,
)


def _serves(state: PoolingState, tasks: tuple[str, ...], route: str) -> None:
    task = state.model.spec.task
    if task not in tasks:
        raise ApiError(
            424, f"{route}: this server's model serves {task}, not {' or '.join(tasks)}",
            "backend",
        )  # fmt: skip


async def embed(request: Request) -> Response:
    """POST /embed: one embedding per input."""

    async def work() -> Response:
        state = get_pooling(request)
        _serves(state, ("embed",), "/embed")
        model = state.model
        body = parse_embed(
            await read_json(request), len(model.tokenizer), state.runner.max_batch_rows
        )
        if body.dimensions is not None and body.dimensions > model.dimension:
            raise ApiError(
                422,
                f"Input validation error: `dimensions` must be at most this model's "
                f"{model.dimension}, got {body.dimensions}",
                "validation",
            )
        left = body.direction == "left"
        pooled = await run_pooling(
            request, "embed", body.inputs, "inputs", body.truncate, left,
            prompt_name=body.prompt_name,
        )  # fmt: skip
        vectors = [finish_embedding(v, body.dimensions, body.normalize) for v in pooled.outputs]
        return JSONResponse(embed_answer(vectors))

    return await answered(request, work)


async def embed_all(request: Request) -> Response:
    """POST /embed_all: each input's hidden state per token."""

    async def work() -> Response:
        state = get_pooling(request)
        _serves(state, ("embed",), "/embed_all")
        body = parse_embed_all(
            await read_json(request), len(state.model.tokenizer), state.runner.max_batch_rows
        )
        left = body.direction == "left"
        pooled = await run_pooling(
            request, "embed", body.inputs, "inputs", body.truncate, left, tokens=True,
            prompt_name=body.prompt_name,
        )  # fmt: skip
        return JSONResponse(embed_all_answer(pooled.outputs))

    return await answered(request, work)


async def rerank(request: Request) -> Response:
    """POST /rerank: the texts scored against the query, best first."""

    async def work() -> Response:
        state = get_pooling(request)
        _serves(state, ("rerank",), "/rerank")
        body = parse_rerank(await read_json(request), state.runner.max_batch_rows)
        pairs = [(body.query, text) for text in body.texts]
        left = body.direction == "left"
        pooled = await run_pooling(request, "rerank", pairs, "texts", body.truncate, left)
        return JSONResponse(rerank_answer(body, [float(out[0]) for out in pooled.outputs]))

    return await answered(request, work)


async def predict(request: Request) -> Response:
    """POST /predict: each input's labels with their scores, best first."""

    async def work() -> Response:
        state = get_pooling(request)
        _serves(state, ("classify", "rerank"), "/predict")
        body = parse_predict(await read_json(request), state.runner.max_batch_rows)
        inputs = [item[0] if len(item) == 1 else (item[0], item[1]) for item in body.inputs]
        left = body.direction == "left"
        pooled = await run_pooling(request, "classify", inputs, "inputs", body.truncate, left)
        return JSONResponse(predict_answer(body, pooled.outputs, state.model.spec.labels))

    return await answered(request, work)


ROUTES = [
    Route("/embed", embed, methods=["POST"]),
    Route("/embed_all", embed_all, methods=["POST"]),
    Route("/rerank", rerank, methods=["POST"]),
    Route("/predict", predict, methods=["POST"]),
]
