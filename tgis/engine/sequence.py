"""Per-sequence scheduling state. Pure Python: no torch, no model, no device."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tgis.engine.block_manager import BlockKeys, ImageMark


# Async scheduling: the id a token being sampled holds in `token_ids` until it is known (no
# vocabulary has it; a step never reads it: the host writes the token in before launching).
PLACEHOLDER_ID = -1


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence the scheduler places: a request, or one of a best_of request's candidates.

    With a slot cache (`Scheduler`) the KV reservation is the worst case (prompt +
    max_new_tokens), taken at admission and held until the sequence leaves. With a paged cache
    (`PagedScheduler`) a sequence holds the blocks its tokens fill: `token_ids` are the prompt
    and every token generated so far, `computed` how many of them have their K/V in the cache
    (back to 0 when the sequence is preempted and will be recomputed).
    """

    seq_id: int
    request_id: str
    prompt_len: int
    max_new_tokens: int
    arrival: float = 0.0
    index: int = 0
    status: SeqStatus = SeqStatus.WAITING
    generated: int = 0
    # time.monotonic() when the sequence was first scheduled (end of its queue time).
    started: float | None = None
    token_ids: list[int] = field(default_factory=list)
    computed: int = 0
    # Prefix-cache key seed: sequences with different salts never share blocks.
    salt: bytes = b""
    # Positions whose embeddings are an image's features: part of their blocks' keys.
    images: tuple[ImageMark, ...] = ()
    # The prefix-cache keys of its full blocks, computed once (paged scheduler).
    block_keys: BlockKeys | None = None
    # False: never take cached blocks (the prompt's logits are wanted at every position).
    cache_lookup: bool = True
    # The prompt's logits are wanted at every position (prompt logprobs) and not yet recorded:
    # its prefill chunks count against the step's prompt-logit budget.
    prompt_logits: bool = False
    # Its forward produced a NaN or an infinity: no block it wrote is reused once it leaves.
    poisoned: bool = False
    # Tokens proposed to follow `token_ids` (speculative decoding), verified by the next step
    # alongside the last token; set by the engine, cleared when scheduled.
    draft: tuple[int, ...] = ()

    @property
    def reserved_tokens(self) -> int:
        """KV tokens this sequence may occupy at most."""
        return self.prompt_len + self.max_new_tokens

    @property
    def total_tokens(self) -> int:
        """KV tokens it occupies now."""
        return self.prompt_len + self.generated

    @property
    def uncomputed(self) -> int:
        """Known tokens whose K/V is not in the cache yet (paged: what the next chunk runs)."""
        return len(self.token_ids) - self.computed

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - self.generated
