"""tgis.engine.stream: work submitted inline (a real device's) or to a simulated device's
timeline of its own: results and errors come back where the host reads them, in order, each
step taking at least the device's step time, and its busy seconds counted."""

from __future__ import annotations

import sys
import threading

import pytest

from tgis.engine.stream import SWITCH_S, DeviceStream, SimulatedStream


def test_inline_work_runs_at_once_and_raises_where_it_is_read() -> None:
    stream = DeviceStream()
    ran: list[str] = []
    done = stream.submit(lambda: ran.append("now") or 7, step=True)
    assert ran == ["now"] and done.done() and done.result() == 7
    failed = stream.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    assert stream.busy_s == 0.0 and stream.waited_s == 0.0  # nothing is timed inline


def test_a_simulated_device_runs_in_order_on_its_own_thread_and_takes_its_step() -> None:
    stream = SimulatedStream(step_s=0.01)
    threads: list[str] = []
    order: list[int] = []

    def work(i: int) -> int:
        threads.append(threading.current_thread().name)
        order.append(i)
        return i * i

    try:
        pending = [stream.submit(lambda i=i: work(i), step=i < 3) for i in range(5)]
        failed = stream.submit(lambda: [][1])
        assert [p.result() for p in pending] == [0, 1, 4, 9, 16]
        with pytest.raises(IndexError):
            failed.result()
    finally:
        stream.close()
    assert order == [0, 1, 2, 3, 4] and set(threads) == {"tgis-simulated-device"}
    # Three steps of at least 10 ms each (a busy machine only makes them longer).
    assert stream.busy_s >= 0.03
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(lambda: 0)


def test_a_negative_step_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0 seconds"):
        SimulatedStream(step_s=-1)


def test_the_switch_interval_comes_back_whatever_order_the_devices_close_in() -> None:
    """Two simulated devices open at once: the fast switch holds until the last one closes,
    then the interval found before the first one is back."""
    before = sys.getswitchinterval()
    first, second = SimulatedStream(0.0), SimulatedStream(0.0)
    assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_S))
    first.close()
    assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_S))
    second.close()
    assert sys.getswitchinterval() == pytest.approx(before)
    second.close()  # closing twice changes nothing
    assert sys.getswitchinterval() == pytest.approx(before)
