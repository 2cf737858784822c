"""`tgis benchmark --engine`: drive a backend in-process (no HTTP), as TGI's
text-generation-benchmark does, and measure prefill and decode per batch size.

    backend = load_backend(model_dir, dtype=None, max_batch=8, prompt_tokens=128, decode_tokens=16)
    bench = EngineBenchmark(backend, [1, 2, 4, 8], prompt_tokens=128, decode_tokens=16, runs=5)
    try:
        bench.execute(console)
    except KeyboardInterrupt:
        pass
    steps = bench.summaries()      # one engine_steps entry per batch size measured

Each run prefills `batch` prompts of random token ids (seeded, special ids avoided) at once, then
runs `decode_tokens` greedy decode steps over the whole batch, then releases the sequences.
Prefill latency is one sample per run; decode latency one sample per step. Throughputs come from
the means: prefill batch * prompt_tokens / mean, decode batch / mean (one token per sequence).

Then the same batch goes once through the serving engine's loop (tgis.engine.Engine, run on
this thread as `tgis serve` runs it; the requests sent from an event loop in another thread):
each decode step of the whole batch is one sample of the loop's step (`decode_step_s`: from
the step before's tokens handed over to its own, scheduling included), of its forward
(`decode_forward_s`), and of the host's work in it (`decode_host_s`: the step less the time the
host waited for the device, or less its forward where the device's time is not known:
scheduling, sampling's launch, stop rules, handing tokens over).

With `simulated_device_ms` the backend is a timer (tgis.backends.simulated) over the model's
vocabulary and the engine's forwards and sampling run on a `SimulatedStream`, whose steps take
that long on a timeline of their own: each loop step also gives the device's busy time
(`decode_device_s`), the host work hidden behind it (`decode_hidden_host_s`: the device's
time less the host's wait for it), and the host work the device waited for
(`decode_exposed_host_s`: the step less the device's busy time).

The loop's requests decode greedily (`sampling` "greedy"), or (`sampling` "mixed") in turns
of four kinds, as a served batch mixes them (`MIXED_SAMPLING`): greedy; seeded sampling at
temperature 0.8 with top-p 0.9; greedy with a repetition penalty of 1.2; greedy with two stop
strings.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from tgis.backends.simulated import SimulatedBackend
from tgis.benchmark.metrics import distribution
from tgis.engine.backend import Backend, FedTokens, PackedItem, PagedBackend, PrefillItem
from tgis.engine.stream import DeviceStream, SimulatedStream
from tgis.errors import ConfigError

if TYPE_CHECKING:
    from tgis.engine.engine import Engine
    from tgis.engine.types import EngineObserver

# The serving loop's requests under `sampling` "mixed", in turns (module doc). The stop
# strings are words of no tokenizer's vocabulary, so each request still runs its full length.
MIXED_SAMPLING: tuple[dict[str, Any], ...] = (
    {},
    {"do_sample": True, "temperature": 0.8, "top_p": 0.9},
    {"repetition_penalty": 1.2},
    {"stop": ["<|tgis-bench-stop|>", "\u241e\u241e\u241e"]},
)
SAMPLING_KINDS = ("greedy", "mixed")

# The largest KV block of any device (cuda's): pools sized in whole blocks of it fit every device.
MAX_BLOCK = 256


def parse_batch_sizes(text: str) -> list[int]:
    """`"1,2,4"` -> [1, 2, 4]; ConfigError naming --batch-sizes when not positive integers."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes):
        raise ConfigError(
            f"--batch-sizes {text!r} must list positive integers", "e.g. --batch-sizes 1,2,4,8"
        )
    return sizes


