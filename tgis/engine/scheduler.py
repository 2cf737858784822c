"""Continuous batching policy, as TGI's router runs it. Pure Python: no torch, no devices.

Each step is either a prefill of waiting sequences (which then join the running batch) or one
decode step of the whole running batch. A prefill is taken when it fits the budgets and, while
a batch is running, when enough requests wait to be worth interrupting it
(`waiting_served_ratio`) or they have waited `max_waiting_tokens` decode steps.

Budgets, all enforced at admission:
- prefill: the prompts of one prefill step sum to at most `max_batch_prefill_tokens`;
- KV: running sequences reserve prompt + max_new_tokens each, at most `max_batch_total_tokens`
  in all, so decoding can never run out of cache;
- size: at most `max_batch_size` running sequences and at most `max_sequences` (backend slots).
A request that could never fit (its reservation exceeds the KV budget alone) is refused by
`check_fits` before it is queued.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from tgis.engine.sequence import SeqStatus, Sequence
from tgis.errors import InputValidationError


class StepKind(Enum):
    PREFILL = "prefill"
    DECODE = "next_token"  # TGI's metric label for decode steps


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_sequences: int
    max_batch_size: int | None = None
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    # Soft cap on one prefill step, from the backend: where prefill is compute-bound (a CPU),
    # bigger steps gain no throughput but delay every first token of the step. The first
    # sequence of a step is admitted whatever its length (up to max_batch_prefill_tokens).
    prefill_step_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_prefill_tokens", "max_batch_total_tokens", "max_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def batch_limit(self) -> int:
        if self.max_batch_size is None:
            return self.max_sequences
        return min(self.max_batch_size, self.max_sequences)


@dataclass(frozen=True)
class Step:
    kind: StepKind
    sequences: tuple[Sequence, ...]


class Scheduler:
    """Decides the next step; the engine runs it and reports finished sequences back."""

    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0  # KV tokens reserved by the running batch
        # Decode steps since the last prefill (TGI's "waiting tokens").
        self.waiting_steps = 0

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse at once a request no batch could ever hold (never queue it forever)."""
        reserved = prompt_len + max_new_tokens
        if reserved > self.limits.max_batch_total_tokens:
            raise InputValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {self.limits.max_batch_total_tokens} "
                f"(the KV cache budget). Given: {prompt_len} `inputs` tokens and {max_new_tokens} "
                "`max_new_tokens`"
            )
        if prompt_len > self.limits.max_batch_prefill_tokens:
            raise InputValidationError(
                f"`inputs` must have less than {self.limits.max_batch_prefill_tokens + 1} tokens "
                f"(--max-batch-prefill-tokens). Given: {prompt_len}"
            )

    def add(self, sequences: Iterable[Sequence]) -> None:
        """Queue sequences (FIFO). All candidates of one request are added together."""
        for seq in sequences:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step | None:
        """The next step, or None when there is nothing to do."""
        batch = self._next_prefill()
        if batch:
            self.waiting_steps = 0
            for seq in batch:
                seq.status = SeqStatus.RUNNING
                self.reserved += seq.reserved_tokens
                self.running.append(seq)
            return Step(StepKind.PREFILL, tuple(batch))
        if self.running:
            self.waiting_steps += 1
            return Step(StepKind.DECODE, tuple(self.running))
        return None

    def finish(self, seq: Sequence) -> None:
        """A sequence left (finished, cancelled, failed): free its reservation."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.reserved -= seq.reserved_tokens
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _next_prefill(self) -> list[Sequence]:
        """Waiting sequences to prefill now, in FIFO order, within every budget."""
        if not self.waiting:
            return []
        free_slots = self.limits.batch_limit - len(self.running)
        if free_slots <= 0:
            return []
        min_size = 0
        if self.running and self.waiting_steps < self.limits.max_waiting_tokens:
            # Never wait for more than the batch can take in.
            ratio = self.limits.waiting_served_ratio
            min_size = min(math.floor(len(self.running) * ratio), free_slots)
        kv_budget = self.limits.max_batch_total_tokens - self.reserved
        prefill_budget = self.limits.max_batch_prefill_tokens
        soft_cap = self.limits.prefill_step_tokens or prefill_budget
        prefill_tokens = 0
        capped = False
        batch: list[Sequence] = []
        for seq in self.waiting:
            if len(batch) == free_slots:
                break
            if prefill_tokens + seq.prompt_len > prefill_budget:
                break
            if batch and prefill_tokens + seq.prompt_len > soft_cap:
                capped = True
                break
            if seq.reserved_tokens > kv_budget:
                break  # FIFO: a large request is not overtaken by smaller ones behind it
            batch.append(seq)
            prefill_tokens += seq.prompt_len
            kv_budget -= seq.reserved_tokens
        # Enough sequences wait to interrupt the batch, but the soft cap splits them over
        # several steps: the first step goes now rather than waiting to grow.
        enough = len(batch) >= min_size or (capped and len(self.waiting) >= min_size)
        if not batch or not enough:
            return []
        for _ in batch:
            self.waiting.popleft()
        return batch
