"""Load kinds: closed-loop virtual users (`throughput`), open-loop Poisson arrivals (`rate`), and
the `sweep` that runs one throughput step then rate steps up to the throughput it found.

A step sends sessions (conversations; one turn for single-shot profiles) taken in turn from a
pre-built pool. Requests started during the first `warmup` seconds run like the others but are
left out of the step's records. No new request starts after `warmup + duration`; requests
already running finish (each is bounded by the client's timeouts, so a step always ends).
Cancelling a step cancels every request it started before the cancellation propagates.

    step = await run_rate(client, sessions, rate=4.0, duration=60, warmup=10, seed=0)
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tgis.benchmark.client import RequestRecord
from tgis.benchmark.prompts import Session, Turn

OnRecord = Callable[[RequestRecord], None]


class Sender(Protocol):
    """What a step needs of a client (BenchmarkClient, or a test double)."""

    async def send(
        self, turn: Turn, history: Sequence[tuple[Turn, RequestRecord]] = ()
    ) -> RequestRecord: ...


@dataclass
class StepResult:
    """The measured requests of one step and its time window (perf_counter seconds)."""

    kind: str  # "throughput" or "rate"
    target: float  # virtual users, or requests (sessions) per second
    measure_from: float
    stop_at: float
    records: list[RequestRecord] = field(default_factory=list)
    warmup_requests: int = 0

    @property
    def elapsed(self) -> float:
        """Seconds from the end of the warmup to the last measured request's end (or the
        step's stop time, whichever is later): the denominator of every rate."""
        last = max((r.end for r in self.records), default=self.stop_at)
        return max(last, self.stop_at) - self.measure_from


class _Recorder:
    """Sorts finished requests into warmup and measured ones."""

    def __init__(self, step: StepResult, on_record: OnRecord | None) -> None:
        self.step, self.on_record = step, on_record

    def add(self, record: RequestRecord) -> None:
        if record.start < self.step.measure_from:
            self.step.warmup_requests += 1
        else:
            self.step.records.append(record)
        if self.on_record is not None:
            self.on_record(record)


async def _run_session(
    client: Sender, session: Session, recorder: _Recorder, stop_at: float
) -> None:
    """The turns of one conversation in order, until one fails or the step stops. The first
    turn always goes: the session arrived within the step, and a client that wakes late (a
    loaded machine) must not drop an arrival its schedule made."""
    history: list[tuple[Turn, RequestRecord]] = []
    for index, turn in enumerate(session.turns):
        if index and time.perf_counter() >= stop_at:
            return
        record = await client.send(turn, history)
        record.turn = index
        recorder.add(record)
        if not record.ok:
            return
        history.append((turn, record))


async def _cancel_all(tasks: set[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _pool(sessions: Sequence[Session]) -> Iterator[Session]:
    if not sessions:
        raise ValueError("a step needs at least one session")
    return itertools.cycle(sessions)


def _check(duration: float, warmup: float) -> None:
    if duration <= 0 or warmup < 0:
        raise ValueError(f"need duration > 0 and warmup >= 0, got {duration} and {warmup}")


async def run_throughput(
    client: Sender,
    sessions: Sequence[Session],
    users: int,
    duration: float,
    warmup: float = 0.0,
    on_record: OnRecord | None = None,
) -> StepResult:
    """`users` virtual users, each running sessions back to back (closed loop)."""
    _check(duration, warmup)
    if users < 1:
        raise ValueError(f"users must be at least 1, got {users}")
    pool = _pool(sessions)
    start = time.perf_counter()
    step = StepResult("throughput", users, start + warmup, start + warmup + duration)
    recorder = _Recorder(step, on_record)

    async def user() -> None:
        while time.perf_counter() < step.stop_at:
            await _run_session(client, next(pool), recorder, step.stop_at)

    tasks = {asyncio.ensure_future(user()) for _ in range(users)}
    try:
        await asyncio.gather(*tasks)
    finally:
        await _cancel_all(tasks)
    return step


async def run_rate(
    client: Sender,
    sessions: Sequence[Session],
    rate: float,
    duration: float,
    warmup: float = 0.0,
    seed: int = 0,
    on_record: OnRecord | None = None,
) -> StepResult:
    """Sessions arriving as a Poisson process of `rate` per second (open loop): exponential
    gaps drawn from `random.Random(seed)`, whatever the server's answers."""
    _check(duration, warmup)
    if not 0 < rate < float("inf"):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    pool = _pool(sessions)
    rng = random.Random(seed)
    start = time.perf_counter()
    step = StepResult("rate", rate, start + warmup, start + warmup + duration)
    recorder = _Recorder(step, on_record)
    tasks: set[asyncio.Task[Any]] = set()
    try:
        arrival = start + rng.expovariate(rate)
        while arrival < step.stop_at:
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            tasks.add(
                asyncio.ensure_future(_run_session(client, next(pool), recorder, step.stop_at))
            )
            arrival += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    finally:
        await _cancel_all(tasks)
    return step


async def run_sweep(
    client: Sender,
    sessions: Sequence[Session],
    users: int,
    steps: int,
    duration: float,
    warmup: float = 0.0,
    seed: int = 0,
    on_record: OnRecord | None = None,
) -> list[StepResult]:
    """A throughput step with `users` users, then `steps` rate steps spread evenly up to the
    sessions per second it started (rates max*k/steps for k = 1..steps)."""
    if steps < 1:
        raise ValueError(f"a sweep needs at least 1 rate step, got {steps}")
    first = await run_throughput(client, sessions, users, duration, warmup, on_record)
    results = [first]
    for k, rate in enumerate(sweep_rates(first, steps), start=1):
        results.append(
            await run_rate(client, sessions, rate, duration, warmup, seed + k, on_record)
        )
    return results


def sweep_rates(first: StepResult, steps: int) -> list[float]:
    """The rates of a sweep's rate steps after its throughput step `first`: max*k/steps for
    k = 1..steps, where max is the sessions per second `first` started (first turns that
    succeeded); none when nothing succeeded (there is no rate to sweep up to)."""
    started = sum(1 for r in first.records if r.turn == 0 and r.ok)
    peak = started / first.elapsed if first.elapsed > 0 else 0.0
    return [peak * k / steps for k in range(1, steps + 1)] if peak > 0 else []
