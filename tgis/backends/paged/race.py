"""`--attention-backend auto` where more than one kernel runs: at warmup each times the same
steps over the pool and the fastest serves (the Triton kernels against flash attention on a
CUDA torch whose `varlen_attn` reads pages).

    times = race(("triton", "flash"), run, clock=time.perf_counter)
    fastest = winner(times)

`run(name)` runs the steps with kernel `name` and waits for the device; each contender runs
once unmeasured (compilation, autotuning), then `repeats` times, and its time is the median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

REPEATS = 3


def race(
    contenders: Sequence[str],
    run: Callable[[str], None],
    clock: Callable[[], float] = time.perf_counter,
    repeats: int = REPEATS,
) -> dict[str, float]:
    """Median seconds of `run(name)` for each contender, in the contenders' order."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    times: dict[str, float] = {}
    for name in contenders:
        run(name)
        samples = []
        for _ in range(repeats):
            start = clock()
            run(name)
            samples.append(clock() - start)
        times[name] = statistics.median(samples)
    return times


def winner(times: dict[str, float]) -> str:
    """The fastest contender; a tie goes to the first (the default kernel)."""
    if not times:
        raise ValueError("a race needs at least one contender")
    return min(times, key=lambda name: times[name])
