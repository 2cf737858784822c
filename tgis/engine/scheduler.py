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
Requests arrive validated (tgis.params.validate) against limits that the validation core has
checked against these budgets (tgis.config.rules), so each one fits a prefill step and the KV
budget on its own; `add` refuses a sequence that breaks that contract.

Queue order is first come, first served, unless `queue_threshold_ms` is set (Gaudi's
QUEUE_THRESHOLD_MS): then requests that have waited longer than the threshold go first, oldest
first, and the others shortest prompt first.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from tgis.engine.sequence import SeqStatus, Sequence


class StepKind(Enum):
    PREFILL = "prefill"
    DECODE = "next_token"  # TGI's metric label for decode steps


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_sequences: int
    max_batch_size: int | None = None
    # TGI's admission policy: while a batch runs, new sequences wait until this many times
    # the running ones wait, or `max_waiting_tokens` steps have passed. 0: admitted as soon
    # as the budgets allow (the paged engine's default; the config layer gives the slot
    # engine TGI's 0.3 and 20).
    waiting_served_ratio: float = 0.0
    max_waiting_tokens: int = 0
    # Soft cap on one prefill step, from the backend: where prefill is compute-bound (a CPU),
    # bigger steps gain no throughput but delay every first token of the step. The first
    # sequence of a step is admitted whatever its length (up to max_batch_prefill_tokens).
    prefill_step_tokens: int | None = None
    # The paged engine: a prefill chunk never ends inside an image (a model whose image rows
    # attend to each other both ways, BackendCapacity.whole_images).
    whole_images: bool = False
    # None: first come, first served. Otherwise overdue requests first, then shortest prompts.
    queue_threshold_ms: int | None = None
    # The paged engine: prompt positions one step returns logits for at most (the chunks of
    # sequences that want prompt logprobs, BackendCapacity.prompt_logit_tokens). None: no cap.
    prompt_logit_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_prefill_tokens", "max_batch_total_tokens", "max_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_logit_tokens is not None and self.prompt_logit_tokens < 1:
            raise ValueError(f"prompt_logit_tokens must be >= 1, got {self.prompt_logit_tokens}")

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

    def __init__(
        self, limits: SchedulerLimits, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self.clock = clock  # the clock of Sequence.arrival
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0  # KV tokens reserved by the running batch
        # Decode steps since the last prefill (TGI's "waiting tokens").
        self.waiting_steps = 0

    def add(self, sequences: Iterable[Sequence]) -> None:
        """Queue sequences. All candidates of one request are added together.

        Raises ValueError for a sequence no step could ever run (larger than the KV budget or
        the prefill budget): the caller validated it against the wrong limits.
        """
        sequences = list(sequences)
        for seq in sequences:
            if (
                seq.reserved_tokens > self.limits.max_batch_total_tokens
                or seq.prompt_len > self.limits.max_batch_prefill_tokens
            ):
                raise ValueError(
                    f"sequence {seq.seq_id} ({seq.prompt_len} prompt + {seq.max_new_tokens} new "
                    f"tokens) can never run within max_batch_prefill_tokens="
                    f"{self.limits.max_batch_prefill_tokens} and max_batch_total_tokens="
                    f"{self.limits.max_batch_total_tokens}"
                )
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

    def queue_order(self) -> list[Sequence]:
        """The waiting sequences in the order they are considered for the next prefill."""
        threshold = self.limits.queue_threshold_ms
        if threshold is None:
            return list(self.waiting)
        cutoff = self.clock() - threshold / 1000  # arrived at or before: overdue
        overdue: list[Sequence] = []
        rest: list[Sequence] = []
        for seq in self.waiting:
            (overdue if seq.arrival <= cutoff else rest).append(seq)
        # sorted() is stable: ties (and a request's candidates) keep their queue order.
        return sorted(overdue, key=lambda s: s.arrival) + sorted(rest, key=lambda s: s.prompt_len)

    def _next_prefill(self) -> list[Sequence]:
        """Waiting sequences to prefill now, in queue order, within every budget."""
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
        for seq in self.queue_order():
            if len(batch) == free_slots:
                break
            if prefill_tokens + seq.prompt_len > prefill_budget:
                break
            if batch and prefill_tokens + seq.prompt_len > soft_cap:
                capped = True
                break
            if seq.reserved_tokens > kv_budget:
                break  # in order: a large request is not overtaken by smaller ones behind it
            batch.append(seq)
            prefill_tokens += seq.prompt_len
            kv_budget -= seq.reserved_tokens
        # Enough sequences wait to interrupt the batch, but the soft cap splits them over
        # several steps: the first step goes now rather than waiting to grow.
        enough = len(batch) >= min_size or (capped and len(self.waiting) >= min_size)
        if not batch or not enough:
            return []
        for seq in batch:
            self.waiting.remove(seq)
        return batch
