"""The engine's two kinds of step, one class each behind `StepRunner`.

The engine (tgis.engine.engine) keeps what every step shares: the inbox, admission, turning
sampled tokens into events (`Engine._emit`) and the failures of requests and steps
(`Engine._fail_step`, `Engine._guarded`). A runner owns its scheduler and what its kind of
backend needs: planning and running a step, what a sequence that leaves gives back, the
scheduler state reported for metrics, and whether its steps can verify speculative drafts.
`Engine.__init__` picks one from the backend's capacity:

- `SlotSteps`, a slot `Backend` (capacity.block_size None: the static devices and the generic
  transformers path): the `Scheduler`'s prefill or decode steps over worst-case reservations;
  a running sequence that leaves frees its slot in the backend.
- `PackedSteps`, a `PagedBackend`: the `PagedScheduler`'s packed steps over its block pool
  (prefill chunks and decodes in one forward; a decode may carry a draft, verified from the
  same forward); the pool's state is reported with the batch's.

A batched step that raises is run again one sequence at a time before anything fails: a row
that poisons its batch (a bad input, a prefix, a sampling parameter) fails alone and its
neighbours go on. The forward and the sampling are retried apart, because a slot backend's
forward has already advanced its cache when the sampling fails.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, cast

from tgis.engine.backend import Backend, FedTokens, PackedItem, PackedOutput, PagedBackend
from tgis.engine.live import LiveSequence
from tgis.engine.paged_scheduler import PackedStep, PagedScheduler
from tgis.engine.sampling import PendingSample, SampleOutput, SamplingBatch
from tgis.engine.scheduler import Scheduler, Step, StepKind
from tgis.engine.sequence import SeqStatus
from tgis.engine.sequence import Sequence as SchedSeq
from tgis.engine.speculation import Verified, verify
from tgis.engine.stream import DeviceStream, Pending
from tgis.engine.types import EngineObserver, ImageInput

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tgis.engine")

BackendT = TypeVar("BackendT", Backend, PagedBackend)
SchedulerT = TypeVar("SchedulerT", Scheduler, PagedScheduler)
StepT = TypeVar("StepT", Step, PackedStep)


class StaleLogits(RuntimeError):
    """A step's batch sampling did not give its choice, and its logits can no longer be read
    to sample each row again (async scheduling launched the next step over them)."""


class NonFiniteScores(ArithmeticError):
    """A sequence's forward produced a NaN or an infinity."""

    def __init__(self) -> None:
        super().__init__(
            "the model's scores for this sequence are not finite (NaN or infinity): the "
            "request fails alone and the KV blocks it wrote are not reused"
        )


class StepHost(Protocol):
    """What a runner calls on the engine that drives it (`tgis.engine.engine.Engine`): the
    sequences alive, the model's EOS ids, and the handling every kind of step shares."""

    eos_token_ids: tuple[int, ...]
    _live: dict[int, LiveSequence]
    stream: DeviceStream

    def _guarded(self, live: LiveSequence, work: Callable[..., Any], *args: Any) -> None: ...

    def _fail_step(self, method: str, lives: list[LiveSequence], exc: Exception) -> None: ...

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
    ) -> None: ...


