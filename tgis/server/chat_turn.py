"""One chat turn of an API that answers in typed parts (the Responses route): render, plan,
validate and start one sequence, then read its output as segments.

Such an API answers with a list of parts (Responses' output items): reasoning, text, and one
per tool call, each opened, extended and closed in a stream. `Segments` turns the chat output's
neutral deltas (tgis.server.chat) into that sequence, so the route only writes its own event
names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio.to_thread
from starlette.requests import Request

from tgis.params import GenerateParameters
from tgis.server.chat import ChatOutput, ChatPlan, plan_chat, render_chat
from tgis.server.generation import EventStream, Prepared
from tgis.server.openai_routes import adapter_of
from tgis.server.sse import unless_disconnected
from tgis.server.state import ServerState
from tgis.server.tool_calls import ToolChoice


@dataclass(frozen=True)
class TurnRequest:
    """What a chat turn asks for, whichever API it came in."""

    messages: tuple[dict[str, Any], ...]
    params: GenerateParameters
    tools: ToolChoice | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    model: str | None = None


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
    text = await anyio.to_thread.run_sync(
        render_chat, state.tokenizer, state.chat, turn.messages, turn.tools, turn.template_kwargs
    )
    plan = plan_chat(state.chat, state.tokenizer, text, turn.params, turn.tools)
    adapter = adapter_of(state.pipeline, state.info.model_id, turn.model)
    prepared = await state.pipeline.prepare(
        text, plan.params, arrival=arrival, stream=False, add_special_tokens=False,
        adapter_id=adapter,
    )  # fmt: skip
    state.contract.check(*contract)
    events = await unless_disconnected(request.receive, lambda: state.pipeline.start(prepared))
    return Turn(prepared, plan, events, adapter)


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
