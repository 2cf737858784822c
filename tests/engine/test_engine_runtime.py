"""The engine's runtime boundaries: the loop on the caller's thread, work sent to the model
thread, tokens handed over once per step and loop, and sequences a consumer ends (a stop
sequence) dropped from the loop."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_engine import (
    PROMPTS,
    collect,
    make_engine,
    request,
    run,
    slots_freed,
    tokenizer,
)
from tgis.engine.live import RequestHandle, deliver, post_step
from tgis.engine.output import SampledToken
from tgis.engine.types import FinishReason, GenerationRequest
from tgis.errors import GenerationError
from tgis.params import GenerateParameters

__all__ = ["tokenizer"]  # the fixture, shared with test_engine


def test_the_loop_runs_on_the_calling_thread_and_takes_calls(
    demo_model_dir: Path, tokenizer: Any
) -> None:
    engine = make_engine(demo_model_dir, tokenizer, start=False)
    assert engine.call(threading.current_thread) is threading.current_thread()  # not running
    ran_on: list[threading.Thread] = []
    answers: list[Any] = []

    def client() -> None:
        try:
            while not engine.healthy():  # until the loop below runs
                time.sleep(0.01)
            ran_on.append(engine.call(threading.current_thread))
            try:
                engine.call(lambda: 1 / 0)
            except ZeroDivisionError as exc:
                answers.append(exc)
            req = request(tokenizer, PROMPTS[0], max_new_tokens=4, ignore_eos=True)
            answers.append(run(collect(engine.generate(req)))[-1].completion)
        finally:
            engine.stop()

    other = threading.Thread(target=client)
    other.start()
    assert engine.run() is True  # returns once the client stopped it
    other.join(10)
    assert ran_on == [threading.main_thread()]  # the call ran on the loop's (this) thread
    assert isinstance(answers[0], ZeroDivisionError)  # the call's failure is the caller's
    assert answers[1] is not None and answers[1].generated_tokens == 4
    with pytest.raises(GenerationError, match="not running"):
        run(collect(engine.generate(request(tokenizer, PROMPTS[0]))))


def test_a_stop_sequence_drops_the_sequence_from_the_loop(
    demo_model_dir: Path, tokenizer: Any
) -> None:
    engine = make_engine(demo_model_dir, tokenizer)
    try:
        probe = run(
            collect(
                engine.generate(request(tokenizer, PROMPTS[0], max_new_tokens=8, ignore_eos=True))
            )
        )
        text = probe[-1].completion.generated_text  # type: ignore[union-attr]
        stop = text.strip()[:2]
        assert stop, text

        async def stopped() -> None:
            req = request(tokenizer, PROMPTS[0], max_new_tokens=200, ignore_eos=True, stop=(stop,))
            events = await collect(engine.generate(req))
            completion = events[-1].completion
            assert completion is not None
            assert completion.finish_reason is FinishReason.STOP_SEQUENCE
            assert completion.generated_tokens < 8
            # The consumer found the stop sequence; the loop drops the sequence at once
            # rather than running it to its 200 tokens.
            await slots_freed(engine, "the stopped sequence still runs in the loop")

        run(stopped())
        assert engine.in_flight == 0
    finally:
        engine.stop()


class RecordingLoop:
    """An event loop stand-in that records `call_soon_threadsafe`."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> None:
        self.calls.append((callback, args))


def test_a_steps_tokens_go_out_in_one_call_per_event_loop() -> None:
    loops = [RecordingLoop(), RecordingLoop()]
    params = GenerateParameters(max_new_tokens=4)
    handles = [
        RequestHandle(GenerationRequest(f"r{i}", (1, 2), params), loops[i % 2], 1)  # type: ignore[arg-type]
        for i in range(5)
    ]
    for i, handle in enumerate(handles):
        handle.pending.append(SampledToken(0, 7 + i, -0.5, 1, [], [], None, 1.0, 0.5, None))
    handles[4].pending.clear()  # a request with nothing this step gets nothing
    post_step(handles)
    assert [len(loop.calls) for loop in loops] == [1, 1]
    ((callback, (batches,)),) = loops[0].calls
    assert callback is deliver
    assert [(h.request.request_id, [t.token_id for t in b]) for h, b in batches] == [
        ("r0", [7]),
        ("r2", [9]),
    ]
    assert all(not h.pending for h in handles)  # handed over once
