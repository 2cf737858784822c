"""Run the steps of one `tgis benchmark` kind with a live rich display, keeping what each step
measured so that an interrupted run (Ctrl-C) still has results.

    run = BenchmarkRun(client, sessions, kind="sweep", window=StepWindow(30, warmup=5),
                       max_vus=32, rates=[], num_rates=5, seed=0)
    try:
        asyncio.run(run.execute(console))
    except KeyboardInterrupt:
        pass
    steps = run.steps()     # finished steps, then the interrupted one if it measured anything
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from tgis.benchmark.client import RequestRecord
from tgis.benchmark.load import (
    Sender,
    StepResult,
    StepWindow,
    run_rate,
    run_throughput,
    sweep_rates,
)
from tgis.benchmark.prompts import Session

KINDS = ("throughput", "rate", "sweep")


@dataclass
class _Current:
    """The step under way: what the live display shows and what Ctrl-C keeps."""

    kind: str
    target: float
    start: float
    window: StepWindow
    records: list[RequestRecord] = field(default_factory=list)
    output_tokens: int = 0

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.output_tokens += record.output_tokens

    def partial(self) -> StepResult:
        """A StepResult of the requests finished so far (the step's window cut at now)."""
        step = self.window.result(self.kind, self.target, time.perf_counter())
        for record in self.records:
            if record.warmup:
                step.warmup_requests += 1
            else:
                step.records.append(record)
        return step


def _label(kind: str, target: float) -> str:
    return f"{int(target)} users" if kind == "throughput" else f"{target:.2f} req/s"


class BenchmarkRun:
    """The steps of one kind against one client; `steps()` is valid at any time."""

    def __init__(
        self,
        client: Sender,
        sessions: Sequence[Session],
        kind: str,
        window: StepWindow,
        max_vus: int,
        rates: Sequence[float],
        num_rates: int,
        seed: int,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}: choose one of {', '.join(KINDS)}")
        self.client, self.sessions, self.kind = client, sessions, kind
        self.window, self.seed = window, seed
        self.max_vus, self.rates, self.num_rates = max_vus, list(rates), num_rates
        self.finished: list[StepResult] = []
        self.current: _Current | None = None

    def steps(self) -> list[StepResult]:
        """Finished steps, then the step under way when it has measured requests."""
        steps = list(self.finished)
        if self.current is not None:
            partial = self.current.partial()
            if partial.records:
                steps.append(partial)
        return steps

    async def execute(self, console: Console | None = None) -> list[StepResult]:
        """Run every step of the kind, showing progress on `console` (none when None)."""
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[clock]}"),
            TextColumn("{task.fields[requests]} requests"),
            TextColumn("{task.fields[tps]} tok/s"),
            console=console or Console(quiet=True),
            transient=False,
        )
        with progress:
            if self.kind == "throughput":
                await self._step(progress, "throughput", self.max_vus, 0)
            elif self.kind == "rate":
                for k, rate in enumerate(self.rates):
                    await self._step(progress, "rate", rate, k)
            else:
                first = await self._step(progress, "throughput", self.max_vus, 0)
                for k, rate in enumerate(sweep_rates(first, self.num_rates), start=1):
                    await self._step(progress, "rate", rate, k)
        return self.finished

    async def _step(self, progress: Progress, kind: str, target: float, index: int) -> StepResult:
        window = self.window.like()
        total = window.warmup + window.duration
        task = progress.add_task(
            f"{kind} {_label(kind, target)}", total=total, clock="", requests=0, tps="0"
        )
        current = _Current(kind, target, time.perf_counter(), window)
        self.current = current
        ticker = asyncio.ensure_future(self._tick(progress, task, current, total))
        try:
            if kind == "throughput":
                step = await run_throughput(
                    self.client, self.sessions, int(target), window, current.add
                )
            else:
                step = await run_rate(
                    self.client, self.sessions, target, window, self.seed + index, current.add
                )
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            self._show(progress, task, current, total)
        self.finished.append(step)
        self.current = None
        return step

    @staticmethod
    def _show(progress: Progress, task: TaskID, current: _Current, total: float) -> None:
        now = time.perf_counter()
        elapsed = now - current.start
        begun = current.window.measure_from
        phase = " warmup" if begun is None or now < begun else ""
        progress.update(
            task,
            completed=min(elapsed, total),
            clock=f"{elapsed:.0f}/{total:.0f}s{phase}",
            requests=f"{len(current.records)}/{current.window.max_requests}"
            if current.window.max_requests is not None
            else len(current.records),
            tps=f"{current.output_tokens / elapsed:.1f}" if elapsed > 0 else "0",
        )

    async def _tick(
        self, progress: Progress, task: TaskID, current: _Current, total: float
    ) -> None:
        while True:
            self._show(progress, task, current, total)
            await asyncio.sleep(0.2)
