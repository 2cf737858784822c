"""The engine's step runners, without a model: which one a backend gets, what a sequence that
leaves gives back, and what each reports for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tgis.engine.backend import BackendCapacity
from tgis.engine.engine import Engine
from tgis.engine.paged_scheduler import PagedScheduler
from tgis.engine.scheduler import Scheduler, SchedulerLimits
from tgis.engine.sequence import SeqStatus, Sequence
from tgis.engine.step_runner import PackedSteps, SlotSteps


@dataclass
class FakeBackend:
    """What the engine and its runners read of a backend before any step runs."""

    capacity: BackendCapacity
    name: str = "fake"
    released: list[int] = field(default_factory=list)

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


@dataclass
class StateRecorder:
    """The observer's state calls, by name."""

    calls: list[str] = field(default_factory=list)

    def on_batch_state(self, *figures: int) -> None:
        self.calls.append("batch")

    def on_kv_state(self, *figures: int) -> None:
        self.calls.append("kv")


def engine_over(block_size: int | None) -> tuple[Engine, FakeBackend]:
    capacity = BackendCapacity(
        max_sequences=4,
        max_sequence_tokens=64,
        kv_tokens=256,
        kv_bytes_per_token=1,
        block_size=block_size,
    )
    backend = FakeBackend(capacity)
    limits = SchedulerLimits(
        max_batch_prefill_tokens=64, max_batch_total_tokens=256, max_sequences=4
    )
    return Engine(backend, None, limits, 4, [2]), backend  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("block_size", "runner", "scheduler", "kv"),
    [(None, SlotSteps, Scheduler, []), (16, PackedSteps, PagedScheduler, ["kv"])],
)
def test_the_block_size_picks_the_runner_and_what_it_reports(
    block_size: int | None, runner: type, scheduler: type, kv: list[str]
) -> None:
    engine, _ = engine_over(block_size)
    assert type(engine.runner) is runner and type(engine.scheduler) is scheduler
    assert engine.runner.speculates is (block_size is not None)
    observer = StateRecorder()
    engine.runner.report_state(observer)  # type: ignore[arg-type]
    assert observer.calls == ["batch", *kv]


def test_a_slot_sequence_frees_its_backend_slot_only_once_it_ran() -> None:
    engine, backend = engine_over(None)
    running, waiting = (Sequence(i, f"r{i}", 4, 4, token_ids=[5] * 4) for i in range(2))
    engine.scheduler.add([running])
    assert engine.scheduler.schedule() is not None and running.status is SeqStatus.RUNNING
    engine.scheduler.add([waiting])
    engine.runner.finish(waiting)
    engine.runner.finish(running)
    assert backend.released == [running.seq_id]
    assert waiting.status is running.status is SeqStatus.FINISHED
    assert not engine.scheduler.has_work
