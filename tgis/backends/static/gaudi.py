"""The gaudi backend: the static batch (static/batch.py) on an Intel Gaudi HPU, with seed 003's
buckets (buckets.gaudi_policy) and HPU graphs.

The model is the project's fixed-shape llama forward (static/kv.py's StaticLlamaForward), so every
step of a bucket has the same shapes. On the HPU it runs in lazy mode: ops accumulate and each
step ends with `habana_frameworks.torch.core.mark_step()`, which compiles the accumulated graph
the first time and reuses it afterwards. On top of that, steps run through HPU graphs
(`habana_frameworks.torch.hpu.HPUGraph` captured inside the `habana_frameworks.torch.hpu.graph`
context): one graph per decode bucket (rows) and, unless LIMIT_HPU_GRAPH, per prefill bucket
(rows, padded length). A graph is captured the first time its bucket runs (warmup runs every
bucket) and replayed afterwards: the step's inputs are copied into the tensors the graph was
captured with, the graph is replayed, and its output, which the next replay overwrites, is
cloned before it is returned.

Seed 003's variables (parsed and validated by tgis.config.gaudi.GaudiSettings):

- BATCH_BUCKET_SIZE, PREFILL_BATCH_BUCKET_SIZE, PAD_SEQUENCE_TO_MULTIPLE_OF: the buckets of
  `gaudi_policy` (decode rows, prefill rows, prompt lengths); warmup runs each one.
- ENABLE_HPU_GRAPH: false runs every step without HPU graphs (lazy mode + mark_step). As in
  TGI, graphs are also off when PT_HPU_LAZY_MODE=0: Habana supports HPU graphs in lazy mode
  only.
- LIMIT_HPU_GRAPH: true (the default) keeps prefill out of HPU graphs: only decode is
  captured, which saves the device memory of one graph per (rows, length) bucket. Prefills that
  return every position's logits (prompt logprobs) always run without a graph.
- PROF_STEP, PROF_WAITSTEP, PROF_WARMUPSTEP, PROF_PATH, PROF_RANKS, PROF_RECORD_SHAPES: with
  PROF_STEP > 0, on a rank (environment RANK, default 0) listed in PROF_RANKS, decode steps are
  profiled with torch.profiler (CPU and HPU activities, schedule wait/warmup/active, a
  TensorBoard trace under PROF_PATH). Warmup steps are not counted; the profiler stops after its
  active steps. Unlike optimum-habana's HabanaProfile, PROF_WARMUPSTEP=0 does not turn
  profiling off.
- USE_FLASH_ATTENTION, FLASH_ATTENTION_RECOMPUTE: ignored. The fixed-shape forward computes
  attention as two batched matmuls with a float32 softmax, not with Habana's fused SDPA kernel;
  setting either to false logs a warning once.
- SKIP_TOKENIZER_IN_TGI: requests and responses of token ids instead of text; the server
  always tokenizes, so true is refused by the validation core.
- QUANT_CONFIG (FP8 through Intel Neural Compressor): not supported; loading refuses it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tgis.backends.common.device import torch_dtype
from tgis.backends.static.batch import ShapeTiming, StaticBatchBackend, pad_token_id
from tgis.backends.static.buckets import Shape, ShapePolicy, gaudi_policy
from tgis.backends.static.graphs import GraphedStaticModel
from tgis.backends.static.kv import StaticLlamaForward
from tgis.config import GaudiSettings, ServeConfig
from tgis.errors import BackendUnavailableError, ConfigError

logger = logging.getLogger(__name__)

# Settings already warned about in this process (the warning is logged once).
_WARNED: set[str] = set()


@dataclass(frozen=True)
class Habana:
    """The habana_frameworks modules the backend calls."""

    core: Any  # habana_frameworks.torch.core: mark_step(device_str="", sync=False)
    hpu: (
        Any  # habana_frameworks.torch.hpu: HPUGraph(), graph(hpu_graph, stream=None, dry_run=False)
    )


def import_habana() -> Habana:
    """habana_frameworks' core and hpu modules, or BackendUnavailableError in one line."""
    try:
        core = importlib.import_module("habana_frameworks.torch.core")
        hpu = importlib.import_module("habana_frameworks.torch.hpu")
    except ImportError:
        raise BackendUnavailableError(
            "the gaudi backend needs habana_frameworks (Intel Gaudi SynapseAI), which is not "
            "installed",
            "run on a Gaudi host with SynapseAI, e.g. in the Dockerfile.gaudi image",
        ) from None
    return Habana(core, hpu)


