"""The consumer's half of a request: the engine loop's sampled tokens become TokenEvents.

The model thread hands each generated token over as a `SampledToken` (ids, numbers, the
reason its stop rules ended the sequence); `SequenceText` turns it into what clients see —
incremental text, stop sequences, token texts, prompt details and the Completion — on the
event loop that consumes the request, so none of it runs between two steps of the model.

A stop sequence is found here, a token or two after the loop has moved on: the consumer then
asks the engine to drop the sequence (`finished_here`). Every other rule (EOS, length, time
limit) is decided by the loop, and by this side too from the same token and timestamp, so both
agree on where a sequence ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tgis.engine.detokenize import TextStream, decoder, token_texts
from tgis.engine.types import (
    Completion,
    FinishReason,
    GenerationRequest,
    Timings,
    TokenEvent,
    TokenInfo,
)

if TYPE_CHECKING:
    from tgis.engine.sampling import PromptDetails


@dataclass(slots=True)
class SampledToken:
    """One generated token of one sequence, as the model thread hands it over."""

    index: int  # the sequence's best_of index
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]
    # EOS_TOKEN, LENGTH or TIME_LIMIT when the loop ended the sequence on this token.
    finish: FinishReason | None
    at: float  # time.monotonic() when the token was taken
    started: float  # when the sequence was first scheduled
    seed: int | None
    # On the first token, when decoder_input_details was asked: the prompt's details.
    prompt: PromptDetails | None = None


class SequenceText:
    """One sequence's text and details on the consumer's side."""

    def __init__(
        self,
        request: GenerationRequest,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        special_ids: frozenset[int],
        keep_details: bool,
        encoder_decoder: bool = False,
    ) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.special_ids = special_ids
        # An encoder-decoder model's output starts anew: the input does not seed the window.
        context = () if encoder_decoder else request.input_ids
        self.text = TextStream(tokenizer, request.params, eos_token_ids, context)
        self._token_text = decoder(tokenizer, clean_up=False)
        # Details are kept when asked, and for best_of (its best candidate is chosen by them).
        self.keep_details = keep_details
        self.tokens: list[TokenInfo] = []
        self.top_tokens: list[tuple[TokenInfo, ...]] = []
        self.prefill: tuple[TokenInfo, ...] = ()
        self.prefill_top: tuple[tuple[TokenInfo, ...], ...] = ()
        self.first_token_at: float | None = None
        self.finish_reason: FinishReason | None = None
        # Finished by a rule of this side (a stop sequence) while the loop still runs it.
        self.finished_here = False

    def event(self, out: SampledToken) -> TokenEvent | None:
        """The TokenEvent of `out` (with a Completion if it is the last); None for a token the
        loop made after this side had already ended the sequence."""
        if self.finish_reason is not None:
            return None
        first = self.first_token_at is None
        if first:
            self.first_token_at = out.at
            self.text.start(self.request.arrival or out.started)
            if out.prompt is not None:
                self._record_prompt(out.prompt)
        pushed = self.text.push(out.token_id, out.at, ended=out.finish)
        token = TokenInfo(
            out.token_id,
            self.text.token_text,
            out.logprob,
            out.token_id in self.special_ids,
            out.rank,
        )
        top = self._alternatives(out.top_ids, out.top_logprobs)
        if self.keep_details:
            self.tokens.append(token)
            self.top_tokens.append(top)
        completion = None
        if pushed.finish is not None:
            self.finish_reason = pushed.finish
            self.finished_here = out.finish is None
            completion = self._completion(out)
        event = TokenEvent(token, pushed.text, top, completion, out.index)
        if first and self.prefill:  # the prompt's details go out with the first token
            event = replace(event, prefill=self.prefill, prefill_top=self.prefill_top)
        return event

    def _record_prompt(self, details: PromptDetails) -> None:
        """Prompt tokens with their logprob, rank and text, and the top_n_tokens alternatives
        at each position."""
        ids = self.request.input_ids
        texts = token_texts(self.tokenizer, ids, self._token_text)
        first = TokenInfo(ids[0], texts[0], None, ids[0] in self.special_ids)
        rest = (
            TokenInfo(i, t, lp, i in self.special_ids, rank)
            for i, t, lp, rank in zip(
                ids[1:], texts[1:], details.logprobs, details.ranks, strict=True
            )
        )
        self.prefill = (first, *rest)
        self.prefill_top = (
            (),
            *(
                self._alternatives(i, lp)
                for i, lp in zip(details.top_ids, details.top_logprobs, strict=True)
            ),
        )

    def _alternatives(self, ids: list[int], logprobs: list[float]) -> tuple[TokenInfo, ...]:
        if not ids:
            return ()
        texts = token_texts(self.tokenizer, ids, self._token_text)
        return tuple(
            TokenInfo(i, t, lp, i in self.special_ids)
            for i, t, lp in zip(ids, texts, logprobs, strict=True)
        )

    def _completion(self, out: SampledToken) -> Completion:
        request = self.request
        arrival = request.arrival or out.started
        return Completion(
            finish_reason=self.text.finish_reason,  # type: ignore[arg-type]
            generated_text=self.text.final_text(),
            generated_tokens=self.text.generated_tokens,
            input_length=len(request.input_ids),
            seed=out.seed,
            prefill=self.prefill,
            prefill_top=self.prefill_top,
            tokens=tuple(self.tokens),
            top_tokens=tuple(self.top_tokens),
            timings=Timings(
                queue=max(0.0, out.started - arrival),
                inference=max(0.0, out.at - out.started),
                first_token=max(0.0, (self.first_token_at or out.at) - arrival),
            ),
            stop_sequence=self.text.stop_sequence,
        )
