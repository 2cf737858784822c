"""The engine over the paged cpu backend (the bundled demo model, float32): packed steps,
chunked prefill, preemption and prefix caching seen from the requests' side."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.engine.test_engine import PROMPTS, collect, hf_model, request, run, tokenizer
from tgis.backends.paged_torch import PagedTorchBackend
from tgis.backends.torch_device import load_causal_lm
from tgis.engine.engine import Engine
from tgis.engine.paged_scheduler import PagedScheduler
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.types import GenerationRequest
from tgis.launch import eos_token_ids
from tgis.server import Metrics

__all__ = ["hf_model", "tokenizer"]  # fixtures shared with test_engine


def make_engine(
    demo_model_dir: Path,
    tokenizer,
    kv_tokens: int = 16 * 256,
    prefill_tokens: int = 2048,
    prefix_caching: bool = True,
    observer: Metrics | None = None,
) -> Engine:
    model = load_causal_lm(demo_model_dir, torch.device("cpu"), "float32")
    backend = PagedTorchBackend(
        model,
        max_sequences=16,
        max_sequence_tokens=256,
        max_prefill_tokens=prefill_tokens,
        kv_tokens=kv_tokens,
    )
    limits = SchedulerLimits(
        max_batch_prefill_tokens=prefill_tokens,
        max_batch_total_tokens=backend.capacity.kv_tokens,
        max_sequences=16,
        prefill_step_tokens=backend.capacity.prefill_step_tokens,
    )
    engine = Engine(
        backend,
        tokenizer,
        limits,
        64,
        eos_token_ids(demo_model_dir, tokenizer),
        observer,
        prefix_caching=prefix_caching,
    )
    engine.start()
    return engine


def paged(engine: Engine) -> PagedScheduler:
    assert isinstance(engine.scheduler, PagedScheduler)
    return engine.scheduler


def tokens_of(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    async def together() -> list[list[int]]:
        results = await asyncio.gather(*(collect(engine.generate(r)) for r in requests))
        return [[e.token.id for e in events] for events in results]

    return run(together())


def test_greedy_equals_generate_alone_and_in_a_chunked_batch(
    demo_model_dir: Path, tokenizer, hf_model
) -> None:
    """Prompts prefilled 8 tokens at a time while the others decode: every request gets the
    tokens transformers' generate gives it alone."""
    reqs = [
        request(tokenizer, PROMPTS[i], f"r{i}", max_new_tokens=12, ignore_eos=True)
        for i in range(8)
    ]
    reference = []
    with torch.no_grad():
        for r in reqs:
            out = hf_model.generate(
                torch.tensor([r.input_ids]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            reference.append(out[0, len(r.input_ids) :].tolist())
    engine = make_engine(demo_model_dir, tokenizer, prefill_tokens=8, prefix_caching=False)
    try:
        assert [tokens_of(engine, [r])[0] for r in reqs] == reference
        assert tokens_of(engine, reqs) == reference
        assert paged(engine).blocks.used_blocks == 0
    finally:
        engine.stop()


def test_preemption_loses_no_request_and_changes_no_token(demo_model_dir: Path, tokenizer) -> None:
    """A pool of 288 tokens for 8 requests that need up to ~60 each: the newest are preempted
    and recomputed; every request completes with the tokens it gets alone."""
    reqs = [
        request(tokenizer, PROMPTS[i], f"r{i}", max_new_tokens=48, ignore_eos=True)
        for i in range(8)
    ]
    engine = make_engine(demo_model_dir, tokenizer, kv_tokens=288, prefix_caching=False)
    try:
        alone = [tokens_of(engine, [r])[0] for r in reqs]
        assert paged(engine).preemptions == 0
        assert tokens_of(engine, reqs) == alone
        assert paged(engine).preemptions > 0
        assert paged(engine).blocks.used_blocks == 0
    finally:
        engine.stop()


def test_prefix_cache_hits_in_metrics_and_identical_tokens(demo_model_dir: Path, tokenizer) -> None:
    shared = "\n".join(PROMPTS)  # several blocks of 16 tokens
    first = request(tokenizer, shared + "\nclass A:", "a", max_new_tokens=8, ignore_eos=True)
    second = request(tokenizer, shared + "\ndef b():", "b", max_new_tokens=8, ignore_eos=True)
    metrics = Metrics()
    cold = make_engine(demo_model_dir, tokenizer, prefix_caching=False)
    warm = make_engine(demo_model_dir, tokenizer, observer=metrics)
    try:
        expected = tokens_of(cold, [second])[0]
        tokens_of(warm, [first])
        assert tokens_of(warm, [second])[0] == expected  # from cached blocks, the same tokens
        stats = paged(warm).blocks.stats
    finally:
        cold.stop()
        warm.stop()
    common = 0
    while first.input_ids[common] == second.input_ids[common]:
        common += 1
    assert stats.hit_tokens == common // 16 * 16 > 0
    text = metrics.render().decode()
    assert f"tgis_prefix_cache_hit_tokens_total {float(stats.hit_tokens)}" in text
    assert f"tgis_prefix_cache_queried_tokens_total {float(stats.queried_tokens)}" in text
    assert "tgis_kv_cache_usage 0.0" in text


def test_prompt_logprobs_over_chunks_equal_one_pass(demo_model_dir: Path, tokenizer) -> None:
    req = request(tokenizer, PROMPTS[2], max_new_tokens=2, details=True, decoder_input_details=True)
    whole = make_engine(demo_model_dir, tokenizer)
    chunked = make_engine(demo_model_dir, tokenizer, prefill_tokens=5)
    try:
        a = run(collect(whole.generate(req)))[-1].completion
        b = run(collect(chunked.generate(req)))[-1].completion
    finally:
        whole.stop()
        chunked.stop()
    assert a is not None and b is not None
    assert [t.id for t in b.prefill] == list(req.input_ids)
    for x, y in zip(a.prefill[1:], b.prefill[1:], strict=True):
        assert y.logprob == pytest.approx(x.logprob, abs=1e-4)


def test_cancel_gives_the_blocks_back(demo_model_dir: Path, tokenizer) -> None:
    engine = make_engine(demo_model_dir, tokenizer, prefix_caching=False)

    async def cancel_after_two() -> None:
        stream = engine.generate(request(tokenizer, PROMPTS[0], max_new_tokens=200))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.aclose()  # type: ignore[attr-defined]

    try:
        run(cancel_after_two())
        deadline = 200
        while paged(engine).has_work and deadline:
            deadline -= 1
            run(asyncio.sleep(0.02))
        assert not paged(engine).has_work and paged(engine).blocks.used_blocks == 0
    finally:
        engine.stop()
