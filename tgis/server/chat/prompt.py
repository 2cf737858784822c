"""A chat turn, whichever API asked for it: the prompt the chat template makes, the grammar
that holds the answer, and the output read back as reasoning, content and tool calls.

The OpenAI chat route, the Responses route and Anthropic's Messages route all go through here:
`ChatFormat` is what the model's tokenizer says (once per server), `render_chat` the prompt,
`plan_chat` the generation parameters of one request, and `ChatOutput` the parser of each of
its sequences. Deltas are API-neutral: `{"reasoning": text}`, `{"content": text}` and
`{"tool_calls": [...]}` in the shape the `openai` client accumulates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tgis.params import GenerateParameters, ThinkingBudget
from tgis.server.chat.reasoning import (
    ReasoningMarkers,
    ReasoningParser,
    find_markers,
    grammar_after_reasoning,
    kept_ids,
    opened_in,
    token_ids,
)
from tgis.server.chat.tool_calls import (
    COMPACT,
    ToolCallScanner,
    ToolChoice,
    ToolFormat,
    prompt_messages,
    template_takes_tools,
)
from tgis.server.chat.tool_formats import find_tool_format, tool_grammar
from tgis.server.http.errors import invalid
from tgis.server.http.images import ImageRef

# What apply_chat_template takes itself: not for `chat_template_kwargs` to set.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

# `reasoning_effort`'s values (OpenAI's), given to the template under that name.
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
# An image's `detail` (OpenAI's Responses API): checked, and changes nothing here, as the
# model's image processor decides the resolution.
IMAGE_DETAILS = ("auto", "low", "high", "original")
# The `media_type`s of Anthropic's base64 image sources.
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


@dataclass(frozen=True)
class ChatFormat:
    """What a model's tokenizer says about chat: its reasoning markers, the format its template
    writes tool calls in, whether the template renders tools, and the special tokens among
    those markers (kept in the output for the parsers), and the markers' token ids (what a
    reasoning budget watches for)."""

    markers: ReasoningMarkers | None
    tools: ToolFormat
    takes_tools: bool
    kept_special_ids: tuple[int, ...]
    marker_ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    @staticmethod
    def of(tokenizer: Any) -> ChatFormat:
        markers = find_markers(tokenizer)
        template = getattr(tokenizer, "chat_template", None)
        takes_tools = template_takes_tools(template)
        tools = find_tool_format(tokenizer) if takes_tools else COMPACT
        texts = [t for t in (tools.trigger, tools.call_end) if t]
        if markers is None:
            return ChatFormat(None, tools, takes_tools, kept_ids(tokenizer, texts))
        ids = (token_ids(tokenizer, markers.start), token_ids(tokenizer, markers.end))
        texts += [markers.start, markers.end]
        return ChatFormat(markers, tools, takes_tools, kept_ids(tokenizer, texts), ids)


def render_chat(
    tokenizer: Any,
    fmt: ChatFormat,
    messages: Sequence[dict[str, Any]],
    tools: ToolChoice | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    prefill: bool = False,
    images: bool = False,
) -> str:
    """The prompt the tokenizer's chat template makes of `messages`, the tools the model may
    call and the request's `chat_template_kwargs`; a 422 without a template. `prefill`: the
    last message is the start of the answer, which the output continues. `images`: the
    template is a vision-language model's, which reads every content as an array of parts
    (an image part writes the model's image placeholder)."""
    from jinja2 import TemplateError

    if getattr(tokenizer, "chat_template", None) is None:
        raise invalid(
            "the model's tokenizer has no chat template, so a chat request cannot build a "
            "prompt: use /v1/completions or /generate with a plain prompt"
        )
    extra = dict(template_kwargs or {})
    if tools is not None and fmt.takes_tools:
        extra["tools"] = tools.definitions()
    # A model's own call format is described by its template: no instruction is added.
    instructed = tools if fmt.tools == COMPACT else None
    try:
        given = prompt_messages(list(messages), instructed, fmt.takes_tools)
        text = tokenizer.apply_chat_template(
            [template_parts(m) for m in given] if images else given,
            tokenize=False,
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
            **extra,
        )
    except TemplateError as exc:
        raise invalid(f"the chat template failed on these messages: {exc}") from None
    return str(text)


def template_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a vision-language template: its content as text and image parts."""
    content = message.get("content")
    if isinstance(content, list):
        parts = [
            {"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["text"]}
            for p in content
        ]
    else:
        parts = [{"type": "text", "text": content}] if content else []
    return {**message, "content": parts}


def chat_images(messages: Sequence[dict[str, Any]]) -> list[ImageRef]:
    """The images of a chat's messages, in order (their image parts)."""
    return [
        ImageRef(part["url"], part["field"])
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part["type"] == "image"
    ]


@dataclass(frozen=True)
class ChatPlan:
    """How one chat request's output is held and read."""

    params: GenerateParameters
    markers: ReasoningMarkers | None
    # The prompt ends inside a reasoning block.
    opened: bool
    tools: ToolChoice | None
    tool_format: ToolFormat
    include_reasoning: bool

    def output(self) -> ChatOutput:
        return ChatOutput(self)


def plan_chat(
    fmt: ChatFormat,
    tokenizer: Any,
    prompt: str,
    params: GenerateParameters,
    tools: ToolChoice | None,
    include_reasoning: bool = True,
    budget: int | None = None,
) -> ChatPlan:
    """The parameters of a chat request whose prompt is `prompt`: the tools' grammar in the
    model's format (else the request's own grammar), after the reasoning block when the model
    has one; the markers that are special tokens kept in the output; at most `budget` tokens
    of reasoning when it is given (a model without markers writes none)."""
    markers = fmt.markers
    opened = markers is not None and opened_in(prompt, markers)
    grammar = (
        tool_grammar(tools, fmt.tools, tokenizer, params.max_new_tokens)
        if tools is not None
        else params.grammar
    )
    if grammar is not None and markers is not None:
        grammar = grammar_after_reasoning(grammar, markers, opened, tokenizer)
    params = replace(params, grammar=grammar, kept_special_ids=fmt.kept_special_ids)
    if budget is not None and markers is not None:
        held = ThinkingBudget(budget, *fmt.marker_ids, opened=opened)
        params = replace(params, thinking_budget=held)
    return ChatPlan(params, fmt.markers, opened, tools, fmt.tools, include_reasoning)


class ChatOutput:
    """One sequence's output as reasoning, content and tool calls, read as it streams."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        markers = plan.markers
        self.reasoning = None if markers is None else ReasoningParser(markers, plan.opened)
        self.calls = None if plan.tools is None else ToolCallScanner(plan.tool_format)
        self.content = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` completes."""
        if self.reasoning is None:
            return self._content(text)
        return self._parts(self.reasoning.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of the text held back until the end of the output."""
        deltas = self._parts(self.reasoning.finish()) if self.reasoning is not None else []
        if self.calls is not None:
            deltas += self.calls.finish()
        return deltas

    def read(self, text: str) -> ChatOutput:
        """Read a whole output at once."""
        self.feed(text)
        self.finish()
        return self

    @property
    def reasoning_text(self) -> str | None:
        """The reasoning so far (None: the output has none, or it is not asked for)."""
        if self.reasoning is None or not self.plan.include_reasoning:
            return None
        return self.reasoning.reasoning

    @property
    def thought(self) -> str:
        """The reasoning parsed out so far, whether or not it is returned."""
        return (self.reasoning.reasoning or "") if self.reasoning is not None else ""

    def message(self) -> dict[str, Any]:
        """The output as a chat message, without its role: `content` (None when only calls
        or only reasoning came), `tool_calls` when the model called tools, and both reasoning
        names (`reasoning_content`, `reasoning`) for a model that has reasoning."""
        message = self.calls.message() if self.calls is not None else {"content": self.content}
        if self.reasoning is not None:
            if not message["content"] and self.reasoning.reasoning:
                message["content"] = None
            reasoning = self.reasoning_text
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish_reason: `tool_calls` when calls ended the output."""
        return reason if self.calls is None else self.calls.finish_reason(reason)

    def _parts(self, parts: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for part, text in parts:
            if part == "reasoning":
                if self.plan.include_reasoning:
                    deltas.append({"reasoning": text})
            else:
                deltas += self._content(text)
        return deltas

    def _content(self, text: str) -> list[dict[str, Any]]:
        if self.calls is not None:
            return self.calls.feed(text)
        self.content += text
        return [{"content": text}] if text else []
