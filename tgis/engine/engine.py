"""The engine loop: schedule -> backend step -> sample -> stop rules -> hand tokens over.

One thread runs the model, and every piece of torch work of the process: `tgis serve` runs the
loop on the process's main thread (the thread that loaded and warmed up the model, so torch
keeps one OpenMP team), the HTTP and gRPC servers on an event loop in another thread. Tests and
embedded users may `start()` it on a thread of its own instead. Requests, cancellations and
work that must touch the model's tensors (`call`: loading a LoRA adapter or a prompt prefix)
reach the loop through a queue. A step's sampled tokens go back to their requests with one
`call_soon_threadsafe` per event loop; each request's consumer turns them into TokenEvents
(text, stop sequences, details: tgis.engine.output) on its own side, off the model's thread.

Two kinds of backend, each with its step runner (tgis.engine.step_runner), picked once from
the backend's capacity: a paged one (`PagedBackend`, capacity.block_size set) runs packed
steps that the `PagedScheduler` plans over its block pool (chunked prefill, preemption, prefix
caching: `PackedSteps`); a slot one (`Backend`: the static devices and the generic
transformers path) runs prefill and decode steps that the `Scheduler` plans over worst-case
reservations (`SlotSteps`). The runner plans and runs the step; the engine keeps what both
share: the inbox, admission, emitting tokens and the failures of requests and steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar, cast

from tgis.config.types import MAX_SPECULATE
from tgis.engine.backend import Backend, PagedBackend, prompt_logprobs_refusal
from tgis.engine.block_manager import BlockManager, ImageMark
from tgis.engine.detokenize import special_ids
from tgis.engine.grammar import BUILD_WAIT_S, Constraint, GrammarCompiler
from tgis.engine.live import LiveSequence, RequestHandle, post_step
from tgis.engine.output import SampledToken, SequenceText
from tgis.engine.paged_scheduler import PagedScheduler
from tgis.engine.sampling import SampleOutput
from tgis.engine.scheduler import Scheduler, SchedulerLimits
from tgis.engine.sequence import SeqStatus
from tgis.engine.sequence import Sequence as SchedSeq
from tgis.engine.speculation import NgramProposer, Proposer, Verified
from tgis.engine.step_runner import PackedSteps, PipelinedSteps, SlotSteps, StepRunner
from tgis.engine.stream import DeviceStream, SimulatedStream
from tgis.engine.thinking import ThinkingLimit
from tgis.engine.types import EngineObserver, FinishReason, GenerationRequest, TokenEvent
from tgis.errors import GenerationError, InputValidationError, OverloadedError, TgisError

# Steps failed in a row after which the engine reports itself unhealthy (/health is 503
# until a step succeeds again: /health's own generation is one).
MAX_FAILED_STEPS = 3

# The token id a prompt prefix's virtual positions carry (their embeddings replace it).
PREFIX_PLACEHOLDER_ID = 0


def image_marks(request: GenerationRequest, offset: int) -> tuple[ImageMark, ...]:
    """Where the request's images' features go in its sequence, whose prompt starts `offset`
    positions before `input_ids` (a prompt prefix's virtual tokens)."""
    marks: list[ImageMark] = []
    for index, image in enumerate(request.images):
        row = 0
        for start, length in image.runs:
            marks.append(ImageMark(offset + start, length, row, image.digest, index))
            row += length
    return tuple(marks)


log = logging.getLogger("tgis.engine")

T = TypeVar("T")


class Engine:
    """Continuous batching over one Backend. Thread-safe `generate`; one model thread."""

    def __init__(
        self,
        backend: Backend | PagedBackend,
        tokenizer: Any,
        limits: SchedulerLimits,
        max_concurrent_requests: int,
        eos_token_ids: Sequence[int],
        observer: EngineObserver | None = None,
        prefix_caching: bool = False,
        on_fatal: Callable[[], None] | None = None,
        speculate: int = 0,
        proposer: Proposer | None = None,
        stream: DeviceStream | None = None,
        async_scheduling: bool | None = None,
    ) -> None:
        """prefix_caching: share the KV blocks of common prompt prefixes (paged backends).
        on_fatal: called if the model thread ever ends other than by `stop` (after every
        request has its answer); `tgis serve` exits then, so that a supervisor restarts it.
        speculate: draft tokens verified with each decode, at most (paged backends; 0: none),
        from `proposer` (default: n-gram prompt lookup; a DraftModelProposer for a draft
        model). stream: where the steps' forwards and sampling are submitted
        (tgis.engine.stream; a SimulatedStream times them as an accelerator would).
        async_scheduling: plan and launch each step while the device runs the one before
        (PipelinedSteps; a paged backend without speculation); None: where the device runs
        apart from the host (CUDA, a simulated device), never on a CPU, whose forward is the
        host's own work."""
        self.backend = backend
        self.stream = stream or DeviceStream()
        self.on_fatal = on_fatal
        self.tokenizer = tokenizer
        capacity = backend.capacity
        # Chosen once: capacity.block_size marks a PagedBackend.
        self.runner: StepRunner
        if capacity.block_size is not None:
            blocks = BlockManager(
                capacity.num_blocks,
                capacity.block_size,
                prefix_caching,
                sliding_window=capacity.sliding_window,
            )
            paged = cast("PagedBackend", backend)
            scheduler = PagedScheduler(limits, blocks)
            if self._pipelined(async_scheduling, speculate):
                self.runner = PipelinedSteps(self, paged, scheduler)
            else:
                self.runner = PackedSteps(self, paged, scheduler)
        else:
            if async_scheduling:
                raise ValueError(
                    f"async scheduling needs a paged backend; {backend.name} keeps a slot cache"
                )
            self.runner = SlotSteps(self, cast("Backend", backend), Scheduler(limits))
        if speculate and not self.runner.speculates:
            raise ValueError(
                f"speculative decoding needs a paged backend; {backend.name} keeps a slot cache"
            )
        if not 0 <= speculate <= MAX_SPECULATE:
            raise ValueError(f"speculate must be in [0, {MAX_SPECULATE}], got {speculate}")
        self.speculate = speculate
        self.proposer: Proposer = proposer or NgramProposer()
        self.max_concurrent_requests = max_concurrent_requests
        self.eos_token_ids = tuple(eos_token_ids)
        # Computed once: every sequence checks its tokens against it.
        self.special_ids = special_ids(tokenizer)
        self.observer = observer
        self.grammars = GrammarCompiler(tokenizer, list(self.eos_token_ids))
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[int, LiveSequence] = {}
        self._seq_ids = itertools.count()
        self._in_flight = 0
        # Steps failed in a row (a success resets it): /health fails at MAX_FAILED_STEPS.
        self._failed_steps = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None  # start(): a thread of its own
        # The thread running the loop (None before it runs); `call` runs work there.
        self._model_thread: threading.Thread | None = None
        self._running = False

    # --- the asyncio side --------------------------------------------------------------

    def start(self) -> None:
        """Run the loop on a thread of its own (tests, embedding); `tgis serve` calls `run`
        on its main thread instead."""
        self._thread = threading.Thread(target=self.run, name="tgis-engine", daemon=True)
        self._running = True
        self._thread.start()

    def run(self) -> bool:
        """Run the loop on the calling thread until `stop`: False when it ended otherwise (a
        failure; `on_fatal` has been called)."""
        self._model_thread = threading.current_thread()
        self._running = True
        return self._run()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (from any thread); requests still running end with a
        GenerationError. Waits for a loop started by `start`."""
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def healthy(self) -> bool:
        """Running, and its last MAX_FAILED_STEPS steps did not all fail."""
        return self._alive() and self._failed_steps < MAX_FAILED_STEPS

    def _alive(self) -> bool:
        return self._running and not self._stopping.is_set()

    def call(self, work: Callable[[], T]) -> T:
        """Run `work` on the model thread and return its result (or raise its exception): the
        one thread of the process that runs torch, so that torch keeps a single OpenMP team.
        Runs at once when called on that thread, or before the loop has started; from
        another thread it waits for the loop to take it between two steps."""
        here = threading.current_thread()
        if not self._running or here is self._model_thread or here is self._thread:
            return work()
        if not self._alive():
            raise GenerationError("the engine is not running", "check the server log")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.put(("call", (work, future)))
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                # The loop ended after the call was queued: nobody will take it.
                if not self._running and future.cancel():
                    raise GenerationError(
                        "the engine is not running", "check the server log"
                    ) from None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def scheduler(self) -> Scheduler | PagedScheduler:
        """The step runner's scheduler: its queue and running batch."""
        return self.runner.scheduler

    def reserve(self, count: int) -> None:
        """Take `count` of the max_concurrent_requests places at once, or none (a batched
        request is admitted whole or refused whole): OverloadedError when they are not free.
        Each `generate(..., reserved=True)` uses one; `release` returns the unused."""
        with self._lock:
            if self._in_flight + count > self.max_concurrent_requests:
                raise OverloadedError("Model is overloaded")
            self._in_flight += count

    def release(self, count: int) -> None:
        """Return `count` reserved places that no `generate` used."""
        with self._lock:
            self._in_flight -= count

    async def generate(
        self, request: GenerationRequest, reserved: bool = False
    ) -> AsyncIterator[TokenEvent]:
        """Token events of `request` (all best_of candidates, interleaved by `index`).
        `reserved`: the place was taken by `reserve` (the iterator gives it back all the same
        once it has started)."""
        if not self._alive():
            if reserved:
                self.release(1)
            raise GenerationError("the engine is not running", "check the server log")
        if not reserved:
            self.reserve(1)
        try:
            params = request.params
            if request.prefix is not None and not self.backend.capacity.prompt_prefixes:
                raise InputValidationError(
                    f"prompt prefixes (`prefix_id`) are not available on the "
                    f"{self.backend.name} backend: its compiled model takes token ids only. "
                    "Serve the model on the cpu or cuda backend to use them"
                )
            capacity = self.backend.capacity
            if request.adapter is not None and not capacity.lora:
                raise InputValidationError(
                    f"LoRA adapters (`adapter_id`) are not available on the {self.backend.name} "
                    "backend: they run in the paged engine of llama-family models on cpu and "
                    "cuda, on one device"
                )
            if request.images and not capacity.images:
                raise InputValidationError(
                    f"images are not available here: the {self.backend.name} backend serves "
                    "this model from text alone. Send the prompt without images, or serve a "
                    "vision-language model (docs/models.md) on the cpu or cuda backend"
                )
            refusal = prompt_logprobs_refusal(
                self.backend.name, capacity.encoder_decoder, capacity.prompt_logprobs
            )
            if params.decoder_input_details and refusal is not None:
                raise InputValidationError(refusal)
            if params.grammar is not None:
                await self._grammars_ready()
            candidates = params.best_of or 1
            handle = RequestHandle(request, asyncio.get_running_loop(), candidates)
            texts = [self._sequence_text(request, candidates) for _ in range(candidates)]
            self._inbox.put(("add", handle))
            try:
                while not handle.done:
                    for item in await handle.next_batch():
                        if isinstance(item, BaseException):
                            raise item
                        event = self._event(texts[item.index], item, handle)
                        if event is not None:
                            yield event
            finally:
                if not handle.done:
                    handle.cancelled = True
                    self._inbox.put(("cancel", handle))
        finally:
            with self._lock:
                self._in_flight -= 1

    async def _grammars_ready(self) -> None:
        """Wait, on the event loop, for the tokenizer's llguidance form (its build started now
        if nobody started it), so that the engine's thread finds it made; a 422 naming why
        when llguidance cannot take the tokenizer."""
        grammars = self.grammars
        if not grammars.ready:
            grammars.prepare()
            try:
                await asyncio.wait_for(asyncio.wrap_future(grammars.built), BUILD_WAIT_S)
            except asyncio.TimeoutError:
                raise GenerationError(
                    "structured output is not ready: its tokenizer is still being built after "
                    f"{BUILD_WAIT_S:.0f} s",
                    "retry shortly",
                ) from None
        if grammars.error is not None:
            raise InputValidationError(
                f"structured output is unavailable with this model's tokenizer: {grammars.error}"
            )

    def _sequence_text(self, request: GenerationRequest, candidates: int) -> SequenceText:
        return SequenceText(
            request,
            self.tokenizer,
            self.eos_token_ids,
            self.special_ids,
            keep_details=request.params.details or candidates > 1,
            encoder_decoder=self.backend.capacity.encoder_decoder,
        )

    def _event(
        self, text: SequenceText, item: SampledToken, handle: RequestHandle
    ) -> TokenEvent | None:
        """On the consumer's side: a sampled token becomes its TokenEvent (text, stop
        sequences, details). A sequence a stop sequence ended is dropped from the loop."""
        try:
            event = text.event(item)
        except Exception as exc:  # detokenizing or a stop rule failed: this request only
            log.exception("request %s failed after its step", handle.request.request_id)
            raise GenerationError(f"{type(exc).__name__}: {exc}") from exc
        if event is not None and event.completion is not None:
            handle.completed += 1
            if text.finished_here:
                self._inbox.put(("drop", (handle, item.index)))
        return event

    # --- the model thread ----------------------------------------------------------------

    def _run(self) -> bool:
        fatal = False
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self.runner.has_work)
                self.runner.run_next()
        except BaseException:  # the loop must never die silently
            log.exception("engine loop failed")
            fatal = True
        finally:
            self._running = False
            error = GenerationError("the server is shutting down", "retry on another replica")
            self._fail_inbox(error)
            self._fail_all(error)
        if fatal and self.on_fatal is not None:
            self.on_fatal()
        return not fatal

    def _pipelined(self, asked: bool | None, speculate: int) -> bool:
        """Whether the paged engine schedules asynchronously (see __init__)."""
        if asked and speculate:
            raise ValueError("async scheduling cannot verify drafts: speculate is 0 with it")
        if asked is not None:
            return asked
        # Only the simulated device schedules asynchronously unless asked: the path has not
        # run on a GPU yet.
        return isinstance(self.stream, SimulatedStream) and not speculate

    def _drain_inbox(self, block: bool) -> None:
        try:
            kind, item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if kind == "add" and not item.cancelled:
                try:
                    self._admit(item)
                except Exception as exc:  # this request's failure alone
                    log.exception("admitting request %s failed", item.request.request_id)
                    self._abandon(item, GenerationError(f"{type(exc).__name__}: {exc}"))
            elif kind == "cancel":
                for live in list(item.sequences):
                    self._drop(live)
                self._report_state()
            elif kind == "drop":  # one sequence that its consumer ended (a stop sequence)
                handle, index = item
                for live in handle.sequences:
                    if live.seq.index == index:
                        self._drop(live)
                self._report_state()
            elif kind == "call":
                work, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(work())
                    except BaseException as exc:  # the caller's failure, not the loop's
                        future.set_exception(exc)
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, handle: RequestHandle) -> None:
        request = handle.request
        max_new = request.params.max_new_tokens or 1
        seqs = []
        prefix = request.prefix
        # A prompt prefix's virtual tokens hold placeholder ids; their embeddings come from
        # the prefix, and its key keeps their blocks apart from other prefixes'. (An
        # encoder-decoder backend places them itself, in the encoder's and decoder's inputs.)
        placed = prefix is not None and not self.backend.capacity.encoder_decoder
        prompt = [PREFIX_PLACEHOLDER_ID] * (prefix.length if placed and prefix else 0)
        prompt.extend(request.input_ids)
        constraint: Constraint | ThinkingLimit | None = None
        if request.params.grammar is not None:
            constraint = self.grammars.constraint(request.params.grammar)
        if request.params.thinking_budget is not None:
            constraint = ThinkingLimit(request.params.thinking_budget, constraint)
        for index in range(handle.candidates):
            seq = SchedSeq(
                next(self._seq_ids),
                request.request_id,
                len(prompt),
                max_new,
                request.arrival,
                index,
                token_ids=list(prompt),
                salt=(prefix.key if prefix else b"")
                + (request.adapter.key if request.adapter else b""),
                images=image_marks(request, len(prompt) - len(request.input_ids)),
                # Every prompt position's logits are computed: none may come from the cache.
                cache_lookup=not request.params.decoder_input_details,
                prompt_logits=request.params.decoder_input_details,
            )
            live = LiveSequence(
                seq, handle, self.eos_token_ids, self.backend.capacity.encoder_decoder
            )
            if constraint is not None:
                live.row.constraint = constraint if index == 0 else constraint.copy()
            self._live[seq.seq_id] = live
            handle.sequences.append(live)
            seqs.append(seq)
        try:
            self.scheduler.add(seqs)
        except ValueError as exc:  # larger than the engine's budgets: refuse, keep serving
            for live in handle.sequences:
                self._live.pop(live.seq.seq_id, None)
            handle.sequences.clear()
            handle.post([InputValidationError(str(exc))])

    def _abandon(self, handle: RequestHandle, error: TgisError) -> None:
        """End a request with `error`, dropping whatever of it the engine holds."""
        for live in list(handle.sequences):
            if live.seq.seq_id in self._live:
                self._drop(live)
        handle.sequences.clear()
        handle.post([error])

    def _drop(self, live: LiveSequence) -> None:
        """Forget a sequence (cancelled or failed), freeing its slot if it had one."""
        seq = live.seq
        if seq.status is not SeqStatus.FINISHED:
            self.runner.finish(seq)
        self._live.pop(seq.seq_id, None)
        self.proposer.release(seq.seq_id)

    # --- what every step shares (the step runners call _guarded, _fail_step, _emit) ----

    def _guarded(self, live: LiveSequence, work: Callable[..., Any], *args: Any) -> None:
        """Per-request work after the step (prompt details): a failure ends that request."""
        if live.seq.seq_id not in self._live:
            return
        try:
            work(*args)
        except Exception as exc:
            log.exception("request %s failed after its step", live.handle.request.request_id)
            self._abandon(live.handle, GenerationError(f"{type(exc).__name__}: {exc}"))

    def _fail_step(self, method: str, lives: list[LiveSequence], exc: Exception) -> None:
        """The step's forward or sampling raised for `lives` (alone, or the retry was not
        possible): their requests fail, the engine serves on."""
        log.exception("%s step failed for %d sequences", method, len(lives), exc_info=exc)
        self._failed_steps += 1
        if self.observer:
            self.observer.on_step_failure(method, "oom" if _is_oom(exc) else "error")
        error = GenerationError(f"{type(exc).__name__}: {exc}")
        for live in lives:
            if live.seq.seq_id in self._live:
                live.handle.post([error])
                self._drop(live)
        self._report_state()

    def _emit(
        self,
        lives: list[LiveSequence],
        choice: SampleOutput,
        method: str,
        tokens: int,
        start: float,
        forward: float,
        joined: bool,
        succeeded: bool = True,
        verified: Sequence[tuple[LiveSequence, Verified]] = (),
    ) -> None:
        """Turn each row's sampled token into an event, finish the completed, report; then
        the tokens of the `verified` sequences (speculative decoding), in order.
        `succeeded`: some row of the step got its token (a success ends a run of failures)."""
        if not succeeded:  # every row failed (and was answered): nothing to emit
            self._report_state()
            return
        self._failed_steps = 0
        touched: dict[int, RequestHandle] = {}
        now = time.monotonic()
        for i, live in enumerate(lives):
            self._push(live, choice, i, now, touched)
        for live, result in verified:
            for i in range(len(result.choice.token_ids)):
                if not self._push(live, result.choice, i, now, touched):
                    break
        post_step(touched.values())
        if self.speculate:
            self._propose([*lives, *(live for live, _ in verified)])
        if self.observer:
            rows = len(lives) + len(verified)
            self.observer.on_step(method, rows, tokens, time.perf_counter() - start, forward)
            if joined:
                self.observer.on_concatenation()
            if verified:
                self.observer.on_speculation(
                    sum(v.drafted for _, v in verified),
                    sum(v.accepted for _, v in verified),
                    sum(len(v.choice.token_ids) for _, v in verified),
                )
        self._report_state()

    def _push(
        self,
        live: LiveSequence,
        choice: SampleOutput,
        row: int,
        now: float,
        touched: dict[int, RequestHandle],
    ) -> bool:
        """Row `row` of `choice` becomes `live`'s next event: True while the sequence goes on
        (False: it finished, or its request failed)."""
        if live.seq.seq_id not in self._live:
            return False  # its request failed earlier in this step (best_of siblings)
        try:
            sampled = live.advance(choice, row, now)
        except Exception as exc:  # the grammar or a stop rule failed: this request only
            log.exception("request %s failed after its step", live.handle.request.request_id)
            live.handle.pending.clear()
            self._abandon(live.handle, GenerationError(f"{type(exc).__name__}: {exc}"))
            return False
        live.handle.pending.append(sampled)
        touched[id(live.handle)] = live.handle
        if sampled.finish is not None:
            self._finish(live)
            return False
        return True

    def _propose(self, lives: Sequence[LiveSequence]) -> None:
        """Drafts for the next step of the sequences that go on, up to --speculate tokens and
        never past max_new_tokens."""
        going = [lv.seq for lv in lives if lv.seq.seq_id in self._live]
        wanted = [
            (seq.seq_id, seq.token_ids, min(self.speculate, seq.remaining_tokens - 1))
            for seq in going
        ]
        try:
            drafts = self.proposer.draft(wanted)
        except Exception:  # no draft is no harm: the step decodes one token each
            log.exception("drafting for %d sequences failed; they decode without", len(going))
            return
        for seq, draft in zip(going, drafts, strict=True):
            seq.draft = draft

    def _report_state(self) -> None:
        """The queue, the batch and the KV pool as they are now (after every change)."""
        if self.observer:
            self.runner.report_state(self.observer)

    def _finish(self, live: LiveSequence) -> None:
        self.runner.finish(live.seq)
        self._live.pop(live.seq.seq_id, None)
        self.proposer.release(live.seq.seq_id)

    def _fail_inbox(self, error: TgisError) -> None:
        """What is still queued when the loop ends gets `error`: requests never admitted, and
        calls (unless their caller gave up on them)."""
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                item.post([error])
            elif kind == "call" and item[1].set_running_or_notify_cancel():
                item[1].set_exception(error)

    def _fail_all(self, error: TgisError) -> None:
        for live in list(self._live.values()):
            if live.finish_reason is None:
                live.handle.post([error])
        self._live.clear()


def _is_oom(exc: Exception) -> bool:
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


__all__ = ["Engine", "FinishReason"]
