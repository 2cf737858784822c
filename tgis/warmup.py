"""Warmup: run every step shape a backend will meet before traffic, and report it.

Shared by `tgis warmup` and `tgis serve` (which runs it before reporting ready unless
WARMUP_ENABLED=false). On compiling devices (tpu, gaudi, cuda/cpu with --compile) each shape
is a graph compiled or captured here, so no request pays for it; with --compile-cache the
compiled programs persist and the next process loads them instead of compiling.

    report = run_warmup(backend, config, on_plan=..., on_shape=...)
    console.print(report_table(report))
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tgis.config import ServeConfig
from tgis.engine.backend import Backend, PagedBackend, Shape, ShapeTiming

log = logging.getLogger("tgis.warmup")


@dataclass(frozen=True)
class WarmupReport:
    """What warmup ran and what the backend holds."""

    backend: str
    device: str
    timings: tuple[ShapeTiming, ...]
    seconds: float
    max_sequences: int
    max_sequence_tokens: int
    kv_tokens: int  # the KV budget the server uses (max_batch_total_tokens)
    kv_budget_tokens: int | None  # what memory holds, when measured (dynamic backends)
    kv_bytes_per_token: int
    compile_cache: str | None
    # Paged backends: tokens per KV block (kv_tokens is the pool); None: slots of full length.
    block_size: int | None = None

    @property
    def compiled(self) -> int:
        """Graphs compiled or captured during warmup."""
        return sum(t.compiled for t in self.timings)

    def summary(self) -> str:
        """One line for logs."""
        line = (
            f"warmup: {len(self.timings)} shapes in {self.seconds:.1f} s, "
            f"{self.compiled} graphs compiled; KV budget {self.kv_tokens} tokens "
            f"({self.max_sequences} x {self.max_sequence_tokens})"
        )
        if self.compile_cache:
            line += f"; compile cache {self.compile_cache}"
        return line

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (`tgis warmup --output`)."""
        return {
            "backend": self.backend,
            "device": self.device,
            "seconds": self.seconds,
            "compiled": self.compiled,
            "max_sequences": self.max_sequences,
            "max_sequence_tokens": self.max_sequence_tokens,
            "max_batch_total_tokens": self.kv_tokens,
            "kv_budget_tokens": self.kv_budget_tokens,
            "block_size": self.block_size,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "compile_cache": self.compile_cache,
            "shapes": [
                {
                    "phase": t.shape.phase,
                    "rows": t.shape.rows,
                    "length": t.shape.length,
                    "seconds": t.seconds,
                    "compiled": t.compiled,
                }
                for t in self.timings
            ],
        }


def batch_limit(backend: Backend | PagedBackend, config: ServeConfig) -> int:
    """The largest batch serving will run: the slots, capped by --max-batch-size."""
    slots = backend.capacity.max_sequences
    return min(slots, config.max_batch_size or slots)


def run_warmup(
    backend: Backend | PagedBackend,
    config: ServeConfig,
    on_plan: Callable[[list[Shape]], None] | None = None,
    on_shape: Callable[[ShapeTiming], None] | None = None,
) -> WarmupReport:
    """Run the backend's warmup plan for `config`'s limits; `on_plan` hears the plan first,
    `on_shape` each shape as it finishes."""
    max_batch = batch_limit(backend, config)
    if on_plan is not None:
        on_plan(backend.warmup_plan(max_batch, config.max_input_tokens))

    def heard(timing: ShapeTiming) -> None:
        log.info(
            "warmup %s: %.2f s, %d graphs compiled",
            timing.shape.label(),
            timing.seconds,
            timing.compiled,
        )
        if on_shape is not None:
            on_shape(timing)

    start = time.perf_counter()
    timings = backend.warmup(max_batch, config.max_input_tokens, heard)
    capacity = backend.capacity
    return WarmupReport(
        backend=backend.name,
        device=backend.device,
        timings=tuple(timings),
        seconds=time.perf_counter() - start,
        max_sequences=capacity.max_sequences,
        max_sequence_tokens=capacity.max_sequence_tokens,
        kv_tokens=capacity.kv_tokens,
        kv_budget_tokens=capacity.kv_budget_tokens,
        kv_bytes_per_token=capacity.kv_bytes_per_token,
        compile_cache=config.compile_cache,
        block_size=capacity.block_size,
    )