class StepRunner(ABC, Generic[BackendT, SchedulerT, StepT]):
    """Runs the steps (StepT) that `scheduler` plans on `backend` for `engine`, on the model
    thread."""

    # Whether its steps can verify draft tokens (the engine's `speculate`).
    speculates: ClassVar[bool]

    def __init__(self, engine: StepHost, backend: BackendT, scheduler: SchedulerT) -> None:
        self.engine = engine
        self.backend: BackendT = backend
        self.scheduler: SchedulerT = scheduler

    def run_next(self) -> None:
        """Plan the next step and run it: the forward, the sampling, the tokens handed to the
        engine. Nothing when no step can run now."""
        step = cast("StepT | None", self.scheduler.schedule())  # SchedulerT plans StepT
        if step is not None:
            lives = [self.engine._live[s.seq_id] for s in step.sequences]
            joined = step.kind is StepKind.PREFILL and len(self.scheduler.running) > len(lives)
            self._run(step, lives, joined)

    def finish(self, seq: SchedSeq) -> None:
        """`seq` left (finished, cancelled, failed): the scheduler frees its place."""
        self.scheduler.finish(seq)

    @property
    def has_work(self) -> bool:
        """Whether a step waits to be planned or run."""
        return self.scheduler.has_work

    def report_state(self, observer: EngineObserver) -> None:
        """The queue and the batch as they are now (after every change)."""
        running = self.scheduler.running
        observer.on_batch_state(
            len(self.scheduler.waiting),
            len(running),
            sum(s.total_tokens for s in running),
            max((s.remaining_tokens for s in running), default=0),
        )

    @abstractmethod
    def _run(self, step: StepT, lives: list[LiveSequence], joined: bool) -> None:
        """Run `step` over `lives`, its sequences' live state in order, and hand the tokens to
        the engine. `joined`: a prefill that joins a running batch (a concatenation, in the
        metrics)."""

    def _choose(
        self,
        method: str,
        lives: list[LiveSequence],
        logits: torch.Tensor | None,
        meanwhile: Callable[[], None] | None = None,
        launched: Pending[PendingSample] | None = None,
    ) -> tuple[list[LiveSequence], SampleOutput]:
        """One token per row of `logits`, or (the batch's sampling raised) per row alone: the
        sequences that got one, and their choice. `meanwhile` runs once, while the device
        samples. `launched`: the batch's sampling, submitted already (async scheduling).
        `logits` None: they may no longer be read (a later step's output may have replaced
        them in place, as a CUDA graph's buffer is): where the batch's sampling did not give
        the choice, `StaleLogits` is raised instead of sampling the rows again."""
        eos_token_ids = self.engine.eos_token_ids
        pending: PendingSample | None = None
        if launched is None and logits is None:
            raise StaleLogits("the step's sampling was not queued")
        if launched is None:
            assert logits is not None
            rows = [lv.row for lv in lives]
            launched = self.engine.stream.submit(
                lambda: SamplingBatch(rows, eos_token_ids).launch(logits)
            )
        if meanwhile is not None:
            meanwhile()
        try:
            pending = launched.result()
        except Exception as exc:
            error = exc
        if pending is not None:
            try:
                return self._finite(method, lives, pending.result())
            except Exception as exc:
                error = exc
        if logits is None:
            raise StaleLogits(f"{type(error).__name__}: {error}") from error
        if not self._retry_alone(method, lives, error):
            return [], SampleOutput.concat([])
        chosen, outputs = [], []
        for i, live in enumerate(lives):
            try:
                row = SamplingBatch([live.row], eos_token_ids).choose(logits[i : i + 1])
            except Exception as exc:
                self.engine._fail_step(method, [live], exc)
                continue
            chosen.append(live)
            outputs.append(row)
        return self._finite(method, chosen, SampleOutput.concat(outputs))

    def _finite(
        self, method: str, lives: list[LiveSequence], choice: SampleOutput
    ) -> tuple[list[LiveSequence], SampleOutput]:
        """`lives` and their `choice`, less the rows whose scores were not finite (a NaN or
        an infinity in the logits makes the chosen token's logprob NaN): each of those fails
        alone, and the blocks its forward wrote are never reused (`Sequence.poisoned`)."""
        bad = [i for i, logprob in enumerate(choice.logprobs) if math.isnan(logprob)]
        if not bad:
            return lives, choice
        for i in bad:
            lives[i].seq.poisoned = True
            self.engine._fail_step(method, [lives[i]], NonFiniteScores())
        failed = set(bad)
        kept = [i for i in range(len(lives)) if i not in failed]
        return [lives[i] for i in kept], choice.take(kept)

    def _retry_alone(self, method: str, lives: list[LiveSequence], exc: Exception) -> bool:
        """A step over `lives` raised `exc`: True when it is worth running each alone (there
        are several); a single sequence's failure is its own."""
        if len(lives) == 1:
            self.engine._fail_step(method, lives, exc)
            return False
        log.warning(
            "%s step over %d sequences failed (%s: %s); running each alone",
            method, len(lives), type(exc).__name__, exc,
        )  # fmt: skip
        return True