def warn_ignored_settings(settings: GaudiSettings) -> list[str]:
    """Log (once per process) the flash-attention settings the fixed-shape forward ignores;
    returns the names set to a non-default value."""
    ignored = [
        name
        for name, value in (
            ("USE_FLASH_ATTENTION", settings.use_flash_attention),
            ("FLASH_ATTENTION_RECOMPUTE", settings.flash_attention_recompute),
        )
        if not value
    ]
    for name in ignored:
        if name not in _WARNED:
            _WARNED.add(name)
            logger.warning(
                "%s=false has no effect on the gaudi backend: its fixed-shape forward computes "
                "attention with batched matmuls, not Habana's fused SDPA kernel",
                name,
            )
    return ignored


class DecodeProfiler:
    """torch.profiler over decode steps: schedule(wait, warmup, active), CPU + HPU activities,
    a TensorBoard trace in `path`. Starts at the first profiled step, steps after each one and
    stops for good after wait + warmup + active steps."""

    def __init__(self, wait: int, warmup: int, active: int, path: str, record_shapes: bool) -> None:
        if active < 1:
            raise ValueError(f"a profiler needs active >= 1 steps, got {active}")
        self.wait, self.warmup, self.active = wait, warmup, active
        self.path, self.record_shapes = path, record_shapes
        self.steps = 0
        self.done = False
        self._profiler: Any = None

    @classmethod
    def from_settings(cls, settings: GaudiSettings) -> DecodeProfiler | None:
        """The profiler PROF_* ask for on this process's rank (RANK), or None (PROF_STEP=0,
        or a rank not listed in PROF_RANKS)."""
        if not settings.profiling or settings.rank not in settings.prof_ranks:
            return None
        return cls(
            settings.prof_waitstep,
            settings.prof_warmupstep,
            settings.prof_step,
            settings.prof_path,
            settings.prof_record_shapes,
        )

    @property
    def total(self) -> int:
        return self.wait + self.warmup + self.active

    @property
    def running(self) -> bool:
        return self._profiler is not None

    def before_step(self) -> None:
        """Start the profiler before the first profiled step."""
        if self.done or self._profiler is not None:
            return
        try:  # Habana's activity profiler registers itself on import (HPU traces).
            importlib.import_module("habana_frameworks.torch.activity_profiler")
        except ImportError:
            logger.debug("habana_frameworks.torch.activity_profiler is not importable")
        activity = torch.profiler.ProfilerActivity
        self._profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(
                wait=self.wait, warmup=self.warmup, active=self.active, repeat=1
            ),
            activities=[activity.CPU, activity.HPU],
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.path),
            record_shapes=self.record_shapes,
        )
        self._profiler.start()
        logger.info(
            "profiling decode steps: wait %d, warmup %d, active %d -> %s",
            self.wait,
            self.warmup,
            self.active,
            self.path,
        )

    def after_step(self) -> None:
        """Advance the schedule after a profiled step (its device work flushed); stop after
        the last active step."""
        if self._profiler is None:
            return
        self.steps += 1
        self._profiler.step()
        if self.steps >= self.total:
            self._profiler.stop()
            self._profiler = None
            self.done = True
            logger.info(
                "profiler stopped after %d decode steps: trace in %s", self.steps, self.path
            )


@dataclass
class HpuRuntime:
    """State shared by the graph model and the device ops: the habana modules and the decode
    profiler."""

    habana: Habana
    profiler: DecodeProfiler | None = None
    profiling_paused: bool = False
    _decode_pending: bool = field(default=False, repr=False)

    def mark_step(self) -> None:
        self.habana.core.mark_step()

    def before_decode(self) -> None:
        if self.profiler is not None and not self.profiling_paused:
            self.profiler.before_step()
            self._decode_pending = True

    def end_step(self) -> None:
        """mark_step, then advance the profiler if the step was a profiled decode."""
        self.mark_step()
        if self._decode_pending:
            self._decode_pending = False
            if self.profiler is not None:
                self.profiler.after_step()

    @contextmanager
    def unprofiled(self) -> Iterator[None]:
        """Steps inside (warmup) are not profiled."""
        previous, self.profiling_paused = self.profiling_paused, True
        try:
            yield
        finally:
            self.profiling_paused = previous


class HpuOps:
    """DeviceOps for the HPU: inputs go to `device`, a step ends with mark_step, and
    `compilations` counts the HPU graphs this backend captured."""

    def __init__(
        self, runtime: HpuRuntime, graphs: GraphedStaticModel, device: str | torch.device = "hpu"
    ) -> None:
        self.runtime = runtime
        self.graphs = graphs
        self.device = torch.device(device)
        self.name = "hpu"

    def sync(self) -> None:
        """Flush the lazily accumulated step to the device (htcore.mark_step)."""
        self.runtime.end_step()

    def compilations(self) -> int:
        """HPU graphs captured so far (graphs the bridge compiles for lazy steps outside HPU
        graphs are not counted: habana_frameworks has no public counter for them)."""
        return self.graphs.captures


