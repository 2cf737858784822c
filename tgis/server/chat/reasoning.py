"""Reasoning output: what a model writes in its thinking block, apart from its answer.

Reasoning models (Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3, Magistral, Seed-OSS,
Command A Reasoning) write their thoughts between two markers, then the answer. Which markers a
model uses is read once from its chat template (the first family of `FAMILIES` whose markers it
writes), else from its vocabulary (the first family whose markers are tokens of it); a model
with neither has no reasoning, and its output is untouched.

A chat template may open the block itself (DeepSeek-R1's ends the prompt with `<think>\\n`) or
close it (Qwen3's with `enable_thinking: false`): the rendered prompt says which, so the parser
knows whether the output starts inside the block. Otherwise only a block at the very start of
the output (after whitespace) is reasoning; a start marker later on is text.

`ReasoningParser` splits the output as it streams: reasoning, then content, with the markers
and the whitespace around them left out, and nothing sent that could still turn out to be part
of a marker. An output cut off inside the block is all reasoning.

A request's grammar (response_format, tools) holds the answer after the block:
`grammar_after_reasoning` lets the block come first and end before the grammar starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from tgis.engine.detokenize import special_ids
from tgis.engine.stopping import StopSequences
from tgis.params import GrammarSpec


@dataclass(frozen=True)
class ReasoningMarkers:
    """A reasoning block's opening and closing text."""

    start: str
    end: str