class SlotSteps(StepRunner[Backend, Scheduler, Step]):
    """A slot backend's steps: a prefill of whole prompts (the sequences take their slots) or
    one decode of the whole running batch, as the `Scheduler` plans them."""

    speculates = False

    def finish(self, seq: SchedSeq) -> None:
        """A running sequence's slot is freed in the backend too."""
        if seq.status is SeqStatus.RUNNING:
            self.backend.release(seq.seq_id)
        super().finish(seq)

    def _run(self, step: Step, lives: list[LiveSequence], joined: bool) -> None:
        engine = self.engine
        method = step.kind.value
        start = time.perf_counter()
        try:
            if step.kind is StepKind.PREFILL:
                for live in lives:
                    live.begin(start_time=time.monotonic())
                items = [lv.prefill_item() for lv in lives]
                out = self.backend.prefill(items)
                logits, prompt_logits = out.last, out.prompt
                tokens = sum(len(i.input_ids) for i in items)
            else:
                seq_ids = [lv.seq.seq_id for lv in lives]
                logits = self.backend.decode(seq_ids, [lv.last_token for lv in lives])
                prompt_logits, tokens = (), len(lives)
        except Exception as exc:
            if not self._retry_alone(method, lives, exc):
                return
            for live in lives:
                self._run(Step(step.kind, (live.seq,)), [live], False)
            return
        forward = time.perf_counter() - start
        sampled, choice = self._choose(method, lives, logits)
        for i, live in enumerate(lives):
            if prompt_logits and prompt_logits[i] is not None:
                engine._guarded(live, live.record_prefill, prompt_logits[i])
                engine._guarded(live, live.prompt_done)
        engine._emit(sampled, choice, method, tokens, start, forward, joined, bool(sampled))


