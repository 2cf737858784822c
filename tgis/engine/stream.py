"""The device's queue of work, as the engine's step runners see it: a step's forward and its
sampling are submitted to a `DeviceStream`, and their results are waited for when the host
needs them.

`DeviceStream` runs each piece of work at once on the calling thread, which is what every real
device needs: CUDA (and any accelerator torch drives) queues the kernels itself and returns,
and the host waits only where it reads a result back (`tgis.engine.transfer`); a CPU computes
as it goes.

`SimulatedStream` stands for an accelerator on a CPU (`tgis benchmark --engine
--simulated-device-ms`): its work runs in order on a thread of its own, on that thread's
timeline, as kernels would on a GPU's: a step's forward (`step=True`) takes at least the stream's `step_s`. The host thread
meanwhile goes on, so the time a step's host work hides behind the
device's is measured on a machine without one. Both count the seconds the device was busy
(`busy_s`) and the seconds the host spent waiting for it (`waited_s`).

    stream = SimulatedStream(step_s=0.002)
    logits = stream.submit(lambda: backend.forward(items), step=True)
    ...                                   # host work overlaps the 2 ms
    out = logits.result()                 # waits for the device
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")

# The interpreter's thread switch interval while a simulated device runs (SimulatedStream).
SWITCH_S = 0.0002


class Pending(Generic[T]):
    """Work submitted to a stream: `result()` waits for it (raising what it raised)."""

    def __init__(self, stream: DeviceStream, future: Future[T]) -> None:
        self._stream, self._future = stream, future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> T:
        if self._future.done():
            return self._future.result()
        start = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._stream.add_wait(time.perf_counter() - start)


class DeviceStream:
    """Work run at once on the calling thread (a real device queues its own kernels)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.waited_s = 0.0

    def submit(self, work: Callable[[], T], step: bool = False) -> Pending[T]:
        """Run `work`; `step`: it is a step's forward (which a simulated device times)."""
        future: Future[T] = Future()
        try:
            future.set_result(work())
        except BaseException as exc:  # raised again by result(), where the host reads it
            future.set_exception(exc)
        return Pending(self, future)

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.waited_s += seconds

    def close(self) -> None:
        """Stop taking work (nothing to stop here)."""


class _FastSwitch:
    """The interpreter's switch interval while any simulated device is open: SWITCH_S from the
    first one opened, the interval found before it once the last one is closed (in whatever
    order they close)."""

    _lock = threading.Lock()
    _open = 0
    _saved = 0.0

    @classmethod
    def enter(cls) -> None:
        with cls._lock:
            if cls._open == 0:
                cls._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(cls._saved, SWITCH_S))
            cls._open += 1

    @classmethod
    def leave(cls) -> None:
        with cls._lock:
            cls._open -= 1
            if cls._open == 0:
                sys.setswitchinterval(cls._saved)


class SimulatedStream(DeviceStream):
    """A device's timeline on a thread of its own. Work runs in submission order, each piece
    starting when it was submitted or when the one before it ended, whichever is later (as a
    GPU starts a kernel queued while it is idle, even where the thread that stands for it gets
    to run later: it shares the interpreter's lock with the host).

    A step's work is its forward (`step=True`) and what is submitted after it (its
    sampling): together they last at least `step_s`. The forward's own result is ready as
    soon as it is computed (the host can only queue more work on it), the later pieces' once
    the step's time is up, and the next step starts no earlier.

    While it is open the interpreter switches threads every SWITCH_S instead of every 5 ms,
    so that the device's thread is not held up for the length of the host's Python work (a
    GPU runs beside the host's thread, not after it)."""

    def __init__(self, step_s: float) -> None:
        if step_s < 0:
            raise ValueError(f"a simulated step takes >= 0 seconds, got {step_s}")
        super().__init__()
        self.step_s = step_s
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], object], float, bool, Future[object]] | None
        ] = queue.SimpleQueue()
        self._free_at = 0.0  # when the last piece of work ended, on the device's timeline
        self._step_end = 0.0  # when the step under way may end at the earliest
        _FastSwitch.enter()
        self._thread = threading.Thread(target=self._run, name="tgis-simulated-device", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], T], step: bool = False) -> Pending[T]:
        if not self._thread.is_alive():
            raise RuntimeError("the simulated device was closed")
        future: Future[T] = Future()
        self._jobs.put((work, time.perf_counter(), step, future))  # type: ignore[arg-type]
        return Pending(self, future)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, submitted, step, future = job
            begin = max(submitted, self._free_at)
            if step:
                # The step before lasts until its time is up: the device is busy until then.
                start = max(begin, self._step_end)
                time.sleep(max(0.0, start - time.perf_counter()))
                held = max(0.0, min(start, self._step_end) - self._free_at)
                self._step_end = start + self.step_s
            else:
                start, held = begin, 0.0
            try:
                value = work()
            except BaseException as exc:
                error: BaseException | None = exc
            else:
                error = None
            if not step:  # the step's later work is done when the step's time is up
                time.sleep(max(0.0, self._step_end - time.perf_counter()))
            end = max(time.perf_counter(), start)
            with self._lock:
                self.busy_s += held + end - start
            self._free_at = end
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)

    def close(self) -> None:
        """Finish the work submitted, then stop the device's thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
            _FastSwitch.leave()
