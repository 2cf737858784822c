"""Streaming answers of the OpenAI routes: chunks per token, an optional usage chunk, [DONE].

Jobs (prompts) stream concurrently into one response; a lock keeps their chunks whole. An
error after the start is sent as `data: {"error": {...}}` and ends the stream, like TGI.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from tgis.engine.types import TokenEvent
from tgis.server.chat.prompt import ChatOutput, ChatPlan
from tgis.server.http.errors import ApiError, openai_body
from tgis.server.http.generation import EventStream, Prepared
from tgis.server.http.sse import Emit, EventStreamResponse, stream_failures
from tgis.server.http.state import ServerState
from tgis.server.openai.payloads import (
    Envelope,
    chat_delta,
    chat_delta_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    sse,
    usage,
)
from tgis.server.openai.requests import OpenAIRequest


def stream_response(
    state: ServerState,
    req: OpenAIRequest,
    prepared: Sequence[Prepared],
    streams: Sequence[EventStream],
    envelope: Envelope,
    plan: ChatPlan | None,
    kind: str,
) -> EventStreamResponse:
    """The event stream of an OpenAI request whose jobs have all started (`plan`: a chat
    request's)."""
    chat = plan is not None
    extra: dict[str, Any] = {"usage": None} if req.include_usage else {}
    generated = [0]

    def chunk(index: int, text: str, finish: str | None, logprobs: Any) -> dict[str, Any]:
        return envelope.body([completion_choice(index, text, finish, logprobs)], **extra)

    def chat_chunk(
        index: int, delta: dict[str, Any], finish: str | None, logprobs: Any
    ) -> dict[str, Any]:
        return envelope.body([chat_delta_choice(index, delta, finish, logprobs)], **extra)

    def logprobs_of(event: TokenEvent, offset: int) -> Any:
        if req.logprobs is None:
            return None
        tops = [event.top_tokens]
        if chat:
            return chat_logprobs([event.token], tops, req.logprobs)
        return completion_logprobs([event.token], tops, req.logprobs, offset)

    async def produce(emit: Emit) -> None:
        lock = anyio.Lock()
        failed = [False]

        async def send(data: dict[str, Any] | str) -> None:
            async with lock:
                await emit(sse(data))

        async def send_deltas(
            index: int, output: ChatOutput, text: str, finish: str | None, logprobs: Any
        ) -> None:
            """A chat event's chunks: its reasoning, content or tool-call deltas; the finish
            reason and logprobs go with the last."""
            deltas = [chat_delta(d) for d in output.feed(text)]
            if finish is not None:
                deltas += [chat_delta(d) for d in output.finish()]
                finish = output.finish_reason(finish)
            if not deltas and (finish or logprobs):
                deltas = [{}]
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                await send(
                    chat_chunk(index, delta, finish if last else None, logprobs if last else None)
                )

        async def run(job: int, prep: Prepared, events: EventStream, group: Any) -> None:
            offsets = dict.fromkeys(range(req.n), len(prep.prompt) if req.echo else 0)
            outputs = [plan.output() for _ in range(req.n)] if plan is not None else []

            async def report(error: ApiError) -> None:
                failed[0] = True
                await send(openai_body(error))
                group.cancel_scope.cancel()

            async with stream_failures(state.metrics, report, events):
                for i in range(req.n):
                    if chat:
                        # The role, once; content null until text comes when tools may be called.
                        first = {"role": "assistant", "content": None if req.tools else ""}
                        await send(chat_chunk(job * req.n + i, first, None, None))
                    elif req.echo:
                        await send(chunk(job * req.n + i, prep.prompt, None, None))
                remaining = req.n
                async for event in events:
                    finish = event.completion.finish_reason.openai() if event.completion else None
                    logprobs = logprobs_of(event, offsets[event.index])
                    offsets[event.index] += len(event.token.text)
                    index = job * req.n + event.index
                    if not chat:
                        if event.text or finish or logprobs:
                            await send(chunk(index, event.text, finish, logprobs))
                    else:
                        await send_deltas(index, outputs[event.index], event.text, finish, logprobs)
                    if event.completion is not None:
                        generated[0] += event.completion.generated_tokens
                        remaining -= 1
                        if remaining == 0:
                            state.pipeline.succeeded(kind, prep, event.completion)
                            return
                raise ApiError(500, "Incomplete generation stream", "incomplete_generation_stream")

        async with anyio.create_task_group() as group:
            for job, (prep, events) in enumerate(zip(prepared, streams, strict=True)):
                group.start_soon(run, job, prep, events, group)
        if req.include_usage and not failed[0]:
            prompt_tokens = sum(p.input_length for p in prepared)
            await send(envelope.body([], usage=usage(prompt_tokens, generated[0])))
        await send("[DONE]")

    return EventStreamResponse(produce)
