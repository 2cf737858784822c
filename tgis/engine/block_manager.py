"""The paged KV cache's bookkeeping: which fixed-size blocks of the pool each sequence owns.

Pure Python: no torch, no device. The pool is `num_blocks` blocks of `block_size` token
positions, allocated once by the backend; this module hands out block ids. A sequence's block
table maps its token positions to the pool: position p lives in block `table[p // block_size]`
at offset `p % block_size` (`slot`, the flat index the backend writes K/V to).

Admission is by free blocks (`can_allocate`): a sequence takes the blocks its tokens need, one
more each time decoding crosses a block boundary (`can_append` / `append`), and gives them all
back when it leaves (`free`): finished, cancelled, or preempted to be recomputed later. Slots
for speculative tokens are taken ahead of them (`reserve`) and given back when those tokens are
rejected (`trim`).

With prefix caching, every full block whose KV has been computed (`mark_computed`) is keyed by
a hash of its tokens and of every token before it (chained block by block, from an optional
`salt` that separates what must not be shared: another prompt prefix, another adapter). A new
sequence whose prompt starts with cached blocks takes them instead of fresh ones (ref-counted,
shared read-only) and prefills only the rest. A cached block nobody uses stays cached until its
space is needed: free blocks are taken first, then cached ones, least recently used first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its tokens, chained to the key of everything before it."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockKeys:
    """The prefix-cache keys of one sequence's full blocks, each computed once. A sequence's
    tokens only grow, so the chain only grows: a prompt looked up at every step while it
    waits, then admitted, then marked computed block by block (and again after a preemption)
    hashes each of its blocks once."""

    def __init__(self, salt: bytes = b"") -> None:
        self.salt = salt
        self._keys: list[bytes] = []

    def key(self, index: int, tokens: Sequence[int], block_size: int) -> bytes:
        """The key of full block `index` of `tokens` (the chain grows up to it)."""
        keys = self._keys
        while len(keys) <= index:
            start = len(keys) * block_size
            keys.append(
                block_hash(keys[-1] if keys else self.salt, tokens[start : start + block_size])
            )
        return keys[index]


@dataclass
class _SeqBlocks:
    tokens: list[int]
    blocks: list[int]
    keys: BlockKeys
    # Leading full blocks whose K/V are computed (and keyed in the cache).
    computed_blocks: int = 0


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0


class BlockManager:
    """Block tables over a pool of `num_blocks` x `block_size` token positions."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks} "
                f"x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.stats = PrefixCacheStats()
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> cached block
        # Cached blocks nobody uses, least recently used first: reclaimed when space is short.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._seqs: dict[int, _SeqBlocks] = {}

    # --- capacity -------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks a new allocation can take: never used, or cached and unused."""
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def can_allocate(
        self,
        token_ids: Sequence[int],
        salt: bytes = b"",
        reserve: int = 0,
        lookup: bool = True,
        keys: BlockKeys | None = None,
    ) -> bool:
        """Whether a sequence of these prompt tokens fits now, leaving `reserve` blocks free
        (`lookup` and `keys` as in `allocate`)."""
        hits = (
            self._cached_prefix(token_ids, keys if keys is not None else BlockKeys(salt))
            if lookup
            else []
        )
        return self._fits(len(token_ids), hits, reserve)

    def can_append(self, seq_ids: Sequence[int]) -> bool:
        """Whether every sequence in `seq_ids` can take one more token now."""
        return self.blocks_to_append(seq_ids) <= self.free_blocks

    def blocks_to_append(self, seq_ids: Sequence[int]) -> int:
        """New blocks one more token for each of `seq_ids` would take."""
        return sum(1 for s in seq_ids if self._short(self._seqs[s], 1))

    def _short(self, state: _SeqBlocks, extra: int) -> int:
        """Blocks `state` lacks for `extra` positions after its tokens."""
        return max(0, self.blocks_for(len(state.tokens) + extra) - len(state.blocks))

    # --- sequences ------------------------------------------------------------------------

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        salt: bytes = b"",
        lookup: bool = True,
        keys: BlockKeys | None = None,
    ) -> int:
        """Give `seq_id` the blocks for its prompt; returns how many leading prompt tokens are
        already in the cache (a multiple of block_size, always fewer than the prompt: the last
        token is computed to get its logits). `lookup=False` takes no cached block (a request
        that wants every prompt position's logits computes them all). `keys`: the sequence's
        own chain of block keys (salted with `salt`), kept by the caller so that no block is
        hashed twice. Raises MemoryError when the pool is short (ask `can_allocate` first) and
        ValueError for a known seq_id or an empty prompt."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not token_ids:
            raise ValueError(f"sequence {seq_id}: an empty prompt needs no blocks")
        keys = keys if keys is not None else BlockKeys(salt)
        hits = self._cached_prefix(token_ids, keys) if lookup else []
        if not self._fits(len(token_ids), hits):
            raise MemoryError(
                f"sequence {seq_id} needs {self.blocks_for(len(token_ids))} blocks, "
                f"{self.free_blocks} of {self.num_blocks} are free"
            )
        for block in hits:
            self._take_cached(block)
        blocks = hits + [
            self._take_free() for _ in range(self.blocks_for(len(token_ids)) - len(hits))
        ]
        cached = len(hits) * self.block_size
        self._seqs[seq_id] = _SeqBlocks(list(token_ids), blocks, keys, len(hits))
        if self.prefix_caching and lookup:
            self.stats.queried_tokens += len(token_ids)
            self.stats.hit_tokens += cached
        return cached

    def append(self, seq_id: int, token_id: int) -> int:
        """Add one token to `seq_id` (taking a block when it starts one); returns its slot."""
        state = self._seqs[seq_id]
        position = len(state.tokens)
        if self._short(state, 1):
            if not self.free_blocks:
                raise MemoryError(
                    f"sequence {seq_id} needs a block, none of {self.num_blocks} is free"
                )
            state.blocks.append(self._take_free())
        state.tokens.append(token_id)
        return self.slot(seq_id, position)

    def reserve(self, seq_id: int, extra: int) -> bool:
        """Give `seq_id` slots for `extra` positions after its tokens (speculative tokens, which
        may be rejected) when the pool has the blocks: False, and nothing taken, when not."""
        state = self._seqs[seq_id]
        short = self._short(state, extra)
        if short > self.free_blocks:
            return False
        state.blocks.extend(self._take_free() for _ in range(short))
        return True

    def trim(self, seq_id: int, num_tokens: int | None = None) -> None:
        """Give back the blocks beyond `seq_id`'s first `num_tokens` positions (default: its
        tokens): what `reserve` took and no accepted token filled. They hold no full block of
        tokens, so none is in the prefix cache."""
        state = self._seqs[seq_id]
        keep = len(state.tokens) if num_tokens is None else max(num_tokens, len(state.tokens))
        while len(state.blocks) > max(1, self.blocks_for(keep)):
            block = state.blocks.pop()
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def mark_computed(self, seq_id: int, num_tokens: int | None = None) -> None:
        """The K/V of the first `num_tokens` tokens (default: all) are now in the cache: their
        full blocks become reusable by other sequences."""
        if not self.prefix_caching:
            return
        state = self._seqs[seq_id]
        full = (len(state.tokens) if num_tokens is None else num_tokens) // self.block_size
        while state.computed_blocks < full:
            index = state.computed_blocks
            key = state.keys.key(index, state.tokens, self.block_size)
            state.computed_blocks += 1
            block = state.blocks[index]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key

    def free(self, seq_id: int) -> None:
        """`seq_id` leaves: its blocks go back (cached ones stay cached until needed)."""
        state = self._seqs.pop(seq_id)
        for block in reversed(state.blocks):  # the tail is evicted before the shared head
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].blocks)

    def num_tokens(self, seq_id: int) -> int:
        return len(self._seqs[seq_id].tokens)

    def slot(self, seq_id: int, position: int) -> int:
        """The flat pool index (block * block_size + offset) of a position of `seq_id`."""
        blocks = self._seqs[seq_id].blocks
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    # --- internals ------------------------------------------------------------------------

    def _cached_prefix(self, token_ids: Sequence[int], keys: BlockKeys) -> list[int]:
        """Cached blocks that hold the leading full blocks of `token_ids` (never its last token)."""
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        for index in range((len(token_ids) - 1) // self.block_size):
            block = self._block_of.get(keys.key(index, token_ids, self.block_size))
            if block is None:
                break
            hits.append(block)
        return hits

    def _fits(self, num_tokens: int, hits: list[int], reserve: int = 0) -> bool:
        """Whether `num_tokens` positions fit, `hits` among them already cached: a hit some
        sequence uses costs nothing, an unused one leaves the free count as a fresh block does."""
        in_use = sum(1 for block in hits if self._refs[block] > 0)
        return self.blocks_for(num_tokens) - in_use <= self.free_blocks - reserve

    def _take_cached(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def _take_free(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.stats.evicted_blocks += 1
        self._refs[block] = 1
        return block
