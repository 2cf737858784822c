"""Per-request and per-sequence runtime state of the engine (sampling, text, details)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tgis.engine.backend import PrefillItem
from tgis.engine.detokenize import TextStream, token_texts
from tgis.engine.sampling import SampleOutput, SamplingRow, derive_seed, prompt_details
from tgis.engine.sequence import Sequence as SchedSeq
from tgis.engine.types import Completion, GenerationRequest, Timings, TokenEvent, TokenInfo

if TYPE_CHECKING:
    import torch


class RequestHandle:
    """Links one request's sequences (model thread) to its asyncio consumer (event loop)."""

    def __init__(
        self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, candidates: int
    ) -> None:
        self.request = request
        self.loop = loop
        self.candidates = candidates
        self.sequences: list[LiveSequence] = []
        self.cancelled = False
        self.pending: list[TokenEvent] = []  # model thread: this step's events
        self.completed = 0  # event loop: candidates whose last event was consumed
        self._queue: asyncio.Queue[list[Any]] = asyncio.Queue()
        params = request.params
        sampling = params.do_sample or params.sampling_warpers
        # best_of candidates draw from seeds derived from one base seed.
        self.base_seed = (
            params.seed if params.seed is not None else (secrets.randbits(64) if sampling else None)
        )

    @property
    def done(self) -> bool:
        return self.completed >= self.candidates

    def seed_for(self, index: int) -> int | None:
        return None if self.base_seed is None else derive_seed(self.base_seed, index)

    def post(self, items: Iterable[Any]) -> None:
        """From the model thread: hand events (or an exception) to the consumer."""
        batch = list(items)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self._queue.put_nowait, batch)

    def flush(self) -> None:
        if self.pending:
            self.post(self.pending)
            self.pending = []

    async def next_batch(self) -> list[Any]:
        batch = await self._queue.get()
        self.completed += sum(
            1 for e in batch if isinstance(e, TokenEvent) and e.completion is not None
        )
        return batch


