"""TGI's REST routes: /generate, /generate_stream, / (compat), /tokenize, /info, /health, /metrics."""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tgis.engine.types import GenerationRequest
from tgis.errors import OverloadedError
from tgis.params import GenerateParameters, truncate_ids
from tgis.server.http import playground
from tgis.server.http.errors import SHUTTING_DOWN, ApiError, classify, error_response, tgi_body
from tgis.server.http.fields import TgiRequest, parse_tgi_request, read_json
from tgis.server.http.generation import (
    EventStream,
    Prepared,
    close_iterator,
    pick_best,
    shift_images,
    timing_headers,
)
from tgis.server.http.images import ImageRef, markdown_images
from tgis.server.http.metrics import CONTENT_TYPE
from tgis.server.http.sse import (
    Emit,
    EventStreamResponse,
    failed_response,
    stream_failures,
    unless_disconnected,
)
from tgis.server.http.state import ServerState, get_state
from tgis.server.tgi.payloads import generate_response, sse, stream_event
from tgis.server.tgi.tokenize import check_truncate, tokenize_with_images, tokenize_with_offsets


async def generate(request: Request) -> Response:
    """POST /generate: the whole generation as one JSON object."""
    return await _serve(request, compat=False, stream=False)


async def generate_stream(request: Request) -> Response:
    """POST /generate_stream: one server-sent event per token."""
    return await _serve(request, compat=False, stream=True)


async def compat_generate(request: Request) -> Response:
    """POST /: `stream` chooses; the JSON answer is a one-element list (api-inference's shape)."""
    return await _serve(request, compat=True, stream=False)


# The request schema of each route: (compat, streamed) -> component name.
_SCHEMAS = {
    (False, False): "GenerateRequest",
    (False, True): "GenerateStreamRequest",
    (True, False): "CompatGenerateRequest",
    (True, True): "CompatGenerateRequest",
}


async def _serve(request: Request, *, compat: bool, stream: bool) -> Response:
    arrival = time.monotonic()
    state = get_state(request)
    try:
        body = await read_json(request, state.config.max_request_body_bytes)
        req = parse_tgi_request(
            body,
            compat=compat,
            default_return_full_text=compat
            and state.info.model_pipeline_tag in (None, "text-generation"),
        )
    except ApiError as error:
        state.metrics.request_received("stream" if stream else "single")
        state.metrics.request_failed(error.error_type)
        return error_response(error)
    stream = stream or req.stream
    state.metrics.request_received("stream" if stream else "single")
    try:
        text, images = state.pipeline.markdown(req.inputs)
        prepared = await state.pipeline.prepare(
            text, req.params, arrival=arrival, stream=stream, prefix_id=req.prefix_id,
            adapter_id=req.adapter_id, images=images,
        )  # fmt: skip
        state.contract.check(_SCHEMAS[compat, stream], body)
        events = await unless_disconnected(request.receive, lambda: state.pipeline.start(prepared))
        if stream:
            return _stream_response(state, req, prepared, events)
        results = await unless_disconnected(
            request.receive, lambda: state.pipeline.collect(events, prepared.params.best_of or 1)
        )
    except Exception as exc:
        return failed_response(state.metrics, exc)
    best, others = pick_best(results)
    state.pipeline.succeeded("single", prepared, best.completion)
    params = prepared.params
    body = generate_response(
        best,
        others,
        details=params.details or params.decoder_input_details,
        prefix=req.inputs if params.return_full_text else "",
        best_of=(params.best_of or 1) > 1,
    )
    headers = timing_headers(prepared, best, state.info.model_device_type)
    return JSONResponse([body] if compat else body, headers=headers)


def _stream_response(
    state: ServerState, req: TgiRequest, prepared: Prepared, events: EventStream
) -> EventStreamResponse:
    prefix = req.inputs if prepared.params.return_full_text else ""

    async def produce(emit: Emit) -> None:
        async def report(error: ApiError) -> None:
            await emit(sse(tgi_body(error)))  # TGI sends errors after the start as an event

        index = 0
        async with stream_failures(state.metrics, report, events):
            async for event in events:
                index += 1
                body = stream_event(index, event, details=prepared.params.details, prefix=prefix)
                await emit(sse(body))
                if event.completion is not None:
                    state.pipeline.succeeded("stream", prepared, event.completion)
                    return
            raise ApiError(500, "Incomplete generation stream", "incomplete_generation_stream")

    headers = {"x-compute-type": state.info.model_device_type}
    return EventStreamResponse(produce, headers=headers)


