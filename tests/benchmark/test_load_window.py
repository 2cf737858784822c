"""StepWindow on a clock the test moves: which requests are warmup, which are measured, when a
step stops, and the bounds its rates are computed over."""

from __future__ import annotations

import pytest

from tgis.benchmark.load import StepWindow


def test_seconds_alone_keep_the_old_window() -> None:
    window = StepWindow(2.0, warmup=1.0)
    window.begin(10.0)
    assert window.measure_from == 11.0
    assert [window.admit(t) for t in (10.0, 10.99, 11.0, 12.99)] == [False, False, True, True]
    assert window.admit(13.0) is None and window.closed(13.0)
    step = window.result("throughput", 2, now=20.0)
    assert (step.measure_from, step.stop_at) == (11.0, 13.0)


def test_counts_size_the_step_whatever_the_clock() -> None:
    window = StepWindow(600.0, max_requests=3, warmup_requests=2)
    window.begin(0.0)
    assert window.measure_from is None  # the warmup has no end yet
    # However slowly the requests come, the first two warm up and the next three are measured.
    assert [window.admit(t) for t in (5.0, 50.0)] == [False, False]
    assert window.measure_from == 50.0
    assert [window.admit(t) for t in (51.0, 120.0, 121.0)] == [True, True, True]
    assert window.closed(121.0) and window.admit(122.0) is None
    step = window.result("rate", 1.5, now=300.0)
    assert (step.measure_from, step.stop_at) == (50.0, 121.0)
    assert (window.warmups, window.measured) == (2, 3)


def test_the_warmup_needs_its_seconds_and_its_requests() -> None:
    window = StepWindow(10.0, warmup=5.0, warmup_requests=1)
    window.begin(0.0)
    assert window.admit(0.5) is False
    assert window.measure_from == 5.0  # the request came early: the seconds still count
    assert window.admit(4.0) is False and window.admit(5.0) is True
    late = StepWindow(10.0, warmup=1.0, warmup_requests=3)
    late.begin(0.0)
    assert [late.admit(t) for t in (0.0, 2.0, 3.0, 3.5)] == [False, False, False, True]
    assert late.measure_from == 3.0  # the third warmup request started after the seconds


def test_duration_still_bounds_a_counted_step() -> None:
    window = StepWindow(1.0, max_requests=100)
    window.begin(0.0)
    assert window.admit(0.5) is True and window.admit(1.0) is None
    assert window.result("throughput", 1, now=9.0).stop_at == 1.0


def test_an_unfinished_window_cuts_at_now_and_a_like_window_is_fresh() -> None:
    window = StepWindow(10.0, warmup=2.0, max_requests=5)
    window.begin(0.0)
    window.admit(3.0)
    step = window.result("throughput", 1, now=4.0)
    assert (step.measure_from, step.stop_at) == (2.0, 4.0)
    fresh = window.like()
    assert (fresh.duration, fresh.warmup, fresh.max_requests) == (10.0, 2.0, 5)
    assert fresh.measured == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"duration": 0}, "duration > 0"),
        ({"duration": 1, "warmup": -1}, "warmup >= 0"),
        ({"duration": 1, "max_requests": 0}, "max_requests must be at least 1"),
        ({"duration": 1, "warmup_requests": -1}, "warmup_requests must be >= 0"),
    ],
)
def test_bad_limits_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepWindow(**kwargs)  # type: ignore[arg-type]
