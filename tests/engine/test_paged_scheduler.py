"""tgis.engine.paged_scheduler: packed steps over a block pool, chunked prefill, preemption,
prefix-cache reuse. A fake model loop stands in for the engine: each sampled token is the
sequence's length so far (deterministic, checkable)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from tgis.engine.block_manager import BlockManager
from tgis.engine.paged_scheduler import PackedStep, PagedScheduler
from tgis.engine.scheduler import SchedulerLimits, StepKind
from tgis.engine.sequence import PLACEHOLDER_ID, SeqStatus, Sequence

_ids = itertools.count()


def seq(prompt: int | list[int] = 10, new: int = 10) -> Sequence:
    n = next(_ids)
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    return Sequence(n, f"r{n}", len(tokens), new, token_ids=list(tokens))


def scheduler(
    blocks: int = 64,
    block_size: int = 4,
    prefill: int = 100,
    batch: int | None = None,
    prefix_caching: bool = False,
    soft_cap: int | None = None,
    window: int | None = None,
    logit_rows: int | None = None,
    **admission: float,
) -> PagedScheduler:
    limits = SchedulerLimits(
        max_batch_prefill_tokens=prefill,
        max_batch_total_tokens=blocks * block_size,
        max_sequences=batch or 1000,
        prefill_step_tokens=soft_cap,
        prompt_logit_tokens=logit_rows,
        **admission,  # type: ignore[arg-type]
    )
    return PagedScheduler(
        limits, BlockManager(blocks, block_size, prefix_caching, sliding_window=window)
    )


def run(s: PagedScheduler, step: PackedStep) -> list[Sequence]:
    """What the engine does after a forward: advance, sample, finish; returns the sampled."""
    s.complete(step)
    sampled = []
    for chunk in step.chunks:
        if chunk.sample:
            chunk.seq.token_ids.append(len(chunk.seq.token_ids))
            chunk.seq.generated += 1
            sampled.append(chunk.seq)
            if chunk.seq.remaining_tokens == 0:
                s.finish(chunk.seq)
    return sampled


def drain(s: PagedScheduler, limit: int = 10_000) -> list[PackedStep]:
    steps = []
    while s.has_work and len(steps) < limit:
        step = s.schedule()
        assert step is not None, "work waits but nothing can run"
        steps.append(step)
        run(s, step)
    assert not s.has_work
    return steps


def test_prefill_then_packed_decodes() -> None:
    s = scheduler()
    a, b = seq(6, new=3), seq(9, new=3)
    s.add([a, b])
    first = s.schedule()
    assert first is not None and first.kind is StepKind.PREFILL
    assert [(c.seq, c.start, c.count, c.sample) for c in first.chunks] == [
        (a, 0, 6, True),
        (b, 0, 9, True),
    ]
    assert first.chunks[0].block_table == (0, 1) and first.chunks[1].block_table == (2, 3, 4)
    run(s, first)
    second = s.schedule()
    assert second is not None and second.kind is StepKind.DECODE
    assert [(c.start, c.count) for c in second.chunks] == [(6, 1), (9, 1)]
    assert second.chunks[0].token_ids == (6,)
    run(s, second)
    assert a.computed == 7 and a.token_ids[-1] == 7


def test_a_new_prompt_joins_running_decodes_in_one_step() -> None:
    s = scheduler()
    a = seq(5, new=5)
    s.add([a])
    run(s, s.schedule())  # type: ignore[arg-type]
    b = seq(7)
    s.add([b])
    step = s.schedule()
    assert step is not None and step.kind is StepKind.PREFILL
    assert [(c.seq, c.count) for c in step.chunks] == [(a, 1), (b, 7)]


def test_long_prompt_is_chunked_while_others_decode() -> None:
    s = scheduler(prefill=8)
    a = seq(3, new=20)
    s.add([a])
    run(s, s.schedule())  # type: ignore[arg-type]
    long = seq(20, new=2)
    s.add([long])
    counts = []
    for _ in range(3):
        step = s.schedule()
        assert step is not None
        # a decodes every step; the long prompt advances 8 tokens at a time
        assert step.chunks[0].seq is a and step.chunks[0].count == 1
        counts.append((step.chunks[1].start, step.chunks[1].count, step.chunks[1].sample))
        run(s, step)
    assert counts == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert long.generated == 1 and a.generated == 4


def test_backend_soft_cap_limits_the_prefill_budget() -> None:
    s = scheduler(prefill=100, soft_cap=10)
    s.add([seq(6), seq(6)])
    step = s.schedule()
    assert step is not None and [c.count for c in step.chunks] == [6, 4]


def test_admission_by_free_blocks_in_order() -> None:
    s = scheduler(blocks=6, block_size=4)
    big, small = seq(20, new=4), seq(2, new=2)  # big needs 5 of 6 blocks, then one more
    s.add([big, small])
    step = s.schedule()
    assert step is not None and [c.seq for c in step.chunks] == [big]
    # small (1 block) would fit, but the running decode needs the last free block next
    assert s.waiting[0] is small


def test_batch_size_limit() -> None:
    s = scheduler(batch=2)
    s.add([seq(3), seq(3), seq(3)])
    step = s.schedule()
    assert step is not None and len(step.chunks) == 2 and len(s.waiting) == 1


def test_preemption_recomputes_the_newest_and_loses_nothing() -> None:
    # 8 blocks of 4: three sequences of 8 prompt tokens (2 blocks each) fill 6 blocks; their
    # decodes need more than the pool has, so the newest is preempted and recomputed later.
    s = scheduler(blocks=8, block_size=4)
    seqs = [seq(8, new=8) for _ in range(3)]
    s.add(seqs)
    first = s.schedule()
    assert first is not None and len(first.chunks) == 3
    run(s, first)
    steps = drain(s)
    assert s.preemptions >= 1
    for sq in seqs:
        assert sq.status is SeqStatus.FINISHED and sq.generated == 8
        # the fake model's tokens prove every position was computed in order
        assert sq.token_ids[8:] == list(range(8, 16))
    recomputed = [
        c for st in steps for c in st.chunks if c.start == 0 and c.count > 8
    ]  # a preempted sequence re-runs its prompt and generated tokens
    assert recomputed and all(c.token_ids[:8] == tuple(range(100, 108)) for c in recomputed)
    assert s.blocks.free_blocks == 8


def test_pool_never_overcommitted() -> None:
    s = scheduler(blocks=10, block_size=4, prefill=16)
    seqs = [seq(3 + (i * 7) % 13, new=2 + (i * 5) % 11) for i in range(12)]
    s.add(seqs)
    while s.has_work:
        step = s.schedule()
        assert step is not None
        assert s.blocks.used_blocks <= 10
        for chunk in step.chunks:  # every computed position has a slot
            assert len(chunk.block_table) * 4 >= chunk.start + chunk.count
        run(s, step)
    assert all(sq.generated == sq.max_new_tokens for sq in seqs)


def test_refuses_a_sequence_larger_than_the_pool() -> None:
    s = scheduler(blocks=4, block_size=4)
    with pytest.raises(ValueError, match="can never fit the KV cache of 16 tokens"):
        s.add([seq(10, new=7)])
    assert not s.has_work


def test_prefix_cache_hit_skips_the_shared_blocks() -> None:
    s = scheduler(blocks=32, block_size=4, prefix_caching=True)
    shared = list(range(500, 512))  # 3 full blocks
    a = seq([*shared, 1, 2], new=1)
    s.add([a])
    drain(s)
    b = seq([*shared, 3, 4, 5], new=1)
    s.add([b])
    step = s.schedule()
    assert step is not None and (step.chunks[0].start, step.chunks[0].count) == (12, 3)
    assert s.blocks.stats.hit_tokens == 12


def launch(s: PagedScheduler, step: PackedStep) -> None:
    """What async scheduling does at a launch: the step's positions count as computed, and
    each sampling sequence holds a placeholder for the token being sampled."""
    s.advance(step)
    for chunk in step.chunks:
        if chunk.sample:
            chunk.seq.token_ids.append(PLACEHOLDER_ID)
            chunk.seq.generated += 1


def test_a_launched_step_fills_the_prefix_cache_only_once_it_lands() -> None:
    """Async scheduling: the blocks a launched step writes are no prefix-cache hit for a
    sequence planned while it runs (the step may still fail); once it lands they are."""
    s = scheduler(blocks=32, block_size=4, prefix_caching=True)
    shared = list(range(500, 512))  # 3 full blocks
    a = seq([*shared, 1], new=4)
    s.add([a])
    first = s.schedule()
    assert first is not None
    launch(s, first)
    b = seq([*shared, 2], new=1)
    s.add([b])
    second = s.schedule()  # planned while `first` runs
    assert second is not None and [(c.start, c.count) for c in second.chunks] == [(13, 1), (0, 13)]
    assert s.blocks.stats.hit_tokens == 0
    s.land(first)
    a.token_ids[-1] = 7  # its sampled token in place of the placeholder
    s.blocks.resolve(a.seq_id, 13, 7)
    launch(s, second)
    c = seq([*shared, 3], new=1)
    s.add([c])
    third = s.schedule()
    assert third is not None and (third.chunks[-1].start, third.chunks[-1].count) == (12, 1)
    assert s.blocks.stats.hit_tokens == 12


def test_a_failed_launch_is_rewound_placeholder_and_all() -> None:
    """A launched step that fails: its positions are uncomputed, no block it was to fill is
    keyed, and the block manager forgets the placeholder its sequence held."""
    s = scheduler(blocks=32, block_size=4, prefix_caching=True)
    a = seq(list(range(500, 508)), new=4)  # 2 full blocks
    s.add([a])
    step = s.schedule()
    assert step is not None
    launch(s, step)
    assert s.schedule() is not None  # plans a's decode over the placeholder
    assert s.blocks.num_tokens(a.seq_id) == 9
    a.token_ids.pop()  # the placeholder goes
    a.generated -= 1
    s.rewind(a, 0)
    assert a.computed == 0 and s.blocks.num_tokens(a.seq_id) == 8
    assert len(s.blocks.block_table(a.seq_id)) == 2
    b = seq(list(range(500, 508)), new=1)
    s.add([b])
    again = s.schedule()
    assert again is not None and s.blocks.stats.hit_tokens == 0


def test_no_lookup_for_sequences_that_want_every_prompt_logit() -> None:
    s = scheduler(blocks=32, block_size=4, prefix_caching=True)
    shared = list(range(500, 512))
    s.add([seq([*shared, 1], new=1)])
    drain(s)
    b = seq([*shared, 2], new=1)
    b.cache_lookup = False
    s.add([b])
    step = s.schedule()
    assert step is not None and (step.chunks[0].start, step.chunks[0].count) == (0, 13)


def test_finish_frees_waiting_and_running() -> None:
    s = scheduler()
    a, b = seq(5), seq(5)
    s.add([a])
    s.schedule()
    s.add([b])
    s.finish(a)
    s.finish(b)
    assert not s.has_work and s.blocks.free_blocks == 64
    assert a.status is SeqStatus.FINISHED and b.status is SeqStatus.FINISHED


def test_a_draft_rides_in_the_decode_and_its_rejected_slots_go_back() -> None:
    s = scheduler(blocks=8, block_size=4)
    a = seq(6, new=20)
    s.add([a])
    run(s, s.schedule())  # prefill: 6 prompt tokens, one sampled
    assert len(a.token_ids) == 7 and a.computed == 6
    a.draft = (50, 51, 52)
    step = s.schedule()
    (chunk,) = step.chunks
    assert chunk.draft == (50, 51, 52) and chunk.token_ids == (6, 50, 51, 52)
    assert step.tokens == 4 and a.draft == ()  # the draft is used once
    assert len(chunk.block_table) == 3  # positions 0..9: slots reserved for the draft
    s.complete(step)
    assert a.computed == 7
    # Two draft tokens accepted, then the verifying token: appended as the engine does.
    a.token_ids.extend([50, 51, 99])
    a.generated += 3
    s.accept(a, 2)
    assert a.computed == 9
    nxt = s.schedule()
    assert nxt.chunks[0].token_ids == (99,) and nxt.chunks[0].start == 9
    assert s.blocks.num_tokens(a.seq_id) == 10 and len(nxt.chunks[0].block_table) == 3


def test_no_one_is_preempted_for_the_slots_of_a_rejected_draft() -> None:
    # 5 blocks of 4. a (7 prompt tokens) and b (6) hold 2 blocks each; b's draft takes the
    # last one. Then a's next token starts a block: the pool has one only once b's rejected
    # draft gives its slots back, and nobody is preempted for it.
    s = scheduler(blocks=5, block_size=4)
    a, b = seq(7, new=10), seq(6, new=10)
    s.add([a, b])
    run(s, s.schedule())
    b.draft = (1, 2, 3, 4, 5)  # positions 7..11: a third block
    step = s.schedule()
    assert step.chunks[1].draft and s.blocks.free_blocks == 0
    run(s, step)  # a's new token is at position 8; b's whole draft was rejected
    step = s.schedule()
    assert s.preemptions == 0 and len(step.chunks) == 2
    assert s.blocks.free_blocks == 0 and len(s.blocks.block_table(a.seq_id)) == 3


def admitted(step: PackedStep | None, running: list[Sequence]) -> list[Sequence]:
    assert step is not None
    return [c.seq for c in step.chunks if c.seq not in running]


def test_admission_waits_for_enough_requests_or_enough_steps() -> None:
    """TGI's policy: with 4 running and a ratio of 0.5, new sequences join once 2 wait, or
    once they have waited `max_waiting_tokens` steps."""
    s = scheduler(waiting_served_ratio=0.5, max_waiting_tokens=3)
    running = [seq(4, new=50) for _ in range(4)]
    s.add(running)
    run(s, s.schedule())  # type: ignore[arg-type]
    late = seq(4, new=5)
    s.add([late])
    for _ in range(3):  # held: 1 waits where 2 are needed
        step = s.schedule()
        assert admitted(step, running) == []
        run(s, step)  # type: ignore[arg-type]
    step = s.schedule()  # 3 steps have passed since the last admission: it joins
    assert admitted(step, running) == [late]
    run(s, step)  # type: ignore[arg-type]
    running.append(late)
    pair = [seq(4, new=5), seq(4, new=5)]
    s.add(pair)
    assert admitted(s.schedule(), running) == pair  # 2 wait where 5 x 0.5 = 2 are needed


def test_admission_without_the_policy_is_at_the_next_step() -> None:
    s = scheduler()  # the paged engine's default: ratio 0
    running = [seq(4, new=50) for _ in range(8)]
    s.add(running)
    run(s, s.schedule())  # type: ignore[arg-type]
    late = seq(4, new=5)
    s.add([late])
    assert admitted(s.schedule(), running) == [late]


def test_a_preempted_sequence_is_never_held() -> None:
    s = scheduler(waiting_served_ratio=10.0, max_waiting_tokens=1000)
    first, second = seq(4, new=50), seq(4, new=50)
    s.add([first, second])
    run(s, s.schedule())  # type: ignore[arg-type]
    s._preempt(second)
    assert s.waiting[0] is second and second.generated == 1
    assert admitted(s.schedule(), [first]) == [second]


# --- sliding window: blocks behind it go back -----------------------------------------------


def check_windows(s: PagedScheduler, step: PackedStep, window: int) -> None:
    """Every position a chunk writes or reads (its queries' windows) is in a block its
    sequence holds, and no block is held twice."""
    blocks = s.blocks
    size = blocks.block_size
    held = [b for sq in s.running for b in blocks.held_blocks(sq.seq_id)]
    assert len(held) == len(set(held)) == blocks.used_blocks
    for chunk in step.chunks:
        seq_id = chunk.seq.seq_id
        end = chunk.start + chunk.count + len(chunk.draft)
        assert chunk.block_table == tuple(blocks.block_table(seq_id))
        assert len(chunk.block_table) * size >= end
        first = blocks.released(seq_id)
        for p in range(max(0, chunk.start - window + 1), end):
            assert p // size >= first, f"position {p} of {seq_id} is in a released block"
        assert len(blocks.held_blocks(seq_id)) <= blocks.peak_blocks(end) + (
            -(-(chunk.count + len(chunk.draft)) // size)
        )


def windowed_drain(
    s: PagedScheduler, window: int, watch: Callable[[PackedStep], None] | None = None
) -> list[PackedStep]:
    """`drain`, checking each step (`check_windows`); `watch` sees each step as scheduled."""
    steps = []
    while s.has_work:
        step = s.schedule()
        assert step is not None and len(steps) < 10_000, "work waits but nothing can run"
        check_windows(s, step, window)
        if watch is not None:
            watch(step)
        steps.append(step)
        run(s, step)
    return steps


def test_blocks_behind_the_window_go_back_as_a_sequence_decodes() -> None:
    s = scheduler(blocks=16, block_size=4, window=6)
    a = seq(5, new=40)
    s.add([a])
    held: list[int] = []
    windowed_drain(s, 6, lambda step: held.append(len(s.blocks.held_blocks(a.seq_id))))
    assert a.token_ids[5:] == list(range(5, 45))  # every position computed, in order
    assert len(held) == 40 and max(held) == 3 and held[-1] == 2
    # 45 tokens: the last query (position 44) reads 39..44, blocks 9 and 10 of 0..10
    assert s.blocks.stats.released_blocks == 9
    assert s.blocks.free_blocks == 16 and s.preemptions == 0


def test_a_pool_too_small_for_a_sequence_serves_it_with_a_window() -> None:
    """45 tokens (12 blocks of 4) through a pool of 4 blocks: refused without a window,
    served with one. A 30-token prompt takes its blocks chunk by chunk."""
    with pytest.raises(ValueError, match="can never fit the KV cache of 16 tokens"):
        scheduler(blocks=4, block_size=4).add([seq(5, new=40)])
    s = scheduler(blocks=4, block_size=4, window=6)
    a, b = seq(5, new=40), seq(30, new=10)
    s.add([a, b])
    windowed_drain(s, 6)
    assert a.token_ids[5:] == list(range(5, 45)) and b.token_ids[30:] == list(range(30, 40))
    assert s.blocks.stats.released_blocks > 0 and s.blocks.free_blocks == 4
    with pytest.raises(ValueError, match="can never fit"):
        scheduler(blocks=2, block_size=4, window=6).add([seq(5, new=40)])  # 3 blocks a window


def test_sequences_outgrowing_the_pool_together_preempt_the_newest() -> None:
    """Five sequences of 42 tokens, a pool of 7 blocks (28 tokens): admitted on their short
    prompts, they grow to a window's worth (3 blocks) each, so the newest are preempted and
    recomputed; every token is still that of the fake model."""
    s = scheduler(blocks=7, block_size=4, prefill=8, window=6)
    seqs = [seq(2, new=40) for _ in range(5)]
    s.add(seqs)
    windowed_drain(s, 6)
    assert s.preemptions >= 1
    for sq in seqs:
        assert sq.status is SeqStatus.FINISHED and sq.token_ids[2:] == list(range(2, 42))
    assert s.blocks.free_blocks == 7


def test_a_preempted_sequence_longer_than_the_pool_is_recomputed_chunk_by_chunk() -> None:
    s = scheduler(blocks=5, block_size=4, prefill=8, window=6)
    a = seq(5, new=45)
    s.add([a])
    while len(a.token_ids) < 30:  # 30 tokens: more than the pool's 20 positions
        run(s, s.schedule())  # type: ignore[arg-type]
    s._preempt(a)
    assert a.computed == 0 and s.blocks.free_blocks == 5
    steps = windowed_drain(s, 6)
    # Recomputed 8 tokens a step (the prefill budget) through a pool of 5 blocks: the blocks
    # behind each chunk's window go back before the next chunk takes its own.
    chunks = [(c.start, c.count) for st in steps[:5] for c in st.chunks]
    assert chunks == [(0, 8), (8, 8), (16, 8), (24, 6), (30, 1)]
    assert len(set(steps[3].chunks[0].block_table)) < len(steps[3].chunks[0].block_table)
    assert a.token_ids[5:] == list(range(5, 50)) and s.blocks.free_blocks == 5


def test_drafts_and_their_rejection_under_a_window() -> None:
    """Drafts reserve slots at the tail and rejected ones go back (`trim`), while blocks
    behind the window go back at the head; nothing is given back twice."""
    s = scheduler(blocks=6, block_size=4, window=6)
    a, b = seq(6, new=30), seq(3, new=30)
    s.add([a, b])
    step = s.schedule()
    rounds, verified, rejected = 0, 0, 0
    while s.has_work:
        assert step is not None
        check_windows(s, step, 6)
        s.complete(step)
        for chunk in step.chunks:
            sq = chunk.seq
            if not chunk.sample or sq.status is not SeqStatus.RUNNING:
                continue
            accepted = rounds % (len(chunk.draft) + 1) if chunk.draft else 0
            verified += bool(chunk.draft)
            rejected += len(chunk.draft) - accepted
            # The fake model: the first `accepted` draft tokens were right, then one more.
            n = len(sq.token_ids)
            new = list(range(n, n + accepted + 1))[: sq.remaining_tokens]
            sq.token_ids.extend(new)
            sq.generated += len(new)
            s.accept(sq, min(accepted, len(new) - 1))
            if sq.remaining_tokens == 0:
                s.finish(sq)
            else:
                sq.draft = tuple(range(len(sq.token_ids), len(sq.token_ids) + 3))
        rounds += 1
        step = s.schedule() if s.has_work else None
    assert a.token_ids[6:] == list(range(6, 36)) and b.token_ids[3:] == list(range(3, 33))
    assert verified > 5 and rejected > 5 and s.preemptions == 0
    assert s.blocks.stats.released_blocks > 0 and s.blocks.free_blocks == 6


def test_a_shared_prefix_keeps_its_blocks_for_its_other_owners() -> None:
    s = scheduler(blocks=16, block_size=4, prefix_caching=True, window=6)
    shared = list(range(500, 508))  # 2 full blocks
    a, b = seq([*shared, 1], new=20), seq([*shared, 2], new=20)
    s.add([a])
    run(s, s.schedule())  # a's prompt is computed: its 2 full blocks are cached
    s.add([b])
    step = s.schedule()
    assert (step.chunks[1].start, step.chunks[1].count) == (8, 1)
    head = s.blocks.block_table(a.seq_id)[:2]
    assert s.blocks.block_table(b.seq_id)[:2] == head
    run(s, step)  # a has computed 10 tokens, b 9
    for _ in range(3):
        run(s, s.schedule())  # type: ignore[arg-type]
    # a (13 computed) is past the shared head; b (12) still reads its second block and keeps
    # it, which a's release did not free.
    assert s.blocks.released(a.seq_id) == 2 and s.blocks.released(b.seq_id) == 1
    assert head[1] in s.blocks.held_blocks(b.seq_id)
    assert head[0] not in s.blocks.held_blocks(a.seq_id) + s.blocks.held_blocks(b.seq_id)
    windowed_drain(s, 6)
    assert a.token_ids[9:] == list(range(9, 29)) and b.token_ids[9:] == list(range(9, 29))
    assert s.blocks.free_blocks == 16


def test_no_window_changes_nothing() -> None:
    """The same workload with and without `sliding_window=None`: the same steps, block for
    block, and no block given back before its sequence leaves."""

    def trace(**kw: int | None) -> list[tuple[tuple[int, int, tuple[int, ...]], ...]]:
        s = scheduler(blocks=8, block_size=4, prefill=6, **kw)  # type: ignore[arg-type]
        seqs = [seq(8, new=8) for _ in range(3)]
        s.add(seqs)
        out = []
        while s.has_work:
            step = s.schedule()
            assert step is not None
            for sq in s.running:
                assert s.blocks.released(sq.seq_id) == 0
            out.append(tuple((c.start, c.count, c.block_table) for c in step.chunks))
            run(s, step)
        assert s.preemptions >= 1 and s.blocks.stats.released_blocks == 0
        return out

    assert trace() == trace(window=None)


def test_prompt_logit_chunks_share_the_steps_logit_rows() -> None:
    """Prompts that want logits at every position take at most `prompt_logit_tokens` of them
    per step between them; a plain prompt takes the rest of the prefill budget, and a waiting
    prompt that wants logits is admitted (in order) once a step has rows left for it."""
    s = scheduler(prefill=100, logit_rows=8)
    a, b, c = seq(20, new=2), seq(10, new=4), seq(6, new=2)
    a.prompt_logits = c.prompt_logits = True
    s.add([a, b, c])
    shapes = []
    for _ in range(3):
        step = s.schedule()
        assert step is not None
        shapes.append([(chunk.seq, chunk.count) for chunk in step.chunks])
        run(s, step)
    assert shapes == [
        [(a, 8), (b, 10)],  # c waits: the step's 8 logit rows are a's
        [(a, 8), (b, 1)],
        [(a, 4), (b, 1), (c, 4)],  # a's last 4 rows leave c 4
    ]
    rest = drain(s)
    assert [[(chunk.seq, chunk.count) for chunk in step.chunks] for step in rest] == [
        [(a, 1), (b, 1), (c, 2)],
        [(c, 1)],
    ]
    assert all(x.status is SeqStatus.FINISHED for x in (a, b, c))
    # Once its prompt is computed, a sequence's decodes and recomputation take no logit rows.
    assert not s._logits(a)


def test_a_bad_prompt_logit_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logit_tokens must be >= 1, got 0"):
        scheduler(logit_rows=0)
