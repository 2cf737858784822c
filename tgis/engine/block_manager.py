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
`salt` that separates what must not be shared: another prompt prefix, another adapter). Rows
whose embeddings are not their tokens' (an image's features behind its placeholder tokens) are
keyed by what fills them: a block holding part of an image hashes in the image's digest and
which of its rows it holds (`ImageMark`), so two images never share a block. A new
sequence whose prompt starts with cached blocks takes them instead of fresh ones (ref-counted,
shared read-only) and prefills only the rest. A cached block nobody uses stays cached until its
space is needed: free blocks are taken first, then cached ones, least recently used first.

With a `sliding_window` W (a model whose every layer attends to the last W positions only, the
query's own included), a sequence does not keep its whole length in the pool. Once the K/V of
its first n tokens are computed (`mark_computed`), every query it can still make is at a
position >= n and reads positions >= n - W + 1: its blocks wholly before that go back to the
pool as it advances (`released`, counted in `stats.released_blocks`), as if freed (a block
shared through the prefix cache loses only this sequence's reference; a cached one stays
cached). Its block table keeps their ids in place, so that position p still maps to
`table[p // block_size]`: the backend masks those positions out and never reads their contents,
which may belong to another sequence by then; `free` and `trim` give back only the blocks the
sequence still holds. A prompt may then take its blocks chunk by chunk as it is computed
(`first` at `allocate`, then `grow`), and of its cached prefix only the blocks inside the
window of its first query. So a decoding sequence of any length holds `peak_blocks`, about
W / block_size + 1, at most (besides the slots of its draft), a prompt chunk those of its
tokens and of their window, and a pool smaller than a sequence still serves it. Admission
counts what sequences will hold rather than their length: `can_allocate` the blocks a prompt
holds once computed, `blocks_ahead` those the running sequences take back as they advance.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageMark:
    """Positions start.. start + length - 1 of a sequence hold the feature rows `row`.. of
    its request's image `image` (identified by `digest`; the index is not part of keys)."""

    start: int
    length: int
    row: int
    digest: bytes
    image: int = 0


def image_spans(marks: Sequence[ImageMark]) -> tuple[tuple[int, int], ...]:
    """(start, length) of each image's positions, from its first row to its last, in order."""
    extent: dict[int, tuple[int, int]] = {}
    for mark in marks:
        lo, hi = extent.get(mark.image, (mark.start, mark.start))
        extent[mark.image] = (min(lo, mark.start), max(hi, mark.start + mark.length))
    return tuple(sorted((lo, hi - lo) for lo, hi in extent.values()))


def block_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """The key of a full block: its tokens (and `extra`, what fills rows that are not their
    tokens' embeddings), chained to the key of everything before it."""
    return hashlib.sha256(parent + array("q", tokens).tobytes() + extra).digest()


class BlockKeys:
    """The prefix-cache keys of one sequence's full blocks, each computed once. A sequence's
    tokens only grow, so the chain only grows: a prompt looked up at every step while it
    waits, then admitted, then marked computed block by block (and again after a preemption)
    hashes each of its blocks once. `marks`: the image rows among its positions."""

    def __init__(self, salt: bytes = b"", marks: Sequence[ImageMark] = ()) -> None:
        self.salt = salt
        self.marks = tuple(marks)
        self._keys: list[bytes] = []

    def _extra(self, start: int, end: int) -> bytes:
        """What fills the image rows among positions start.. end - 1: for each mark that
        overlaps them, its digest and the feature row at each end of the overlap."""
        parts = []
        for mark in self.marks:
            lo, hi = max(start, mark.start), min(end, mark.start + mark.length)
            if lo < hi:
                first = mark.row + lo - mark.start
                parts.append(mark.digest + array("q", (lo - start, hi - start, first)).tobytes())
        return b"".join(parts)

    def key(self, index: int, tokens: Sequence[int], block_size: int) -> bytes:
        """The key of full block `index` of `tokens` (the chain grows up to it)."""
        keys = self._keys
        while len(keys) <= index:
            start = len(keys) * block_size
            end = start + block_size
            extra = self._extra(start, end) if self.marks else b""
            keys.append(block_hash(keys[-1] if keys else self.salt, tokens[start:end], extra))
        return keys[index]


@dataclass
class _SeqBlocks:
    tokens: list[int]
    blocks: list[int]
    keys: BlockKeys
    # Leading full blocks whose K/V are computed (and keyed in the cache).
    computed_blocks: int = 0
    # Leading entries of `blocks` given back behind the sliding window: no longer held.
    released: int = 0


@dataclass
class BlockStats:
    """Prompt tokens looked up in the prefix cache and how many were found, cached blocks
    evicted, and blocks given back behind a sliding window."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    released_blocks: int = 0


class BlockManager:
    """Block tables over a pool of `num_blocks` x `block_size` token positions; blocks behind
    a `sliding_window` go back as sequences advance (module doc)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks} "
                f"x {block_size}"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"a sliding window needs >= 1 positions, got {sliding_window}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.sliding_window = sliding_window
        self.stats = BlockStats()
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

    def peak_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` positions holds at once: all of them,
        or with a sliding window, those of one query's window (its own block and the
        blocks the W - 1 positions before it reach into)."""
        whole = self.blocks_for(num_tokens)
        if self.sliding_window is None:
            return whole
        return min(whole, self._window_blocks())

    def can_allocate(
        self,
        token_ids: Sequence[int],
        salt: bytes = b"",
        reserve: int = 0,
        lookup: bool = True,
        keys: BlockKeys | None = None,
        first: int | None = None,
    ) -> bool:
        """Whether a sequence of these prompt tokens fits now, leaving `reserve` blocks free:
        the blocks `allocate` takes (`lookup`, `keys` and `first` as there), and those it holds
        once its prompt is computed: all of them, or with a sliding window those its first
        generated token's window touches (a prompt taken chunk by chunk is not admitted only
        to be preempted when its later chunks find the pool short)."""
        hits = (
            self._cached_prefix(token_ids, keys if keys is not None else BlockKeys(salt))
            if lookup
            else []
        )
        n = len(token_ids)
        held = self._held(n, hits)  # without a window, what allocate takes
        need = held if self.sliding_window is None else max(self._taken(n, hits, first), held)
        return need <= self.free_blocks - reserve

    def can_append(self, seq_ids: Sequence[int]) -> bool:
        """Whether every sequence in `seq_ids` can take one more token now."""
        return self.blocks_to_append(seq_ids) <= self.free_blocks

    def blocks_to_append(self, seq_ids: Sequence[int]) -> int:
        """New blocks one more token for each of `seq_ids` would take (one for a prompt that
        takes its blocks chunk by chunk and lacks some: its next chunk needs one at least)."""
        return sum(1 for s in seq_ids if self._short(self._seqs[s], 1))

    def blocks_ahead(self, seq_ids: Sequence[int]) -> int:
        """Blocks to keep free for `seq_ids` when another sequence is admitted: what one more
        token of each takes, and for one that gives blocks back behind its window, as many as
        bring it to a window's worth (it takes a block for each one it gives back, and without
        them it would be preempted at its next block boundary)."""
        if self.sliding_window is None:
            return self.blocks_to_append(seq_ids)
        window = self._window_blocks()
        total = 0
        for seq_id in seq_ids:
            state = self._seqs[seq_id]
            short = 1 if self._short(state, 1) else 0
            if state.released:
                short = max(short, window - (len(state.blocks) - state.released))
            total += short
        return total

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
        first: int | None = None,
    ) -> int:
        """Give `seq_id` the blocks for its prompt; returns how many leading prompt tokens are
        already in the cache (a multiple of block_size, always fewer than the prompt: the last
        token is computed to get its logits). `lookup=False` takes no cached block (a request
        that wants every prompt position's logits computes them all). `keys`: the sequence's
        own chain of block keys (salted with `salt`), kept by the caller so that no block is
        hashed twice. `first`: slots now for only the first `first` positions to compute
        (after the cached ones); `grow` gives the rest as they are reached. With a sliding
        window, cached blocks wholly before the window of the first query are not taken: they
        stay in the table as released. Raises MemoryError when the pool is short (ask
        `can_allocate` first) and ValueError for a known seq_id or an empty prompt."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not token_ids:
            raise ValueError(f"sequence {seq_id}: an empty prompt needs no blocks")
        keys = keys if keys is not None else BlockKeys(salt)
        hits = self._cached_prefix(token_ids, keys) if lookup else []
        taken = self._taken(len(token_ids), hits, first)
        if taken > self.free_blocks:
            raise MemoryError(
                f"sequence {seq_id} needs {taken} blocks, "
                f"{self.free_blocks} of {self.num_blocks} are free"
            )
        cached = len(hits) * self.block_size
        skipped = self._behind(cached)
        for block in hits[skipped:]:
            self._take_cached(block)
        blocks = hits + [
            self._take_free() for _ in range(self._end(len(token_ids), hits, first) - len(hits))
        ]
        self._seqs[seq_id] = _SeqBlocks(list(token_ids), blocks, keys, len(hits), skipped)
        if self.prefix_caching and lookup:
            self.stats.queried_tokens += len(token_ids)
            self.stats.hit_tokens += cached
        return cached

    def append(self, seq_id: int, token_id: int) -> int:
        """Add one token to `seq_id` (taking a block when it starts one); returns its slot."""
        state = self._seqs[seq_id]
        position = len(state.tokens)
        short = self._short(state, 1)
        if short > self.free_blocks:
            raise MemoryError(f"sequence {seq_id} needs a block, none of {self.num_blocks} is free")
        state.blocks.extend(self._take_free() for _ in range(short))
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

    def grow(self, seq_id: int, end: int, keep: int = 0) -> int:
        """Give `seq_id` slots toward position `end` (exclusive): as many of the blocks it
        lacks as the pool has beyond `keep` free ones. Returns the end of the positions it
        has slots for now (`covered`), which may fall short of `end`."""
        state = self._seqs[seq_id]
        lacking = self.blocks_for(end) - len(state.blocks)
        take = min(lacking, self.free_blocks - keep)
        state.blocks.extend(self._take_free() for _ in range(max(0, take)))
        return self.covered(seq_id)

    def covered(self, seq_id: int) -> int:
        """How many leading positions of `seq_id` its block table maps (released or held)."""
        return len(self._seqs[seq_id].blocks) * self.block_size

    def trim(self, seq_id: int, num_tokens: int | None = None) -> None:
        """Give back the blocks beyond `seq_id`'s first `num_tokens` positions (default: its
        tokens): what `reserve` took and no accepted token filled. They hold no full block of
        tokens, so none is in the prefix cache, and they are after any released one."""
        state = self._seqs[seq_id]
        keep = len(state.tokens) if num_tokens is None else max(num_tokens, len(state.tokens))
        while len(state.blocks) > max(1, state.released, self.blocks_for(keep)):
            self._give_back(state.blocks.pop())

    def mark_computed(self, seq_id: int, num_tokens: int | None = None) -> None:
        """The K/V of the first `num_tokens` tokens (default: all) are now in the cache and
        `seq_id` computes no position before them again: their full blocks become reusable by
        other sequences, and with a sliding window the blocks behind the window of its next
        query go back to the pool."""
        state = self._seqs[seq_id]
        computed = len(state.tokens) if num_tokens is None else num_tokens
        if self.prefix_caching:
            full = computed // self.block_size
            while state.computed_blocks < full:
                index = state.computed_blocks
                key = state.keys.key(index, state.tokens, self.block_size)
                state.computed_blocks += 1
                block = state.blocks[index]
                if key not in self._block_of and block not in self._key_of:
                    self._block_of[key] = block
                    self._key_of[block] = key
        behind = min(self._behind(computed), len(state.blocks))
        while state.released < behind:
            self._give_back(state.blocks[state.released])
            state.released += 1
            self.stats.released_blocks += 1

    def resolve(self, seq_id: int, position: int, token_id: int) -> None:
        """The token at `position` of `seq_id`, appended as a placeholder while the step that
        samples it ran (async scheduling), is `token_id`. Its block has no key yet: keys come
        only with computed positions, and this one is not computed."""
        state = self._seqs.get(seq_id)
        if state is not None and position < len(state.tokens):
            if position < state.computed_blocks * self.block_size:
                raise ValueError(f"sequence {seq_id}: position {position} is keyed already")
            state.tokens[position] = token_id

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """`seq_id` has only its first `num_tokens` tokens again (a placeholder appended for a
        step that failed is gone): the later ones, never computed nor keyed, are forgotten
        and the blocks only they needed go back."""
        state = self._seqs.get(seq_id)
        if state is None or num_tokens >= len(state.tokens):
            return
        if num_tokens < state.computed_blocks * self.block_size:
            raise ValueError(f"sequence {seq_id}: position {num_tokens} is keyed already")
        del state.tokens[num_tokens:]
        self.trim(seq_id, num_tokens)

    def rewind(self, seq_id: int, num_tokens: int) -> None:
        """`seq_id`'s positions from `num_tokens` on were marked computed by a step that then
        failed: the full blocks they completed leave the prefix cache (their K/V is not what
        their keys say) and count as uncomputed again."""
        state = self._seqs.get(seq_id)
        if state is None:
            return
        full = num_tokens // self.block_size
        for index in range(full, state.computed_blocks):
            block = state.blocks[index]
            key = self._key_of.get(block)
            if key is not None and key == state.keys.key(index, state.tokens, self.block_size):
                self._uncache(block)
        state.computed_blocks = min(state.computed_blocks, full)

    def free(self, seq_id: int, reuse: bool = True) -> None:
        """`seq_id` leaves: the blocks it holds go back (cached ones stay cached until
        needed). `reuse` False: what they hold is bad (its forward produced NaN), so every
        block of its table leaves the prefix cache first, and no later sequence finds it
        there."""
        state = self._seqs.pop(seq_id)
        if not reuse:
            for block in state.blocks:
                self._uncache(block)
        # The tail is evicted before the shared head.
        for block in reversed(state.blocks[state.released :]):
            self._give_back(block)

    def block_table(self, seq_id: int) -> list[int]:
        """`seq_id`'s blocks, position p in entry p // block_size (released ones in place)."""
        return list(self._seqs[seq_id].blocks)

    def held_blocks(self, seq_id: int) -> list[int]:
        """The blocks `seq_id` holds: its table less the released entries."""
        state = self._seqs[seq_id]
        return state.blocks[state.released :]

    def released(self, seq_id: int) -> int:
        """How many leading entries of `seq_id`'s table went back behind the window."""
        return self._seqs[seq_id].released

    def num_tokens(self, seq_id: int) -> int:
        return len(self._seqs[seq_id].tokens)

    def slot(self, seq_id: int, position: int) -> int:
        """The flat pool index (block * block_size + offset) of a position of `seq_id`."""
        blocks = self._seqs[seq_id].blocks
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    # --- internals ------------------------------------------------------------------------

    def _window_blocks(self) -> int:
        """The most blocks one query's window touches (a long sequence's steady hold)."""
        assert self.sliding_window is not None
        return self.blocks_for(self.sliding_window - 1) + 1

    def _behind(self, computed: int) -> int:
        """Leading blocks no query at a position >= `computed` reads: those wholly before
        computed - W + 1 (none without a sliding window)."""
        if self.sliding_window is None:
            return 0
        return max(0, computed - self.sliding_window + 1) // self.block_size

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

    def _end(self, num_tokens: int, hits: list[int], first: int | None) -> int:
        """Table entries a new sequence of `num_tokens` prompt positions starts with: all, or
        up to the first `first` positions after the cached `hits`."""
        if first is None:
            return self.blocks_for(num_tokens)
        cached = len(hits) * self.block_size
        return self.blocks_for(min(num_tokens, cached + max(1, first)))

    def _taken(self, num_tokens: int, hits: list[int], first: int | None) -> int:
        """Free blocks `allocate` takes for a new sequence: a hit some sequence uses costs
        nothing, an unused one leaves the free count as a fresh block does, one behind the
        window of the first query is not taken."""
        skipped = self._behind(len(hits) * self.block_size)
        return self._end(num_tokens, hits, first) - skipped - self._in_use(hits[skipped:])

    def _held(self, num_tokens: int, hits: list[int]) -> int:
        """Free blocks a new sequence holds once its prompt is computed: the whole prompt's,
        or with a sliding window those of its first generated token's window."""
        if self.sliding_window is None:
            return self._taken(num_tokens, hits, None)
        behind = self._behind(num_tokens)
        return self.blocks_for(num_tokens + 1) - behind - self._in_use(hits[behind:])

    def _in_use(self, blocks: list[int]) -> int:
        """How many of these cached blocks some sequence holds."""
        return sum(1 for block in blocks if self._refs[block] > 0)

    def _give_back(self, block: int) -> None:
        """Drop one reference to `block`: unused, it is free again, or evictable if cached."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _uncache(self, block: int) -> None:
        """`block` is no prefix-cache entry from now on: free if nothing holds it."""
        key = self._key_of.pop(block, None)
        if key is None:
            return
        del self._block_of[key]
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)

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