async def tokenize(request: Request) -> Response:
    """POST /tokenize: TGI's list of {id, text, start, stop} (byte offsets into `inputs`)."""
    start = time.monotonic()
    state = get_state(request)
    try:
        body = await read_json(request, state.config.max_request_body_bytes)
        req = parse_tgi_request(body)
        text, refs = state.pipeline.markdown(req.inputs)
        state.pipeline.check_length(text)
        state.contract.check("GenerateRequest", body)
        tokens = await _tokens(state, req.inputs, text, refs, req.params.truncate)
    except Exception as exc:
        return error_response(classify(exc))
    state.metrics.tokenize_request(1, len(tokens), time.monotonic() - start)
    return JSONResponse(tokens)


async def _tokens(
    state: ServerState, inputs: str, text: str, refs: list[ImageRef], truncate: int | None
) -> list[dict[str, Any]]:
    """/tokenize's tokens of `inputs` (`text` and `refs`: as `Pipeline.markdown` reads it); a
    vision-language model's markdown images become the tokens the processor writes for them
    (which count toward every limit)."""
    pipeline = state.pipeline
    if not refs:
        return await anyio.to_thread.run_sync(
            tokenize_with_offsets, state.tokenizer, inputs, truncate
        )
    check_truncate(truncate)
    ids, images = await pipeline.process_images(text, refs, add_special_tokens=True)
    kept = truncate_ids(ids, truncate)
    shift_images(images, len(ids) - len(kept))  # a 422 when it would cut into an image
    vision = pipeline.vision
    assert vision is not None
    spans = [(start, end) for start, end, _ in markdown_images(inputs)]
    tokens = await anyio.to_thread.run_sync(
        tokenize_with_images, state.tokenizer, inputs, spans, vision.placeholder, ids
    )
    return tokens[len(ids) - len(kept) :]


async def info(request: Request) -> Response:
    """GET /info: the model and the router's limits."""
    return JSONResponse(get_state(request).info.to_json())


async def health(request: Request) -> Response:
    """GET /health: 200 while the server admits requests and the engine can generate. With
    no request in flight (nothing else shows that it works) a one-token generation runs
    through the engine first, as TGI and TGIS do."""
    state = get_state(request)
    if state.lifecycle.draining:
        return error_response(SHUTTING_DOWN)
    if not state.engine.healthy() and state.engine.in_flight:
        return error_response(ApiError(503, "unhealthy", "healthcheck"))
    if state.engine.in_flight == 0:
        try:
            with anyio.fail_after(HEALTH_GENERATION_S):
                await _generate_one_token(state)
        except OverloadedError:
            pass  # busy after all: requests show the engine works
        except Exception as exc:
            return error_response(
                ApiError(503, f"the health generation failed: {exc}", "healthcheck")
            )
    if not state.engine.healthy():
        return error_response(ApiError(503, "unhealthy", "healthcheck"))
    return Response(status_code=200)


# How long /health's own generation may take before the engine counts as stuck.
HEALTH_GENERATION_S = 30.0


async def _generate_one_token(state: ServerState) -> None:
    tokenizer = state.tokenizer
    token = tokenizer.bos_token_id
    if token is None:
        token = (tokenizer.encode("a", add_special_tokens=False) or [0])[0]
    request = GenerationRequest(
        "health", (token,), GenerateParameters(max_new_tokens=1), arrival=time.monotonic()
    )
    iterator = state.engine.generate(request)
    try:
        async for _ in iterator:
            pass
    finally:
        await close_iterator(iterator)


async def metrics(request: Request) -> Response:
    """GET /metrics: Prometheus text exposition of the tgi_* metrics."""
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def root(request: Request) -> Response:
    """/: POST generates (compat_generate); GET answers like /health, as TGI's does, except to
    a browser when the playground is on (tgis.server.http.playground). One route, so that a 405 on
    / allows both."""
    if request.method == "POST":
        return await compat_generate(request)
    if get_state(request).config.playground and playground.wants_page(request):
        return playground.page()
    return await health(request)


ROUTES = [
    Route("/", root, methods=["GET", "POST"]),
    Route("/generate", generate, methods=["POST"]),
    Route("/generate_stream", generate_stream, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/info", info, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
