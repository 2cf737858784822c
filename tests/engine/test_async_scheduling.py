"""Async scheduling (tgis.engine.step_runner.PipelinedSteps) over the simulated device: the next
step is launched before the step in flight's tokens are handed over, a sequence that ends has
its extra token dropped and its blocks back once the step that wrote them is done, grammars
follow their tokens, a failed step is undone and run again alone, and the tokens are the
serial engine's."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tests.factories import tiny_tokenizer
from tgis.backends.simulated import SimulatedBackend
from tgis.engine.backend import BackendCapacity, FedTokens, PackedItem, PackedOutput
from tgis.engine.engine import Engine
from tgis.engine.live import LiveSequence
from tgis.engine.paged_scheduler import PagedScheduler
from tgis.engine.sampling import PendingSample, SamplingBatch
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.step_runner import PackedSteps, PipelinedSteps
from tgis.engine.stream import DeviceStream, SimulatedStream
from tgis.engine.types import FinishReason, GenerationRequest, TokenEvent
from tgis.errors import GenerationError
from tgis.params import GenerateParameters, GrammarSpec

PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24]]


class Recorded(SimulatedBackend):
    """A simulated device that logs each forward's rows once done (and can fail one)."""

    def __init__(self, vocab: int, log: list[str], fail_on: int | None = None) -> None:
        super().__init__(vocab_size=vocab, max_sequences=8, max_sequence_tokens=96)
        self.log, self.fail_on, self.calls = log, fail_on, 0

    def forward(self, items: Sequence[PackedItem], fed: FedTokens | None = None) -> PackedOutput:
        self.calls += 1
        if self.fail_on is not None and self.calls >= self.fail_on and len(items) > 1:
            self.fail_on = None
            self.log.append("failed")
            raise RuntimeError("device lost")
        out = super().forward(items, fed)  # raises where `fed` reads a failed step's ids
        self.log.append(f"forward {len(items)}")
        return out


def engine_over(
    backend: SimulatedBackend, stream: DeviceStream, pipelined: bool | None = None, **kw: Any
) -> Engine:
    tokenizer = kw.pop("tokenizer", None) or tiny_tokenizer()
    limits = SchedulerLimits(
        max_batch_prefill_tokens=256,
        max_batch_total_tokens=backend.capacity.kv_tokens,
        max_sequences=8,
    )
    engine = Engine(
        backend, tokenizer, limits, 16, kw.pop("eos", ()), stream=stream,
        async_scheduling=pipelined, **kw,
    )  # fmt: skip
    engine.start()
    return engine


def generate(
    engine: Engine, prompts: list[list[int]], **params: Any
) -> list[list[TokenEvent] | BaseException]:
    async def one(i: int, prompt: list[int]) -> list[TokenEvent]:
        request = GenerationRequest(
            f"r{i}", tuple(prompt), GenerateParameters(**{"max_new_tokens": 6, **params})
        )
        return [event async for event in engine.generate(request)]

    async def all_of() -> list[Any]:
        coros = (one(i, p) for i, p in enumerate(prompts))
        return list(await asyncio.gather(*coros, return_exceptions=True))

    return asyncio.run(asyncio.wait_for(all_of(), timeout=60))


def ids(results: list[Any]) -> list[list[int]]:
    return [[event.token.id for event in events] for events in results]


def blocks_in_use_once_idle(engine: Engine) -> int:
    """The blocks still held once the runner has no step in flight (2 s at most)."""
    scheduler = engine.scheduler
    assert isinstance(scheduler, PagedScheduler)
    for _ in range(200):
        if not engine.runner.has_work and not scheduler.blocks.used_blocks:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert not engine.runner.has_work, "a step is still in flight"
    return scheduler.blocks.used_blocks


def test_a_simulated_device_schedules_asynchronously_and_a_cpu_does_not() -> None:
    backend = SimulatedBackend(vocab_size=64, max_sequences=8, max_sequence_tokens=96)
    stream = SimulatedStream(step_s=0.0)
    try:
        assert isinstance(engine_over(backend, stream).runner, PipelinedSteps)
        assert type(engine_over(backend, DeviceStream()).runner) is PackedSteps
        assert type(engine_over(backend, stream, speculate=2).runner) is PackedSteps
        with pytest.raises(ValueError, match="cannot verify drafts"):
            engine_over(backend, stream, True, speculate=2)
    finally:
        stream.close()


