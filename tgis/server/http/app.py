"""The Starlette application: TGI's, OpenAI's and Anthropic's routes over one EngineClient.

Middleware, outermost first: CORS (when origins are given), API-key check, graceful-shutdown
gate (tgis.server.http.lifecycle), then the routes. Errors become TGI's JSON
(`{"error": ..., "error_type": ...}`), OpenAI's on /v1/* or Anthropic's on /v1/messages, never
a traceback.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tgis.config import ServeConfig
from tgis.engine.backend import prompt_logprobs_refusal
from tgis.engine.types import EngineClient
from tgis.params import RequestLimits
from tgis.prefix_store import PrefixStore
from tgis.server.anthropic import openapi as anthropic_openapi
from tgis.server.anthropic import routes as anthropic_routes
from tgis.server.chat.prompt import ChatFormat
from tgis.server.http import playground, pooling
from tgis.server.http.contract import RequestContract
from tgis.server.http.errors import (
    UNAUTHORIZED,
    ApiError,
    classify,
    error_body,
    error_response,
    error_status,
    shape_of,
)
from tgis.server.http.generation import Pipeline
from tgis.server.http.images import ImageLimits, UrlPolicy
from tgis.server.http.info import ModelInfo
from tgis.server.http.lifecycle import Lifecycle, LifecycleMiddleware
from tgis.server.http.metrics import Metrics
from tgis.server.http.openapi import docs, docs_asset, openapi_json
from tgis.server.http.openapi_schemas import AdapterChoice, RequestSchemas
from tgis.server.http.state import ServerState
from tgis.server.openai import embeddings as openai_embeddings
from tgis.server.openai import embeddings_openapi as openai_embeddings_openapi
from tgis.server.openai import openapi as openai_openapi
from tgis.server.openai import routes as openai_routes
from tgis.server.rerank import openapi as rerank_openapi
from tgis.server.rerank import routes as rerank_routes
from tgis.server.responses import openapi as responses_openapi
from tgis.server.responses import routes as responses_routes
from tgis.server.responses.store import ResponseStore
from tgis.server.tei import openapi as tei_openapi
from tgis.server.tei import routes as tei_routes
from tgis.server.tgi import openapi as tgi_openapi
from tgis.server.tgi import routes as tgi_routes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tgis.adapter_store import AdapterStore
    from tgis.pooling.model import PoolingModel
    from tgis.pooling.runner import PoolingRunner
    from tgis.vision.processor import ImageProcessor

# Routes that need the API key when one is set; health, info, metrics and docs stay open.
PROTECTED_PATHS = frozenset(
    {
        "/",
        "/generate",
        "/generate_stream",
        "/tokenize",
        "/embed",
        "/embed_all",
        "/rerank",
        "/predict",
        "/score",
    }
)


def pooling_contract() -> RequestContract:
    """The request contract of a pooling server's APIs (their schemas need no limits)."""
    return _gathered([(api.requests(), api.RESPONSES, api.paths(), api.TAGS) for api in
                      (openai_embeddings_openapi, tei_openapi, rerank_openapi)])  # fmt: skip


def _gathered(
    apis: Sequence[tuple[dict[str, Any], dict[str, Any], dict[str, Any], Sequence[dict[str, str]]]],
) -> RequestContract:
    requests: dict[str, Any] = {}
    responses: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    tags: list[dict[str, str]] = []
    for api_requests, api_responses, api_paths, api_tags in apis:
        requests.update(api_requests)
        responses.update(api_responses)
        paths.update(api_paths)
        tags.extend(api_tags)
    return RequestContract(requests, responses, paths, tuple(tags))


