"""Continuous batching over a paged KV cache: packed steps, chunked prefill, preemption.

Pure Python: no torch, no devices. The `BlockManager` it owns mirrors the backend's pool of
KV blocks; the scheduler decides which tokens of which sequences one forward computes.

Every sequence is a list of known tokens (`Sequence.token_ids`: the prompt, then each sampled
token) of which the first `computed` have their K/V in the cache. A step is a list of chunks,
one per sequence, each the next uncomputed tokens of that sequence; a chunk that reaches the
last known token yields logits and a sampled token. So one packed forward mixes decodes (one
token each) with prefill chunks of new prompts, of any lengths, without padding:

1. Blocks for the tokens sampled last step: each running sequence gets a block when its new
   token starts one. When the pool has none left, the newest running sequence is preempted: its
   blocks go back, it returns to the head of the queue, and it is recomputed (prompt and the
   tokens it has generated) when blocks are free again. Nothing is lost and nothing runs out of
   memory; with prefix caching most of the recomputation is a cache hit.
2. Every running sequence is scheduled: a decode (one token) always; a prompt still being
   prefilled takes its next chunk from the step's prefill budget. A decode carries the
   sequence's draft (speculative decoding: tokens proposed to follow, verified in the same
   forward) when the pool has slots for it; the engine reports how many were accepted
   (`accept`), and the slots of rejected ones go back before the next step.
3. Waiting sequences are admitted in order while the step has prefill budget, the batch has
   room (`max_batch_size`) and the pool has blocks for the whole prompt (less the blocks the
   prefix cache already holds) beyond the blocks the running decodes need next. The last one
   admitted may get only a first chunk of its prompt; the rest follows in the next steps while
   the others keep decoding. While a batch runs, TGI's admission policy may hold new
   sequences back: until `waiting_served_ratio` x the running ones wait (at most the room the
   batch has), or `max_waiting_tokens` steps have passed since the last admission. A ratio of
   0 admits at the next step; a preempted sequence is never held (it was served already).

The prefill budget of a step is `max_batch_prefill_tokens`, capped by the backend's
`prefill_step_tokens` where prefill is compute-bound. The chunks of sequences that want their
prompt's logits at every position (prompt logprobs) also share `prompt_logit_tokens`, the rows
of logits a step may hold: such a prompt is prefilled in chunks of that size at most, and a
waiting one is not admitted in a step whose logit budget is spent. A request is refused at `add` only when
it could never fit the pool even alone.

With a sliding window (`BlockManager.sliding_window`: a model whose every layer attends to the
last W positions only), a sequence gives back the blocks behind its window as it is computed,
so it holds about W / block_size + 1 blocks whatever its length, and it takes its prompt's
blocks chunk by chunk. A waiting sequence is admitted when the pool has the blocks its prompt
holds once computed (those its first generated token's window touches) beyond what the running
ones need: one more token's each, and for one past its window as many as bring it back to a
window's worth (it takes a block for each one it gives back). It takes the blocks of its first
token to compute, then each chunk is as long as the free blocks allow beyond what the running
decodes need. A prompt that lacks even the block of its next token preempts the newest
sequence, as a decode does. So a sequence longer than the whole pool is served, and after a
preemption it is recomputed through the pool chunk by chunk; `add` refuses only one whose
window alone exceeds the pool.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tgis.engine.block_manager import BlockKeys, BlockManager, image_spans
from tgis.engine.scheduler import SchedulerLimits, StepKind
from tgis.engine.sequence import PLACEHOLDER_ID, SeqStatus, Sequence


@dataclass(frozen=True)
class Chunk:
    """Tokens `start`..`start + count - 1` of `seq` computed in one step, with the sequence's
    block table at that time. `sample`: the chunk ends at the last known token, so its logits
    give the next token. `draft`: speculative tokens after the last known one, computed in the
    same step (their slots reserved) to verify them."""

    seq: Sequence
    start: int
    count: int
    block_table: tuple[int, ...]
    draft: tuple[int, ...] = ()

    @property
    def sample(self) -> bool:
        return self.start + self.count == len(self.seq.token_ids)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self.seq.token_ids[self.start : self.start + self.count]) + self.draft


@dataclass(frozen=True)
class PackedStep:
    """One packed forward. `kind` is PREFILL when any chunk is a prompt chunk (for metrics)."""

    kind: StepKind
    chunks: tuple[Chunk, ...]

    @property
    def sequences(self) -> tuple[Sequence, ...]:
        return tuple(c.seq for c in self.chunks)

    @property
    def tokens(self) -> int:
        return sum(c.count + len(c.draft) for c in self.chunks)


class PagedScheduler:
    """Decides the next packed step; the engine runs it, then reports back (`complete`,
    `finish`). `limits.max_batch_total_tokens` is informational here: the pool is the limit."""

    def __init__(self, limits: SchedulerLimits, blocks: BlockManager) -> None:
        self.limits = limits
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.preemptions = 0
        # Async scheduling: where the launched step's chunk of each sequence starts. Its
        # positions count as computed for planning, but no block they fill is keyed for the
        # prefix cache until the step `land`s (it may still fail).
        self._landing: dict[int, int] = {}
        # Steps since a sequence was last admitted (TGI's "waiting tokens").
        self.waiting_steps = 0
        soft = limits.prefill_step_tokens
        self.prefill_budget = min(limits.max_batch_prefill_tokens, soft or math.inf)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, sequences: Iterable[Sequence]) -> None:
        """Queue sequences (a request's candidates together). Raises ValueError for one whose
        prompt plus max_new_tokens needs more blocks at once than the whole pool has (all of
        them; with a sliding window, those of one window): it could never finish."""
        sequences = list(sequences)
        blocks = self.blocks
        pool = blocks.num_blocks * blocks.block_size
        for seq in sequences:
            if not seq.token_ids:
                raise ValueError(f"sequence {seq.seq_id} has no prompt tokens")
            if blocks.peak_blocks(seq.reserved_tokens) > blocks.num_blocks:
                raise ValueError(
                    f"sequence {seq.seq_id} ({seq.prompt_len} prompt + {seq.max_new_tokens} new "
                    f"tokens) can never fit the KV cache of {pool} tokens "
                    f"(max_batch_total_tokens)"
                )
        for seq in sequences:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)

    def schedule(self) -> PackedStep | None:
        """The next step, or None when nothing can run."""
        self._extend_blocks()
        budget = self.prefill_budget
        windowed = self.blocks.sliding_window is not None
        # Blocks a prompt's next chunk leaves free: what the running decodes need next.
        keep = (
            self.blocks.blocks_ahead([s.seq_id for s in self.running if s.uncomputed == 1])
            if windowed
            else 0
        )
        logit_rows = self.limits.prompt_logit_tokens or math.inf
        chunks: list[Chunk] = []
        for seq in self.running:
            need = seq.uncomputed
            if need == 1 and seq.remaining_tokens <= 0 and seq.token_ids[-1] == PLACEHOLDER_ID:
                continue  # its last token is being sampled (async scheduling): it ends then
            if need == 1:
                chunks.append(self._decode(seq))
            elif need > 1 and budget > 0:
                room = self._room(seq, budget, logit_rows)
                take = self._whole(seq, self._fit(seq, room, keep), keep) if room else 0
                if take:
                    budget -= take
                    logit_rows -= take if self._logits(seq) else 0
                    chunks.append(self._chunk(seq, take))
        admitted = False
        held = self._held()
        while (
            not held and self.waiting and budget > 0 and len(self.running) < self.limits.batch_limit
        ):
            seq = self.waiting[0]
            if not self._room(seq, budget, logit_rows):
                break  # its prompt logits wait for the next step's budget
            reserve = self.blocks.blocks_ahead([s.seq_id for s in self.running])
            if seq.block_keys is None:
                seq.block_keys = BlockKeys(seq.salt, seq.images)
            keys = seq.block_keys
            # With a window, the prompt's blocks come chunk by chunk (module doc).
            first = 1 if windowed else None
            if not self.blocks.can_allocate(
                seq.token_ids, reserve=reserve, lookup=seq.cache_lookup, keys=keys, first=first
            ):
                break  # in order: a large request is not overtaken by smaller ones
            self.waiting.popleft()
            seq.computed = self.blocks.allocate(
                seq.seq_id, seq.token_ids, lookup=seq.cache_lookup, keys=keys, first=first
            )
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            take = self._fit(seq, self._room(seq, budget, logit_rows), reserve)
            take = self._whole(seq, take, reserve)
            if take:
                budget -= take
                logit_rows -= take if self._logits(seq) else 0
                chunks.append(self._chunk(seq, take))
            admitted = True
        self.waiting_steps = 0 if admitted else self.waiting_steps + 1
        if not chunks:
            return None
        prefill = any(c.seq.computed < c.seq.prompt_len or c.count > 1 for c in chunks)
        return PackedStep(StepKind.PREFILL if prefill else StepKind.DECODE, tuple(chunks))

    def _held(self) -> bool:
        """Whether the admission policy holds the waiting sequences back this step (module
        doc, 3)."""
        limits = self.limits
        if not self.running or not self.waiting or self.waiting_steps >= limits.max_waiting_tokens:
            return False
        head = self.waiting[0]
        if head.generated > 0:  # preempted
            return False
        room = limits.batch_limit - len(self.running)
        return len(self.waiting) < min(
            math.floor(len(self.running) * limits.waiting_served_ratio), room
        )

    def complete(self, step: PackedStep) -> None:
        """The step's K/V are in the cache: advance each chunk's sequence (full blocks become
        prefix-cache entries). Call before the sampled tokens are appended."""
        for chunk in step.chunks:
            seq = chunk.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.computed = chunk.start + chunk.count
            self.blocks.mark_computed(seq.seq_id, seq.computed)

    def advance(self, step: PackedStep) -> None:
        """The step was launched (async scheduling): its sequences' positions count as
        computed for planning the next step; the device computes them before any later
        step reads them. Their blocks are keyed once the step `land`s, or `rewind` undoes
        this if it fails."""
        for chunk in step.chunks:
            if chunk.seq.status is SeqStatus.RUNNING:
                chunk.seq.computed = chunk.start + chunk.count
                self._landing[chunk.seq.seq_id] = chunk.start

    def land(self, step: PackedStep) -> None:
        """The launched step is done: its K/V are in the cache, and the full blocks they fill
        become prefix-cache entries. A sequence preempted since the launch (and perhaps
        admitted again, from its tokens) is left as it is now."""
        for chunk in step.chunks:
            seq = chunk.seq
            if self._landing.pop(seq.seq_id, None) is not None and seq.status is SeqStatus.RUNNING:
                self.blocks.mark_computed(seq.seq_id, chunk.start + chunk.count)

    def rewind(self, seq: Sequence, start: int) -> None:
        """A launched step failed: `seq` computed nothing from `start` on, and the block
        manager forgets what it was told of tokens the sequence no longer has (its reserved
        placeholder)."""
        self._landing.pop(seq.seq_id, None)
        if seq.status is SeqStatus.RUNNING:
            seq.computed = min(seq.computed, start)
            self.blocks.rewind(seq.seq_id, start)
            self.blocks.truncate(seq.seq_id, len(seq.token_ids))

    def retire(self, seq: Sequence) -> None:
        """`seq` left while a launched step still writes its blocks: it is planned no more,
        and its blocks go back with `release` once that step is done."""
        self._landing.pop(seq.seq_id, None)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def release(self, seq: Sequence) -> None:
        """The blocks of a retired sequence go back."""
        if seq.seq_id in self.blocks:
            self.blocks.free(seq.seq_id, reuse=not seq.poisoned)

    def accept(self, seq: Sequence, count: int) -> None:
        """The first `count` draft tokens of `seq`'s last step were accepted (and appended to
        its tokens after `complete`): their K/V, computed in that step, are in the cache too."""
        if seq.status is SeqStatus.RUNNING:
            seq.computed += count

    def finish(self, seq: Sequence) -> None:
        """A sequence left (finished, cancelled, failed): its blocks go back."""
        self.retire(seq)
        self.release(seq)

    @staticmethod
    def _logits(seq: Sequence) -> bool:
        """Whether `seq`'s next prompt chunk returns logits at every position."""
        return seq.prompt_logits and seq.computed < seq.prompt_len

    def _room(self, seq: Sequence, budget: float, logit_rows: float) -> int:
        """The most of `seq`'s uncomputed tokens the step may take: within the prefill budget
        and, when its prompt's logits are wanted, the step's prompt-logit rows."""
        cap = min(budget, logit_rows) if self._logits(seq) else budget
        return int(min(seq.uncomputed, cap))

    def _fit(self, seq: Sequence, take: int, keep: int) -> int:
        """How many of the next `take` tokens of `seq` the step computes: all of them when its
        block table maps them, else as many as the blocks it can take now (beyond `keep` free
        ones) give slots for; at least one (`_extend_blocks` saw to its next token's)."""
        return min(take, self.blocks.grow(seq.seq_id, seq.computed + take, keep) - seq.computed)

    def _whole(self, seq: Sequence, take: int, keep: int) -> int:
        """`take` moved so that the chunk does not end inside an image, where images are
        computed whole (`limits.whole_images`): back to the image's start, or, for a chunk
        that starts inside or at it, on to its end (past the prefill budget: an image is never
        split) when blocks for it can be had now; 0: nothing this step."""
        if not self.limits.whole_images or not seq.images:
            return take
        start = seq.computed
        end = start + take
        for lo, length in image_spans(seq.images):
            hi = lo + length
            if not lo < end < hi:
                continue
            if lo > start:
                return lo - start
            return hi - start if self.blocks.grow(seq.seq_id, hi, keep) >= hi else 0
        return take

    def _chunk(self, seq: Sequence, count: int) -> Chunk:
        return Chunk(seq, seq.computed, count, tuple(self.blocks.block_table(seq.seq_id)))

    def _decode(self, seq: Sequence) -> Chunk:
        """A decode chunk: the last token, and the sequence's draft when the pool has slots
        for it (a draft never preempts anyone; without slots the step decodes one token)."""
        draft, seq.draft = seq.draft, ()
        if draft and not self.blocks.reserve(seq.seq_id, len(draft)):
            draft = ()
        chunk = self._chunk(seq, 1)
        return Chunk(chunk.seq, chunk.start, 1, chunk.block_table, draft) if draft else chunk

    def _extend_blocks(self) -> None:
        """Give each running sequence slots for its sampled tokens, preempting the newest
        sequences while the pool is short."""
        # Slots reserved for draft tokens that were rejected go back first, so that no one is
        # preempted for blocks that only held a rejected draft. (Accepted ones hold K/V.)
        for seq in self.running:
            self.blocks.trim(seq.seq_id, len(seq.token_ids))
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            known = self.blocks.num_tokens(seq.seq_id)
            while known < len(seq.token_ids):
                if self.blocks.can_append([seq.seq_id]):
                    self.blocks.append(seq.seq_id, seq.token_ids[known])
                    known += 1
                    continue
                self._preempt(self.running[-1])
                if seq.status is not SeqStatus.RUNNING:
                    return  # it was the newest: everything after it is gone too
            # A prompt that takes its blocks chunk by chunk (a sliding window) needs the slot
            # of its next token at least, as a decode does.
            while (
                seq.computed < len(seq.token_ids)
                and self.blocks.covered(seq.seq_id) <= seq.computed
            ):
                if self.blocks.grow(seq.seq_id, seq.computed + 1) > seq.computed:
                    break
                self._preempt(self.running[-1])
                if seq.status is not SeqStatus.RUNNING:
                    return
            # Accepted draft tokens are computed tokens now, whose full blocks the prefix
            # cache may keep (and behind whose window blocks go back); a launched step's
            # positions wait until it lands.
            landed = min(seq.computed, self._landing.get(seq.seq_id, seq.computed))
            self.blocks.mark_computed(seq.seq_id, landed)
            index += 1

    def _preempt(self, seq: Sequence) -> None:
        """Send `seq` back to the head of the queue; it will be recomputed from its tokens."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        self._landing.pop(seq.seq_id, None)
        seq.computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
