"""One request's failure is that request's alone; a dead engine answers everyone and asks to
exit; the batch gauges follow every change."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_engine import PROMPTS, collect, request, run, tokenizer
from tgis.backends.common.device import load_causal_lm
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine import live as live_module
from tgis.engine import output as output_module
from tgis.engine.engine import Engine
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.types import GenerationRequest
from tgis.errors import GenerationError
from tgis.launch import eos_token_ids

__all__ = ["tokenizer"]


class Gauges:
    """An EngineObserver that keeps the last batch state it was told."""

    def __init__(self) -> None:
        self.batch: tuple[int, int, int, int] | None = None

    def on_batch_state(self, *state: int) -> None:
        self.batch = state  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def make_engine(demo_model_dir: Path, tokenizer: Any, **kw: Any) -> Engine:
    model = load_causal_lm(demo_model_dir, torch.device("cpu"), "float32")
    backend = PagedTorchBackend(
        model, max_sequences=8, max_sequence_tokens=256, max_prefill_tokens=256, kv_tokens=2048
    )
    limits = SchedulerLimits(
        max_batch_prefill_tokens=256, max_batch_total_tokens=2048, max_sequences=8
    )
    engine = Engine(backend, tokenizer, limits, 16, eos_token_ids(demo_model_dir, tokenizer), **kw)
    engine.start()
    return engine


def outcomes(engine: Engine, reqs: list[GenerationRequest]) -> list[list[int] | str]:
    """Each request's token ids, or the error it ended with."""

    async def one(r: GenerationRequest) -> list[int] | str:
        try:
            return [e.token.id for e in await collect(engine.generate(r))]
        except GenerationError as exc:
            return str(exc)

    async def together() -> list[list[int] | str]:
        return list(await asyncio.gather(*(one(r) for r in reqs)))

    return run(together())


def batch_of(tokenizer: Any, bad: str | None = None) -> list[GenerationRequest]:
    return [
        request(tokenizer, PROMPTS[i % len(PROMPTS)], bad if i == 2 and bad else f"r{i}",
                max_new_tokens=8, ignore_eos=True)
        for i in range(5)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def expected(demo_model_dir: Path, tokenizer: Any) -> list[list[int] | str]:
    engine = make_engine(demo_model_dir, tokenizer)
    try:
        return outcomes(engine, batch_of(tokenizer))
    finally:
        engine.stop()


@pytest.mark.parametrize(
    "where",
    [
        # The model thread's half (grammar, stop rules) and the consumer's (detokenizing).
        (live_module.LiveSequence, "advance", lambda self: self.handle.request.request_id),
        (output_module.SequenceText, "event", lambda self: self.request.request_id),
    ],
    ids=["model-thread", "consumer"],
)
def test_a_request_failing_after_its_step_fails_alone(
    demo_model_dir: Path,
    tokenizer: Any,
    expected: list[list[int] | str],
    monkeypatch: Any,
    where: tuple[type, str, Any],
) -> None:
    owner, name, request_id = where
    original = getattr(owner, name)
    calls = {"n": 0}

    def failing(self: Any, *args: Any) -> Any:
        if request_id(self) == "bad":
            calls["n"] += 1
            if calls["n"] == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(self, *args)

    monkeypatch.setattr(owner, name, failing)
    engine = make_engine(demo_model_dir, tokenizer)
    try:
        got = outcomes(engine, batch_of(tokenizer, bad="bad"))
        assert "UnicodeDecodeError" in str(got[2])
        assert [g for i, g in enumerate(got) if i != 2] == [
            e for i, e in enumerate(expected) if i != 2
        ]
        assert engine.healthy()
        assert outcomes(engine, batch_of(tokenizer)) == expected  # still serving
    finally:
        engine.stop()


def test_a_request_failing_at_admission_fails_alone(
    demo_model_dir: Path, tokenizer: Any, expected: list[list[int] | str], monkeypatch: Any
) -> None:
    init = live_module.LiveSequence.__init__

    def failing_init(self: Any, seq: Any, handle: Any, *args: Any) -> None:
        if handle.request.request_id == "bad":
            raise OverflowError("injected at admission")
        init(self, seq, handle, *args)

    monkeypatch.setattr(live_module.LiveSequence, "__init__", failing_init)
    engine = make_engine(demo_model_dir, tokenizer)
    try:
        got = outcomes(engine, batch_of(tokenizer, bad="bad"))
        assert "OverflowError: injected at admission" in str(got[2])
        assert [g for i, g in enumerate(got) if i != 2] == [
            e for i, e in enumerate(expected) if i != 2
        ]
        assert engine.healthy() and engine.in_flight == 0
    finally:
        engine.stop()


def test_a_dead_engine_answers_everyone_and_asks_to_exit(
    demo_model_dir: Path, tokenizer: Any
) -> None:
    fatal = threading.Event()
    engine = make_engine(demo_model_dir, tokenizer, on_fatal=fatal.set)
    schedule = engine.scheduler.schedule
    calls = {"n": 0}

    def dying_schedule() -> Any:
        calls["n"] += 1
        if calls["n"] == 5:  # in the middle of the requests' decoding
            raise RuntimeError("the scheduler's state is broken")
        return schedule()

    engine.scheduler.schedule = dying_schedule  # type: ignore[method-assign]
    try:
        got = outcomes(engine, batch_of(tokenizer))
        assert all(isinstance(g, str) and "shutting down" in g for g in got)
        assert fatal.wait(5) and not engine.healthy()
    finally:
        engine.stop()


def test_the_batch_gauge_follows_a_cancel(demo_model_dir: Path, tokenizer: Any) -> None:
    gauges = Gauges()
    engine = make_engine(demo_model_dir, tokenizer, observer=gauges)
    try:
        long = request(tokenizer, PROMPTS[0], "long", max_new_tokens=200, ignore_eos=True)

        async def cancel_after_two() -> None:
            stream = engine.generate(long)
            await stream.__anext__()
            await stream.__anext__()
            assert gauges.batch is not None and gauges.batch[1] == 1  # one running
            await stream.aclose()  # type: ignore[attr-defined]
            for _ in range(100):
                if gauges.batch is not None and gauges.batch[1] == 0:
                    return
                await asyncio.sleep(0.02)

        run(cancel_after_two())
        assert gauges.batch is not None and gauges.batch[1] == 0
    finally:
        engine.stop()


def test_consecutive_failed_steps_make_the_engine_unhealthy_until_one_succeeds(
    demo_model_dir: Path, tokenizer: Any
) -> None:
    engine = make_engine(demo_model_dir, tokenizer)
    forward = engine.backend.forward  # type: ignore[union-attr]

    def broken(items: Any) -> Any:
        raise RuntimeError("the device is gone")

    try:
        engine.backend.forward = broken  # type: ignore[union-attr, method-assign]
        for i in range(3):
            got = outcomes(engine, [request(tokenizer, PROMPTS[0], f"f{i}", max_new_tokens=2)])
            assert "the device is gone" in str(got[0])
        assert not engine.healthy()
        engine.backend.forward = forward  # type: ignore[union-attr, method-assign]
        assert isinstance(outcomes(engine, [request(tokenizer, PROMPTS[0], "ok")])[0], list)
        assert engine.healthy()  # a step succeeded again
    finally:
        engine.stop()
