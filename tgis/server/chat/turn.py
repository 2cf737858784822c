"""One chat turn of an API that answers in typed parts (Responses, Messages): render, plan,
validate and start one sequence, then read its output as segments.

Such an API answers with a list of parts (Responses' output items, Messages' content blocks):
reasoning, text, and one per tool call, each opened, extended and closed in a stream. `Segments`
turns the chat output's neutral deltas (tgis.server.chat.prompt) into that sequence, so the route only
writes its own event names.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response

from tgis.engine.types import Completion
from tgis.params import GenerateParameters
from tgis.server.chat.prompt import ChatOutput, ChatPlan, chat_images, plan_chat, render_chat
from tgis.server.chat.tool_calls import ToolChoice
from tgis.server.http.errors import ApiError, Shape, error_response
from tgis.server.http.generation import EventStream, Prepared, adapter_of
from tgis.server.http.images import ImageRef
from tgis.server.http.sse import failed_response, unless_disconnected
from tgis.server.http.state import ServerState


def new_id(prefix: str) -> str:
    """A response's, message's or part's id: `prefix`_ and 32 random hex digits."""
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass(frozen=True)
class TurnRequest:
    """What a chat turn asks for, whichever API it came in."""

    messages: tuple[dict[str, Any], ...]
    params: GenerateParameters
    tools: ToolChoice | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    # The last message starts the answer (Anthropic's prefill): the output continues it.
    prefill: bool = False
    # At most this many tokens of reasoning (Anthropic's `thinking.budget_tokens`).
    thinking_budget: int | None = None
    # Whether the reasoning is returned (it is parsed out of the answer anyway).
    include_reasoning: bool = True

    @property
    def images(self) -> list[ImageRef]:
        """The images of the messages (their image parts), in order."""
        return chat_images(self.messages)


@dataclass
class Turn:
    """A started turn: its validated request, its plan and its engine events."""

    prepared: Prepared
    plan: ChatPlan
    events: EventStream
    adapter: str | None


async def start_turn(
    state: ServerState,
    request: Request,
    turn: TurnRequest,
    arrival: float,
    contract: tuple[str, Any],
) -> Turn:
    """Render the prompt, plan and validate it (then hold the body to its schema,
    `contract`: the component's name and the body), and start it. Raises ApiError,
    InputValidationError, ClientDisconnected or the engine's errors."""
    text = await render_turn(state, turn)
    plan = plan_chat(
        state.chat, state.tokenizer, text, turn.params, turn.tools, turn.include_reasoning,
        turn.thinking_budget,
    )  # fmt: skip
    adapter = adapter_of(state.pipeline, state.info.model_id, turn.model)
    prepared = await state.pipeline.prepare(
        text, plan.params, arrival=arrival, stream=False, add_special_tokens=False,
        adapter_id=adapter, images=turn.images,
    )  # fmt: skip
    state.contract.check(*contract)
    events = await unless_disconnected(request.receive, lambda: state.pipeline.start(prepared))
    return Turn(prepared, plan, events, adapter)


async def collect_turn(state: ServerState, request: Request, turn: Turn) -> Completion:
    """The whole output of a started turn (ClientDisconnected if the client leaves first)."""
    results = await unless_disconnected(
        request.receive, lambda: state.pipeline.collect(turn.events, 1)
    )
    return results[0].completion


def refused(state: ServerState, error: ApiError, shape: Shape) -> Response:
    """The response to a body refused before it was read whole (counted as a single one)."""
    state.metrics.request_received("single")
    state.metrics.request_failed(error.error_type)
    return error_response(error, shape)


async def turn_failed(
    state: ServerState, turn: Turn | None, exc: Exception, shape: Shape
) -> Response:
    """The response to a turn that failed before its answer: 499 for a client that went
    away (counted as cancelled), else the error in the route's shape; the engine's events are
    closed either way."""
    if turn is not None:
        await turn.events.aclose()
    return failed_response(state.metrics, exc, shape)


