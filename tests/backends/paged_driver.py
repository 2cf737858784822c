"""A greedy generation loop over a paged backend and the engine's pure-Python scheduler: the
engine's step cycle without its threads and text, to test backends on exact token ids."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine.backend import PackedItem, PagedBackend
from tgis.engine.block_manager import BlockManager
from tgis.engine.paged_scheduler import PagedScheduler
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.sequence import Sequence as SchedSeq
from tgis.engine.types import LoraAdapter


def paged(
    model: PreTrainedModel,
    blocks: int = 32,
    block_size: int = 4,
    max_sequences: int = 16,
    max_sequence_tokens: int = 64,
    prefill: int = 64,
    packed_weights: bool = False,
) -> PagedTorchBackend:
    """A paged backend over `model` with an explicit pool of `blocks` blocks (no memory
    probing); its projections over oneDNN-packed weights with `packed_weights` (the model's
    own then move to the meta device: compute references first)."""
    return PagedTorchBackend(
        model,
        max_sequences=max_sequences,
        max_sequence_tokens=max_sequence_tokens,
        max_prefill_tokens=prefill,
        kv_tokens=blocks * block_size,
        block_size=block_size,
        packed_weights=packed_weights,
    )


def scheduler_for(
    backend: PagedBackend,
    prefill_tokens: int = 512,
    prefix_caching: bool = False,
    max_batch: int | None = None,
    sliding_window: bool = False,
) -> PagedScheduler:
    """`sliding_window`: the pool gives back the blocks behind the backend's sliding window
    (`capacity.sliding_window`), as the engine's does."""
    cap = backend.capacity
    assert cap.block_size is not None
    limits = SchedulerLimits(
        max_batch_prefill_tokens=prefill_tokens,
        max_batch_total_tokens=cap.kv_tokens,
        max_sequences=max_batch or cap.max_sequences,
        prefill_step_tokens=cap.prefill_step_tokens,
    )
    window = cap.sliding_window if sliding_window else None
    blocks = BlockManager(cap.num_blocks, cap.block_size, prefix_caching, sliding_window=window)
    return PagedScheduler(limits, blocks)


def greedy(
    backend: PagedBackend,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    scheduler: PagedScheduler | None = None,
    adapters: Sequence[LoraAdapter | None] | None = None,
) -> list[list[int]]:
    """Greedy tokens after each prompt, all requests submitted at once; `adapters`: the
    LoRA adapter of each prompt's request."""
    sched = scheduler or scheduler_for(backend)
    seqs = [
        SchedSeq(i, f"r{i}", len(p), new_tokens, token_ids=list(p)) for i, p in enumerate(prompts)
    ]
    sched.add(seqs)
    steps = 0
    while sched.has_work:
        step = sched.schedule()
        assert step is not None and steps < 10_000
        steps += 1
        out = backend.forward(
            [
                PackedItem(
                    c.seq.seq_id,
                    c.token_ids,
                    c.start,
                    c.block_table,
                    c.sample,
                    adapter=adapters[c.seq.seq_id] if adapters else None,
                )
                for c in step.chunks
            ]
        )
        sched.complete(step)
        sampled = [c.seq for c in step.chunks if c.sample]
        for seq, token in zip(sampled, out.last.argmax(-1).tolist(), strict=True):
            seq.token_ids.append(token)
            seq.generated += 1
            if seq.generated == new_tokens:
                sched.finish(seq)
    return [s.token_ids[s.prompt_len :] for s in seqs]
