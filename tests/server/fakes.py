"""A deterministic EngineClient test double, for testing the HTTP layer alone.

FakeEngine "generates" a fixed script with a real tokenizer: sequence i of a request is the
script's token ids rotated by i, so best_of candidates differ. Log-probabilities are made up
so that later sequences score higher (best_of must pick by score, not by position). It honours
max_new_tokens, ignore_eos, stop sequences (with include_stop_sequence and held-back text, as
the engine does), details, decoder_input_details, top_n_tokens, best_of and seeds; it can fail,
be slow, be overloaded or unhealthy, and it records which requests were closed before they
finished.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio

from tgis.engine.types import (
    Completion,
    FinishReason,
    GenerationRequest,
    Timings,
    TokenEvent,
    TokenInfo,
)
from tgis.errors import GenerationError, OverloadedError

SCRIPT = " The quick brown fox jumps over the lazy dog. Hello world! Hello tokens, hello batches."


def logprob(step: int, index: int) -> float:
    """Made-up log-probability of token `step` of sequence `index` (later sequences score higher)."""
    return -(1.0 / (index + 1)) * (1.0 + 0.1 * (step % 3))


class FakeEngine:
    """EngineClient double. Attributes set after construction change later requests."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        script: str = SCRIPT,
        delay: float = 0.0,
        fail_after: int | None = None,
        overloaded: bool = False,
        eos_after: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.script_ids: list[int] = list(tokenizer.encode(script, add_special_tokens=False))
        self.delay = delay
        self.fail_after = fail_after
        self.overloaded = overloaded
        self.eos_after = eos_after
        self.is_healthy = True
        self.requests: list[GenerationRequest] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        # Set when a request is closed before it finished (from whichever thread runs it).
        self.cancel_seen = threading.Event()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def healthy(self) -> bool:
        return self.is_healthy

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.overloaded:
            raise OverloadedError("Model is overloaded")
        self.requests.append(request)
        return self._run(request)

    def sequence_ids(self, index: int, length: int, ignore_eos: bool = False) -> list[int]:
        """The ids sequence `index` generates (before stop sequences cut it): with
        `eos_after`, the EOS after that many tokens ends it, unless `ignore_eos` (then the
        EOS is one token of it and the script goes on, as the engine samples on)."""
        rotated = self.script_ids[index:] + self.script_ids[:index]
        ids = [rotated[k % len(rotated)] for k in range(length)]
        if self.eos_after is not None and self.eos_after < length:
            rest = ids[self.eos_after + 1 :] if ignore_eos else []
            ids = [*ids[: self.eos_after], self.tokenizer.eos_token_id, *rest]
        return ids

    def _token(self, token_id: int, step: int, index: int) -> TokenInfo:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        special = token_id in self.tokenizer.all_special_ids
        return TokenInfo(token_id, text, round(logprob(step, index), 4), special)

    def _top(self, token_id: int, step: int, index: int, n: int) -> tuple[TokenInfo, ...]:
        vocab = len(self.tokenizer)
        ids = [token_id] + [(token_id + k) % vocab for k in range(1, n)]
        return tuple(
            TokenInfo(i, self.tokenizer.decode([i]), round(logprob(step, index) - k, 4))
            for k, i in enumerate(ids)
        )

    async def _run(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self._in_flight += 1
        finished = False
        remaining = request.params.best_of or 1
        try:
            async for event in self._events(request):
                if event.completion is not None:
                    remaining -= 1
                    # Finished once its last completion is out: the consumer may close at once.
                    finished = remaining == 0
                yield event
        finally:
            self._in_flight -= 1
            if finished:
                self.finished.append(request.request_id)
            else:
                self.cancelled.append(request.request_id)
                self.cancel_seen.set()

    async def _events(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        p = request.params
        start = time.monotonic()
        length = p.max_new_tokens or 20
        sequences = [_Sequence(self, request, i, length) for i in range(p.best_of or 1)]
        emitted = 0
        for step in range(length):
            await anyio.sleep(self.delay)
            for seq in sequences:
                if seq.done:
                    continue
                if self.fail_after is not None and emitted >= self.fail_after:
                    raise GenerationError("the fake backend failed")
                emitted += 1
                yield seq.step(step, time.monotonic() - start)


class _Sequence:
    """One sequence of a FakeEngine request: its state between steps."""

    def __init__(
        self, engine: FakeEngine, request: GenerationRequest, index: int, length: int
    ) -> None:
        self.engine, self.request, self.index = engine, request, index
        self.ids = engine.sequence_ids(index, length, request.params.ignore_eos)
        self.tokens: list[TokenInfo] = []
        self.tops: list[tuple[TokenInfo, ...]] = []
        self.shown = ""  # text already sent
        self.done = False

    def step(self, step: int, elapsed: float) -> TokenEvent:
        e, p = self.engine, self.request.params
        token_id = self.ids[step]
        token = e._token(token_id, step, self.index)
        top = e._top(token_id, step, self.index, p.top_n_tokens) if p.top_n_tokens else ()
        self.tokens.append(token)
        self.tops.append(top)
        text = e.tokenizer.decode(self.ids[: step + 1], skip_special_tokens=p.skip_special_tokens)
        reason = None
        matched = None
        if token.special and token_id == e.tokenizer.eos_token_id and not p.ignore_eos:
            reason = FinishReason.EOS_TOKEN
        for stop in p.stop:
            at = text.find(stop)
            if at >= 0:
                reason, matched = FinishReason.STOP_SEQUENCE, stop
                text = text[: at + len(stop)] if p.include_stop_sequence else text[:at]
                break
        if reason is None and step + 1 >= len(self.ids):
            reason = FinishReason.LENGTH
        visible = text if reason is not None else text[: len(text) - _held(text, p.stop)]
        delta, self.shown = visible[len(self.shown) :], visible
        completion = None
        if reason is not None:
            self.done = True
            completion = self._completion(reason, text, step + 1, elapsed, matched)
        return TokenEvent(token, delta, top, completion, self.index)

    def _completion(
        self, reason: FinishReason, text: str, count: int, elapsed: float, stop: str | None
    ) -> Completion:
        p, e = self.request.params, self.engine
        prefill: tuple[TokenInfo, ...] = ()
        if p.decoder_input_details:
            prefill = tuple(
                TokenInfo(i, e.tokenizer.decode([i]), None if k == 0 else -2.0)
                for k, i in enumerate(self.request.input_ids)
            )
        keep = p.details or p.decoder_input_details
        seed = None
        if p.do_sample:
            seed = (1234 if p.seed is None else p.seed) + self.index
        return Completion(
            finish_reason=reason,
            generated_text=text,
            generated_tokens=count,
            input_length=len(self.request.input_ids),
            seed=seed,
            prefill=prefill,
            tokens=tuple(self.tokens) if keep else (),
            top_tokens=tuple(self.tops) if keep and p.top_n_tokens else (),
            timings=Timings(queue=0.001, inference=elapsed, first_token=0.001),
            stop_sequence=stop,
        )


def _held(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters could start a stop sequence (held back from the stream)."""
    for k in range(min(len(text), max((len(s) for s in stops), default=0)), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0