class PackedSteps(StepRunner[PagedBackend, PagedScheduler, PackedStep]):
    """A paged backend's steps: one packed forward of the chunks the `PagedScheduler` plans
    over its block pool; the chunks that end at their last known token sample, and those with
    a draft verify it."""

    speculates = True

    def report_state(self, observer: EngineObserver) -> None:
        """The batch's state, then the block pool's (blocks used, prefix-cache hits and
        evictions, preemptions)."""
        super().report_state(observer)
        blocks = self.scheduler.blocks
        observer.on_kv_state(
            blocks.used_blocks,
            blocks.num_blocks,
            blocks.stats.queried_tokens,
            blocks.stats.hit_tokens,
            blocks.stats.evicted_blocks,
            self.scheduler.preemptions,
        )

    def _items(self, step: PackedStep, lives: list[LiveSequence]) -> list[PackedItem]:
        """The step's items for the backend, its new sequences begun and the features of the
        images its chunks reach encoded first."""
        now = time.monotonic()
        cached = 0
        for chunk, live in zip(step.chunks, lives, strict=True):
            if not live.started:
                live.begin(start_time=now)
                cached += live.images_cached(chunk.start)
        self._encode_images(step, lives, cached)
        return [
            PackedItem(
                chunk.seq.seq_id, chunk.token_ids, chunk.start, chunk.block_table,
                chunk.sample,
                (live.wants_prompt_logprobs and not live.prompt_recorded and not chunk.draft
                 and chunk.start < live.seq.prompt_len)
                or bool(chunk.draft),
                live.row_embeds(chunk.start, chunk.count), live.handle.request.adapter,
                live.grids, live.spans,
            )
            for chunk, live in zip(step.chunks, lives, strict=True)
        ]  # fmt: skip

    def _run(self, step: PackedStep, lives: list[LiveSequence], joined: bool) -> None:
        """One packed forward; the chunks that end at their last known token sample."""
        engine = self.engine
        method = step.kind.value
        start = time.perf_counter()
        try:
            items = self._items(step, lives)
            backend = self.backend
            out = engine.stream.submit(lambda: backend.forward(items), step=True).result()
        except Exception as exc:
            if not self._retry_alone(method, lives, exc):
                return
            for chunk, live in zip(step.chunks, lives, strict=True):
                self._run(PackedStep(step.kind, (chunk,)), [live], False)
            return
        forward = time.perf_counter() - start
        # out.last has a row per sampling chunk, in order; chunks with a draft are verified
        # from their logits at every position (out.prompt) instead.
        plain = [lv for lv, c in zip(lives, step.chunks, strict=True) if c.sample and not c.draft]
        drafted = [
            (lv, c.draft, part)
            for lv, c, part in zip(lives, step.chunks, out.prompt, strict=True)
            if c.draft
        ]
        wanted = bool(plain or drafted)
        logits = out.last
        if drafted and plain:
            sampling = [c for c in step.chunks if c.sample]
            logits = out.last[[i for i, c in enumerate(sampling) if not c.draft]]
        # The step's K/V are in the cache whatever the sampling does: the scheduler's host
        # bookkeeping runs while the device samples.
        complete = partial(self.scheduler.complete, step)
        if plain:
            sampled, choice = self._choose(method, plain, logits, complete)
        else:
            complete()
            sampled, choice = [], SampleOutput.concat([])
        verified = self._verify(method, drafted)
        for live, chunk, part in zip(lives, step.chunks, out.prompt, strict=True):
            if part is not None and not chunk.draft:
                engine._guarded(live, live.record_prefill, part, chunk.start)
        for live in sampled:
            engine._guarded(live, live.prompt_done)
        ok = bool(sampled or verified) or not wanted
        engine._emit(sampled, choice, method, step.tokens, start, forward, joined, ok, verified)
        # The accepted draft tokens' K/V are in the cache too (a sequence that has left
        # meanwhile is not RUNNING: `accept` leaves it be).
        for live, result in verified:
            self.scheduler.accept(live.seq, result.accepted)

    def _encode_images(self, step: PackedStep, lives: list[LiveSequence], cached: int) -> None:
        """The features of the images the step's chunks reach that are not encoded yet: one
        call of the backend's vision encoder for all of them (an image that two sequences
        hold, or one twice, encoded once); `cached` images were found in the prefix cache."""
        wanted: dict[bytes, ImageInput] = {}
        takers: list[tuple[LiveSequence, int, bytes]] = []
        for chunk, live in zip(step.chunks, lives, strict=True):
            for index in live.images_wanted(chunk.start, chunk.count):
                image = live.handle.request.images[index]
                wanted.setdefault(image.digest, image)
                takers.append((live, index, image.digest))
        observer = self.engine.observer
        if wanted:
            features = dict(
                zip(wanted, self.backend.encode_images(list(wanted.values())), strict=True)
            )
            for live, index, digest in takers:
                live.features[index] = features[digest]
        if observer is not None and (wanted or cached):
            observer.on_images(len(wanted), cached)

    def _verify(
        self, method: str, drafted: list[tuple[LiveSequence, tuple[int, ...], torch.Tensor | None]]
    ) -> list[tuple[LiveSequence, Verified]]:
        """The tokens of the sequences whose step verified a draft (alone when the batch's
        verification raised): the sequences that got them, and what they got."""
        if not drafted:
            return []
        eos_token_ids = self.engine.eos_token_ids
        try:
            results = verify(
                [lv.row for lv, _, _ in drafted],
                [part for _, _, part in drafted],  # type: ignore[misc]
                [draft for _, draft, _ in drafted],
                eos_token_ids,
            )
            return [(lv, r) for (lv, _, _), r in zip(drafted, results, strict=True)]
        except Exception as exc:
            if not self._retry_alone(method, [lv for lv, _, _ in drafted], exc):
                return []
        out = []
        for live, draft, part in drafted:
            try:
                (result,) = verify([live.row], [part], [draft], eos_token_ids)  # type: ignore[list-item]
            except Exception as exc:
                self.engine._fail_step(method, [live], exc)
                continue
            out.append((live, result))
        return out