class LiveSequence:
    """One sequence being generated: its sampling row, text stream and collected details."""

    def __init__(
        self,
        seq: SchedSeq,
        handle: RequestHandle,
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        special_ids: frozenset[int],
        encoder_decoder: bool = False,
    ) -> None:
        request = handle.request
        self.seq = seq
        self.handle = handle
        self.tokenizer = tokenizer
        self.params = request.params
        # An encoder-decoder model's output starts anew: the input seeds neither the
        # penalties nor the detokenizer's window.
        self.encoder_decoder = encoder_decoder
        context = () if encoder_decoder else request.input_ids
        self.row = SamplingRow(self.params, context, seed=handle.seed_for(seq.index))
        self.text = TextStream(tokenizer, self.params, eos_token_ids, context)
        self.special_ids = special_ids
        # Details are kept when asked, and for best_of, whose best candidate is chosen by them.
        self.keep_details = self.params.details or handle.candidates > 1
        self.last_token = -1
        self.tokens: list[TokenInfo] = []
        self.top_tokens: list[tuple[TokenInfo, ...]] = []
        self.prefill: tuple[TokenInfo, ...] = ()
        # The top_n_tokens alternatives at each prompt position (the first has none).
        self.prefill_top: tuple[tuple[TokenInfo, ...], ...] = ()
        # Prompt logits of a chunked prefill so far (paged backends), in position order.
        self.prompt_parts: list[torch.Tensor] = []
        self.started = 0.0
        self.first_token_at: float | None = None
        self.finish_reason = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.decoder_input_details

    @property
    def prefix_length(self) -> int:
        """Virtual tokens placed before the prompt's tokens in the sequence."""
        prefix = self.handle.request.prefix
        return prefix.length if prefix is not None and not self.encoder_decoder else 0

    def prefill_item(self) -> PrefillItem:
        """The slot backend's prefill of this sequence: its prompt and prefix."""
        prefix = self.handle.request.prefix
        if self.encoder_decoder:
            return PrefillItem(
                self.seq.seq_id,
                tuple(self.seq.token_ids),
                self.wants_prompt_logprobs,
                prefix.embeddings if prefix is not None and prefix.length else None,
                prefix.encoder if prefix is not None else None,
            )
        return PrefillItem(
            self.seq.seq_id,
            tuple(self.seq.token_ids),
            self.wants_prompt_logprobs,
            self.prefix_embeds(0, len(self.seq.token_ids)),
        )

    def prefix_embeds(self, start: int, count: int) -> torch.Tensor | None:
        """Embeddings of positions start.. start + count - 1 that are a prompt prefix's
        virtual tokens (the first ones of them, if any), or None."""
        prefix = self.handle.request.prefix
        if prefix is None or start >= self.prefix_length:
            return None
        return prefix.embeddings[start : min(start + count, prefix.length)]

    def begin(self, start_time: float) -> None:
        """First scheduled: the queue time ends. The time limit runs from the request's
        arrival (TGIS), or from here when the request has none."""
        self.started = start_time
        self.seq.started = start_time
        self.text.start(self.handle.request.arrival or start_time)

    def add_prompt_logits(self, start: int, logits: torch.Tensor) -> None:
        """Logits of prompt positions start.. from one prefill chunk; a chunk at 0 begins anew
        (the sequence was preempted and is recomputed)."""
        if start == 0:
            self.prompt_parts.clear()
        self.prompt_parts.append(logits)

    def record_prompt_parts(self) -> None:
        """The prefill is complete: record the chunks' logits (see `record_prefill`)."""
        if self.prompt_parts:
            import torch

            self.record_prefill(torch.cat(self.prompt_parts))
            self.prompt_parts.clear()

    def record_prefill(self, logits: torch.Tensor) -> None:
        """Prompt tokens with the logprob and rank the model gave each, and the top_n_tokens
        alternatives at each position when asked ([len, vocab] logits)."""
        ids = self.handle.request.input_ids
        # Rows of a prompt prefix's virtual tokens predict nothing the client sent.
        logits = logits[self.prefix_length :]
        details = prompt_details(logits, ids, self.params.top_n_tokens or 0)
        texts = token_texts(self.tokenizer, ids)
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
        texts = token_texts(self.tokenizer, ids) if ids else []
        return tuple(
            TokenInfo(i, t, lp, i in self.special_ids)
            for i, t, lp in zip(ids, texts, logprobs, strict=True)
        )

    def push(self, choice: SampleOutput, row: int, now: float) -> TokenEvent:
        """Turn this row's sampled token into a TokenEvent (with a Completion if it is the last)."""
        token_id = choice.token_ids[row]
        if self.row.constraint is not None:
            self.row.constraint.advance(token_id)
        pushed = self.text.push(token_id, now)
        self.seq.generated += 1
        self.seq.token_ids.append(token_id)
        self.last_token = token_id
        first = self.first_token_at is None
        if first:
            self.first_token_at = now
        token = TokenInfo(
            token_id,
            self.text.token_text,
            choice.logprobs[row],
            token_id in self.special_ids,
            choice.ranks[row],
        )
        top = self._alternatives(choice.top_ids[row], choice.top_logprobs[row])
        if self.keep_details:
            self.tokens.append(token)
            self.top_tokens.append(top)
        completion = None
        if pushed.finish is not None:
            self.finish_reason = pushed.finish
            completion = self._completion(now)
        event = TokenEvent(token, pushed.text, top, completion, self.seq.index)
        if first and self.prefill:  # the prompt's details go out with the first token
            event = replace(event, prefill=self.prefill, prefill_top=self.prefill_top)
        return event

    def _completion(self, now: float) -> Completion:
        request = self.handle.request
        arrival = request.arrival or self.started
        return Completion(
            finish_reason=self.text.finish_reason,  # type: ignore[arg-type]
            generated_text=self.text.final_text(),
            generated_tokens=self.text.generated_tokens,
            input_length=len(request.input_ids),
            seed=self.row.seed,
            prefill=self.prefill,
            prefill_top=self.prefill_top,
            tokens=tuple(self.tokens),
            top_tokens=tuple(self.top_tokens),
            timings=Timings(
                queue=max(0.0, self.started - arrival),
                inference=max(0.0, now - self.started),
                first_token=max(0.0, (self.first_token_at or now) - arrival),
            ),
            stop_sequence=self.text.stop_sequence,
        )
