"""What the routes of a pooling model share (`app.state.tgis_pooling`): the model and its
batching runner (tgis.pooling), admission, and the request path every embeddings, rerank and
classify route takes: tokenize off the event loop, hold each input to the model's length (or
cut it when the request says `truncate`), admit it (429 past --max-concurrent-requests), run it
in the runner's next batches, count it; a client that leaves cancels its request.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tgis.config import ServeConfig
from tgis.errors import InputValidationError, OverloadedError
from tgis.pooling.model import PoolingModel
from tgis.pooling.runner import PoolingRunner
from tgis.server.http.contract import RequestContract
from tgis.server.http.errors import SHUTTING_DOWN, ApiError, Shape, error_response
from tgis.server.http.fields import PoolingInput
from tgis.server.http.lifecycle import Lifecycle
from tgis.server.http.metrics import CONTENT_TYPE, Metrics
from tgis.server.http.sse import failed_response, unless_disconnected

# One input of a pooling request: text, token ids, or a text and its pair (rerank, predict).
Text = PoolingInput | tuple[str, str]


@dataclass
class PoolingState:
    """The served pooling model and the machinery its routes share."""

    model: PoolingModel
    runner: PoolingRunner
    config: ServeConfig
    metrics: Metrics
    lifecycle: Lifecycle
    # What /info and the answers' `model` name.
    model_id: str
    # The pooling APIs' operations and schemas (`/openapi.json`).
    contract: RequestContract
    # Requests admitted and not yet answered (429 at config.max_concurrent_requests).
    admitted: int = field(default=0)


def get_pooling(request: Request) -> PoolingState:
    state: PoolingState = request.app.state.tgis_pooling
    return state


@dataclass(frozen=True)
class Pooled:
    """A request's outputs, in input order, and each input's length in tokens."""

    outputs: list[torch.Tensor]
    lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


async def run_pooling(
    request: Request,
    kind: str,
    inputs: Sequence[Text],
    field_name: str,
    truncate: bool | None = False,
    left: bool = False,
    tokens: bool = False,
    prompt_name: str | None = None,
) -> Pooled:
    """Run `inputs` (the request's field `field_name`) through the served model, cut to its
    length when `truncate` (None: the API has no such field). Raises InputValidationError
    (an input past the model's length otherwise), OverloadedError, ClientDisconnected, or the
    model's error. `tokens`: each input's outputs per token (TEI's /embed_all). An embedding
    model's text inputs start with its prompt `prompt_name` (None: its default prompt, if any;
    an InputValidationError for a name it does not have); token ids and pairs take none."""
    state = get_pooling(request)
    arrival = time.monotonic()
    state.metrics.request_received(kind, len(inputs))
    if state.admitted >= state.config.max_concurrent_requests:
        raise OverloadedError("Model is overloaded")
    state.admitted += 1
    try:
        model = state.model
        prompt = model.prompt(prompt_name) if model.spec.task == "embed" else None
        encoded = await anyio.to_thread.run_sync(
            lambda: [_encode(model, x, bool(truncate), left, prompt) for x in inputs]
        )
        longest = state.model.max_length
        for i, row in enumerate(encoded):
            n = len(row["input_ids"])
            if longest is not None and n > longest:
                where = f"`{field_name}`" if len(inputs) == 1 else f"`{field_name}[{i}]`"
                raise InputValidationError(
                    f"{where} has {n} tokens, more than this model's {longest}: shorten it"
                    + (", or set `truncate`" if truncate is not None else "")
                )
            if n == 0:
                raise InputValidationError(f"`{field_name}` has an input of no tokens")
        outputs = await unless_disconnected(
            request.receive, lambda: state.runner.run(encoded, tokens)
        )
    finally:
        state.admitted -= 1
    lengths = [len(row["input_ids"]) for row in encoded]
    state.metrics.pooled(kind, lengths, time.monotonic() - arrival)
    return Pooled(outputs, lengths)


def _encode(
    model: PoolingModel, text: Text, truncate: bool, left: bool, prompt: str | None
) -> dict[str, list[int]]:
    if isinstance(text, str):
        return model.encode(text, truncate, left, prompt)
    first, second = text[0], text[-1]
    if isinstance(first, str) and isinstance(second, str):  # a text and its pair
        return model.encode((first, second), truncate, left)
    ids = [int(t) for t in text]  # token ids given
    return model.cut_ids(ids, left) if truncate else {"input_ids": ids}


async def answered(
    request: Request, work: Callable[[], Awaitable[Response]], shape: Shape = "tgi"
) -> Response:
    """`work()`'s response, or the failure's in the route family's shape (`tgi` or `openai`),
    counted; 499 when the client left."""
    state = get_pooling(request)
    if state.lifecycle.draining:
        return error_response(SHUTTING_DOWN, shape)
    try:
        return await work()
    except Exception as exc:
        return failed_response(state.metrics, exc, shape)


async def health(request: Request) -> Response:
    """GET /health: 200 while the server admits requests and the runner runs."""
    state = get_pooling(request)
    if state.lifecycle.draining:
        return error_response(SHUTTING_DOWN)
    if not state.runner.running:
        return error_response(ApiError(503, "unhealthy", "healthcheck"))
    return Response(status_code=200)


async def info(request: Request) -> Response:
    """GET /info: the model, its task (embed, rerank, classify) and its limits."""
    state = get_pooling(request)
    model = state.model
    spec = model.spec
    body = {
        "model_id": state.model_id,
        "model_type": "pooling",
        "task": spec.task,
        "max_input_length": model.max_length,
        "max_concurrent_requests": state.config.max_concurrent_requests,
        "max_batch_tokens": state.runner.max_batch_tokens,
        "max_client_batch_size": state.runner.max_batch_rows,
        "version": _version(),
    }
    if spec.task == "embed":
        body |= {"pooling": list(spec.modes), "normalized": spec.normalize,
                 "dimensions": model.dimension, "matryoshka_dimensions": list(spec.dimensions)}  # fmt: skip
    else:
        body["labels"] = list(spec.labels)
    return JSONResponse(body)


async def metrics(request: Request) -> Response:
    """GET /metrics: Prometheus text exposition of the tgi_* metrics."""
    return Response(get_pooling(request).metrics.render(), media_type=CONTENT_TYPE)


def _version() -> str:
    from importlib.metadata import version

    return version("tgis")


async def openapi(request: Request) -> Response:
    """GET /openapi.json of a pooling server."""
    from tgis.server.http.openapi import openapi_document

    return JSONResponse(openapi_document(get_pooling(request).contract))
