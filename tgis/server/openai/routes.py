"""OpenAI's routes: /v1/completions, /v1/chat/completions, /v1/models.

Each prompt of a request is one engine request (a "job"); its `n` sequences come from the
engine's best_of machinery and all become choices (choice index = job * n + sequence).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tgis.server.chat.prompt import ChatPlan, chat_images, plan_chat, render_chat
from tgis.server.http.errors import ApiError, error_response
from tgis.server.http.fields import read_json
from tgis.server.http.generation import (
    EventStream,
    Pipeline,
    Prepared,
    SequenceResult,
    adapter_of,
)
from tgis.server.http.images import ImageRef
from tgis.server.http.sse import failed_response, unless_disconnected
from tgis.server.http.state import ServerState, get_state
from tgis.server.openai.payloads import (
    Envelope,
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    usage,
)
from tgis.server.openai.requests import OpenAIRequest, parse_chat_request, parse_completion_request
from tgis.server.openai.stream import stream_response


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    return await _serve(request, chat=False)


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions: the tokenizer's chat template renders the messages."""
    return await _serve(request, chat=True)


async def models(request: Request) -> Response:
    """GET /v1/models: the served model, as TGI lists it, then its LoRA adapters (each with
    the model as `parent`, as vLLM lists them)."""
    state = get_state(request)
    model_id = state.info.model_id
    cards = [
        {
            "id": model_id,
            "object": "model",
            "created": 0,
            "owned_by": model_id,
            "input_modalities": list(state.info.input_modalities),
        }
    ]
    adapters = state.pipeline.adapters
    if adapters is not None:
        names = await anyio.to_thread.run_sync(adapters.names)
        cards.extend(
            {"id": n, "object": "model", "created": 0, "owned_by": model_id, "parent": model_id}
            for n in names
        )
    return JSONResponse({"object": "list", "data": cards})


async def _serve(request: Request, *, chat: bool) -> Response:
    arrival = time.monotonic()
    state = get_state(request)
    try:
        body = await read_json(request, state.config.max_request_body_bytes)
        if chat:
            req = parse_chat_request(body, state.info)
        else:
            req = parse_completion_request(body, state.info, state.pipeline.limits.max_new_tokens)
    except ApiError as error:
        state.metrics.request_received("single")
        state.metrics.request_failed(error.error_type)
        return error_response(error, "openai")
    kind = "stream" if req.stream else ("batch" if len(req.prompts) > 1 else "single")
    state.metrics.request_received(kind, inputs=max(len(req.prompts), 1))
    streams: list[EventStream] = []
    plan: ChatPlan | None = None
    try:
        params = req.params
        images: list[ImageRef] = []
        if chat:
            images = chat_images(req.messages)
            state.pipeline.check_images(images)
            text = await anyio.to_thread.run_sync(
                render_chat, state.tokenizer, state.chat, req.messages, req.tools,
                req.template_kwargs, False, state.pipeline.vision is not None,
            )  # fmt: skip
            plan = plan_chat(
                state.chat, state.tokenizer, text, params, req.tools, req.include_reasoning
            )
            params = plan.params
            # The template writes the special tokens (BOS) itself.
            inputs: list[tuple[str | Sequence[int], bool]] = [(text, False)]
        else:
            inputs = [(prompt, True) for prompt in req.prompts]
        adapter_id = adapter_of(state.pipeline, state.info.model_id, req.model)
        prepared = []
        for prompt, add_special in inputs:
            # stream=False: OpenAI streams carry any number of choices, so n > 1 streams too.
            prepared.append(
                await state.pipeline.prepare(
                    prompt,
                    params,
                    arrival=arrival,
                    stream=False,
                    add_special_tokens=add_special,
                    prefix_id=req.prefix_id,
                    adapter_id=adapter_id,
                    images=images,
                )
            )
        state.contract.check("ChatRequest" if chat else "CompletionRequest", body)
        streams = await unless_disconnected(
            request.receive, lambda: _start_all(state.pipeline, prepared)
        )
        envelope = Envelope.new(
            prepared[0].request.request_id, chat, req.stream, state.info, adapter_id
        )
        if req.stream:
            return stream_response(state, req, prepared, streams, envelope, plan, kind)
        results = [
            await unless_disconnected(request.receive, partial(state.pipeline.collect, s, req.n))
            for s in streams
        ]
    except Exception as exc:
        await _close_all(streams)
        return failed_response(state.metrics, exc, "openai")
    return JSONResponse(_response(state, req, prepared, results, envelope, plan, kind))


async def _start_all(pipeline: Pipeline, prepared: Sequence[Prepared]) -> list[EventStream]:
    """Submit every job at once, then wait for each one's first event."""
    streams: list[EventStream | None] = [None] * len(prepared)
    failures: list[BaseException] = []

    async def start(i: int) -> None:
        try:
            streams[i] = await pipeline.start(prepared[i])
        except Exception as exc:
            failures.append(exc)

    async with anyio.create_task_group() as group:
        for i in range(len(prepared)):
            group.start_soon(start, i)
    opened = [s for s in streams if s is not None]
    if failures:
        await _close_all(opened)
        raise failures[0]
    return opened


async def _close_all(streams: Sequence[EventStream]) -> None:
    for stream in streams:
        await stream.aclose()


def _response(
    state: ServerState,
    req: OpenAIRequest,
    prepared: Sequence[Prepared],
    results: Sequence[Sequence[SequenceResult]],
    envelope: Envelope,
    plan: ChatPlan | None,
    kind: str,
) -> dict[str, Any]:
    choices = []
    prompt_tokens = completion_tokens = 0
    for job, (prep, sequences) in enumerate(zip(prepared, results, strict=True)):
        prompt_tokens += prep.input_length
        for result in sequences:
            c = result.completion
            completion_tokens += c.generated_tokens
            index = job * req.n + result.index
            reason = c.finish_reason.openai()
            tokens, tops = list(result.details_tokens), list(result.details_top_tokens)
            if plan is not None:
                logprobs = (
                    None if req.logprobs is None else chat_logprobs(tokens, tops, req.logprobs)
                )
                output = plan.output().read(c.generated_text)
                choices.append(
                    chat_choice(index, output.message(), output.finish_reason(reason), logprobs)
                )
                continue
            text = prep.prompt + c.generated_text if req.echo else c.generated_text
            logprobs = None
            if req.logprobs is not None:
                if req.echo:
                    tops = [()] * len(c.prefill) + tops
                    tokens = list(c.prefill) + tokens
                logprobs = completion_logprobs(tokens, tops, req.logprobs)
            choices.append(completion_choice(index, text, reason, logprobs))
        state.pipeline.succeeded(kind, prep, sequences[0].completion)
    return envelope.body(choices, usage=usage(prompt_tokens, completion_tokens))


ROUTES = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
]