def api_contract(schemas: RequestSchemas) -> RequestContract:
    """The request contract of every API this app serves, from each API's own schemas."""
    apis = (tgi_openapi, openai_openapi, responses_openapi, anthropic_openapi)
    return _gathered([(api.requests(schemas), api.RESPONSES, api.paths(), api.TAGS) for api in apis])  # fmt: skip


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on
    generation routes and /v1/*, in the route family's error shape."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _protected(scope):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            key = headers.get(b"x-api-key")
            if key is not None:  # Anthropic's header, accepted on every protected route
                given = b"Bearer " + key
            # Constant-time comparison: the key must not leak through response timing.
            if not hmac.compare_digest(given, self.expected):
                shape = shape_of(scope["path"])
                body = json.dumps(error_body(UNAUTHORIZED, shape)).encode()
                headers_out = [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                ]
                status = error_status(UNAUTHORIZED, shape)
                await send(
                    {"type": "http.response.start", "status": status, "headers": headers_out}
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _protected(scope: Scope) -> bool:
    path: str = scope["path"]
    if scope["method"] == "OPTIONS":  # CORS preflight requests carry no credentials
        return False
    if path == "/":
        return scope["method"] == "POST"  # GET / is not an API route
    return path in PROTECTED_PATHS or path.startswith(("/v1/", "/v2/"))


def _middleware(
    api_key: str | None, cors_origins: Sequence[str], lifecycle: Lifecycle
) -> list[Middleware]:
    """CORS (for `cors_origins`), the API key's check, the graceful-shutdown gate."""
    middleware = []
    if cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors_origins),
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["*"],
            )
        )
    if api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=api_key))
    middleware.append(Middleware(LifecycleMiddleware, lifecycle=lifecycle))
    return middleware


async def _http_error(request: Request, exc: Exception) -> Response:
    """404 / 405 as JSON in the route family's shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "Internal server error"
    error_type = {404: "not_found", 405: "method_not_allowed"}.get(status, "internal")
    response = error_response(ApiError(status, str(detail), error_type), shape_of(request.url.path))
    if isinstance(exc, HTTPException) and exc.headers:  # a 405's Allow
        response.headers.update(exc.headers)
    return response


async def _unexpected(request: Request, exc: Exception) -> Response:
    """Anything a route did not handle: a logged 500 "internal", without details."""
    return error_response(classify(exc), shape_of(request.url.path))


def create_app(
    engine: EngineClient,
    tokenizer: PreTrainedTokenizerBase,
    config: ServeConfig,
    model_info: ModelInfo,
    metrics: Metrics | None = None,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    prefixes: PrefixStore | None = None,
    prompt_logprobs: bool = True,
    adapters: AdapterStore | None = None,
    vision: ImageProcessor | None = None,
) -> Starlette:
    """The HTTP server of one model.

    `engine` generates (it runs in its own thread); `tokenizer` (a transformers tokenizer)
    tokenizes prompts and renders chat templates; `config` gives the request limits;
    `model_info` is what /info and /v1/models report. Pass `metrics` to share it with the
    engine as its EngineObserver (one is made otherwise: `app.state.tgis.metrics`).
    `api_key` guards the generation routes; `cors_origins` enables CORS for those origins;
    `prefixes` serves tuned prompt prefixes (`prefix_id`); `prompt_logprobs`: the backend
    returns prompt logprobs (the API's schema allows `decoder_input_details` only then);
    `adapters`: the LoRA adapters requests may select (`adapter_id`, OpenAI's `model`);
    `vision`: a vision-language model's processor (prompts may hold images).
    """
    if metrics is None:
        metrics = Metrics(
            max_total_tokens=config.max_total_tokens,
            max_batch_size=config.batch_slots,
        )
    runtime = model_info.runtime or {}
    if "weight_bytes" in runtime:
        metrics.on_weights(runtime.get("quantization"), runtime["weight_bytes"])
    lifecycle = Lifecycle()
    limits = RequestLimits.from_config(config)
    pipeline = Pipeline(
        engine,
        tokenizer,
        limits,
        metrics,
        prefixes,
        adapters,
        vision,
        image_limits=ImageLimits(
            config.max_images_per_request, config.max_image_pixels, config.max_image_bytes
        ),
        url_policy=UrlPolicy() if config.allow_image_urls else None,
    )
    schemas = RequestSchemas(
        limits,
        max_client_batch_size=model_info.max_client_batch_size,
        vocab_size=pipeline.vocab_size,
        prefixes=prefixes is not None,
        adapters=AdapterChoice.of(adapters),
        no_prompt_logprobs=prompt_logprobs_refusal(
            model_info.backend, model_info.model_kind != "decoder_only", prompt_logprobs
        ),
        stored_responses=config.max_stored_responses,
        images=pipeline.image_limits if vision is not None else None,
    )
    middleware = _middleware(api_key, cors_origins, lifecycle)
    routes = [
        *tgi_routes.ROUTES,
        *openai_routes.ROUTES,
        *responses_routes.ROUTES,
        *anthropic_routes.ROUTES,
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
        Route("/docs/assets/{name}", docs_asset, methods=["GET"]),
    ]
    if config.playground:
        routes += playground.ROUTES
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _unexpected},
    )
    app.state.tgis = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        config=config,
        info=model_info,
        metrics=metrics,
        pipeline=pipeline,
        lifecycle=lifecycle,
        contract=api_contract(schemas),
        chat=ChatFormat.of(tokenizer),
    )
    # The Responses API's own state: the responses it keeps for previous_response_id.
    app.state.tgis_responses = ResponseStore(config.max_stored_responses)
    return app


def create_pooling_app(
    model: PoolingModel,
    runner: PoolingRunner,
    config: ServeConfig,
    metrics: Metrics | None = None,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
) -> Starlette:
    """The HTTP server of one pooling model (tgis.pooling): OpenAI's /v1/embeddings, TEI's
    /embed, /rerank and /predict, and the rerank APIs' /v1/rerank, /v2/rerank and /score over
    `runner`'s batches, with /health, /info, /metrics, /openapi.json and /docs;
    the API key, CORS and graceful shutdown as on a generation server."""
    if metrics is None:
        metrics = Metrics(
            max_total_tokens=config.max_total_tokens, max_batch_size=config.batch_slots
        )
    lifecycle = Lifecycle()
    middleware = _middleware(api_key, cors_origins, lifecycle)
    routes = [
        *openai_embeddings.ROUTES,
        *tei_routes.ROUTES,
        *rerank_routes.ROUTES,
        Route("/health", pooling.health, methods=["GET"]),
        Route("/info", pooling.info, methods=["GET"]),
        Route("/metrics", pooling.metrics, methods=["GET"]),
        Route("/openapi.json", pooling.openapi, methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
        Route("/docs/assets/{name}", docs_asset, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _unexpected},
    )
    app.state.tgis_pooling = pooling.PoolingState(
        model, runner, config, metrics, lifecycle, config.model_id, pooling_contract()
    )
    return app
