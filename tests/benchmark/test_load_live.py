"""Both load kinds against a real server (uvicorn + FakeEngine) through all three APIs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.benchmark.conftest import SMALL
from tests.server.fakes import FakeEngine
from tgis.benchmark.client import BenchmarkClient, RequestRecord
from tgis.benchmark.load import StepResult, StepWindow, run_rate, run_sweep, run_throughput
from tgis.benchmark.metrics import summarize
from tgis.benchmark.profiles import LengthDistribution
from tgis.benchmark.prompts import Turn, build_sessions

APIS = ["tgi", "openai-chat", "openai-completions"]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def with_client(url: str, api: str, work: Any) -> Any:
    client = BenchmarkClient(url, api=api, model="tiny-llama", request_timeout=10)  # type: ignore[arg-type]
    try:
        return await work(client)
    finally:
        await client.aclose()


def check_successful(step: StepResult) -> None:
    assert step.records, "no request was measured"
    for r in step.records:
        assert r.ok, (r.error, r.error_message)
        assert r.start >= step.measure_from
        # FakeEngine honours max_new_tokens; TGI sends one event per token, OpenAI one chunk
        # per token with text (the tiny tokenizer has tokens that decode to nothing).
        assert r.output_tokens == r.max_new_tokens
        assert 1 <= len(r.token_times) <= r.output_tokens
        assert r.ttft is not None and 0 < r.ttft <= r.latency


@pytest.mark.parametrize("api", APIS)
def test_throughput_step(api: str, server_url: str, tokenizer: Any) -> None:
    sessions = build_sessions(SMALL, tokenizer, 8, seed=0)
    seen: list[RequestRecord] = []

    async def work(client: BenchmarkClient) -> StepResult:
        window = StepWindow(60, max_requests=9, warmup_requests=3)
        return await run_throughput(client, sessions, 3, window, on_record=seen.append)

    step = run(with_client(server_url, api, work))
    check_successful(step)
    assert step.kind == "throughput" and step.target == 3
    assert step.warmup_requests == 3 and len(step.records) == 9
    assert len(seen) == 12 and [r.warmup for r in seen].count(True) == 3
    # The warmup's requests all started before the measured ones.
    assert max(r.start for r in seen if r.warmup) <= min(r.start for r in step.records)
    summary = summarize(step, {"ttft": 5.0})
    assert summary["requests"]["ok"] == len(step.records)
    assert summary["output_tokens"] == sum(r.max_new_tokens for r in step.records)
    assert summary["itl_s"]["p50"] > 0.001  # the engine sleeps 2 ms per token
    assert summary["goodput"]["fraction"] == 1.0
    assert summary["output_tokens_per_s"] > 0


@pytest.mark.parametrize("api", APIS)
def test_rate_step(api: str, server_url: str, tokenizer: Any, engine: FakeEngine) -> None:
    sessions = build_sessions(SMALL, tokenizer, 4, seed=0)

    async def work(client: BenchmarkClient) -> StepResult:
        window = StepWindow(60, max_requests=10, warmup_requests=2)
        return await run_rate(client, sessions, 40.0, window, seed=3)

    step = run(with_client(server_url, api, work))
    check_successful(step)
    assert step.warmup_requests == 2 and len(step.records) == 10
    assert len(engine.requests) == 12


def test_rate_arrivals_are_fixed_by_the_seed(server_url: str, tokenizer: Any) -> None:
    sessions = build_sessions(SMALL, tokenizer, 4, seed=0)

    def arrivals(seed: int) -> int:
        async def work(client: BenchmarkClient) -> int:
            step = await run_rate(client, sessions, 60.0, StepWindow(0.3), seed=seed)
            return len(step.records)

        return run(with_client(server_url, "tgi", work))

    # The exponential gaps of random.Random(seed) at 60/s put 15 arrivals (seed 2) and 9
    # (seed 15) within 0.3 s; the schedule decides, so an arrival the client wakes up for
    # late (a loaded machine) still sends its request.
    assert [arrivals(2), arrivals(15), arrivals(2)] == [15, 9, 15]


def test_chat_turns_carry_history(server_url: str, tokenizer: Any, engine: FakeEngine) -> None:
    chat = SMALL.with_lengths(
        turns=3, prompt=LengthDistribution.fixed(8), decode=LengthDistribution.fixed(5)
    )
    sessions = build_sessions(chat, tokenizer, 1, seed=0)

    async def work(client: BenchmarkClient) -> StepResult:
        # The step stops after 3 requests: the one session's 3 turns.
        return await run_throughput(client, sessions, 1, StepWindow(60, max_requests=3))

    step = run(with_client(server_url, "openai-chat", work))
    first = step.records
    assert len(first) == 3
    assert [r.turn for r in first] == [0, 1, 2]
    turns = sessions[0].turns
    # Each turn's prompt holds the earlier prompts and answers.
    assert first[1].prompt_tokens > first[0].prompt_tokens + turns[1].tokens
    assert all(r.ok and r.text for r in first), first
    lengths = [len(req.input_ids) for req in engine.requests[:3]]
    assert lengths[0] < lengths[1] < lengths[2]


def test_sweep_runs_rate_steps_up_to_the_throughput(server_url: str, tokenizer: Any) -> None:
    sessions = build_sessions(SMALL, tokenizer, 4, seed=0)

    async def work(client: BenchmarkClient) -> list[StepResult]:
        return await run_sweep(client, sessions, 2, 2, StepWindow(60, max_requests=6))

    steps = run(with_client(server_url, "tgi", work))
    assert [s.kind for s in steps] == ["throughput", "rate", "rate"]
    assert [len(s.records) for s in steps] == [6, 6, 6]
    assert steps[2].target == pytest.approx(2 * steps[1].target)
    assert steps[2].target == pytest.approx(
        sum(1 for r in steps[0].records if r.ok) / steps[0].elapsed
    )


def test_client_request_bodies() -> None:
    one, two = Turn("hello", 1, 4), Turn(" again", 1, 5)
    answer = RequestRecord(0.0, 1, 4, text=" world", output_tokens=1)
    tgi = BenchmarkClient("http://x", api="tgi", extra_parameters={"ignore_eos": True})
    assert tgi.body(two, [(one, answer)]) == {
        "inputs": "hello world again",
        "parameters": {"max_new_tokens": 5, "ignore_eos": True},
    }
    chat = BenchmarkClient("http://x", api="openai-chat", model="m").body(two, [(one, answer)])
    assert chat["messages"] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": " world"},
        {"role": "user", "content": " again"},
    ]
    assert chat["stream"] is True and chat["max_tokens"] == 5 and chat["model"] == "m"
    completions = BenchmarkClient("http://x", api="openai-completions").body(one, [])
    assert completions["prompt"] == "hello"
    with pytest.raises(ValueError, match="unknown api 'grpc'"):
        BenchmarkClient("http://x", api="grpc")  # type: ignore[arg-type]


class StallingSender:
    """A test double whose first request holds the event loop past the step's end, as a
    loaded machine can: every arrival after it wakes up late."""

    def __init__(self, stall: float) -> None:
        self.stall = stall
        self.sent = 0

    async def send(self, turn: Turn, history: Any = ()) -> RequestRecord:
        if not self.sent:
            time.sleep(self.stall)
        self.sent += 1
        record = RequestRecord(time.perf_counter(), 1, turn.max_new_tokens)
        record.end = time.perf_counter()
        return record


def test_a_late_wake_up_does_not_drop_scheduled_arrivals(tokenizer: Any) -> None:
    sessions = build_sessions(SMALL, tokenizer, 4, seed=0)
    sender = StallingSender(stall=0.4)
    step = run(run_rate(sender, sessions, 60.0, StepWindow(0.3), seed=2))
    # Seed 2 schedules 15 arrivals within 0.3 s (as above); all wake after the step's end.
    assert sender.sent == 15
    assert len(step.records) == 15
