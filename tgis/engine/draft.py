"""Drafts from a small model of the same tokenizer (`--draft-model`), for speculative decoding.

The draft model runs on its own paged backend with its own block pool: for every sequence to
draft, one packed forward catches its cache up with the sequence's tokens (the prompt the first
time, then the tokens accepted since) and gives the first draft token, and k - 1 packed decode
steps give the rest, greedily. A greedy draft is a deterministic proposal, so verification
(tgis.engine.speculation) keeps the target's output exactly as it does for prompt lookup.

What the draft cache holds stays valid as far as the sequence agrees with it: positions up to
the last token are computed by the catch-up, and the draft tokens after it only while the
target accepted them; the next catch-up starts from the first disagreement. A sequence whose
draft cache has no room gets no draft (it never holds up the target), and its blocks go back
when the sequence leaves (`release`). A draft model with a sliding window (its capacity's
`sliding_window`) gives back the blocks behind the window of the next catch-up as it drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tgis.engine.backend import PackedItem, PagedBackend
from tgis.engine.block_manager import BlockManager

# The token id of positions reserved before they are known (the draft cache's bookkeeping
# counts positions, it keys no prefix cache).
_UNKNOWN = 0


@dataclass
class _Cached:
    """A sequence in the draft cache: its first `valid` positions hold the K/V of the
    sequence's own tokens; `drafted` are the draft tokens computed after them last time."""

    valid: int
    start: int
    drafted: tuple[int, ...] = ()


class DraftModelProposer:
    """Greedy drafts of up to k tokens per sequence from a draft model's paged backend."""

    def __init__(
        self,
        backend: PagedBackend,
        vocab_size: int | None = None,
        max_step_tokens: int | None = None,
    ) -> None:
        """vocab_size: the target's; a draft model's logits past it (padding rows of a larger
        embedding) are never drafted. max_step_tokens: the most tokens one catch-up forward
        computes (longer catch-ups take several); None: the backend's prefill step, if any."""
        capacity = backend.capacity
        if capacity.block_size is None:
            raise ValueError("a draft model needs a paged backend")
        self.backend = backend
        self.vocab_size = vocab_size
        self.max_step_tokens = max_step_tokens or capacity.prefill_step_tokens or 1 << 30
        self.max_positions = capacity.max_sequence_tokens
        self.blocks = BlockManager(
            capacity.num_blocks, capacity.block_size, sliding_window=capacity.sliding_window
        )
        self._seqs: dict[int, _Cached] = {}

    def draft(self, wanted: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """Drafts for (seq_id, tokens, k) requests, in order (empty where none can be made)."""
        active = [
            (seq_id, list(tokens), k)
            for seq_id, tokens, k in wanted
            if k > 0 and self._room(seq_id, tokens, k)
        ]
        first = self._catch_up([(seq_id, tokens) for seq_id, tokens, _ in active])
        drafts = {seq_id: [token] for (seq_id, _, _), token in zip(active, first, strict=True)}
        step = 1
        active = [entry for entry in active if entry[2] > 1]
        while active:
            items = [
                self._item(seq_id, (drafts[seq_id][-1],), len(tokens) + step - 1)
                for seq_id, tokens, _ in active
            ]
            for (seq_id, _, _), token in zip(active, self._choose(items), strict=True):
                drafts[seq_id].append(token)
            step += 1
            active = [entry for entry in active if entry[2] > step]
        out = []
        for seq_id, tokens, _ in wanted:
            made = tuple(drafts.get(seq_id, ()))
            if seq_id in drafts:
                # Positions up to the last token are computed; the draft tokens fed back (all
                # but the last) are valid only as far as the sequence will agree with them.
                self._seqs[seq_id] = _Cached(len(tokens), len(tokens), made[:-1])
                # The next catch-up starts at the last token at the earliest: with a sliding
                # window, the blocks behind that token's window go back.
                self.blocks.mark_computed(seq_id, len(tokens) - 1)
            out.append(made)
        return out

    def _catch_up(self, seqs: Sequence[tuple[int, list[int]]]) -> list[int]:
        """Compute each sequence's tokens from its first invalid position on, in forwards of
        at most max_step_tokens tokens; the draft token after each sequence's last one."""
        pending = [(seq_id, self._seqs[seq_id].valid, tokens) for seq_id, tokens in seqs]
        first: dict[int, int] = {}
        while pending:
            items, rest, budget = [], [], self.max_step_tokens
            for seq_id, start, tokens in pending:
                take = min(len(tokens) - start, budget)
                if take <= 0:
                    rest.append((seq_id, start, tokens))
                    continue
                done = start + take == len(tokens)
                item = self._item(seq_id, tokens[start : start + take], start)
                items.append(item if done else replace(item, sample=False))
                budget -= take
                if not done:
                    rest.append((seq_id, start + take, tokens))
            sampled = [item.seq_id for item in items if item.sample]
            first.update(zip(sampled, self._choose(items), strict=True))
            pending = rest
        return [first[seq_id] for seq_id, _ in seqs]

    def _choose(self, items: Sequence[PackedItem]) -> list[int]:
        """The greedy next token of each sampling item of one forward."""
        if not items:
            return []
        logits = self.backend.forward(items).last[:, : self.vocab_size]
        return [int(token) for token in logits.argmax(dim=-1).tolist()]

    def release(self, seq_id: int) -> None:
        """The sequence left: its draft cache blocks go back."""
        if self._seqs.pop(seq_id, None) is not None:
            self.blocks.free(seq_id)

    def _item(self, seq_id: int, tokens: Sequence[int], start: int) -> PackedItem:
        table = tuple(self.blocks.block_table(seq_id))
        return PackedItem(seq_id, tuple(tokens), start, table)

    def _room(self, seq_id: int, tokens: Sequence[int], k: int) -> bool:
        """Bring the sequence's draft cache in line with `tokens` and give it slots for the
        catch-up and k - 1 fed-back draft tokens; False (no draft) when the pool is short or
        the positions would pass the draft model's limit."""
        need = len(tokens) + k - 1
        if need > self.max_positions:
            return False
        cached = self._seqs.get(seq_id)
        if cached is None:
            if not self.blocks.can_allocate([_UNKNOWN] * need):
                return False
            self.blocks.allocate(seq_id, [_UNKNOWN] * need)
            self._seqs[seq_id] = _Cached(0, 0)
            return True
        agreed = 0
        for drafted, actual in zip(cached.drafted, tokens[cached.start :], strict=False):
            if drafted != actual:
                break
            agreed += 1
        cached.valid = min(cached.start + agreed, len(tokens) - 1)
        cached.drafted = ()
        while self.blocks.num_tokens(seq_id) < need:
            if not self.blocks.can_append([seq_id]):
                return False
            self.blocks.append(seq_id, _UNKNOWN)
        return True