def default_device() -> str:
    """The device to run on: "cuda" when torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_backend(
    model_dir: Path,
    device: str,
    dtype: str | None,
    max_batch: int,
    prompt_tokens: int,
    decode_tokens: int,
    compile: bool = False,
    num_shard: int = 1,
    model_impl: str = "auto",
    quantize: str | None = None,
    kv_cache_dtype: str | None = None,
) -> Backend | PagedBackend:
    """The backend `tgis serve` would run for `model_dir` (backends/choose.py picks it from the
    same validated config), sized for `max_batch` sequences of the run and warmed up as serve
    warms it (CUDA graphs recorded, or with `compile` decode compiled, here); over `num_shard`
    tensor-parallel processes when more than 1; `model_impl`, `quantize` and `kv_cache_dtype`
    as `tgis serve --model-impl`, `--quantize` and `--kv-cache-dtype` take them (int4 in its
    default groups)."""
    from tgis.backends.choose import choose_backend
    from tgis.backends.choose import load_backend as load_chosen
    from tgis.backends.registry import detect_backend
    from tgis.config import LauncherArgs, build_serve_config
    from tgis.hub import read_model_facts
    from tgis.warmup import run_warmup

    total = prompt_tokens + decode_tokens + 1
    facts = read_model_facts(model_dir)
    args = LauncherArgs(
        model_id=str(model_dir),
        backend=device,
        dtype=dtype,
        max_concurrent_requests=max_batch,
        max_batch_size=max_batch,
        max_input_tokens=prompt_tokens,
        max_total_tokens=total,
        max_batch_prefill_tokens=max_batch * prompt_tokens,
        max_batch_total_tokens=max_batch * -(-total // MAX_BLOCK) * MAX_BLOCK,
        # The engine decodes as asked: --compile builds (or loads) its graphs before measuring.
        compile=compile,
        num_shard=num_shard,
        master_port=free_port() if num_shard > 1 else None,
        model_impl=model_impl,
        quantize=quantize,
        kv_cache_dtype=kv_cache_dtype,
    )
    config = build_serve_config(args, facts, {}, detect_backend)
    backend = load_chosen(
        config, model_dir, choose_backend(config, facts), compile_in_background=False
    )
    try:
        run_warmup(backend, config)
    except BaseException:
        close = getattr(backend, "close", None)
        if close is not None:  # tensor-parallel shards
            close()
        raise
    return backend


def free_port() -> int:
    """A free TCP port on this machine (the shards' rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def special_token_ids(model_dir: Path) -> set[int]:
    """bos/eos/pad ids of the model's config.json (none when it cannot be read)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int):
                ids.add(item)
    return ids


@dataclass
class BatchMeasure:
    """What the runs of one batch size measured (seconds)."""

    batch_size: int
    prefill: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    # Decode steps of the whole batch in the engine's loop.
    loop: list[LoopStep] = field(default_factory=list)

    def summary(self, prompt_tokens: int, decode_tokens: int) -> dict[str, Any]:
        """The `engine_steps` entry of the results schema."""
        prefill, decode = distribution(self.prefill), distribution(self.decode)
        loop: dict[str, Any] = {}
        if self.loop:
            loop = {
                "decode_step_s": distribution([s.step for s in self.loop]),
                "decode_forward_s": distribution([s.forward for s in self.loop]),
                "decode_host_s": distribution([s.host for s in self.loop]),
            }
            if any(s.device for s in self.loop):
                loop["decode_device_s"] = distribution([s.device for s in self.loop])
                loop["decode_hidden_host_s"] = distribution([s.hidden for s in self.loop])
                loop["decode_exposed_host_s"] = distribution([s.exposed for s in self.loop])
        return {
            "batch_size": self.batch_size,
            "runs": len(self.prefill),
            "prompt_tokens": prompt_tokens,
            "decode_tokens": decode_tokens,
            "prefill_latency_s": prefill,
            "prefill_tokens_per_s": (
                self.batch_size * prompt_tokens / prefill["mean"] if prefill else 0.0
            ),
            "decode_latency_s": decode,
            "decode_tokens_per_s": self.batch_size / decode["mean"] if decode else 0.0,
            **loop,
        }


@dataclass(frozen=True)
class LoopStep:
    """One decode step of the engine's loop (seconds): from the step before's end to its own,
    its forward, the time the host waited for the device in it, and the device's busy time
    (0: not known, a real device)."""

    step: float
    forward: float
    waited: float = 0.0
    device: float = 0.0

    @property
    def host(self) -> float:
        """The host's work in the step, hidden behind the device or not."""
        return self.step - max(self.forward, self.waited)

    @property
    def hidden(self) -> float:
        """The host's work done while the device was busy."""
        return max(0.0, self.device - self.waited)

    @property
    def exposed(self) -> float:
        """The host's work the device waited for: the step less the device's busy time."""
        return max(0.0, self.step - self.device)


class LoopTimings:
    """An EngineObserver keeping each decode step's rows and `LoopStep`, the device's times
    read from `stream` (the engine's) between one step's end and the next."""

    def __init__(self, stream: DeviceStream | None = None) -> None:
        self.stream = stream
        self.decode: list[tuple[int, LoopStep]] = []
        self._last: tuple[float, float, float] | None = None  # end, busy, waited

    def on_step(
        self, method: str, batch_size: int, tokens: int, duration: float, forward: float
    ) -> None:
        now = time.perf_counter()
        busy = self.stream.busy_s if self.stream is not None else 0.0
        waited = self.stream.waited_s if self.stream is not None else 0.0
        if method == "next_token" and self._last is not None:
            end, busy_before, waited_before = self._last
            self.decode.append(
                (
                    batch_size,
                    LoopStep(now - end, forward, waited - waited_before, busy - busy_before),
                )
            )
        self._last = (now, busy, waited)

    def on_step_failure(self, method: str, reason: str) -> None:
        pass

    def on_concatenation(self) -> None:
        pass

    def on_batch_state(
        self, waiting: int, running: int, input_tokens: int, max_remaining: int
    ) -> None:
        pass

    def on_kv_state(self, *counts: int) -> None:
        pass

    def on_speculation(self, draft_tokens: int, accepted_tokens: int, emitted: int) -> None:
        pass

    def on_images(self, encoded: int, cached: int) -> None:
        pass


class EngineBenchmark:
    """Prefill and decode timings of `backend` per batch size; `summaries()` valid any time."""

    def __init__(
        self,
        backend: Backend | PagedBackend,
        batch_sizes: Sequence[int],
        prompt_tokens: int,
        decode_tokens: int,
        runs: int,
        seed: int = 0,
        warmups: int = 1,
        avoid_ids: set[int] | None = None,
        engine: Callable[[EngineObserver, DeviceStream | None], Engine] | None = None,
        stream: Callable[[], DeviceStream] | None = None,
        sampling: str = "greedy",
    ) -> None:
        """engine: builds the serving engine over `backend` with an observer and a device
        stream (its loop is then measured per batch size too: `serving_engines`); None: the
        backend alone. stream: makes the stream each engine's steps run on (a simulated
        device's; None: the device's own). sampling: the loop's requests' (module doc)."""
        if sampling not in SAMPLING_KINDS:
            raise ConfigError(
                f"--sampling {sampling!r} is not one of {', '.join(SAMPLING_KINDS)}",
                "use --sampling greedy (every request) or mixed (four kinds in turns)",
            )
        self.engine, self.stream, self.sampling = engine, stream, sampling
        self.backend, self.batch_sizes = backend, list(batch_sizes)
        self.prompt_tokens, self.decode_tokens = prompt_tokens, decode_tokens
        self.runs, self.warmups = runs, warmups
        self.rng = random.Random(seed)
        avoid = avoid_ids or set()
        self.token_pool = [i for i in range(backend.vocab_size) if i not in avoid]
        self.measures: list[BatchMeasure] = []
        self._next_id = 0

    def summaries(self) -> list[dict[str, Any]]:
        """One summary per batch size with at least one finished run."""
        return [
            m.summary(self.prompt_tokens, self.decode_tokens) for m in self.measures if m.prefill
        ]

    def execute(self, console: Console | None = None) -> list[dict[str, Any]]:
        """Warm up and measure every batch size, showing progress on `console`."""
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=console or Console(quiet=True),
        )
        with progress:
            for batch in self.batch_sizes:
                task = progress.add_task(f"batch {batch}", total=self.warmups + self.runs)
                measure = BatchMeasure(batch)
                self.measures.append(measure)
                for index in range(self.warmups + self.runs):
                    self.run_once(batch, measure if index >= self.warmups else None)
                    progress.advance(task)
                if self.engine is not None:
                    stream = self.stream() if self.stream is not None else None
                    timings = LoopTimings(stream)
                    engine = self.engine(timings, stream)
                    try:
                        measure.loop = self.loop_steps(engine, timings, batch)
                    finally:
                        if stream is not None:
                            stream.close()
        return self.summaries()

    def loop_steps(self, engine: Engine, timings: LoopTimings, batch: int) -> list[LoopStep]:
        """`batch` random prompts through `engine`'s loop (observed by `timings`), run on this
        thread until they are done: each decode step of the whole batch."""
        from tgis.engine.types import GenerationRequest
        from tgis.params import GenerateParameters

        kinds = MIXED_SAMPLING if self.sampling == "mixed" else MIXED_SAMPLING[:1]
        requests = [
            GenerationRequest(
                f"bench-{i}",
                tuple(self.rng.choices(self.token_pool, k=self.prompt_tokens)),
                GenerateParameters(
                    max_new_tokens=self.decode_tokens,
                    ignore_eos=True,
                    seed=i if kinds[i % len(kinds)].get("do_sample") else None,
                    **kinds[i % len(kinds)],
                ),
            )
            for i in range(batch)
        ]
        failures: list[BaseException] = []

        async def send_all() -> None:
            async def one(request: GenerationRequest) -> None:
                async for _ in engine.generate(request):
                    pass

            await asyncio.gather(*(one(r) for r in requests))

        def client() -> None:
            try:
                while not engine.healthy():  # until the loop below runs
                    time.sleep(0.005)
                asyncio.run(send_all())
            except BaseException as exc:  # reported on this thread, after the loop
                failures.append(exc)
            finally:
                engine.stop()

        sender = threading.Thread(target=client, name="tgis-bench-client", daemon=True)
        sender.start()
        engine.run()
        sender.join()
        if failures:
            raise failures[0]
        return [step for rows, step in timings.decode if rows == batch]

    def run_once(self, batch: int, measure: BatchMeasure | None) -> None:
        """Prefill `batch` random prompts, decode them greedily, release them; record the
        timings in `measure` (none for a warmup run). A run cut short records nothing."""
        ids = list(range(self._next_id, self._next_id + batch))
        self._next_id += batch
        items = [
            PrefillItem(seq_id, tuple(self.rng.choices(self.token_pool, k=self.prompt_tokens)))
            for seq_id in ids
        ]
        if self.backend.capacity.block_size is not None:
            self._run_paged(items, measure)
            return
        started: list[int] = []
        prefill_s, decode_s = 0.0, []
        try:
            start = time.perf_counter()
            logits = self.backend.prefill(items).last
            started = ids
            tokens = logits.argmax(dim=-1).tolist()  # .tolist() waits for the device
            prefill_s = time.perf_counter() - start
            for _ in range(self.decode_tokens):
                start = time.perf_counter()
                tokens = self.backend.decode(ids, tokens).argmax(dim=-1).tolist()
                decode_s.append(time.perf_counter() - start)
        finally:
            for seq_id in started:
                self.backend.release(seq_id)
        if measure is not None:
            measure.prefill.append(prefill_s)
            measure.decode.extend(decode_s)

    def _run_paged(self, items: list[PrefillItem], measure: BatchMeasure | None) -> None:
        """`run_once` on a paged backend: each sequence gets its own run of blocks."""
        backend: PagedBackend = self.backend  # type: ignore[assignment]
        size = backend.capacity.block_size or 1
        per_seq = -(-(self.prompt_tokens + self.decode_tokens + 1) // size)
        tables = [tuple(range(r * per_seq, (r + 1) * per_seq)) for r in range(len(items))]
        start = time.perf_counter()
        out = backend.forward(
            [PackedItem(i.seq_id, i.input_ids, 0, t) for i, t in zip(items, tables, strict=True)]
        )
        tokens = out.last.argmax(dim=-1).tolist()  # .tolist() waits for the device
        prefill_s, decode_s = time.perf_counter() - start, []
        for step in range(self.decode_tokens):
            start = time.perf_counter()
            packed = [
                PackedItem(i.seq_id, (token,), self.prompt_tokens + step, t)
                for i, token, t in zip(items, tokens, tables, strict=True)
            ]
            tokens = backend.forward(packed).last.argmax(dim=-1).tolist()
            decode_s.append(time.perf_counter() - start)
        if measure is not None:
            measure.prefill.append(prefill_s)
            measure.decode.extend(decode_s)


def check_simulated(
    ms: float,
    compile: bool,
    num_shard: int,
    model_impl: str,
    quantize: str | None,
    kv_cache_dtype: str | None,
) -> None:
    """--simulated-device-ms's value, and none of the flags that shape a real forward."""
    if not 0 <= ms <= 10_000:
        raise ConfigError(
            f"--simulated-device-ms {ms} must be 0 to 10000 milliseconds", "e.g. 2 for a 1B model"
        )
    given = forward_flags(compile, num_shard, model_impl, quantize, kv_cache_dtype)
    if given:
        raise ConfigError(
            f"{given[0]} shapes the model's forward, which --simulated-device-ms replaces by a "
            "timer",
            f"drop {given[0]} or --simulated-device-ms",
        )


def forward_flags(
    compile: bool,
    num_shard: int,
    model_impl: str,
    quantize: str | None,
    kv_cache_dtype: str | None,
) -> list[str]:
    """The flags given that shape the model's forward in `--engine` runs."""
    return [
        flag
        for given, flag in (
            (compile, "--compile"),
            (num_shard != 1, "--num-shard"),
            (model_impl != "auto", "--model-impl"),
            (quantize is not None, "--quantize"),
            (kv_cache_dtype is not None, "--kv-cache-dtype"),
        )
        if given
    ]


def simulated_backend(model_dir: Path, max_batch: int, max_tokens: int) -> SimulatedBackend:
    """A simulated device over `model_dir`'s vocabulary (its config's `vocab_size`)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 2:
        raise ConfigError(f"{model_dir / 'config.json'} has no vocab_size")
    return SimulatedBackend(vocab, max_batch, max_tokens)


class OnStream:
    """A paged backend whose forwards run on `stream`, each one step (the direct runs of a
    simulated device)."""

    def __init__(self, backend: PagedBackend, stream: DeviceStream) -> None:
        self.backend, self.stream = backend, stream
        self.name, self.device, self.vocab_size = backend.name, backend.device, backend.vocab_size

    @property
    def capacity(self) -> Any:
        return self.backend.capacity

    def forward(self, items: Sequence[PackedItem], fed: FedTokens | None = None) -> Any:
        """The step's logits, once the step's time on the device is up."""
        out = self.stream.submit(lambda: self.backend.forward(items, fed), step=True)
        self.stream.submit(lambda: None).result()
        return out.result()

    def close(self) -> None:
        self.stream.close()


def serving_engines(
    backend: Backend | PagedBackend,
    model_dir: Path,
    max_batch: int,
    async_scheduling: bool | None = None,
) -> Callable[[EngineObserver, DeviceStream | None], Engine]:
    """What builds the engine `tgis serve` would run over `backend` (not started; an engine
    stops once, so one per measurement), its scheduler's budgets the backend's: `max_batch`
    sequences, prompts prefilled in steps of the backend's size. The tokenizer is read once."""
    from tgis.engine.engine import Engine
    from tgis.engine.scheduler import SchedulerLimits
    from tgis.launch import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model_dir, tokenizer)
    capacity = backend.capacity
    limits = SchedulerLimits(
        max_batch_prefill_tokens=capacity.max_sequence_tokens * max_batch,
        max_batch_total_tokens=capacity.kv_tokens,
        max_sequences=min(capacity.max_sequences, max_batch),
        prefill_step_tokens=capacity.prefill_step_tokens,
        prompt_logit_tokens=capacity.prompt_logit_tokens,
    )

    def build(observer: EngineObserver, stream: DeviceStream | None = None) -> Engine:
        return Engine(
            backend, tokenizer, limits, max_batch, eos, observer, stream=stream,
            async_scheduling=async_scheduling,
        )  # fmt: skip

    return build


