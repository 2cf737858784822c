"""The engine over the paged cpu backend (the bundled demo model, float32): packed steps,
chunked prefill, preemption and prefix caching seen from the requests' side."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_engine import (
    PROMPTS,
    collect,
    hf_model,
    request,
    run,
    slots_freed,
    tokenizer,
)
from tgis.backends.common.device import load_causal_lm
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine.engine import Engine
from tgis.engine.paged_scheduler import PagedScheduler
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.step_runner import PipelinedSteps
from tgis.engine.types import FinishReason, GenerationRequest
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
    async_scheduling: bool | None = None,
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
        async_scheduling=async_scheduling,
    )
    engine.start()
    return engine


# Each request's tokens and events are the same whether a step is planned after the one
# before it is handed over (serial, a CPU's default) or while it runs (async scheduling, an
# accelerator's: the CPU runs it too, its forward inline).
SCHEDULING = pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "async"])


def paged(engine: Engine) -> PagedScheduler:
    assert isinstance(engine.scheduler, PagedScheduler)
    return engine.scheduler


def tokens_of(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    async def together() -> list[list[int]]:
        results = await asyncio.gather(*(collect(engine.generate(r)) for r in requests))
        return [[e.token.id for e in events] for events in results]

    return run(together())


@SCHEDULING
def test_greedy_equals_generate_alone_and_in_a_chunked_batch(
    demo_model_dir: Path, tokenizer, hf_model, pipelined: bool
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
    engine = make_engine(
        demo_model_dir, tokenizer, prefill_tokens=8, prefix_caching=False,
        async_scheduling=pipelined,
    )  # fmt: skip
    try:
        assert [tokens_of(engine, [r])[0] for r in reqs] == reference
        assert tokens_of(engine, reqs) == reference
        if pipelined:  # its decode steps read the ids the step before sampled on the device
            assert isinstance(engine.runner, PipelinedSteps) and engine.runner.fed_steps > 0
        run(slots_freed(engine, "a finished sequence still holds its blocks"))
        assert paged(engine).blocks.used_blocks == 0
    finally:
        engine.stop()


@SCHEDULING
def test_preemption_loses_no_request_and_changes_no_token(
    demo_model_dir: Path, tokenizer, pipelined: bool
) -> None:
    """A pool of 288 tokens for 8 requests that need up to ~60 each: the newest are preempted
    and recomputed; every request completes with the tokens it gets alone."""
    reqs = [
        request(tokenizer, PROMPTS[i], f"r{i}", max_new_tokens=48, ignore_eos=True)
        for i in range(8)
    ]
    engine = make_engine(
        demo_model_dir, tokenizer, kv_tokens=288, prefix_caching=False,
        async_scheduling=pipelined,
    )  # fmt: skip
    try:
        alone = [tokens_of(engine, [r])[0] for r in reqs]
        assert paged(engine).preemptions == 0
        assert tokens_of(engine, reqs) == alone
        assert paged(engine).preemptions > 0
        run(slots_freed(engine, "a finished sequence still holds its blocks"))
        assert paged(engine).blocks.used_blocks == 0
    finally:
        engine.stop()


@SCHEDULING
def test_preempted_requests_keep_their_prompt_details_and_stop_sequences(
    demo_model_dir: Path, tokenizer, pipelined: bool
) -> None:
    """Requests recomputed after a preemption, their prompts prefilled in chunks, hand the
    same events over as alone: prompt logprobs (taken chunk by chunk, once), token texts, and
    a stop sequence the consumer finds."""
    reqs = [
        request(tokenizer, PROMPTS[i], f"r{i}", max_new_tokens=40, ignore_eos=True,
                decoder_input_details=True, top_n_tokens=2, stop=("__init__(",))
        for i in range(8)
    ]  # fmt: skip

    def events_of(engine: Engine, requests: list[GenerationRequest]) -> list[list[Any]]:
        async def together() -> list[list[Any]]:
            return list(await asyncio.gather(*(collect(engine.generate(r)) for r in requests)))

        return [
            [(e.token, e.text, e.top_tokens, e.prefill, e.prefill_top) for e in events]
            + [events[-1].completion.finish_reason, events[-1].completion.generated_text]
            for events in run(together())
        ]

    engine = make_engine(demo_model_dir, tokenizer, kv_tokens=288, prefill_tokens=8,
                         prefix_caching=False, async_scheduling=pipelined)  # fmt: skip
    try:
        alone = [events_of(engine, [r])[0] for r in reqs]
        assert paged(engine).preemptions == 0
        together = events_of(engine, reqs)
        assert paged(engine).preemptions > 0
        for got, want in zip(together, alone, strict=True):
            assert got[-2:] == want[-2:]  # finish reason (a stop sequence) and text
            assert len(got) == len(want)
            for (token, text, top, prefill, prefill_top), expected in zip(
                got[:-2], want[:-2], strict=True
            ):
                assert (token.id, token.text, text) == (
                    expected[0].id,
                    expected[0].text,
                    expected[1],
                )
                # Logprobs of a batched step may differ from a lone one in the last bits.
                assert token.logprob == pytest.approx(expected[0].logprob, abs=1e-4)
                assert [t.id for t in top] == [t.id for t in expected[2]]
                assert [(t.id, t.rank) for t in prefill] == [(t.id, t.rank) for t in expected[3]]
                assert [t.logprob for t in prefill] == pytest.approx(
                    [t.logprob for t in expected[3]], abs=1e-4
                )
                assert [[t.id for t in alts] for alts in prefill_top] == [
                    [t.id for t in alts] for alts in expected[4]
                ]
            assert got[0][3]  # the prompt's details came with the first token, once
        reasons = {got[-2] for got in together}
        assert FinishReason.STOP_SEQUENCE in reasons and FinishReason.LENGTH in reasons
        # A sequence its consumer stopped is dropped by the loop's next step.
        run(slots_freed(engine, "a stopped sequence still holds its blocks"))
        assert paged(engine).blocks.used_blocks == 0
    finally:
        engine.stop()


@SCHEDULING
def test_prefix_cache_hits_in_metrics_and_identical_tokens(
    demo_model_dir: Path, tokenizer, pipelined: bool
) -> None:
    shared = "\n".join(PROMPTS)  # several blocks of 16 tokens
    first = request(tokenizer, shared + "\nclass A:", "a", max_new_tokens=8, ignore_eos=True)
    second = request(tokenizer, shared + "\ndef b():", "b", max_new_tokens=8, ignore_eos=True)
    metrics = Metrics()
    cold = make_engine(demo_model_dir, tokenizer, prefix_caching=False)
    warm = make_engine(demo_model_dir, tokenizer, observer=metrics, async_scheduling=pipelined)
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


@SCHEDULING
def test_prompt_logprobs_over_chunks_equal_one_pass(
    demo_model_dir: Path, tokenizer, pipelined: bool
) -> None:
    req = request(tokenizer, PROMPTS[2], max_new_tokens=2, details=True, decoder_input_details=True)
    whole = make_engine(demo_model_dir, tokenizer)
    chunked = make_engine(demo_model_dir, tokenizer, prefill_tokens=5, async_scheduling=pipelined)
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


@SCHEDULING
def test_cancel_gives_the_blocks_back(demo_model_dir: Path, tokenizer, pipelined: bool) -> None:
    engine = make_engine(
        demo_model_dir, tokenizer, prefix_caching=False, async_scheduling=pipelined
    )

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
        while engine.runner.has_work and deadline:
            deadline -= 1
            run(asyncio.sleep(0.02))
        assert not engine.runner.has_work and paged(engine).blocks.used_blocks == 0
    finally:
        engine.stop()
