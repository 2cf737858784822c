"""Stop criteria of one sequence. Pure Python: no torch, no tokenizer.

Two parts, combined per token by `tgis.engine.detokenize.TextStream`:

- `StoppingCriteria`: the token-level rules (max_new_tokens, EOS ids, time limit,
  min_new_tokens), with the generated-token count.
- `StopSequences`: finds stop sequences in the growing decoded text, across token
  boundaries, and tells how much of the text's end could still become a match.

When several reasons hold on the same token the most specific wins: EOS_TOKEN, then
STOP_SEQUENCE, then LENGTH, then TIME_LIMIT. Before `min_new_tokens` tokens neither EOS nor a
stop sequence ends the sequence (sampling masks EOS meanwhile, see tgis.engine.sampling). With
`ignore_eos` (vLLM's) an EOS id ends nothing and is an ordinary token, never masked: the
sequence runs to max_new_tokens, a stop sequence or the time limit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tgis.engine.types import FinishReason
from tgis.params import GenerateParameters


class StoppingCriteria:
    """Token-level stop rules of one sequence; call `on_token` once per generated token."""

    def __init__(
        self,
        params: GenerateParameters,
        eos_token_ids: Iterable[int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # None only for unvalidated params: then the engine's capacity limit applies alone.
        self.max_new_tokens = params.max_new_tokens
        self.min_new_tokens = params.min_new_tokens
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.time_limit = None if params.time_limit_ms is None else params.time_limit_ms / 1000
        self.clock = clock
        self.generated = 0
        self.started: float | None = None

    def start(self, now: float | None = None) -> None:
        """Mark the first scheduling of the sequence: the time limit runs from here.

        Without a call, the clock starts at the first token.
        """
        if self.started is None:
            self.started = self.clock() if now is None else now

    def on_token(self, token_id: int) -> FinishReason | None:
        """Count one generated token; EOS_TOKEN if it is an EOS id that may end the sequence."""
        self.start()
        self.generated += 1
        # The EOS token itself is not one of the min_new_tokens (HF's MinNewTokens semantics).
        if token_id in self.eos_token_ids and self.generated > self.min_new_tokens:
            return FinishReason.EOS_TOKEN
        return None

    @property
    def stop_sequences_allowed(self) -> bool:
        """Whether a stop sequence may end the sequence now (min_new_tokens reached)."""
        return self.generated >= self.min_new_tokens

    def limit_reached(self, now: float | None = None) -> FinishReason | None:
        """LENGTH once max_new_tokens are generated, TIME_LIMIT once time_limit_ms has passed."""
        if self.max_new_tokens is not None and self.generated >= self.max_new_tokens:
            return FinishReason.LENGTH
        if self.time_limit is not None and self.started is not None:
            elapsed = (self.clock() if now is None else now) - self.started
            if elapsed >= self.time_limit:
                return FinishReason.TIME_LIMIT
        return None


@dataclass(frozen=True)
class StopMatch:
    """A stop sequence found in the text at [start, end)."""

    sequence: str
    start: int
    end: int


class StopSequences:
    """The stop sequences of one request (empty strings ignored, duplicates merged)."""

    def __init__(self, sequences: Iterable[str]) -> None:
        self.sequences = tuple(s for s in dict.fromkeys(sequences) if s)
        self.max_len = max((len(s) for s in self.sequences), default=0)

    def __bool__(self) -> bool:
        return bool(self.sequences)

    def find(self, text: str, new_from: int) -> StopMatch | None:
        """The earliest match that ends past `new_from` (it uses text added since then).

        Matches wholly inside text[:new_from] were looked for before and are not reported.
        On a tie the longest sequence wins.
        """
        best: StopMatch | None = None
        for seq in self.sequences:
            at = text.find(seq, max(0, new_from - len(seq) + 1))
            if at < 0:
                continue
            if best is None or (at, -len(seq)) < (best.start, -len(best.sequence)):
                best = StopMatch(seq, at, at + len(seq))
        return best

    def partial_len(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of a stop sequence:
        text that must be held back from a stream while it may still become a match."""
        longest = 0
        for seq in self.sequences:
            for k in range(min(len(seq) - 1, len(text)), longest, -1):
                if text.endswith(seq[:k]):
                    longest = k
                    break
        return longest
