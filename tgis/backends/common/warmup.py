"""What every compiling backend does around warmup: run the plan shape by shape, then notice
a serving step that still compiles (a shape warmup missed, paid for by a request)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tgis.engine.backend import Shape, ShapeTiming

logger = logging.getLogger(__name__)


def run_plan(
    plan: Sequence[Shape],
    run_shape: Callable[[Shape], ShapeTiming],
    on_shape: Callable[[ShapeTiming], None] | None = None,
) -> list[ShapeTiming]:
    """Run each shape once, in plan order, telling `on_shape` of each as it finishes."""
    timings = []
    for shape in plan:
        timings.append(run_shape(shape))
        if on_shape is not None:
            on_shape(timings[-1])
    return timings


class CompileWatch:
    """Counts graphs compiled after warmup. `count` reads the backend's compilations so far."""

    def __init__(self, count: Callable[[], int]) -> None:
        self._count = count
        self._mark: int | None = None
        self.late = 0  # graphs compiled by serving steps after warmup

    def arm(self) -> None:
        """Warmup is over: from now on, a compilation is late."""
        self._mark = self._count()

    def check(self, label: str) -> None:
        """After a serving step: count and log what it compiled (nothing before `arm`)."""
        if self._mark is None:
            return
        now = self._count()
        if now > self._mark:
            self.late += now - self._mark
            logger.warning(
                "%s compiled %d graph(s) after warmup: a shape warmup did not cover",
                label,
                now - self._mark,
            )
            self._mark = now


class PhaseClock:
    """Seconds of consecutive phases: `done(name)` ends one, which began when the one before
    it ended (or the clock was made); a name done twice adds up. `seconds` keeps them in
    the order first done."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """Powers of two from the first >= `low` below `high`, then `high` itself."""
    values, v = [], 1
    while v < low:
        v *= 2
    while v < high:
        values.append(v)
        v *= 2
    values.append(high)
    return tuple(values)
