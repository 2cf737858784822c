"""Per-request and per-sequence runtime state of the engine loop (sampling, stop rules,
prompt details), and the handle that links a request's sequences to its consumer.

The loop hands each generated token over as a `SampledToken` (ids and numbers only); turning
it into text, stop sequences and TokenEvents is the consumer's work (tgis.engine.output),
done on the event loop's side rather than between two steps of the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from tgis.engine.backend import PrefillItem
from tgis.engine.block_manager import image_spans
from tgis.engine.output import SampledToken
from tgis.engine.sampling import (
    PromptDetails,
    SampleOutput,
    SamplingRow,
    derive_seed,
    prompt_details,
)
from tgis.engine.sequence import PLACEHOLDER_ID
from tgis.engine.sequence import Sequence as SchedSeq
from tgis.engine.stopping import StoppingCriteria
from tgis.engine.types import FinishReason, GenerationRequest

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
        self.pending: list[SampledToken] = []  # model thread: this step's tokens
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
        """From the model thread: hand items (tokens, or an exception) to the consumer."""
        batch = list(items)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self._queue.put_nowait, batch)

    def take_pending(self) -> list[SampledToken]:
        """This step's tokens, handed over once (see `deliver`)."""
        batch, self.pending = self.pending, []
        return batch

    async def next_batch(self) -> list[Any]:
        return await self._queue.get()


def deliver(batches: list[tuple[RequestHandle, list[Any]]]) -> None:
    """On the event loop: one step's items of every request of that loop, in one callback."""
    for handle, batch in batches:
        handle._queue.put_nowait(batch)


