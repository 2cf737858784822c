"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over one chat turn.

A stream is Responses' event sequence: response.created, response.in_progress, then for each
output item output_item.added, its content (content_part.added, output_text.delta ...
output_text.done, content_part.done; reasoning_text.delta ... done; or
function_call_arguments.delta ... done) and output_item.done, then response.completed (or
response.incomplete when max_output_tokens cut it). Each event is `event: TYPE` with its JSON,
numbered by `sequence_number`. A failure after the start is an `error` event.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tgis.engine.types import Completion
from tgis.server.chat.prompt import ChatOutput
from tgis.server.chat.turn import (
    Segment,
    Segments,
    Turn,
    collect_turn,
    new_id,
    reasoning_tokens,
    refused,
    start_turn,
    stream_segments,
    turn_failed,
)
from tgis.server.http.errors import ApiError, error_response
from tgis.server.http.fields import read_json
from tgis.server.http.sse import (
    Emit,
    EventStreamResponse,
    stream_failures,
)
from tgis.server.http.state import ServerState, get_state
from tgis.server.responses.requests import (
    ResponseObject,
    ResponsesRequest,
    item_id,
    item_of,
    output_messages,
    parse_responses_request,
    response_usage,
    text_part,
)
from tgis.server.responses.store import ResponseStore, store_of

CONTRACT = "ResponsesRequest"


async def create_response(request: Request) -> Response:
    """POST /v1/responses."""
    arrival = time.monotonic()
    state = get_state(request)
    store = store_of(request)
    turn: Turn | None = None
    try:
        body = await read_json(request, state.config.max_request_body_bytes)
        req = parse_responses_request(body, store.size)
    except ApiError as error:
        return refused(state, error, "openai")
    kind = "stream" if req.stream else "single"
    state.metrics.request_received(kind)
    try:
        history: tuple[dict[str, Any], ...] = ()
        if req.previous_response_id is not None:
            _, history = store.get(req.previous_response_id, "previous_response_id")
        turn = await start_turn(state, request, req.turn_after(history), arrival, (CONTRACT, body))
        response = ResponseObject(new_id("resp"), turn.adapter or state.info.model_id, req)
        conversation = (*history, *req.input_messages)
        if req.stream:
            return _stream(state, store, req, turn, response, conversation, kind)
        completion = await collect_turn(state, request, turn)
    except Exception as exc:
        return await turn_failed(state, turn, exc, "openai")
    output = turn.plan.output()
    parts = Segments().read(output, completion.generated_text)
    items = [item_of(p, item_id(p), done=True) for p in parts]
    body_out = await _finished(state, response, items, output, turn, completion)
    if req.store:
        store.put(body_out, (*conversation, *output_messages(parts)))
    state.pipeline.succeeded(kind, turn.prepared, completion)
    return JSONResponse(body_out)


async def get_response(request: Request) -> Response:
    """GET /v1/responses/{response_id}: a stored response; 404 when not kept."""
    try:
        body, _ = store_of(request).get(request.path_params["response_id"], "response_id")
    except ApiError as error:
        return error_response(error, "openai")
    return JSONResponse(body)


async def _finished(
    state: ServerState,
    response: ResponseObject,
    items: list[dict[str, Any]],
    output: ChatOutput,
    turn: Turn,
    completion: Completion,
) -> dict[str, Any]:
    """The response object once the output is whole (the reasoning's tokens are counted in a
    worker thread)."""
    usage = response_usage(
        turn.prepared.input_length,
        completion.generated_tokens,
        await reasoning_tokens(state, output, completion.generated_tokens),
    )
    cut = completion.finish_reason.openai() == "length"
    status, reason = ("incomplete", "max_output_tokens") if cut else ("completed", None)
    return response.body(status, items, usage, reason)


def _stream(
    state: ServerState,
    store: ResponseStore,
    req: ResponsesRequest,
    turn: Turn,
    response: ResponseObject,
    conversation: tuple[dict[str, Any], ...],
    kind: str,
) -> EventStreamResponse:
    async def produce(emit: Emit) -> None:
        number = [0]

        async def send(kind_: str, **data: Any) -> None:
            payload = {"type": kind_, "sequence_number": number[0], **data}
            number[0] += 1
            await emit(f"event: {kind_}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n")

        items: list[dict[str, Any]] = []
        ids: dict[int, str] = {}

        async def act(action: str, segment: Segment, text: str) -> None:
            where = {"output_index": segment.index}
            if action == "open":
                ids[segment.index] = item_id(segment)
                item = item_of(segment, ids[segment.index], done=False)
                await send("response.output_item.added", item=item, **where)
                where["item_id"] = ids[segment.index]
                if segment.kind == "text":
                    await send("response.content_part.added", content_index=0,
                               part=text_part(""), **where)  # fmt: skip
                elif segment.kind == "reasoning":
                    part = {"type": "reasoning_text", "text": ""}
                    await send("response.content_part.added", content_index=0, part=part, **where)
                return
            where["item_id"] = ids[segment.index]
            if action == "delta":
                if segment.kind == "text":
                    await send("response.output_text.delta", content_index=0, delta=text,
                               logprobs=[], **where)  # fmt: skip
                elif segment.kind == "reasoning":
                    await send("response.reasoning_text.delta", content_index=0, delta=text,
                               **where)  # fmt: skip
                else:
                    await send("response.function_call_arguments.delta", delta=text, **where)
                return
            if segment.kind == "text":
                await send("response.output_text.done", content_index=0, text=segment.text,
                           logprobs=[], **where)  # fmt: skip
                await send("response.content_part.done", content_index=0,
                           part=text_part(segment.text), **where)  # fmt: skip
            elif segment.kind == "reasoning":
                await send("response.reasoning_text.done", content_index=0, text=segment.text,
                           **where)  # fmt: skip
                part = {"type": "reasoning_text", "text": segment.text}
                await send("response.content_part.done", content_index=0, part=part, **where)
            else:
                await send("response.function_call_arguments.done", arguments=segment.text,
                           **where)  # fmt: skip
            item = item_of(segment, ids[segment.index], done=True)
            items.append(item)
            del where["item_id"]
            await send("response.output_item.done", item=item, **where)

        async def report(error: ApiError) -> None:
            await send("error", code=error.error_type, message=error.message, param=None)

        async with stream_failures(state.metrics, report, turn.events):
            await send("response.created", response=response.body("in_progress", []))
            await send("response.in_progress", response=response.body("in_progress", []))
            output, parts, completion = await stream_segments(turn, act)
            body = await _finished(state, response, items, output, turn, completion)
            if req.store:
                store.put(body, (*conversation, *output_messages(parts)))
            state.pipeline.succeeded(kind, turn.prepared, completion)
            done = "response.incomplete" if body["status"] == "incomplete" else None
            await send(done or "response.completed", response=body)

    return EventStreamResponse(produce)


ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
]
