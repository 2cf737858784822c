"""tgis.engine.block_manager: block tables, admission by free blocks, prefix caching."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

import tgis.engine.block_manager as bm
from tgis.engine.block_manager import BlockKeys, BlockManager, ImageMark, block_hash


def test_module_is_pure_python() -> None:
    tree = ast.parse(Path(bm.__file__).read_text())
    imported = {
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert not {m for m in imported if m and m.split(".")[0] in ("torch", "numpy", "tgis")}


def test_block_table_and_slots() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    assert m.allocate(0, list(range(10))) == 0
    assert m.block_table(0) == [0, 1, 2] and m.free_blocks == 5
    assert m.allocate(1, [7, 7]) == 0
    assert m.block_table(1) == [3]
    # position p -> block table[p // 4], offset p % 4
    assert [m.slot(0, p) for p in (0, 3, 4, 9)] == [0, 3, 4, 9]
    assert [m.slot(1, p) for p in (0, 1)] == [12, 13]
    assert m.append(0, 5) == 10 and m.append(0, 5) == 11  # fills block 2
    assert m.append(0, 5) == 16 and m.block_table(0) == [0, 1, 2, 4]  # crosses into a new block
    assert m.num_tokens(0) == 13 and m.used_blocks == 5


def test_admission_by_free_blocks() -> None:
    m = BlockManager(num_blocks=4, block_size=4)
    assert m.can_allocate([1] * 16) and not m.can_allocate([1] * 17)
    m.allocate(0, [1] * 12)
    assert m.can_allocate([2] * 4) and not m.can_allocate([2] * 5)
    assert not m.can_allocate([2] * 4, reserve=1)  # room kept for running decodes
    with pytest.raises(MemoryError, match="needs 2 blocks, 1 of 4 are free"):
        m.allocate(1, [2] * 5)
    assert 1 not in m and m.free_blocks == 1  # a refused allocation takes nothing


def test_append_needs_a_block_only_at_a_boundary() -> None:
    m = BlockManager(num_blocks=2, block_size=4)
    m.allocate(0, [1, 2, 3])
    m.allocate(1, [1, 2, 3, 4])
    assert m.blocks_to_append([0, 1]) == 1  # seq 1 is at a boundary, seq 0 is not
    assert not m.can_append([0, 1]) and m.can_append([0])
    m.append(0, 9)
    with pytest.raises(MemoryError, match="needs a block"):
        m.append(1, 9)
    assert m.num_tokens(1) == 4  # nothing changed


def test_free_returns_every_block() -> None:
    m = BlockManager(num_blocks=6, block_size=2)
    rng = random.Random(0)
    live: list[int] = []
    for step in range(300):
        if live and (rng.random() < 0.3 or not m.can_allocate([0] * 5)):
            m.free(live.pop(rng.randrange(len(live))))
        else:
            m.allocate(step, [0] * rng.randint(1, 5))
            live.append(step)
        owned = [b for s in live for b in m.block_table(s)]
        assert len(owned) == len(set(owned)) == m.used_blocks  # no block given twice
    for s in live:
        m.free(s)
    assert m.free_blocks == 6


def test_errors_name_the_sequence() -> None:
    m = BlockManager(4, 4)
    m.allocate(3, [1])
    with pytest.raises(ValueError, match="sequence 3 already has blocks"):
        m.allocate(3, [1])
    with pytest.raises(ValueError, match="sequence 4: an empty prompt"):
        m.allocate(4, [])
    with pytest.raises(ValueError, match="needs num_blocks >= 1 and block_size >= 1, got 0 x 4"):
        BlockManager(0, 4)


# --- prefix caching -----------------------------------------------------------------------

PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4 and 2 more


def test_shared_prefix_reuses_computed_blocks_only() -> None:
    m = BlockManager(num_blocks=10, block_size=4, prefix_caching=True)
    assert m.allocate(0, PROMPT) == 0
    # Not computed yet: nothing to share (the first prefill has not written it).
    assert m.allocate(1, PROMPT) == 0
    m.free(1)
    m.mark_computed(0)
    assert m.allocate(2, [*PROMPT[:8], 1, 2, 3]) == 8
    assert m.block_table(2)[:2] == m.block_table(0)[:2]
    assert m.block_table(2)[2] not in m.block_table(0)
    assert (m.stats.queried_tokens, m.stats.hit_tokens) == (10 + 10 + 11, 8)


def test_a_different_earlier_block_or_salt_breaks_the_chain() -> None:
    m = BlockManager(num_blocks=12, block_size=4, prefix_caching=True)
    m.allocate(0, PROMPT)
    m.mark_computed(0)
    changed_first = [999, *PROMPT[1:]]  # same second block, different first: no hit
    assert m.allocate(1, changed_first) == 0
    assert m.allocate(2, PROMPT, salt=b"prefix-a") == 0  # another tuned prefix: no hit
    assert block_hash(b"", [1, 2]) != block_hash(b"x", [1, 2])


def test_the_last_prompt_token_is_always_computed() -> None:
    m = BlockManager(num_blocks=10, block_size=4, prefix_caching=True)
    m.allocate(0, PROMPT[:8])
    m.mark_computed(0)
    # The whole 8-token prompt is cached, but its logits need the last token run again.
    assert m.allocate(1, PROMPT[:8]) == 4
    assert m.allocate(2, PROMPT[:9]) == 8


def test_cached_blocks_outlive_their_sequence_until_space_is_needed() -> None:
    m = BlockManager(num_blocks=4, block_size=4, prefix_caching=True)
    m.allocate(0, PROMPT)  # 3 blocks
    m.mark_computed(0)
    m.free(0)
    assert m.free_blocks == 4  # cached blocks count as free
    assert m.allocate(1, PROMPT) == 8 and m.stats.evicted_blocks == 0
    m.free(1)
    m.allocate(2, [5] * 16)  # needs all four: evicts the cached ones
    assert m.stats.evicted_blocks == 2
    m.free(2)
    assert m.allocate(3, PROMPT) == 0  # gone from the cache


def test_eviction_is_least_recently_used() -> None:
    m = BlockManager(num_blocks=7, block_size=2, prefix_caching=True)
    a, b = [1, 1, 1, 1, 9], [2, 2, 2, 2, 9]  # two full blocks each, cached once computed
    for seq, prompt in ((0, a), (1, b)):
        m.allocate(seq, prompt)
        m.mark_computed(seq)
    m.free(0)
    m.free(1)  # a's blocks were released first: least recently used
    m.allocate(2, [7, 7, 7])  # never-used blocks are taken before cached ones
    assert m.stats.evicted_blocks == 0
    m.allocate(3, [8, 8, 8])  # one free block left, then a's tail block is evicted
    assert m.stats.evicted_blocks == 1
    assert m.allocate(4, b) == 4  # b is intact; its third block evicts a's first
    assert m.stats.evicted_blocks == 2
    m.free(4)
    assert m.allocate(5, a) == 0


def test_a_shared_block_is_freed_only_by_its_last_user() -> None:
    m = BlockManager(num_blocks=5, block_size=4, prefix_caching=True)
    m.allocate(0, PROMPT)
    m.mark_computed(0)
    m.allocate(1, PROMPT)
    shared = m.block_table(0)[:2]
    assert m.block_table(1)[:2] == shared and m.free_blocks == 1
    m.free(0)
    assert m.free_blocks == 2  # seq 0's own last block; the shared two stay with seq 1
    assert m.can_allocate(PROMPT)  # the shared two are in use: one new block suffices
    m.free(1)
    assert m.free_blocks == 5


def test_decoded_tokens_fill_blocks_that_become_shareable() -> None:
    m = BlockManager(num_blocks=8, block_size=4, prefix_caching=True)
    m.allocate(0, [1, 2, 3])
    m.mark_computed(0)
    for token in (4, 5, 6):
        m.append(0, token)
    m.mark_computed(0, 6)  # the newest token is not fed yet
    assert m.allocate(1, [1, 2, 3, 4, 5, 6]) == 4


def test_caching_off_never_shares() -> None:
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate(0, PROMPT)
    m.mark_computed(0)
    assert m.allocate(1, PROMPT) == 0
    assert m.stats.queried_tokens == 0


def test_a_sequences_blocks_are_hashed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt looked up while it waits, then admitted, then marked computed, then (after a
    preemption) admitted again: each of its full blocks is hashed once, with the keys a fresh
    lookup computes."""
    hashed: list[tuple[int, ...]] = []

    def counting(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
        hashed.append(tuple(tokens))
        return block_hash(parent, tokens, extra)

    prompt = list(range(40))  # 10 full blocks of 4, the last token in the 10th
    blocks = BlockManager(num_blocks=12, block_size=4, prefix_caching=True)
    blocks.allocate(0, list(range(100, 140)))  # holds the pool: the prompt must wait
    monkeypatch.setattr(bm, "block_hash", counting)
    keys = bm.BlockKeys(b"salt")
    for _ in range(3):  # three scheduling passes while it waits
        assert not blocks.can_allocate(prompt, keys=keys)
    blocks.free(0)
    assert blocks.can_allocate(prompt, keys=keys)
    blocks.allocate(1, prompt, keys=keys)
    blocks.mark_computed(1)
    blocks.free(1)  # preempted
    assert blocks.allocate(1, prompt, keys=keys) == 36  # its own blocks, found again
    assert sorted(hashed) == sorted(tuple(prompt[i : i + 4]) for i in range(0, 40, 4))
    monkeypatch.undo()
    fresh = BlockManager(num_blocks=12, block_size=4, prefix_caching=True)
    fresh.allocate(2, prompt, salt=b"salt")
    fresh.mark_computed(2)
    fresh.free(2)
    assert fresh.allocate(3, prompt, salt=b"salt") == 36  # the same keys without a chain


# --- sliding window ------------------------------------------------------------------------

W = 6  # a query at position p reads positions p - 5 .. p


def advance(m: BlockManager, seq_id: int, count: int) -> None:
    """Decode `count` tokens: each is appended, then its K/V computed (as the scheduler does)."""
    for _ in range(count):
        m.append(seq_id, 7)
        m.mark_computed(seq_id, m.num_tokens(seq_id))


def test_blocks_behind_the_window_go_back_as_a_sequence_advances() -> None:
    m = BlockManager(num_blocks=8, block_size=4, sliding_window=W)
    m.allocate(0, list(range(8)))
    m.mark_computed(0, 8)  # the next query (position 8) reads 3..8: block 0 is still read
    assert m.released(0) == 0 and m.free_blocks == 6
    m.append(0, 8)
    m.mark_computed(0, 9)  # position 9 reads 4..9: block 0 (positions 0..3) goes back
    assert m.released(0) == 1 and m.stats.released_blocks == 1
    assert m.block_table(0) == [0, 1, 2] and m.held_blocks(0) == [1, 2]
    assert m.free_blocks == 6  # block 2 was taken for position 8, block 0 came back
    for _ in range(40):
        advance(m, 0, 1)
        n = m.num_tokens(0)
        table, released = m.block_table(0), m.released(0)
        assert len(table) == m.blocks_for(n)  # positions keep mapping to table[p // 4]
        # Exactly the blocks wholly before the next query's window went back.
        assert all((i + 1) * 4 - 1 < n - W + 1 for i in range(released))
        assert all((i + 1) * 4 - 1 >= n - W + 1 for i in range(released, len(table)))
        assert m.used_blocks == len(m.held_blocks(0)) <= m.peak_blocks(n) == 3
    assert m.num_tokens(0) == 49 and m.stats.released_blocks == m.released(0) == 11
    assert m.slot(0, 48) == m.block_table(0)[12] * 4  # a released id is reused at the tail


def test_released_blocks_are_never_given_back_twice() -> None:
    m = BlockManager(num_blocks=6, block_size=4, sliding_window=W)
    m.allocate(0, list(range(5)))
    advance(m, 0, 20)
    assert m.released(0) > 0
    assert m.reserve(0, 6)  # speculative slots at the tail, then rejected
    m.trim(0)
    assert m.used_blocks == len(m.held_blocks(0))
    m.free(0)
    assert m.free_blocks == 6  # the released ids in its table were not freed again
    m.allocate(1, [1] * 24)  # the whole pool: six distinct blocks
    assert sorted(m.block_table(1)) == list(range(6)) and not m.can_allocate([1])


def test_held_blocks_stay_distinct_through_reserve_trim_and_free() -> None:
    m = BlockManager(num_blocks=12, block_size=2, sliding_window=3)
    rng = random.Random(1)
    live: list[int] = []
    for step in range(400):
        roll = rng.random()
        if live and roll < 0.15:
            m.free(live.pop(rng.randrange(len(live))))
        elif roll < 0.3 and m.can_allocate([0] * 3):
            m.allocate(step, [0] * 3)
            m.mark_computed(step, 3)
            live.append(step)
        elif live:
            seq_id = rng.choice(live)
            if m.can_append([seq_id]):
                advance(m, seq_id, 1)
            if rng.random() < 0.5:
                m.reserve(seq_id, rng.randint(1, 4))
            else:
                m.trim(seq_id)
        held = [b for s in live for b in m.held_blocks(s)]
        assert len(held) == len(set(held)) == m.used_blocks
    assert m.stats.released_blocks > 0
    for s in live:
        m.free(s)
    assert m.free_blocks == 12


def test_a_shared_prefix_block_keeps_its_other_owners() -> None:
    m = BlockManager(num_blocks=8, block_size=4, prefix_caching=True, sliding_window=W)
    m.allocate(0, PROMPT)  # 10 tokens: blocks 0, 1, 2
    m.mark_computed(0, 8)  # two full blocks cached; position 8 still reads block 0
    assert m.allocate(1, PROMPT) == 8
    shared = m.block_table(0)[:2]
    assert m.block_table(1)[:2] == shared
    free = m.free_blocks
    m.mark_computed(1, 10)  # seq 1 is past block 0: it drops its reference only
    assert m.released(1) == 1 and m.free_blocks == free
    assert shared[0] in m.held_blocks(0)
    m.mark_computed(0, 10)  # its last owner leaves it too: cached, so evictable, not lost
    assert m.free_blocks == free + 1
    m.free(0)
    m.free(1)
    assert m.free_blocks == 8 and m.stats.evicted_blocks == 0
    # A released cached block is found again like any freed cached block.
    assert m.allocate(2, PROMPT) == 8 and m.block_table(2)[:2] == shared


def test_cached_blocks_behind_the_first_querys_window_are_not_taken() -> None:
    m = BlockManager(num_blocks=8, block_size=4, prefix_caching=True, sliding_window=W)
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks cached, the last token not
    m.allocate(0, prompt)
    m.mark_computed(0)
    m.free(0)
    released = m.stats.released_blocks
    assert m.can_allocate(prompt, first=1)
    assert m.allocate(1, prompt, first=1) == 16
    # The first query (position 16) reads 11..16: blocks 2, 3 and the new block 4.
    assert m.block_table(1)[:4] == [0, 1, 2, 3] and m.released(1) == 2
    assert m.held_blocks(1) == [2, 3, 4] and m.used_blocks == 3
    assert m.stats.released_blocks == released  # never taken, so never given back
    m.free(1)
    assert m.free_blocks == 8


def test_a_prompt_takes_its_blocks_chunk_by_chunk() -> None:
    m = BlockManager(num_blocks=3, block_size=4, sliding_window=W)
    prompt = list(range(30))  # 8 blocks' worth in a pool of 3
    assert not m.can_allocate(prompt) and m.can_allocate(prompt, first=1)
    assert m.allocate(0, prompt, first=5) == 0
    assert m.covered(0) == 8 and m.free_blocks == 1
    computed = 0
    while computed < len(prompt):
        end = m.grow(0, len(prompt))  # as far as the pool allows
        assert end > computed
        computed = min(end, len(prompt))
        m.mark_computed(0, computed)
        assert len(m.held_blocks(0)) <= m.peak_blocks(len(prompt)) == 3
    assert m.covered(0) == 32 and m.released(0) == 6
    assert m.grow(0, 40, keep=1) == 32  # one free block, kept back


def test_a_window_as_long_as_the_sequence_releases_nothing() -> None:
    m = BlockManager(num_blocks=8, block_size=4, sliding_window=32)
    m.allocate(0, [1] * 5)
    advance(m, 0, 27)
    assert m.released(0) == 0 and m.stats.released_blocks == 0 and m.used_blocks == 8


def test_no_window_releases_nothing() -> None:
    m = BlockManager(num_blocks=8, block_size=4, sliding_window=None)
    assert m.peak_blocks(100) == 25
    m.allocate(0, [1] * 5)
    advance(m, 0, 27)
    assert m.block_table(0) == list(range(8)) == m.held_blocks(0)
    assert m.released(0) == 0 and m.stats.released_blocks == 0 and m.free_blocks == 0
    assert m.can_allocate([1] * 4, first=1) is False  # `first` takes a block all the same
    m.free(0)
    assert m.free_blocks == 8


def test_a_window_needs_a_position() -> None:
    with pytest.raises(ValueError, match="sliding window needs >= 1 positions, got 0"):
        BlockManager(4, 4, sliding_window=0)


def test_image_rows_key_blocks_by_the_image_they_hold() -> None:
    """Placeholder tokens are alike whatever image fills them: a block holding image rows is
    keyed by the image's digest and which of its rows it holds, so a prompt with another
    image (or the same image elsewhere) shares only the blocks before it."""
    prompt = [5] * 4 + [9] * 8 + [6] * 4  # blocks of 4: text, image, image, text
    first = BlockKeys(b"", [ImageMark(4, 8, 0, b"red")])
    same = BlockKeys(b"", [ImageMark(4, 8, 0, b"red")])
    other = BlockKeys(b"", [ImageMark(4, 8, 0, b"blue")])
    shifted = BlockKeys(b"", [ImageMark(4, 4, 0, b"red"), ImageMark(8, 4, 8, b"red")])
    keys = [[k.key(i, prompt, 4) for i in range(4)] for k in (first, same, other, shifted)]
    assert keys[0] == keys[1]
    assert keys[2][0] == keys[0][0] and keys[2][1] != keys[0][1] and keys[2][3] != keys[0][3]
    assert keys[3][1] == keys[0][1] and keys[3][2] != keys[0][2]
    # A text prompt of the same ids shares nothing past its text.
    plain = BlockKeys(b"")
    assert plain.key(0, prompt, 4) == keys[0][0] and plain.key(1, prompt, 4) != keys[0][1]
