"""Incremental detokenization and the per-sequence text stream. Pure Python over any HF tokenizer.

`IncrementalDetokenizer` uses TGI's / vLLM's prefix_offset / read_offset technique: decode a
small window of ids twice (without and with the new ids) and emit the difference, so that
decoders which look at neighbouring tokens (sentencepiece's leading "▁", WordPiece's "##",
clean-up of spaces) give the same text as decoding everything at once. While the window's text
ends with U+FFFD (an incomplete UTF-8 sequence split across byte-level tokens) nothing is
emitted. The window starts on the last prompt tokens, so the first generated token keeps its
leading space as it would in the middle of the text (TGI does the same).

`TextStream` combines it with `tgis.engine.stopping` into the one object a sequence's consumer
calls per generated token (tgis.engine.output).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from tgis.engine.stopping import StoppingCriteria, StopSequences
from tgis.engine.types import FinishReason
from tgis.params import GenerateParameters

# Prompt tokens that seed the decode window (TGI: prefix_offset = prompt_length - 5).
CONTEXT_WINDOW = 5
# Ids kept before the window are dropped once this many accumulate.
_TRIM_AFTER = 256
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TokenizerFacts:
    """What the server reads of a tokenizer once rather than per request: reading them walks
    its vocabulary (`len()` of a transformers fast tokenizer builds the whole vocabulary: a
    tenth of a second, holding the GIL, for a 128k-token one)."""

    # TGI's `special` flag, skipped by skip_special_tokens: the named special tokens and every
    # added token marked special.
    special_ids: frozenset[int]
    # len(tokenizer): ids below it are the tokenizer's (None: a tokenizer without a size).
    vocab_size: int | None

    @staticmethod
    def read(tokenizer: Any) -> TokenizerFacts:
        """The facts of `tokenizer`, read now (`tokenizer_facts` reads them once)."""
        ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        ids.update(i for i, token in added.items() if getattr(token, "special", False))
        try:
            size: int | None = len(tokenizer)
        except TypeError:  # a tokenizer without a size
            size = None
        return TokenizerFacts(frozenset(ids), size)


# The facts of the tokenizers seen last, by identity: a lookup never reads the tokenizer. A
# tokenizer is not changed once it serves (the facts of one changed afterwards are stale).
_FACTS: dict[int, tuple[Any, TokenizerFacts]] = {}
_FACTS_KEPT = 16


def tokenizer_facts(tokenizer: Any) -> TokenizerFacts:
    """The facts of `tokenizer`, read on its first call and kept: every later call, from any
    thread, is a dictionary lookup."""
    entry = _FACTS.get(id(tokenizer))
    if entry is not None and entry[0] is tokenizer:
        return entry[1]
    facts = TokenizerFacts.read(tokenizer)
    while len(_FACTS) >= _FACTS_KEPT:  # the oldest first (dicts keep insertion order)
        _FACTS.pop(next(iter(_FACTS)), None)
    # Kept with the tokenizer itself: its id cannot be another object's while it is here.
    _FACTS[id(tokenizer)] = (tokenizer, facts)
    return facts


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's special token ids (`TokenizerFacts.special_ids`), read once."""
    return tokenizer_facts(tokenizer).special_ids


Decode = Callable[[list[int], bool], str]


def decoder(tokenizer: Any, clean_up: bool | None = None) -> Decode:
    """`tokenizer.decode(ids, skip_special_tokens=skip)` as a function of (ids, skip), with
    `clean_up` (None: the tokenizer's clean_up_tokenization_spaces). For transformers' fast
    tokenizers it calls the Rust tokenizer directly and applies the clean-up as their `decode`
    does — the same text at a fifth of the cost per call, which every streamed token pays
    several times; any other tokenizer goes through its own `decode`."""
    if _plain_fast(type(tokenizer)) and hasattr(getattr(tokenizer, "_tokenizer", None), "decode"):
        raw = tokenizer._tokenizer.decode
        if clean_up is None:
            clean_up = bool(tokenizer.clean_up_tokenization_spaces)
        if clean_up:
            clean = tokenizer.clean_up_tokenization
            return lambda ids, skip: clean(raw(ids, skip_special_tokens=skip))
        return lambda ids, skip: raw(ids, skip_special_tokens=skip)
    if clean_up is None:
        return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(
        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean_up
    )