def run_engine(
    model_id: str,
    batch_sizes: Sequence[int],
    prompt_tokens: int,
    decode_tokens: int,
    runs: int,
    dtype: str | None,
    seed: int,
    console: Console | None = None,
    compile: bool = False,
    num_shard: int = 1,
    model_impl: str = "auto",
    quantize: str | None = None,
    kv_cache_dtype: str | None = None,
    simulated_device_ms: float | None = None,
    async_scheduling: bool | None = None,
    sampling: str = "greedy",
) -> tuple[dict[str, Any], bool]:
    """Load `model_id` (a directory or cached id) and measure it; returns the results document
    and whether Ctrl-C cut the run short (the document then holds the batch sizes measured).
    `simulated_device_ms`: the model's forward replaced by a simulated device's steps of that
    many milliseconds (module doc)."""
    from tgis.benchmark.results import build_results
    from tgis.hub import resolve_model_dir

    for flag, value in (
        ("--prompt-tokens", prompt_tokens),
        ("--decode-tokens", decode_tokens),
        ("--runs", runs),
    ):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    model_dir = resolve_model_dir(model_id)
    streams: Callable[[], DeviceStream] | None = None
    if simulated_device_ms is None:
        device = default_device()
        backend = load_backend(
            model_dir, device, dtype, max(batch_sizes), prompt_tokens, decode_tokens, compile,
            num_shard, model_impl, quantize, kv_cache_dtype,
        )  # fmt: skip
        measured: Backend | PagedBackend = backend
    else:
        check_simulated(
            simulated_device_ms, compile, num_shard, model_impl, quantize, kv_cache_dtype
        )
        device = "simulated"
        streams = partial(SimulatedStream, simulated_device_ms / 1e3)
        simulated = simulated_backend(
            model_dir, max(batch_sizes), prompt_tokens + decode_tokens + 1
        )
        backend, measured = simulated, OnStream(simulated, streams())
    bench = EngineBenchmark(
        measured,
        batch_sizes,
        prompt_tokens,
        decode_tokens,
        runs,
        seed,
        avoid_ids=special_token_ids(model_dir),
        engine=serving_engines(backend, model_dir, max(batch_sizes), async_scheduling),
        stream=streams,
        sampling=sampling,
    )
    interrupted = False
    try:
        bench.execute(console)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        close = getattr(measured, "close", None)
        if close is not None:  # tensor-parallel shards, a simulated device's stream
            close()
    config = {
        "mode": "engine",
        "model": model_id,
        "device": device,
        "dtype": dtype,
        "batch_sizes": list(batch_sizes),
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "runs": runs,
        "seed": seed,
        "compile": compile,
        "num_shard": num_shard,
        "model_impl": model_impl,
        "quantize": quantize,
        "kv_cache_dtype": kv_cache_dtype,
        "simulated_device_ms": simulated_device_ms,
        "async_scheduling": async_scheduling,
        "sampling": sampling,
        "interrupted": interrupted,
    }
    return build_results(config, [], engine_steps=bench.summaries()), interrupted
