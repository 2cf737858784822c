"""Per-sequence scheduling state. Pure Python: no torch, no model, no device."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence the scheduler places: a request, or one of a best_of request's candidates.

    The KV reservation is the worst case (prompt + max_new_tokens), taken at admission and
    held until the sequence leaves, so the running batch can never outgrow the KV budget.
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

    @property
    def reserved_tokens(self) -> int:
        """KV tokens this sequence may occupy at most."""
        return self.prompt_len + self.max_new_tokens

    @property
    def total_tokens(self) -> int:
        """KV tokens it occupies now."""
        return self.prompt_len + self.generated

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - self.generated
