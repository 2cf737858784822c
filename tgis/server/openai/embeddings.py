"""OpenAI's `POST /v1/embeddings` body and answer, as the `openai` client sends and reads them.

`input` is a string, an array of strings, an array of token ids (one input) or an array of
arrays of token ids; at most MAX_INPUTS inputs, none empty. `encoding_format` is `float` (JSON
numbers) or `base64` (each embedding's little-endian float32 bytes, which the `openai` client
asks for by default and decodes). `dimensions` cuts a Matryoshka model's embeddings to one of
the sizes it declares. `user` is OpenAI's end-user id, taken and not used, as OpenAI's own
servers use it only for abuse monitoring.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tgis.pooling.model import finish_embedding
from tgis.server.http.errors import ApiError, invalid
from tgis.server.http.fields import Fields, PoolingInput, pooling_inputs, read_json
from tgis.server.http.pooling import answered, get_pooling, run_pooling

# OpenAI's bound on the inputs of one request.
MAX_INPUTS = 2048
EncodingFormat = Literal["float", "base64"]


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str | None
    inputs: tuple[PoolingInput, ...]
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None


def parse_embeddings_request(
    body: Any, vocab_size: int, size: int, matryoshka: Sequence[int] = ()
) -> EmbeddingsRequest:
    """The request in `body`, or a 422 naming the field: `vocab_size` bounds token ids, `size`
    is the model's embedding size and `matryoshka` the sizes it may be cut to."""
    f = Fields(body)
    f.string("user")
    encoding = f.string("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid(f'`encoding_format` must be "float" or "base64", got {encoding!r}')
    dimensions = f.integer("dimensions")
    if dimensions is not None:
        if not matryoshka:
            raise invalid(
                f"`dimensions`: this model's embeddings have {size} values and cannot be cut "
                "(its config.json declares no matryoshka_dimensions); leave `dimensions` out"
            )
        allowed = sorted(set(matryoshka) | {size})
        if dimensions not in allowed:
            raise invalid(
                f"`dimensions` must be one of {', '.join(map(str, allowed))} for this model, "
                f"got {dimensions}"
            )
    value = body.get("input") if isinstance(body, dict) else None
    inputs = pooling_inputs(value, "input", vocab_size, MAX_INPUTS)
    return EmbeddingsRequest(f.string("model"), inputs, encoding, dimensions)  # type: ignore[arg-type]


def embeddings_response(
    vectors: Sequence[torch.Tensor], model: str, encoding: EncodingFormat, prompt_tokens: int
) -> dict[str, Any]:
    """OpenAI's `CreateEmbeddingResponse` of `vectors`, in request order."""
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(vector, encoding)}
        for i, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def encode_vector(vector: torch.Tensor, encoding: EncodingFormat) -> list[float] | str:
    """An embedding as JSON numbers, or base64 of its little-endian float32 bytes."""
    values = vector.detach().to(torch.float32).cpu().contiguous()
    if encoding == "float":
        return values.tolist()
    raw = values.numpy().astype("<f4").tobytes()
    return base64.b64encode(raw).decode("ascii")


async def embeddings(request: Request) -> Response:
    """POST /v1/embeddings."""

    async def work() -> Response:
        state = get_pooling(request)
        model = state.model
        if model.spec.task != "embed":
            raise ApiError(
                404,
                f"this server's model {state.model_id} serves {model.spec.task}, not "
                "embeddings: use /rerank or /predict",
                "not_found",
            )
        body = parse_embeddings_request(
            await read_json(request), len(model.tokenizer), model.dimension, model.spec.dimensions
        )
        pooled = await run_pooling(request, "embed", body.inputs, "input", truncate=None)
        vectors = [
            finish_embedding(vector, body.dimensions, model.spec.normalize)
            for vector in pooled.outputs
        ]
        answer = embeddings_response(
            vectors, body.model or state.model_id, body.encoding_format, pooled.tokens
        )
        return JSONResponse(answer)

    return await answered(request, work, "openai")


ROUTES = [Route("/v1/embeddings", embeddings, methods=["POST"])]