@dataclass
class _InFlight:
    """A launched step of `PipelinedSteps`: what it runs, over whom, and its device work."""

    step: PackedStep
    lives: list[LiveSequence]
    joined: bool
    start: float  # perf_counter() when its launch began
    launch_s: float  # the host's seconds to launch it
    samples: list[bool]  # each chunk's `sample`, as launched (a reserved token changes it)
    plain: list[LiveSequence]  # the rows that sample, in the order of their sampled ids
    forward: Pending[PackedOutput]
    seq_ids: frozenset[int]
    sampling: Pending[PendingSample] | None = None
    # The rows of the forward's `last` that `plain` samples (None: all of them; fewer where
    # a sequence left between the forward's launch and its sampling's).
    taken: list[int] | None = None
    # Sequences that left while it ran: their blocks go back once it is done.
    retired: list[SchedSeq] = field(default_factory=list)

    def logits(self, out: PackedOutput) -> torch.Tensor:
        """The logits of the rows `plain` samples."""
        return out.last if self.taken is None else out.last[self.taken]


class PipelinedSteps(PackedSteps):
    """Async scheduling over a paged backend: while step N runs on the device, the host plans
    step N+1, launches it, and hands step N's tokens over.

    Each `run_next`:
    1. plans the next step, counting the tokens being sampled by the step in flight as known
       (each sampling sequence holds a placeholder at its end: `LiveSequence.reserve`);
    2. launches its forward before the step in flight's ids are on the host: the
       placeholders are read on the device from that step's sampled ids (`FedTokens`, on a
       backend whose capacity says `fed_tokens`), so the device goes from one step to the
       next without waiting for the host;
    3. waits for the step in flight's ids and writes them in place of the placeholders
       (`resolve`; a grammar moves on here);
    4. launches the new step's sampling, which needs the host's view (grammar masks,
       penalties, the rows still running): it is queued behind the forward, which the
       device is running meanwhile;
    5. hands the previous step's tokens over (stop rules, text, streaming) while the device
       runs the new one; a sequence that ends there has a row in the new step: its token is
       dropped, and its blocks go back once that step is done (`retire`, then `release`);
    6. counts the new step's positions as computed and reserves its sampled tokens' places.

    A backend that cannot read tokens on the device (tensor-parallel shards) launches the
    next step after step 3 instead: the host then waits for the ids (a small copy) between
    two steps. Either way scheduling and every per-token rule run while the device computes.
    A step that fails is undone (its positions uncomputed, their blocks out of the prefix
    cache) and its chunks run again alone, as `PackedSteps` runs them; the step launched on
    it is waited for and dropped, and planned again. So is a step whose batch sampling did
    not give its choice once the next one was launched: its ids never existed for the next
    step to read, and its logits may have been overwritten by the next step's (a CUDA
    graph's output buffer), so its rows are not sampled again from them. No drafts: the
    engine runs `PackedSteps` when it speculates.
    """

    speculates = False

    def __init__(self, engine: StepHost, backend: PagedBackend, scheduler: PagedScheduler) -> None:
        super().__init__(engine, backend, scheduler)
        self._in_flight: _InFlight | None = None
        self.fed_steps = 0  # steps launched before the ids of the step before were on the host

    @property
    def has_work(self) -> bool:
        """Whether a step waits to be planned or run, or is in flight."""
        return self.scheduler.has_work or self._in_flight is not None

    def finish(self, seq: SchedSeq) -> None:
        """`seq` left: its blocks go back now, or once the step in flight that writes them is
        done."""
        flight = self._in_flight
        if flight is not None and seq.seq_id in flight.seq_ids:
            self.scheduler.retire(seq)
            flight.retired.append(seq)
        else:
            self.scheduler.finish(seq)

    def run_next(self) -> None:
        step = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        lives: list[LiveSequence] = []
        joined = False
        if step is not None:
            lives = [self.engine._live[s.seq_id] for s in step.sequences]
            joined = step.kind is StepKind.PREFILL and len(self.scheduler.running) > len(lives)
        launch_failed = False
        early, fed = self._fed(step, lives, previous) if step is not None else (False, None)
        if step is not None and early:
            try:
                self._in_flight = self._launch(step, lives, joined, fed)
            except Exception:  # before anything reached the device: it runs after the tokens
                launch_failed = True
        resolved: tuple[PackedOutput, list[LiveSequence], SampleOutput] | None = None
        if previous is not None:
            resolved = self._resolve(previous)
            if resolved is None:  # it failed and ran again alone
                return
        if step is not None and (launch_failed or not early):
            # Launched now or run after the tokens: a sequence failed while the last step was
            # read back (its row's scores, its grammar) has left, and its chunk goes too.
            kept = [
                i for i, c in enumerate(step.chunks)
                if c.seq.seq_id in self.engine._live and c.seq.status is SeqStatus.RUNNING
            ]  # fmt: skip
            step = PackedStep(step.kind, tuple(step.chunks[i] for i in kept)) if kept else None
            lives = [lives[i] for i in kept]
            if step is not None and not early:
                try:
                    self._in_flight = self._launch(step, lives, joined, None)
                except Exception:
                    launch_failed = True
        flight = self._in_flight
        if flight is not None:
            self._sample(flight)
        if previous is not None and resolved is not None:
            self._conclude(previous, *resolved)
        if launch_failed and step is not None:
            # Run after the tokens: those that ended there leave the step first.
            kept = [i for i, live in enumerate(lives) if live.seq.status is SeqStatus.RUNNING]
            if kept:
                self._run(
                    PackedStep(step.kind, tuple(step.chunks[i] for i in kept)),
                    [lives[i] for i in kept], False,
                )  # fmt: skip
        flight = self._in_flight
        if flight is not None:
            self.scheduler.advance(flight.step)
            for live, sample in zip(flight.lives, flight.samples, strict=True):
                if sample and live.seq.status is SeqStatus.RUNNING:
                    live.reserve()

    def _fed(
        self, step: PackedStep, lives: list[LiveSequence], previous: _InFlight | None
    ) -> tuple[bool, FedTokens | None]:
        """Whether `step` may launch before `previous`'s ids are on the host, and its items
        whose last token `previous` is sampling, to be read on the device (None: none). It
        may not where some are and the backend cannot read them, or `previous`'s sampling was
        not queued."""
        # A chunk that ends at a reserved token's place holds its placeholder last.
        items = [
            i for i, (chunk, live) in enumerate(zip(step.chunks, lives, strict=True))
            if live.reserved and chunk.sample
        ]  # fmt: skip
        if not items:
            return True, None
        rows = {id(live): row for row, live in enumerate(previous.plain)} if previous else {}
        if (
            previous is None
            or previous.sampling is None
            or not self.backend.capacity.fed_tokens
            or any(id(lives[i]) not in rows for i in items)
        ):
            return False, None
        sampling = previous.sampling
        return True, FedTokens(
            tuple(items),
            tuple(rows[id(lives[i])] for i in items),
            lambda: sampling.result().token_ids,
        )

    def _drop_launched(self) -> None:
        """The step launched on the last one's ids is void: wait for the device to be done
        with it, give back the blocks of the sequences that left meanwhile, and forget it
        (its positions were never counted as computed: it is planned again)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        try:
            flight.forward.result()
        except Exception:  # its input was the failed step's: nothing of it is used
            log.debug("a step launched on a failed one failed too", exc_info=True)
        for seq in flight.retired:
            self.scheduler.release(seq)

    def _launch(
        self,
        step: PackedStep,
        lives: list[LiveSequence],
        joined: bool,
        fed: FedTokens | None,
    ) -> _InFlight:
        """Submit the step's forward to the stream, without waiting."""
        start = time.perf_counter()
        items = self._items(step, lives)
        samples = [chunk.sample for chunk in step.chunks]
        plain = [lv for lv, sample in zip(lives, samples, strict=True) if sample]
        backend = self.backend
        if fed is None:
            forward = self.engine.stream.submit(lambda: backend.forward(items), step=True)
        else:
            forward = self.engine.stream.submit(lambda: backend.forward(items, fed), step=True)
            self.fed_steps += 1
        return _InFlight(
            step, lives, joined, start, time.perf_counter() - start, samples, plain, forward,
            frozenset(s.seq_id for s in step.sequences),
        )  # fmt: skip

    def _sample(self, flight: _InFlight) -> None:
        """Queue the sampling of the launched step's rows still running, behind its forward
        (a failure to queue it leaves them to be sampled when the step is read back)."""
        if not flight.plain:
            return
        start = time.perf_counter()
        running = self.engine._live
        kept = [
            i for i, live in enumerate(flight.plain)
            if live.seq.seq_id in running and live.seq.status is SeqStatus.RUNNING
        ]  # fmt: skip
        if len(kept) < len(flight.plain):
            flight.plain = [flight.plain[i] for i in kept]
            flight.taken = kept
        if flight.plain:
            rows, eos = [lv.row for lv in flight.plain], self.engine.eos_token_ids
            forward = flight.forward
            try:
                flight.sampling = self.engine.stream.submit(
                    lambda: SamplingBatch(rows, eos).launch(flight.logits(forward.result()))
                )
            except Exception:  # the forward is queued: its rows are sampled when it is read
                log.exception("queueing a step's sampling failed; it samples when read back")
        flight.launch_s += time.perf_counter() - start

    def _resolve(
        self, flight: _InFlight
    ) -> tuple[PackedOutput, list[LiveSequence], SampleOutput] | None:
        """Wait for the step and put its sampled ids in place; None when it did not stand
        (`_again_alone`)."""
        method = flight.step.kind.value
        try:
            out = flight.forward.result()
        except Exception as exc:
            self._again_alone(flight, exc)
            return None
        for seq in flight.retired:  # the step that wrote their blocks is done
            self.scheduler.release(seq)
        flight.retired.clear()
        sampled: list[LiveSequence] = []
        choice = SampleOutput.concat([])
        if flight.plain:
            # A step launched since may have put its logits where this one's were (a CUDA
            # graph's output buffer): past the batch's own choice they are not read.
            logits = None if self._in_flight is not None else flight.logits(out)
            try:
                sampled, choice = self._choose(
                    method, flight.plain, logits, launched=flight.sampling
                )
            except StaleLogits as exc:
                self._again_alone(flight, exc)
                return None
        blocks, engine = self.scheduler.blocks, self.engine
        for live, token in zip(sampled, choice.token_ids, strict=True):
            if live.reserved:
                # A grammar that refuses the token ends that request alone.
                engine._guarded(live, live.resolve, token)
                if live.seq.seq_id in engine._live:
                    blocks.resolve(live.seq.seq_id, len(live.seq.token_ids) - 1, token)
        # Its positions are in the cache: their full blocks become prefix-cache entries.
        self.scheduler.land(flight.step)
        return out, sampled, choice

    def _again_alone(self, flight: _InFlight, exc: Exception) -> None:
        """The step did not stand (its forward raised, or its sampling did past the point
        where its logits could be read again): the step launched on it is dropped, it is
        undone, and each of its chunks runs again alone, as `PackedSteps` runs them (a chunk
        whose sequence was preempted meanwhile is planned anew instead)."""
        self._drop_launched()
        self._undo(flight)
        for seq in flight.retired:
            self.scheduler.release(seq)
        flight.retired.clear()
        if not self._retry_alone(flight.step.kind.value, flight.lives, exc):
            return
        blocks = self.scheduler.blocks
        for chunk, live in zip(flight.step.chunks, flight.lives, strict=True):
            seq = live.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            table = blocks.block_table(seq.seq_id)[: len(chunk.block_table)]
            if tuple(table) == chunk.block_table:  # else preempted and admitted again
                self._run(PackedStep(flight.step.kind, (chunk,)), [live], False)

    def _undo(self, flight: _InFlight) -> None:
        """The step's forward failed: nothing it was to compute counts as computed."""
        for chunk, live in zip(flight.step.chunks, flight.lives, strict=True):
            live.unreserve()
            self.scheduler.rewind(chunk.seq, chunk.start)

    def _conclude(
        self,
        flight: _InFlight,
        out: PackedOutput,
        sampled: list[LiveSequence],
        choice: SampleOutput,
    ) -> None:
        """Hand the step's tokens over (and its prompt details), as `PackedSteps._run` does."""
        engine = self.engine
        for live, chunk, part in zip(flight.lives, flight.step.chunks, out.prompt, strict=True):
            if part is not None:
                engine._guarded(live, live.record_prefill, part, chunk.start)
        for live in sampled:
            engine._guarded(live, live.prompt_done)
        ok = bool(sampled) or not flight.plain
        engine._emit(
            sampled, choice, flight.step.kind.value, flight.step.tokens, flight.start,
            flight.launch_s, flight.joined, ok,
        )  # fmt: skip
