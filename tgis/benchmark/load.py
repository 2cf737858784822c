"""Load kinds: closed-loop virtual users (`throughput`), open-loop Poisson arrivals (`rate`), and
the `sweep` that runs one throughput step then rate steps up to the throughput it found.

A step sends sessions (conversations; one turn for single-shot profiles) taken in turn from a
pre-built pool. Its `StepWindow` says which requests are measured: the warmup lasts `warmup`
seconds and at least `warmup_requests` requests (those run like the others but are left out of
the step's records); then the step measures for `duration` seconds or until `max_requests`
measured requests have started, whichever comes first. No new request starts after that;
requests already running finish (each is bounded by the client's timeouts, so a step always
ends). Cancelling a step cancels every request it started before the cancellation propagates.

    step = await run_rate(client, sessions, 4.0, StepWindow(60, warmup=10), seed=0)
    step = await run_throughput(client, sessions, 8, StepWindow(600, max_requests=200))
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


class StepWindow:
    """Which requests of one step are warmup, which are measured, and when the step stops.

    Made with the step's limits; `begin` starts its clock. The warmup ends once `warmup`
    seconds have passed and `warmup_requests` requests have started; the measured part ends
    `duration` seconds later, or when `max_requests` measured requests have started. Counts
    make a step's size independent of the machine's speed (a loaded machine measures the same
    requests, later); seconds bound it."""

    def __init__(
        self,
        duration: float,
        warmup: float = 0.0,
        *,
        max_requests: int | None = None,
        warmup_requests: int = 0,
    ) -> None:
        if duration <= 0 or warmup < 0:
            raise ValueError(f"need duration > 0 and warmup >= 0, got {duration} and {warmup}")
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"max_requests must be at least 1, got {max_requests}")
        if warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {warmup_requests}")
        self.duration, self.warmup = duration, warmup
        self.max_requests, self.warmup_requests = max_requests, warmup_requests
        self.start = 0.0
        self.warmups = self.measured = 0
        self._counted_at: float | None = None  # when warmup_requests had started
        self._full_at: float | None = None  # when max_requests measured ones had started

    def like(self) -> StepWindow:
        """A fresh window with the same limits (for the next step)."""
        return StepWindow(
            self.duration,
            self.warmup,
            max_requests=self.max_requests,
            warmup_requests=self.warmup_requests,
        )

    def begin(self, now: float) -> None:
        self.start = now
        self._counted_at = now if self.warmup_requests == 0 else None

    @property
    def measure_from(self) -> float | None:
        """When the warmup ended (None while it has not)."""
        if self._counted_at is None:
            return None
        return max(self.start + self.warmup, self._counted_at)

    def closed(self, now: float) -> bool:
        """Whether a request starting at `now` would start after the step stopped."""
        if self._full_at is not None:
            return True
        begun = self.measure_from
        return begun is not None and now >= begun + self.duration

    def admit(self, now: float) -> bool | None:
        """A request starting at `now` (a scheduled arrival: the time it was due): True when
        measured, False when warmup, None when the step has stopped."""
        if self.closed(now):
            return None
        begun = self.measure_from
        if begun is None or now < begun:
            self.warmups += 1
            if self._counted_at is None and self.warmups >= self.warmup_requests:
                self._counted_at = now
            return False
        self.measured += 1
        if self.max_requests is not None and self.measured >= self.max_requests:
            self._full_at = now
        return True

    def result(self, kind: str, target: float, now: float) -> StepResult:
        """An empty StepResult over the window as it stands at `now`: measured from the end of
        the warmup to the stop (the last measured start when the count stopped it)."""
        begun = self.measure_from
        if begun is None:
            begun = max(now, self.start + self.warmup)
        stop = begun + self.duration if self._full_at is None else self._full_at
        return StepResult(kind, target, begun, max(begun, min(stop, now)))


class _Recorder:
    """Sorts finished requests into warmup and measured ones (each flagged when it started)."""

    def __init__(self, step: StepResult, on_record: OnRecord | None) -> None:
        self.step, self.on_record = step, on_record

    def add(self, record: RequestRecord) -> None:
        if record.warmup:
            self.step.warmup_requests += 1
        else:
            self.step.records.append(record)
        if self.on_record is not None:
            self.on_record(record)


async def _run_session(
    client: Sender, session: Session, recorder: _Recorder, window: StepWindow, measured: bool
) -> None:
    """The turns of one conversation in order, until one fails or the step stops. The first
    turn was admitted by the caller (`measured` or warmup): a session that arrived within the
    step always sends it, even when the client wakes late (a loaded machine)."""
    history: list[tuple[Turn, RequestRecord]] = []
    for index, turn in enumerate(session.turns):
        if index:
            admitted = window.admit(time.perf_counter())
            if admitted is None:
                return
            measured = admitted
        record = await client.send(turn, history)
        record.turn, record.warmup = index, not measured
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


def _finish(step: StepResult, window: StepWindow) -> StepResult:
    """The step's records under the window's final bounds."""
    final = window.result(step.kind, step.target, time.perf_counter())
    step.measure_from, step.stop_at = final.measure_from, final.stop_at
    return step


async def run_throughput(
    client: Sender,
    sessions: Sequence[Session],
    users: int,
    window: StepWindow,
    on_record: OnRecord | None = None,
) -> StepResult:
    """`users` virtual users, each running sessions back to back (closed loop)."""
    if users < 1:
        raise ValueError(f"users must be at least 1, got {users}")
    pool = _pool(sessions)
    window.begin(time.perf_counter())
    step = StepResult("throughput", users, window.start, window.start)
    recorder = _Recorder(step, on_record)

    async def user() -> None:
        while (measured := window.admit(time.perf_counter())) is not None:
            await _run_session(client, next(pool), recorder, window, measured)

    tasks = {asyncio.ensure_future(user()) for _ in range(users)}
    try:
        await asyncio.gather(*tasks)
    finally:
        await _cancel_all(tasks)
    return _finish(step, window)


async def run_rate(
    client: Sender,
    sessions: Sequence[Session],
    rate: float,
    window: StepWindow,
    seed: int = 0,
    on_record: OnRecord | None = None,
) -> StepResult:
    """Sessions arriving as a Poisson process of `rate` per second (open loop): exponential
    gaps drawn from `random.Random(seed)`, whatever the server's answers. An arrival is judged
    by its scheduled time, so a client that wakes late still sends what its schedule made."""
    if not 0 < rate < float("inf"):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    pool = _pool(sessions)
    rng = random.Random(seed)
    window.begin(time.perf_counter())
    step = StepResult("rate", rate, window.start, window.start)
    recorder = _Recorder(step, on_record)
    tasks: set[asyncio.Task[Any]] = set()
    try:
        arrival = window.start + rng.expovariate(rate)
        while (measured := window.admit(arrival)) is not None:
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            session = _run_session(client, next(pool), recorder, window, measured)
            tasks.add(asyncio.ensure_future(session))
            arrival += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    finally:
        await _cancel_all(tasks)
    return _finish(step, window)


async def run_sweep(
    client: Sender,
    sessions: Sequence[Session],
    users: int,
    steps: int,
    window: StepWindow,
    seed: int = 0,
    on_record: OnRecord | None = None,
) -> list[StepResult]:
    """A throughput step with `users` users, then `steps` rate steps spread evenly up to the
    sessions per second it started (rates max*k/steps for k = 1..steps); each step has a
    fresh window like `window`."""
    if steps < 1:
        raise ValueError(f"a sweep needs at least 1 rate step, got {steps}")
    first = await run_throughput(client, sessions, users, window.like(), on_record)
    results = [first]
    for k, rate in enumerate(sweep_rates(first, steps), start=1):
        results.append(await run_rate(client, sessions, rate, window.like(), seed + k, on_record))
    return results


def sweep_rates(first: StepResult, steps: int) -> list[float]:
    """The rates of a sweep's rate steps after its throughput step `first`: max*k/steps for
    k = 1..steps, where max is the sessions per second `first` started (first turns that
    succeeded); none when nothing succeeded (there is no rate to sweep up to)."""
    started = sum(1 for r in first.records if r.turn == 0 and r.ok)
    peak = started / first.elapsed if first.elapsed > 0 else 0.0
    return [peak * k / steps for k in range(1, steps + 1)] if peak > 0 else []