class HostFed(SimulatedBackend):
    """A simulated device that cannot read tokens on the device (as tensor-parallel shards)."""

    @property
    def capacity(self) -> BackendCapacity:
        return dc_replace(super().capacity, fed_tokens=False)


@pytest.mark.parametrize("on_device", [True, False], ids=["fed-on-device", "host-fed"])
def test_the_next_step_launches_before_the_last_ones_tokens_are_handed_over(
    monkeypatch: pytest.MonkeyPatch, on_device: bool
) -> None:
    """The order the host works in, whatever the machine's speed: each step's forward is
    submitted before the tokens of the step before it are handed over, and a sequence at its
    last token is not planned again (no wasted row). On a device that reads the sampled ids
    itself, the forward goes before the host even has the step before's ids; otherwise it
    waits for them."""
    log: list[str] = []
    original, read = Engine._emit, PendingSample.result

    def emit(self: Engine, lives: Any, *args: Any, **kw: Any) -> None:
        log.append("emit")
        original(self, lives, *args, **kw)

    def ids_read(self: PendingSample) -> Any:
        log.append("ids")
        return read(self)

    class Logged(SimulatedStream):
        def submit(self, work: Any, step: bool = False) -> Any:
            if step:
                log.append("launch")
            return super().submit(work, step)

    monkeypatch.setattr(Engine, "_emit", emit)
    monkeypatch.setattr(PendingSample, "result", ids_read)
    stream = Logged(step_s=0.001)
    kind = SimulatedBackend if on_device else HostFed
    backend = kind(len(tiny_tokenizer()), max_sequences=8, max_sequence_tokens=96)
    engine = engine_over(backend, stream)
    try:
        (events,) = generate(engine, PROMPTS[:1], max_new_tokens=4, ignore_eos=True)
    finally:
        engine.stop()
        stream.close()
    assert len(events) == 4  # type: ignore[arg-type]
    runner = engine.runner
    assert isinstance(runner, PipelinedSteps)
    # The prefill, then each decode step launched before the step before's token goes out.
    if on_device:
        decode = ["launch", "ids", "emit"]
        assert runner.fed_steps == 3
    else:
        decode = ["ids", "launch", "emit"]
        assert runner.fed_steps == 0
    assert log == ["launch", *decode * 3, "ids", "emit"]


def test_async_tokens_equal_the_serial_engines_and_late_stops_drop_the_extra_token() -> None:
    """EOS after a few tokens (greedy over the table), stop at max_new_tokens, sampling with
    seeds and penalties: the async engine hands over exactly the serial engine's events, and
    every block comes back."""
    vocab = len(tiny_tokenizer())
    backend = SimulatedBackend(vocab_size=vocab, max_sequences=8, max_sequence_tokens=96)
    eos = (generate_serial_first_token(backend, PROMPTS[2]),)
    cases = [
        {"max_new_tokens": 6, "ignore_eos": True},
        {"max_new_tokens": 9},  # PROMPTS[2] stops at its first token: EOS
        {"max_new_tokens": 7, "do_sample": True, "seed": 3, "repetition_penalty": 1.3},
    ]
    tokens = []
    for params in cases:
        got = {}
        for pipelined in (False, True):
            stream = SimulatedStream(step_s=0.0) if pipelined else DeviceStream()
            engine = engine_over(backend, stream, pipelined, eos=eos)
            try:
                results = generate(engine, PROMPTS, **params)
                assert blocks_in_use_once_idle(engine) == 0
            finally:
                engine.stop()
                stream.close()
            got[pipelined] = [
                [(e.token.id, e.token.logprob, e.completion and e.completion.finish_reason)
                 for e in events]  # type: ignore[union-attr]
                for events in results
            ]  # fmt: skip
        assert got[True] == got[False], params
        tokens.append([[event[0] for event in events] for events in got[False]])
    assert any(events[-1][2] == FinishReason.EOS_TOKEN for events in got[False])
    # Sampling left the greedy path somewhere (each case's first tokens are compared).
    assert any(s[:6] != g[:6] for s, g in zip(tokens[2], tokens[0], strict=True))