async def render_turn(state: ServerState, turn: TurnRequest) -> str:
    """The turn's prompt (the chat template runs in a worker thread); a 422 for images sent
    to a model that takes none."""
    state.pipeline.check_images(turn.images)
    return await anyio.to_thread.run_sync(
        render_chat, state.tokenizer, state.chat, turn.messages, turn.tools,
        turn.template_kwargs, turn.prefill, state.pipeline.vision is not None,
    )  # fmt: skip


async def reasoning_tokens(state: ServerState, output: ChatOutput, generated: int) -> int:
    """The tokens of an output's reasoning, returned or not (its text re-tokenized in a worker
    thread; at most the output's own `generated` count)."""
    reasoning = output.thought
    if not reasoning:
        return 0
    return min(len(await state.pipeline.encode(reasoning, add_special_tokens=False)), generated)


SegmentKind = Literal["reasoning", "text", "call"]
Action = Literal["open", "delta", "close"]


@dataclass
class Segment:
    """One part of an answer: reasoning, text, or a tool call (its arguments in `text`)."""

    kind: SegmentKind
    index: int
    text: str = ""
    call_id: str | None = None
    name: str | None = None


@dataclass
class Segments:
    """The parts of one output, from the chat output's deltas, in order."""

    parts: list[Segment] = field(default_factory=list)
    _open: Segment | None = None

    def feed(self, deltas: Sequence[dict[str, Any]]) -> list[tuple[Action, Segment, str]]:
        """What the deltas do: open a part, add text to it (the text), close it."""
        out: list[tuple[Action, Segment, str]] = []
        for delta in deltas:
            if "reasoning" in delta:
                self._add(out, "reasoning", delta["reasoning"])
            elif "content" in delta:
                if delta["content"]:
                    self._add(out, "text", delta["content"])
            else:
                for call in delta["tool_calls"]:
                    function = call.get("function", {})
                    if "id" in call:
                        self._close(out)
                        segment = Segment("call", len(self.parts), "", call["id"], function["name"])
                        self._start(out, segment)
                    self._extend(out, function.get("arguments", ""))
        return out

    def close(self) -> list[tuple[Action, Segment, str]]:
        """Close the part still open (at the end of the output)."""
        out: list[tuple[Action, Segment, str]] = []
        self._close(out)
        return out

    def read(self, output: ChatOutput, text: str) -> list[Segment]:
        """A whole output's parts."""
        self.feed(output.feed(text) + output.finish())
        self.close()
        return self.parts

    def _add(self, out: list[tuple[Action, Segment, str]], kind: SegmentKind, text: str) -> None:
        if self._open is None or self._open.kind != kind:
            self._close(out)
            self._start(out, Segment(kind, len(self.parts)))
        self._extend(out, text)

    def _start(self, out: list[tuple[Action, Segment, str]], segment: Segment) -> None:
        self.parts.append(segment)
        self._open = segment
        out.append(("open", segment, ""))

    def _extend(self, out: list[tuple[Action, Segment, str]], text: str) -> None:
        if text and self._open is not None:
            self._open.text += text
            out.append(("delta", self._open, text))

    def _close(self, out: list[tuple[Action, Segment, str]]) -> None:
        if self._open is not None:
            out.append(("close", self._open, ""))
            self._open = None


async def stream_segments(
    turn: Turn, act: Callable[[Action, Segment, str], Awaitable[None]]
) -> tuple[ChatOutput, list[Segment], Completion]:
    """Read a started turn's events as segments, `act`ing on each step as it comes; then the
    output, its parts and its completion (a 500 if the events end without one)."""
    output = turn.plan.output()
    segments = Segments()
    async for event in turn.events:
        deltas = output.feed(event.text)
        if event.completion is not None:
            deltas += output.finish()
        for step in segments.feed(deltas):
            await act(*step)
        if event.completion is not None:
            for step in segments.close():
                await act(*step)
            return output, segments.parts, event.completion
    raise ApiError(500, "Incomplete generation stream", "incomplete_generation_stream")
