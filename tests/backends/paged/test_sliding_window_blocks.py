"""Blocks behind a sliding window go back to the pool (tgis.engine.block_manager) while the real
paged backend computes: a tiny random mistral with a 6-token window over blocks of 4 serves
sequences whose lengths add up to several times the pool, together, and its greedy tokens stay
those of `generate`. Every test builds its own model: the backend takes the model's weights
(fused views)."""

from __future__ import annotations

from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, VARIANTS, greedy_reference
from tests.backends.paged_driver import greedy, paged, scheduler_for
from tests.factories import tiny_model
from tgis.engine.paged_scheduler import PagedScheduler

WINDOW = 6
NEW = 30
# A pool of 12 blocks of 4: 48 positions, the longest sequence's length (the backend holds
# one whole sequence at least). Each sequence holds 3 blocks at most once its window slides.
BLOCKS = 12
LONGEST = 48
SHARED = tuple(range(40, 52))  # 3 blocks of 4
# Prompts whose 30 greedy tokens never have EOS on top: generate (min_new_tokens) passes it by.
PROMPTS_30 = (*PROMPTS[1:], (7, 7, 9, 200, 31), (9, 99, 199))


def fresh(variant: str = "llama", seed: int = 0, **overrides: object) -> PreTrainedModel:
    arch, fields = VARIANTS[variant]
    return tiny_model(arch, seed=seed, **{**fields, **overrides})  # type: ignore[arg-type]


def windowed() -> PreTrainedModel:
    return fresh("mistral", seed=2, sliding_window=WINDOW)


def test_the_backend_reports_its_window() -> None:
    assert paged(windowed()).capacity.sliding_window == WINDOW
    assert paged(fresh("llama", seed=1)).capacity.sliding_window is None


def test_sequences_far_longer_than_the_pool_give_the_tokens_of_generate() -> None:
    """Four sequences of 32 to 43 tokens (143 in all) through 48 positions: giving blocks back,
    they run together without a preemption; keeping them, the same pool must preempt. The
    tokens are generate's either way."""
    model = windowed()
    prompts = list(PROMPTS_30)
    reference = [greedy_reference(model, p, NEW) for p in prompts]
    backend = paged(model, blocks=BLOCKS, max_sequence_tokens=LONGEST)
    assert sum(len(p) + NEW for p in prompts) > 2 * BLOCKS * 4

    sched = scheduler_for(backend, sliding_window=True)
    batch = watch_batch(sched)
    assert greedy(backend, prompts, NEW, sched) == reference
    assert sched.blocks.stats.released_blocks > 0 and sched.preemptions == 0
    assert max(batch) == len(prompts)  # all four at once
    assert sched.blocks.free_blocks == BLOCKS

    whole = scheduler_for(backend)
    assert greedy(backend, prompts, NEW, whole) == reference
    assert whole.blocks.stats.released_blocks == 0 and whole.preemptions > 0


def test_chunked_prefill_preemption_and_prefix_cache_under_the_window() -> None:
    """Prompts chunked by 5 tokens, three sharing a cached prefix of 3 blocks, then eight
    sequences at once: the short prompts are admitted on a block each and outgrow the pool
    as their windows fill, so the newest are preempted and recomputed chunk by chunk; the
    shared prefix's blocks are found in the cache though the first sequence released them.
    The tokens stay those of generate."""
    model = windowed()
    prompts = [
        (*SHARED, 8, 9, 10),
        (*SHARED, 99),
        (*SHARED, 5, 6, 7, 8),
        (200, 11),
        (7, 7, 9),
        (9, 99, 199),
        (17, 4),
        (60, 61, 62),
        (128, 5),
    ]
    reference = [greedy_reference(model, p, NEW) for p in prompts]
    backend = paged(model, blocks=BLOCKS, max_sequence_tokens=LONGEST)
    sched = scheduler_for(backend, prefill_tokens=5, prefix_caching=True, sliding_window=True)
    assert greedy(backend, prompts[:1], NEW, sched) == reference[:1]
    assert greedy(backend, prompts[1:], NEW, sched) == reference[1:]
    stats = sched.blocks.stats
    assert stats.released_blocks > 0 and stats.hit_tokens >= 2 * len(SHARED)
    assert sched.preemptions > 0
    assert sched.blocks.free_blocks == BLOCKS


def watch_batch(sched: PagedScheduler) -> list[int]:
    """The number of running sequences after each step `sched` schedules."""
    sizes: list[int] = []
    schedule = sched.schedule

    def counting() -> object:
        step = schedule()
        sizes.append(len(sched.running))
        return step

    sched.schedule = counting  # type: ignore[method-assign]
    return sizes