def generate_serial_first_token(backend: SimulatedBackend, prompt: list[int]) -> int:
    """The greedy token the table gives after `prompt` (then used as an EOS id)."""
    return int(backend._table[backend.row(prompt[-1], len(prompt) - 1)].argmax())


def test_a_grammar_row_gets_each_mask_after_its_last_token(demo_model_dir: Path) -> None:
    """A regex grammar under async scheduling (the demo model's tokenizer, which llguidance
    reads): the grammar moves on with each token before the next step's mask is made, so
    every answer matches, as the serial engine's does."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    backend = SimulatedBackend(vocab_size=len(tokenizer), max_sequences=8, max_sequence_tokens=96)
    answers = {}
    for pipelined in (False, True):
        stream = SimulatedStream(step_s=0.0) if pipelined else DeviceStream()
        engine = engine_over(backend, stream, pipelined, tokenizer=tokenizer)
        try:
            results = generate(
                engine, PROMPTS, max_new_tokens=12, grammar=GrammarSpec.regex("[a-c]{3,5}")
            )
        finally:
            engine.stop()
            stream.close()
        answers[pipelined] = [
            tokenizer.decode([e.token.id for e in events if not e.token.special])
            for events in results  # type: ignore[union-attr]
        ]
    assert answers[True] == answers[False]
    for text in answers[True]:
        assert 3 <= len(text) <= 5 and set(text) <= set("abc"), text


def test_a_failed_step_is_undone_and_its_sequences_run_again_alone() -> None:
    """The third forward (a decode step of both) raises: it is undone (its positions
    uncomputed, its placeholders gone) and each sequence's chunk runs alone, so both
    requests still get the tokens they get with nothing failing."""
    vocab = len(tiny_tokenizer())
    expected = ids(generate_with(Recorded(vocab, []), False))
    log: list[str] = []
    got = generate_with(Recorded(vocab, log, fail_on=3), True)
    assert ids(got) == expected
    failed = log.index("failed")
    assert log[failed + 1 : failed + 3] == ["forward 1", "forward 1"]  # each alone


def test_a_step_fed_ids_the_host_did_not_keep_is_dropped_and_planned_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch's sampling raises once, after the next step was launched on its ids (which
    do not exist): that step is dropped (not failed: the only batch run again row by row is
    the one whose sampling raised), planned again, and both requests get the tokens they get
    with nothing failing."""
    vocab = len(tiny_tokenizer())
    expected = ids(generate_with(Recorded(vocab, []), False))
    original = SamplingBatch.launch
    calls = [0]

    def launch(self: SamplingBatch, logits: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("sampling lost")
        return original(self, logits)

    monkeypatch.setattr(SamplingBatch, "launch", launch)
    with caplog.at_level(logging.WARNING, logger="tgis.engine"):
        assert ids(generate_with(Recorded(vocab, []), True)) == expected
    assert calls[0] > 3
    alone = [r.getMessage() for r in caplog.records if "running each alone" in r.getMessage()]
    assert len(alone) == 1 and "sampling lost" in alone[0], alone


class Buffered(Recorded):
    """A device whose logits come back in one buffer that each forward overwrites, as a CUDA
    graph's output does."""

    def __init__(self, vocab: int) -> None:
        super().__init__(vocab, [])
        self.buffer = torch.full((8, vocab), math.nan)

    def forward(self, items: Sequence[PackedItem], fed: FedTokens | None = None) -> PackedOutput:
        out = super().forward(items, fed)
        rows = out.last.shape[0]
        self.buffer[:rows].copy_(out.last)
        return PackedOutput(self.buffer[:rows], out.prompt)


def test_a_choice_the_host_could_not_read_is_not_taken_from_a_later_steps_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading the batch's choice back fails once, after the next step was launched over the
    same output buffer: the step is run again alone (its forward too), not sampled again
    from logits the next step has overwritten, so tokens and logprobs are the serial
    engine's."""
    vocab = len(tiny_tokenizer())
    expected = events_of(generate_with(Recorded(vocab, []), False))
    original = PendingSample.result
    calls = [0]

    def result(self: PendingSample) -> Any:
        calls[0] += 1
        if calls[0] == 2:  # the first decode step's, its successor launched
            raise RuntimeError("the copy down failed")
        return original(self)

    monkeypatch.setattr(PendingSample, "result", result)
    # An inline stream: the next step's forward has run by the time the choice is read.
    stream = DeviceStream()
    engine = engine_over(Buffered(vocab), stream, True)
    try:
        got = generate(engine, PROMPTS[:2], max_new_tokens=5, ignore_eos=True)
    finally:
        engine.stop()
    assert events_of(got) == expected
    assert calls[0] > 2


def events_of(results: list[Any]) -> list[list[tuple[int, float]]]:
    return [[(e.token.id, e.token.logprob) for e in events] for events in results]


def test_a_token_refused_as_it_is_read_back_ends_that_request_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Putting a sampled id in place raises for one request (its grammar refuses it): that
    request fails, its chunk leaves the step planned meanwhile, its blocks go back, and the
    other request gets the tokens it gets with nothing failing."""
    vocab = len(tiny_tokenizer())
    expected = ids(generate_with(Recorded(vocab, []), False))
    original = LiveSequence.resolve

    def resolve(self: LiveSequence, token_id: int) -> None:
        if self.handle.request.request_id == "r1" and self.seq.generated == 3:
            raise ValueError("the grammar refuses the token")
        original(self, token_id)

    monkeypatch.setattr(LiveSequence, "resolve", resolve)
    stream = SimulatedStream(step_s=0.0)
    engine = engine_over(Recorded(vocab, []), stream, True)
    try:
        results = generate(engine, PROMPTS[:2], max_new_tokens=5, ignore_eos=True)
        assert ids(results[:1]) == expected[:1]
        assert isinstance(results[1], GenerationError) and "refuses" in str(results[1])
        assert blocks_in_use_once_idle(engine) == 0
        assert ids(generate(engine, PROMPTS[:1], max_new_tokens=5, ignore_eos=True)) == expected[:1]
    finally:
        engine.stop()
        stream.close()


def generate_with(backend: SimulatedBackend, pipelined: bool) -> list[Any]:
    stream = SimulatedStream(step_s=0.0) if pipelined else DeviceStream()
    engine = engine_over(backend, stream, pipelined)
    try:
        results = generate(engine, PROMPTS[:2], max_new_tokens=5, ignore_eos=True)
    finally:
        engine.stop()
        stream.close()
    assert not any(isinstance(r, BaseException) for r in results), results
    return results


def test_a_cancelled_sequence_in_flight_gives_its_blocks_back_after_its_step() -> None:
    vocab = len(tiny_tokenizer())
    backend = SimulatedBackend(vocab_size=vocab, max_sequences=8, max_sequence_tokens=96)
    stream = SimulatedStream(step_s=0.002)
    engine = engine_over(backend, stream, True)

    async def cancel_after_two() -> None:
        params = GenerateParameters(max_new_tokens=60, ignore_eos=True)
        stream_ = engine.generate(GenerationRequest("c", tuple(PROMPTS[0]), params))
        seen = 0
        async for _ in stream_:
            seen += 1
            if seen == 2:
                break
        await stream_.aclose()  # type: ignore[attr-defined]

    try:
        asyncio.run(cancel_after_two())
        assert blocks_in_use_once_idle(engine) == 0
        # The engine serves on.
        assert len(ids(generate(engine, PROMPTS[:1], max_new_tokens=3, ignore_eos=True))[0]) == 3
    finally:
        engine.stop()
        stream.close()


def test_async_scheduling_needs_a_paged_backend() -> None:
    from tgis.engine.engine import Engine as EngineClass

    class Slot:
        name, device, vocab_size = "slot", "cpu", 10

        @property
        def capacity(self) -> Any:
            from tgis.engine.backend import BackendCapacity

            return BackendCapacity(max_sequences=1, max_sequence_tokens=8, kv_tokens=8,
                                   kv_bytes_per_token=0)  # fmt: skip

    limits = SchedulerLimits(max_batch_prefill_tokens=8, max_batch_total_tokens=8, max_sequences=1)
    with pytest.raises(ValueError, match="async scheduling needs a paged backend"):
        EngineClass(Slot(), tiny_tokenizer(), limits, 1, (), async_scheduling=True)  # type: ignore[arg-type]
