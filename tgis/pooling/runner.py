"""Requests to a pooling model gathered into batches on one thread, as generation's engine
gathers them into steps.

Each request is a list of encoded inputs. The thread takes inputs in arrival order (a request's
inputs may span batches) while the batch's size stays within `max_batch_tokens` (its tokens
where the model runs rows back to back, `PoolingModel.packed`; else its rows padded to the
longest) and its
rows within `max_batch_rows` (and its requests ask for the same kind of output: pooled, or per
token), runs one forward, and completes each request when its last input
is done. A request cancelled before its inputs ran is skipped; one whose forward failed gets
the error, and the thread serves on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tgis.errors import InputValidationError
from tgis.pooling.model import Encoded, PoolingModel

Results = list[torch.Tensor]


@dataclass
class _Request:
    inputs: Sequence[Encoded]
    future: concurrent.futures.Future[Results]
    # Per-token outputs (PoolingModel.run's `tokens`): batched only with requests like it.
    tokens: bool = False
    results: list[torch.Tensor | None] = field(default_factory=list)
    # The next input to put in a batch, and how many have come back.
    next: int = 0
    done: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * len(self.inputs)


class PoolingRunner:
    """The batching thread of one PoolingModel."""

    def __init__(
        self,
        model: PoolingModel,
        max_batch_tokens: int,
        max_batch_rows: int,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        if max_batch_tokens < 1 or max_batch_rows < 1:
            raise ValueError("max_batch_tokens and max_batch_rows must be >= 1")
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_rows = max_batch_rows
        # Called with (rows, tokens computed: padded, or packed) of each batch run (metrics).
        self.on_batch = on_batch
        self._queue: deque[_Request] = deque()
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._in_flight = 0

    def open(self) -> None:
        """Take requests from now on (they wait for the loop to run them)."""
        with self._wake:
            self._running = True

    def start(self) -> None:
        """Run the loop on a thread of its own."""
        self.open()
        self._thread = threading.Thread(target=self._loop, name="tgis-pooling", daemon=True)
        self._thread.start()

    def run_loop(self) -> None:
        """Run the loop on this thread (`tgis serve`'s main thread, as the engine's) until
        `stop`."""
        self.open()
        self._loop()

    @property
    def running(self) -> bool:
        return self._running

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet answered."""
        return self._in_flight

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(30)
        for request in self._queue:
            request.future.cancel()
        self._queue.clear()

    def submit(
        self, inputs: Sequence[Encoded], tokens: bool = False
    ) -> concurrent.futures.Future[Results]:
        """Each input's output, in order, once all have run (per token with `tokens`)."""
        if not inputs:
            raise ValueError("a request needs at least one input")
        for row in inputs:
            if len(row["input_ids"]) > self.max_batch_tokens:
                raise InputValidationError(
                    f"an input of {len(row['input_ids'])} tokens exceeds a batch's "
                    f"{self.max_batch_tokens} (--max-batch-prefill-tokens): shorten it"
                )
        future: concurrent.futures.Future[Results] = concurrent.futures.Future()
        with self._wake:
            if not self._running:
                raise RuntimeError("the pooling runner is not running")
            self._queue.append(_Request(inputs, future, tokens=tokens))
            self._in_flight += 1
            self._wake.notify()
        future.add_done_callback(self._answered)
        return future

    def _answered(self, _: concurrent.futures.Future[Results]) -> None:
        with self._wake:
            self._in_flight -= 1

    async def run(self, inputs: Sequence[Encoded], tokens: bool = False) -> Results:
        """`submit` for a coroutine: cancelling it cancels the request."""
        future = self.submit(inputs, tokens)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._running and not self._queue:
                    self._wake.wait()
                if not self._running:
                    return
                batch = self._take()
            if batch:
                self._run(batch)

    def _take(self) -> list[tuple[_Request, int]]:
        """The next batch: (request, input index) in arrival order, within the limits."""
        batch: list[tuple[_Request, int]] = []
        width = total = 0
        packed = self.model.packed
        while self._queue:
            request = self._queue[0]
            if request.future.done():  # cancelled, or failed in an earlier batch
                self._queue.popleft()
                continue
            if batch and request.tokens != batch[0][0].tokens:
                return batch  # per-token and pooled outputs come from forwards of their own
            while request.next < len(request.inputs):
                n = len(request.inputs[request.next]["input_ids"])
                wider = max(width, n)
                cost = total + n if packed else wider * (len(batch) + 1)
                if batch and (len(batch) + 1 > self.max_batch_rows or cost > self.max_batch_tokens):
                    return batch
                batch.append((request, request.next))
                width, total = wider, total + n
                request.next += 1
            self._queue.popleft()
        return batch

    def _run(self, batch: list[tuple[_Request, int]]) -> None:
        live = [(r, i) for r, i in batch if not r.future.cancelled()]
        if not live:
            return
        try:
            out = self.model.run([r.inputs[i] for r, i in live], tokens=live[0][0].tokens)
        except Exception as exc:  # the requests get the error; the thread serves on
            for request in {id(r): r for r, _ in live}.values():
                if not request.future.done():
                    request.future.set_exception(exc)
            return
        if self.on_batch is not None:
            lengths = [len(r.inputs[i]["input_ids"]) for r, i in live]
            cost = sum(lengths) if self.model.packed else max(lengths) * len(live)
            self.on_batch(len(live), cost)
        for (request, index), row in zip(live, out.rows, strict=True):
            request.results[index] = row
            request.done += 1
            if request.done == len(request.inputs) and not request.future.done():
                request.future.set_result([r for r in request.results if r is not None])