@functools.cache
def _plain_fast(kind: type) -> bool:
    """A transformers fast tokenizer class whose decoding is the library's own (no subclass
    of it decodes in its own way); answered once per class."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return False
    return (
        issubclass(kind, PreTrainedTokenizerFast)
        and kind._decode is PreTrainedTokenizerFast._decode
        and kind.decode is PreTrainedTokenizerBase.decode
    )


def token_texts(tokenizer: Any, ids: Iterable[int], decode: Decode | None = None) -> list[str]:
    """Each id decoded on its own, special tokens kept, no clean-up: the `text` TGI reports
    for prompt tokens (decoder_input_details) and top-n alternatives. `decode`: a
    `decoder(tokenizer, clean_up=False)` made once by the caller."""
    decode = decode or decoder(tokenizer, clean_up=False)
    return [decode([i], False) for i in ids]


class IncrementalDetokenizer:
    """Turns one id at a time into the text it adds. With skip_special_tokens, special ids
    add nothing and never enter the decode window, except the `kept` ones: their text stays
    (the window, free of the others, is then decoded with special tokens kept)."""

    def __init__(
        self,
        tokenizer: Any,
        context_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        decode: Decode | None = None,
        kept: Iterable[int] = (),
    ) -> None:
        """decode: `decoder(tokenizer)`, when the caller made it already."""
        self.tokenizer = tokenizer
        kept = frozenset(kept)
        self.skip_special_tokens = skip_special_tokens and not kept
        self._decode_ids = decode or decoder(tokenizer)
        self._special = special_ids(tokenizer) - kept if skip_special_tokens else frozenset()
        ctx = [i for i in context_ids if i not in self._special][-CONTEXT_WINDOW:]
        self._ids: list[int] = ctx
        self._prefix = 0  # window start: already-emitted ids kept only as decode context
        self._read = len(ctx)  # ids before this are emitted
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(self._prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""  # an incomplete UTF-8 character: wait for its next bytes
        piece = new_text[len(self._prefix_text) :]
        self._prefix, self._read, self._prefix_text = self._read, len(self._ids), None
        if self._prefix > _TRIM_AFTER:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return piece

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while held back)."""
        if token_id in self._special:
            return ""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Release held-back text at the end of a sequence, incomplete characters included."""
        return self._advance(final=True) if self._read < len(self._ids) else ""

    def pending(self) -> str:
        """The held-back text, without releasing it."""
        if self._read == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix : self._read])
        return self._decode(self._ids[self._prefix :])[len(prefix) :]


class Pushed(NamedTuple):
    """What one token did: the newly visible text, and the finish reason if it was the last."""

    text: str
    finish: FinishReason | None


class TextStream:
    """One sequence's generated text, stop rules included. The engine calls `push` once per
    generated token, in order, until it returns a finish reason.

    Streamed text never shows what will be cut: with include_stop_sequence=False, an end of
    the text that could still grow into a stop sequence is held back until it cannot (or is
    cut). The concatenation of all `push` texts equals `final_text()`.

    After each push, `token_text` is TGI's `token.text` for that token: the incremental text
    with special tokens kept ("" while a character is incomplete). Prompt tokens and top-n
    alternatives use the plain per-id text of `token_texts` instead, as TGI does.
    """

    def __init__(
        self,
        tokenizer: Any,
        params: GenerateParameters,
        eos_token_ids: Iterable[int],
        prompt_ids: Sequence[int] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.params = params
        self.criteria = StoppingCriteria(params, eos_token_ids, clock)
        self.stops = StopSequences(params.stop)
        decode = decoder(tokenizer)
        self._visible = IncrementalDetokenizer(
            tokenizer, prompt_ids, params.skip_special_tokens, decode, params.kept_special_ids
        )
        # TGI's token.text is the incremental text with special tokens kept.
        self._raw = (
            IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False, decode=decode)
            if params.skip_special_tokens
            else None
        )
        self._text = ""  # generated text so far, cut at the stop sequence when one matched
        self._emitted = 0  # characters of _text already returned by push
        self.token_text = ""  # TGI's token.text of the last pushed token
        self.finish_reason: FinishReason | None = None
        self.stop_sequence: str | None = None

    @property
    def generated_tokens(self) -> int:
        """Tokens pushed so far."""
        return self.criteria.generated

    def start(self, now: float | None = None) -> None:
        """The sequence was scheduled for the first time: start its time limit."""
        self.criteria.start(now)

    def push(
        self, token_id: int, now: float | None = None, ended: FinishReason | None = None
    ) -> Pushed:
        """Add one generated token. Returns the text it makes visible and, on the last token,
        why the sequence stopped. After that, `final_text()` is the generated text.
        `ended`: the reason the engine loop's own stop rules ended the sequence on this token
        (they are these rules, so they agree; it ends here whatever the clock says)."""
        if self.finish_reason is not None:
            raise RuntimeError(f"sequence already finished ({self.finish_reason.value})")
        piece = self._visible.push(token_id)
        self.token_text = piece if self._raw is None else self._raw.push(token_id)
        reason = self.criteria.on_token(token_id)
        searched = len(self._text)
        self._text += piece
        if reason is None and self.stops and self.criteria.stop_sequences_allowed:
            match = self.stops.find(self._text, searched)
            if match is not None:
                reason, self.stop_sequence = FinishReason.STOP_SEQUENCE, match.sequence
                cut = match.end if self.params.include_stop_sequence else match.start
                self._text = self._text[:cut]
        if reason is None:
            reason = self.criteria.limit_reached(now) or ended
        if reason is not None:
            if reason is not FinishReason.STOP_SEQUENCE:
                self._text += self._visible.flush()
            self.finish_reason = reason
            return Pushed(self._release(len(self._text)), reason)
        hold = 0
        if self.stops and not self.params.include_stop_sequence:
            hold = self.stops.partial_len(self._text)
        return Pushed(self._release(len(self._text) - hold), None)

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out

    def final_text(self) -> str:
        """The whole generated text: cut at the stop sequence if one matched; before the end,
        the text so far including what is still held back."""
        if self.finish_reason is not None:
            return self._text
        return self._text + self._visible.pending()
