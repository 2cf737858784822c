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
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from tgis.benchmark.metrics import distribution
from tgis.engine.backend import Backend, PackedItem, PagedBackend, PrefillItem
from tgis.errors import ConfigError

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
) -> Backend | PagedBackend:
    """The backend `tgis serve` would run for `model_dir`, sized for `max_batch` sequences of
    the run: the paged one for llama-family models (its CUDA graphs recorded here; over
    `num_shard` tensor-parallel processes when more than 1), the slot one for the others and
    with `compile` (decode through torch.compile, compiled here)."""
    import torch

    from tgis.backends.paged_torch import PagedTorchBackend, paged_unsupported_reason
    from tgis.backends.torch_device import load_causal_lm
    from tgis.backends.torch_dynamic import TorchDynamicBackend

    total = prompt_tokens + decode_tokens + 1
    if num_shard > 1:
        return _sharded(model_dir, device, dtype, max_batch, prompt_tokens, total, num_shard)
    model = load_causal_lm(model_dir, torch.device(device), dtype)
    if paged_unsupported_reason(model, compile) is None:
        paged = PagedTorchBackend(
            model,
            max_sequences=max_batch,
            max_sequence_tokens=total,
            max_prefill_tokens=max_batch * prompt_tokens,
            kv_tokens=max_batch * -(-total // MAX_BLOCK) * MAX_BLOCK,
        )
        if paged.graphs is not None:
            paged.warmup(max_batch, prompt_tokens)
        return paged
    backend = TorchDynamicBackend(
        model,
        max_sequences=max_batch,
        max_sequence_tokens=total,
        kv_tokens=max_batch * total,
        compile=compile,
    )
    if compile:
        backend.warmup(max_batch, prompt_tokens)
    return backend


def _sharded(
    model_dir: Path,
    device: str,
    dtype: str | None,
    max_batch: int,
    prompt_tokens: int,
    total: int,
    num_shard: int,
) -> PagedBackend:
    """The paged backend over `num_shard` tensor-parallel processes (tensor_parallel.py)."""
    import socket

    from tgis.backends.tensor_parallel import ShardSettings, TensorParallelBackend

    with socket.socket() as s:  # a free rendezvous port on this machine
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    settings = ShardSettings(
        model_dir=str(model_dir),
        device=device,
        dtype=dtype,
        max_sequences=max_batch,
        max_sequence_tokens=total,
        max_prefill_tokens=max_batch * prompt_tokens,
        kv_tokens=max_batch * -(-total // MAX_BLOCK) * MAX_BLOCK,
        memory_fraction=None,
        master_addr="127.0.0.1",
        master_port=port,
        world=num_shard,
    )
    return TensorParallelBackend(settings)


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

    def summary(self, prompt_tokens: int, decode_tokens: int) -> dict[str, Any]:
        """The `engine_steps` entry of the results schema."""
        prefill, decode = distribution(self.prefill), distribution(self.decode)
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
        }


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
    ) -> None:
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
        return self.summaries()

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
) -> tuple[dict[str, Any], bool]:
    """Load `model_id` (a directory or cached id) and measure it; returns the results document
    and whether Ctrl-C cut the run short (the document then holds the batch sizes measured)."""
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
    device = default_device()
    backend = load_backend(
        model_dir, device, dtype, max(batch_sizes), prompt_tokens, decode_tokens, compile,
        num_shard,
    )  # fmt: skip
    bench = EngineBenchmark(
        backend,
        batch_sizes,
        prompt_tokens,
        decode_tokens,
        runs,
        seed,
        avoid_ids=special_token_ids(model_dir),
    )
    interrupted = False
    try:
        bench.execute(console)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        close = getattr(backend, "close", None)
        if close is not None:  # tensor-parallel shards
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
        "interrupted": interrupted,
    }
    return build_results(config, [], engine_steps=bench.summaries()), interrupted