def post_step(handles: Iterable[RequestHandle]) -> None:
    """From the model thread: the step's tokens of `handles`, one `call_soon_threadsafe` per
    event loop (not per request)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, list[Any]]]] = {}
    for handle in handles:
        if handle.pending:
            by_loop.setdefault(handle.loop, []).append((handle, handle.take_pending()))
    for loop, batches in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            loop.call_soon_threadsafe(deliver, batches)


class LiveSequence:
    """One sequence being generated, as the model thread sees it: its sampling row, its
    token-level stop rules (EOS, length, time limit) and its prompt details."""

    def __init__(
        self,
        seq: SchedSeq,
        handle: RequestHandle,
        eos_token_ids: Sequence[int],
        encoder_decoder: bool = False,
    ) -> None:
        request = handle.request
        self.seq = seq
        self.handle = handle
        self.params = request.params
        # An encoder-decoder model's output starts anew: the input seeds no penalty.
        self.encoder_decoder = encoder_decoder
        context = () if encoder_decoder else request.input_ids
        self.row = SamplingRow(self.params, context, seed=handle.seed_for(seq.index))
        self.criteria = StoppingCriteria(self.params, eos_token_ids)
        self.last_token = -1
        # The prompt's details, computed once (a preempted sequence is not asked again) and
        # handed over with the first token.
        self.prompt: PromptDetails | None = None
        self.prompt_recorded = False
        # Async scheduling: the last of seq.token_ids holds the place of a token being sampled.
        self.reserved = False
        # The details of a chunked prefill's chunks so far (paged backends), in order.
        self._details: PromptDetails | None = None
        # Features of the request's images (by index) while its prompt is being computed.
        self.features: dict[int, torch.Tensor] = {}
        # (first position, t, h, w) of the images whose rows fill a grid (PackedItem.grids).
        first: dict[int, int] = {}
        for mark in seq.images:
            first.setdefault(mark.image, mark.start)
        self.grids = tuple(
            (first[index], *image.grid)
            for index, image in enumerate(request.images)
            if image.grid is not None and index in first
        )
        self.spans = image_spans(seq.images)
        self.started = 0.0
        self.finish_reason: FinishReason | None = None

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

    def row_embeds(self, start: int, count: int) -> tuple[tuple[int, torch.Tensor], ...]:
        """The rows among positions start.. start + count - 1 whose embeddings are not their
        tokens': (offset from start, [k, hidden]) for the prompt prefix's and for each image's
        (whose features `features` holds: see `images_wanted`)."""
        rows: list[tuple[int, torch.Tensor]] = []
        prefix = self.prefix_embeds(start, count)
        if prefix is not None:
            rows.append((0, prefix))
        end = start + count
        for mark in self.seq.images:
            lo, hi = max(start, mark.start), min(end, mark.start + mark.length)
            if lo < hi:
                first = mark.row + lo - mark.start
                rows.append((lo - start, self.features[mark.image][first : first + hi - lo]))
        return tuple(rows)

    def images_wanted(self, start: int, count: int) -> list[int]:
        """The request's images (indices) with rows among positions start.. start + count - 1
        whose features are not at hand: what the step encodes first."""
        end = start + count
        wanted: list[int] = []
        for mark in self.seq.images:
            overlaps = mark.start < end and start < mark.start + mark.length
            if overlaps and mark.image not in self.features and mark.image not in wanted:
                wanted.append(mark.image)
        return wanted

    def images_cached(self, computed: int) -> int:
        """The request's images whose every row is among the first `computed` positions
        (their K/V came from the prefix cache: never encoded)."""
        last: dict[int, int] = {}
        for mark in self.seq.images:
            last[mark.image] = max(last.get(mark.image, 0), mark.start + mark.length)
        return sum(end <= computed for end in last.values())

    def begin(self, start_time: float) -> None:
        """First scheduled: the queue time ends. The time limit runs from the request's
        arrival (TGIS), or from here when the request has none."""
        self.started = start_time
        self.seq.started = start_time
        self.criteria.start(self.handle.request.arrival or start_time)

    def record_prefill(self, logits: torch.Tensor, start: int = 0) -> None:
        """The logprob and rank the model gave each prompt token whose logits these are (rows
        of sequence positions start.., [rows, vocab]), and the top_n_tokens alternatives at
        each position when asked. Taken at once, so that a long prompt prefilled in chunks
        holds one chunk's logits at a time; a chunk at 0 begins anew (the sequence was
        preempted and is recomputed). `prompt_done` hands the whole over."""
        if start == 0:
            self._details = PromptDetails([], [], [], [])
        # Rows of a prompt prefix's virtual tokens predict nothing the client sent; the row
        # of prompt token j predicts token j + 1.
        skip = max(0, self.prefix_length - start)
        first = start + skip - self.prefix_length
        ids = self.handle.request.input_ids
        window = ids[first : first + logits.shape[0] - skip + 1]
        self._details.extend(prompt_details(logits[skip:], window, self.params.top_n_tokens or 0))

    def prompt_done(self) -> None:
        """The prefill is complete: its prompt details go out with the first token."""
        self.features.clear()  # a recomputed prompt (after preemption) encodes them again
        self.seq.prompt_logits = False  # a recomputation needs no prompt logits
        if self._details is not None:
            self.prompt, self._details = self._details, None
            self.prompt_recorded = True

    def reserve(self) -> None:
        """Async scheduling: the step that samples this sequence's next token was launched;
        the token's place is held (PLACEHOLDER_ID) so the next step can be planned now."""
        self.seq.token_ids.append(PLACEHOLDER_ID)
        self.seq.generated += 1
        self.reserved = True

    def unreserve(self) -> None:
        """The launched step failed: its token's place goes."""
        if self.reserved:
            self.seq.token_ids.pop()
            self.seq.generated -= 1
            self.reserved = False

    def resolve(self, token_id: int) -> None:
        """The reserved token is `token_id` (before the next step launches): it takes its
        place, and the grammar moves on (the next step's mask needs it)."""
        self.seq.token_ids[-1] = token_id
        self.last_token = token_id
        if self.row.constraint is not None:
            self.row.constraint.advance(token_id)

    def advance(self, choice: SampleOutput, row: int, now: float) -> SampledToken:
        """Take this row's sampled token: the grammar and the stop rules move on; the token
        goes to the consumer, with the reason the sequence ends if it is the last. A reserved
        token (`resolve`d already) is taken where it is."""
        token_id = choice.token_ids[row]
        if self.reserved:
            self.reserved = False
        else:
            if self.row.constraint is not None:
                self.row.constraint.advance(token_id)
            self.seq.generated += 1
            self.seq.token_ids.append(token_id)
            self.last_token = token_id
        reason = self.criteria.on_token(token_id)
        if reason is None:
            reason = self.criteria.limit_reached(now)
        self.finish_reason = reason
        prompt, self.prompt = self.prompt, None
        return SampledToken(
            self.seq.index,
            token_id,
            choice.logprobs[row],
            choice.ranks[row],
            choice.top_ids[row],
            choice.top_logprobs[row],
            reason,
            now,
            self.started,
            self.row.seed,
            prompt,
        )