# Known families, most specific first: `<think>` also ends the list as the usual fallback.
FAMILIES: tuple[ReasoningMarkers, ...] = (
    ReasoningMarkers("<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
    ReasoningMarkers("<|START_THINKING|>", "<|END_THINKING|>"),  # Cohere Command A Reasoning
    ReasoningMarkers("[THINK]", "[/THINK]"),  # Mistral Magistral
    ReasoningMarkers("◁think▷", "◁/think▷"),  # Kimi thinking models
    # Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3, Phi-4-reasoning, GLM-4.5, ...
    ReasoningMarkers("<think>", "</think>"),
)

Part = Literal["reasoning", "content"]


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template source ("" without one; a dict of named templates is
    read as all of them)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def find_markers(tokenizer: Any) -> ReasoningMarkers | None:
    """The reasoning markers of a model: by its chat template, else by its vocabulary."""
    template = template_text(tokenizer)
    for family in FAMILIES:
        if family.start in template and family.end in template:
            return family
    vocab = _vocabulary(tokenizer)
    for family in FAMILIES:
        if family.start in vocab and family.end in vocab:
            return family
    return None


def _vocabulary(tokenizer: Any) -> set[str]:
    """The tokens' texts that could be markers: the added tokens (where every family's
    markers live), else the whole vocabulary."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added:
        return {str(token) for token in added.values()}
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return set(get_vocab()) if get_vocab is not None else set()


def opened_in(prompt: str, markers: ReasoningMarkers) -> bool:
    """Whether a rendered prompt ends inside a reasoning block (the template opened it)."""
    start = prompt.rfind(markers.start)
    return start >= 0 and start > prompt.rfind(markers.end)


def special_token(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when it is one special token of the tokenizer (its text is skipped
    from outputs unless kept, and grammars must name it as a token)."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    token = convert(text) if convert is not None else None
    if not isinstance(token, int) or token not in special_ids(tokenizer):
        return None  # not one token (the unknown token's id comes back then), or not special
    return token if tokenizer.convert_ids_to_tokens(token) == text else None


def lark_literal(tokenizer: Any, text: str) -> str:
    """`text` in llguidance's Lark: a special token by its id, else the string."""
    token = special_token(tokenizer, text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def kept_ids(tokenizer: Any, texts: Iterable[str]) -> tuple[int, ...]:
    """The special tokens among `texts`, whose text the parsers need in the output."""
    ids = (special_token(tokenizer, t) for t in texts)
    return tuple(sorted({i for i in ids if i is not None}))


# Whitespace characters a grammar allows after a reasoning marker ("</think>\n\n" is usual).
SPACE_AFTER_MARKER = 4


def grammar_after_reasoning(
    answer: GrammarSpec, markers: ReasoningMarkers, opened: bool, tokenizer: Any
) -> GrammarSpec:
    """`answer` after an optional reasoning block (a required one's end when the prompt
    opened it), with up to SPACE_AFTER_MARKER whitespace characters after each marker (as
    models write them; unbounded, whitespace could fill the output until its limit)."""
    body = answer.grammar()
    if body.lstrip().startswith("{"):
        grammars = json.loads(body)["grammars"]
    else:  # Lark text
        grammars = [{"lark_grammar": body}]
    grammars[0] = {**grammars[0], "name": "tgis_answer"}
    end, start = lark_literal(tokenizer, markers.end), lark_literal(tokenizer, markers.start)
    # A special end token cannot be part of the text lexeme; a text one ends it lazily.
    lazy = "" if end.startswith("<[") else "[lazy]"
    lines = [
        "start: thought SPACE? @tgis_answer"
        if opened
        else "start: (opening thought SPACE?)? @tgis_answer",
        f"opening: {start} SPACE?",
        f"thought{lazy}: THOUGHT {end}",
        r"THOUGHT: /(.|\n)*/",
        rf"SPACE: /[ \t\r\n]{{1,{SPACE_AFTER_MARKER}}}/",
    ]
    if opened:
        del lines[1]
    main = {"name": "tgis_reasoning", "lark_grammar": "\n".join(lines) + "\n"}
    return GrammarSpec.llguidance(json.dumps({"grammars": [main, *grammars]}), answer.source)


def token_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """A marker as the tokenizer writes it."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))


class ReasoningParser:
    """Splits one sequence's output, as it streams, into reasoning and content."""

    def __init__(self, markers: ReasoningMarkers, opened: bool) -> None:
        self.markers = markers
        # start: may open a block; reasoning: in it; content: after it (or no block).
        self.state: Literal["start", "reasoning", "content"] = "reasoning" if opened else "start"
        self.reasoning: str | None = "" if opened else None
        self.content = ""
        self._held = ""  # text not yet classified
        self._leading = True  # at the start of a part: its whitespace is dropped

    def feed(self, text: str) -> list[tuple[Part, str]]:
        """The parts `text` completes, in order."""
        self._held += text
        out: list[tuple[Part, str]] = []
        while self._held:
            if self.state == "start":
                rest = self._held.lstrip()
                if rest.startswith(self.markers.start):
                    self._held = rest[len(self.markers.start) :]
                    self.state, self.reasoning, self._leading = "reasoning", "", True
                    continue
                if not rest or self.markers.start.startswith(rest):
                    break  # whitespace, or the marker's beginning: wait for more
                self.state, self._leading = "content", False  # no block: the text as is
                continue
            if self.state == "reasoning":
                at = self._held.find(self.markers.end)
                if at >= 0:
                    self._emit(out, "reasoning", self._held[:at].rstrip())
                    self._held = self._held[at + len(self.markers.end) :]
                    self.state, self._leading = "content", True
                    continue
                keep = partial_length(self._held, self.markers.end)
                piece = self._held[: len(self._held) - keep]
                stripped = piece.rstrip()  # trailing whitespace may precede the end marker
                self._emit(out, "reasoning", stripped)
                self._held = piece[len(stripped) :] + self._held[len(piece) :]
                break
            self._emit(out, "content", self._held)
            self._held = ""
        return out

    def finish(self) -> list[tuple[Part, str]]:
        """The held text, at the end of the output: an unclosed block's tail is reasoning,
        a start that never became a block is content."""
        held, self._held = self._held, ""
        if not held:
            return []
        out: list[tuple[Part, str]] = []
        if self.state == "reasoning":
            self._emit(out, "reasoning", held.rstrip())
        elif self.state == "start":
            self.state = "content"
            self._emit(out, "content", held)
        return out

    def _emit(self, out: list[tuple[Part, str]], part: Part, text: str) -> None:
        if self._leading:
            text = text.lstrip()
        if not text:
            return
        self._leading = False
        if part == "reasoning":
            self.reasoning = (self.reasoning or "") + text
        else:
            self.content += text
        out.append((part, text))


def partial_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back from a stream
    while it may still become the marker)."""
    return StopSequences((marker,)).partial_len(text)
