"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over one chat turn.

A stream is Anthropic's event sequence: message_start, then for each content block
content_block_start, its deltas (text_delta, thinking_delta or input_json_delta) and
content_block_stop, then message_delta (stop_reason, stop_sequence, usage) and message_stop.
Each event is `event: TYPE` with its JSON. A failure after the start is an `error` event;
errors before it are Anthropic's error JSON (`{"type": "error", "error": {...}}`), 400 for
invalid requests.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tgis.engine.types import Completion
from tgis.server.anthropic.requests import (
    block_of,
    message_body,
    parse_messages_request,
    stop_reason,
    usage,
)
from tgis.server.chat.prompt import ChatOutput
from tgis.server.chat.turn import (
    Segment,
    Segments,
    Turn,
    collect_turn,
    new_id,
    reasoning_tokens,
    refused,
    render_turn,
    start_turn,
    stream_segments,
    turn_failed,
)
from tgis.server.http.errors import ApiError, classify, error_event, error_response
from tgis.server.http.fields import read_json
from tgis.server.http.generation import adapter_of
from tgis.server.http.sse import (
    Emit,
    EventStreamResponse,
    stream_failures,
)
from tgis.server.http.state import ServerState, get_state

CONTRACT = "MessagesRequest"
COUNT_CONTRACT = "CountTokensRequest"


async def create_message(request: Request) -> Response:
    """POST /v1/messages."""
    arrival = time.monotonic()
    state = get_state(request)
    turn: Turn | None = None
    try:
        body = await read_json(request, state.config.max_request_body_bytes)
        req = parse_messages_request(body)
    except ApiError as error:
        return refused(state, error, "anthropic")
    kind = "stream" if req.stream else "single"
    state.metrics.request_received(kind)
    try:
        turn = await start_turn(state, request, req.turn, arrival, (CONTRACT, body))
        message_id, model = new_id("msg"), turn.adapter or state.info.model_id
        if req.stream:
            return _stream(state, turn, message_id, model, kind)
        completion = await collect_turn(state, request, turn)
    except Exception as exc:
        return await turn_failed(state, turn, exc, "anthropic")
    output = turn.plan.output()
    parts = Segments().read(output, completion.generated_text)
    body_out = message_body(
        message_id,
        model,
        [block_of(p, done=True) for p in parts],
        stop_reason(output, completion),
        await _usage(state, turn, output, completion),
    )
    state.pipeline.succeeded(kind, turn.prepared, completion)
    return JSONResponse(body_out)


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's tokens, as /v1/messages would make it
    (a vision-language model's images as the tokens its processor gives them)."""
    start = time.monotonic()
    state = get_state(request)
    try:
        body = await read_json(request, state.config.max_request_body_bytes)
        req = parse_messages_request(body, count_only=True)
        adapter_of(state.pipeline, state.info.model_id, req.turn.model)
        text = await render_turn(state, req.turn)
        state.contract.check(COUNT_CONTRACT, body)
        images = req.turn.images
        if images:
            ids, _ = await state.pipeline.process_images(text, images, add_special_tokens=False)
        else:
            ids = await state.pipeline.encode(text, add_special_tokens=False)
    except Exception as exc:
        return error_response(classify(exc), "anthropic")
    state.metrics.tokenize_request(1, len(ids), time.monotonic() - start)
    return JSONResponse({"input_tokens": len(ids)})


def _stream(
    state: ServerState,
    turn: Turn,
    message_id: str,
    model: str,
    kind: str,
) -> EventStreamResponse:
    async def produce(emit: Emit) -> None:
        async def send(event: str, **data: Any) -> None:
            payload = json.dumps({"type": event, **data}, ensure_ascii=False)
            await emit(f"event: {event}\ndata: {payload}\n\n")

        async def act(action: str, segment: Segment, text: str) -> None:
            if action == "open":
                block = block_of(segment, done=False)
                await send("content_block_start", index=segment.index, content_block=block)
            elif action == "delta":
                await send("content_block_delta", index=segment.index, delta=_delta(segment, text))
            else:
                await send("content_block_stop", index=segment.index)

        async def report(error: ApiError) -> None:
            await emit(error_event(error, "anthropic"))

        async with stream_failures(state.metrics, report, turn.events):
            start = usage(turn.prepared.input_length, 0)
            await send("message_start", message=message_body(
                message_id, model, [], (None, None), start
            ))  # fmt: skip
            output, _, completion = await stream_segments(turn, act)
            reason, sequence = stop_reason(output, completion)
            tokens = await _usage(state, turn, output, completion)
            state.pipeline.succeeded(kind, turn.prepared, completion)
            await send("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                       usage=tokens)  # fmt: skip
            await send("message_stop")

    return EventStreamResponse(produce)


async def _usage(
    state: ServerState, turn: Turn, output: ChatOutput, completion: Completion
) -> dict[str, Any]:
    generated = completion.generated_tokens
    thinking = await reasoning_tokens(state, output, generated)
    return usage(turn.prepared.input_length, generated, thinking)


def _delta(segment: Segment, text: str) -> dict[str, Any]:
    if segment.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    if segment.kind == "text":
        return {"type": "text_delta", "text": text}
    return {"type": "input_json_delta", "partial_json": text}


ROUTES = [
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