class HpuGraphApi:
    """GraphApi for HPU graphs: `HPUGraph` recorded inside the `hpu.graph` context (recording
    also runs the step), `replay()` after."""

    def __init__(self, runtime: HpuRuntime) -> None:
        self.runtime = runtime

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        hpu = self.runtime.habana.hpu
        # Materialize the input copies now, so the graph reads them instead of recording them.
        self.runtime.mark_step()
        graph = hpu.HPUGraph()
        with hpu.graph(graph):
            output = step()
        return graph, output

    def replay(self, graph: Any) -> None:
        graph.replay()


class HpuGraphModel(GraphedStaticModel):
    """A StaticModel running a StaticLlamaForward through HPU graphs, one per bucket shape:
    decode always, prefill unless LIMIT_HPU_GRAPH; none with graphs disabled. Decode steps
    drive the PROF_* profiler."""

    def __init__(
        self,
        forward: StaticLlamaForward,
        runtime: HpuRuntime,
        enable_graphs: bool = True,
        limit_graphs: bool = True,
    ) -> None:
        super().__init__(
            forward,
            HpuGraphApi(runtime),
            enabled=enable_graphs,
            graph_prefill=not limit_graphs,
            on_decode=runtime.before_decode,
        )
        self.runtime = runtime


class GaudiBatchBackend(StaticBatchBackend):
    """The static batch over an HpuGraphModel: warmup steps are kept out of the profile."""

    def __init__(
        self,
        model: HpuGraphModel,
        policy: ShapePolicy,
        ops: HpuOps,
        name: str = "gaudi",
        pad_token_id: int = 0,
    ) -> None:
        super().__init__(model, policy, ops, name, pad_token_id)
        self.runtime = ops.runtime

    def run_shape(self, shape: Shape) -> ShapeTiming:
        with self.runtime.unprofiled():
            return super().run_shape(shape)


def build_gaudi_backend(
    model: Any,
    settings: GaudiSettings,
    max_total_tokens: int,
    habana: Habana,
    *,
    device: str | torch.device = "hpu",
) -> GaudiBatchBackend:
    """The backend over a loaded llama-family `model` (already on `device`; backends/choose.py
    refuses other families)."""
    enable_graphs = settings.enable_hpu_graph and settings.lazy_mode
    if settings.enable_hpu_graph and not settings.lazy_mode:
        logger.warning("PT_HPU_LAZY_MODE=0: HPU graphs need lazy mode, running without them")
    warn_ignored_settings(settings)
    runtime = HpuRuntime(habana, DecodeProfiler.from_settings(settings))
    forward = StaticLlamaForward(model, settings.decode_batch_size, max_total_tokens)
    graph_model = HpuGraphModel(forward, runtime, enable_graphs, settings.limit_hpu_graph)
    policy = gaudi_policy(settings, max_total_tokens)
    ops = HpuOps(runtime, graph_model, device)
    return GaudiBatchBackend(graph_model, policy, ops, "gaudi", pad_token_id(model.config))


def load_gaudi_backend(
    config: ServeConfig,
    model_dir: Path,
    *,
    device: str = "hpu",
) -> StaticBatchBackend:
    """Load the llama-family model in `model_dir` onto the HPU (bfloat16 unless config.dtype
    says otherwise) and wrap it in the static batch with seed 003's buckets.

    RANK and PT_HPU_LAZY_MODE come with the settings (tgis.config.gaudi); `device` is "hpu"
    except in tests.
    """
    settings = config.gaudi
    if settings is None:
        raise ConfigError(
            f"the gaudi backend needs the gaudi settings, but the config is for {config.backend}",
            "serve with --backend gaudi",
        )
    if settings.quant_config:
        raise ConfigError(
            f"QUANT_CONFIG={settings.quant_config} asks for FP8 quantization, which the gaudi "
            "backend does not support",
            "unset QUANT_CONFIG to serve in bfloat16 (or --dtype)",
        )
    habana = import_habana()
    from transformers import AutoModelForCausalLM

    dtype = torch_dtype(config.dtype) if config.dtype else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.eval().to(torch.device(device))
    return build_gaudi_backend(model, settings, config.max_total_tokens, habana, device=device)


__all__ = [
    "DecodeProfiler",
    "GaudiBatchBackend",
    "Habana",
    "HpuGraphModel",
    "HpuOps",
    "HpuRuntime",
    "build_gaudi_backend",
    "import_habana",
    "load_gaudi_backend",
    "warn_ignored_settings",
]
