"""The cpu / cuda backend for llama-family models: packed steps over a paged KV pool.

Implements `PagedBackend`: it holds the model (`PagedForward`) and the pool, and keeps no
per-sequence state. Each `forward` gets the step's chunks with their block tables (the
engine's `PagedScheduler` owns them), packs the tokens, builds the attention metadata once and
runs one forward for prefill chunks and decodes together.

The pool's size is `kv_tokens` when given (`--max-batch-total-tokens`); otherwise it is what
memory holds, capped at what `max_sequences` sequences of `max_sequence_tokens` could ever
fill: on an accelerator the share `--cuda-memory-fraction` allows of the device, less the
measured peak of the largest step with the weights (a profiling forward, as TGI and vLLM do);
on CPU half the available memory. What differs by device (block size, prefill chunk, which
memory) is the backend's `DeviceTraits` (paged/traits.py), so the CUDA configuration runs on a
CPU in tests.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from tgis.backends.common.device import available_memory, layer_shape, load_model
from tgis.backends.common.gemm import choose_packing
from tgis.backends.common.graphs import GraphApi
from tgis.backends.common.kv import kv_bytes_per_token
from tgis.backends.common.quant_bnb import BNB_METHODS
from tgis.backends.common.quant_checkpoint import model_quantization
from tgis.backends.common.warmup import PhaseClock, powers_of_two, run_plan
from tgis.backends.models.decoder import native_kv_shape
from tgis.backends.models.mrope import rope_positions
from tgis.backends.paged.attention import (
    attention_path,
    flash_paged_available,
    slots_of,
    step_metadata,
    torch_attention_reason,
)
from tgis.backends.paged.compile import GRAPHS, CompiledDecode, weight_copies_bytes
from tgis.backends.paged.forward import KVPool, PagedForward
from tgis.backends.paged.graphs import CudaGraphApi, DecodeGraphs
from tgis.backends.paged.lora import LoraShapes, LoraStacks
from tgis.backends.paged.packages import BackgroundBuild, BuildRecipe, PackageStore, default_root
from tgis.backends.paged.race import race, winner
from tgis.backends.paged.traits import DeviceTraits, device_traits
from tgis.backends.paged.triton_attention import interpreted, triton_available
from tgis.config import use_inductor_cache
from tgis.engine.backend import (
    BackendCapacity,
    FedTokens,
    PackedItem,
    PackedOutput,
    Shape,
    ShapeTiming,
)
from tgis.engine.transfer import to_device
from tgis.errors import ConfigError

if TYPE_CHECKING:
    from tgis.backends.common.memory import DeviceMemory
    from tgis.backends.common.quant import Quantization
    from tgis.backends.models.parallel import TensorParallel
    from tgis.engine.types import ImageInput
    from tgis.vision.encoder import VisionEncoder

logger = logging.getLogger(__name__)

# Prompt length of the short sequences warmup decodes with.
WARMUP_PROMPT = 8
# The steps `auto` races its kernels over (`_race_steps`): a decode step of this many rows at
# this much context each, and a prompt chunk of this many tokens (each within the budgets).
RACE_BATCH = 16
RACE_CONTEXT = 2048
RACE_PREFILL = 2048


def paged_kv_bytes_per_token(model: PreTrainedModel, kv_dtype: torch.dtype | None = None) -> int:
    """Bytes the paged pool holds per token of `model`: every layer's K and V, in `kv_dtype`
    (None: the model's dtype)."""
    shape = native_kv_shape(model)
    dtype = kv_dtype or next(model.parameters()).dtype
    return kv_bytes_per_token(shape.num_layers, shape.num_heads, shape.head_dim, dtype)


def _common_window(windows: Sequence[int | None]) -> int | None:
    """The sliding window every layer keeps within (the widest of theirs); None when some
    layer attends to the whole sequence."""
    sized = [w for w in windows if w is not None]
    return max(sized) if sized and len(sized) == len(windows) else None


class PagedTorchBackend:
    """A llama-family causal LM on a torch CPU or CUDA device (implements `PagedBackend`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_sequences: int,
        max_sequence_tokens: int,
        max_prefill_tokens: int,
        kv_tokens: int | None = None,
        block_size: int | None = None,
        memory_fraction: float | None = None,
        cuda_graphs: bool | None = None,
        graph_api: GraphApi | None = None,
        parallel: TensorParallel | None = None,
        shared_kv_bytes_per_token: int = 0,
        compile: bool = False,
        packed_weights: bool | None = False,
        quantization: Quantization | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        vision: VisionEncoder | None = None,
        bidirectional_images: bool = False,
        traits: DeviceTraits | None = None,
        attention_backend: str | None = None,
        packages: PackageStore | None = None,
        autotune: bool = True,
        build: BuildRecipe | None = None,
    ) -> None:
        """Wrap an already loaded `model` (eval mode, on its device, in its dtype) and
        allocate the pool. max_sequences: the most sequences one step holds (the batch);
        max_sequence_tokens: prompt + generated tokens of one sequence (rope tables);
        max_prefill_tokens: the most prompt tokens of one step (profiling and warmup).
        cuda_graphs: decode through CUDA graphs recorded at warmup (paged/graphs.py); None:
        wherever flash attention runs; True where it cannot is a ConfigError. graph_api: how
        graphs are recorded (CUDA graphs by default). shared_kv_bytes_per_token: the bytes per
        token of another cache sized along with this one (a draft model's, as many tokens): a
        pool sized from memory leaves it its share. compile: decode steps run through graphs
        compiled at warmup (paged/compile.py; the plain-torch attention path only), and a pool
        sized from memory leaves room for their copies of the weights. packed_weights: the
        projections over oneDNN-packed weights (common/gemm.py), which moves the model's own
        to the meta device (models/decoder.py); None: where a probe measures them faster on
        this CPU. quantization: the projections quantized at load (common/quant.py), then
        never packed. kv_cache_dtype: the pool's dtype where it is not the model's (a float8
        one, `--kv-cache-dtype`: attention through plain torch, which widens what it
        gathers). vision: the vision tower of a vision-language model whose language model
        `model` is (tgis.vision.encoder): prompts may hold images. bidirectional_images: the
        model's image rows attend to each other both ways (Gemma 3), as `vision`'s family
        says, or, for a tensor-parallel shard without the tower, as given. traits: how the
        device runs the engine (paged/traits.py; the model's device's own by default);
        `block_size` overrides theirs. attention_backend: "triton", "flash" or "torch"
        (`--attention-backend`; a choice that cannot run here is a ConfigError naming why);
        None: triton on CUDA where it runs (the faster of it and flash attention at warmup,
        where both run), else flash where it runs, else torch. packages: with `compile`, the
        store that keeps the compiled graphs as packages (paged/packages.py); autotune: as
        paged/compile.py's `compile_options`. build: how a process of its own builds
        missing packages while this one serves eagerly (`warmup` starts it); None: warmup
        builds them itself.

        Built in stages, each complete before the next starts: the device and attention
        path; the weights and rope tables; the step's own parts (LoRA stacks, the vision
        tower), so that the profiling forward that sizes the pool runs the serving path; the
        pool; then what runs over the pool (compiled decode, CUDA graphs)."""
        if min(max_sequences, max_sequence_tokens, max_prefill_tokens) < 1:
            raise ValueError(
                "max_sequences, max_sequence_tokens and max_prefill_tokens must be >= 1"
            )
        self._adopt(model, traits, parallel, max_sequence_tokens, max_prefill_tokens, block_size)
        self._choose_attention(
            model, vision, bidirectional_images, kv_cache_dtype, attention_backend
        )
        self._load_weights(model, quantization, packed_weights, compile)
        graphs = self._use_graphs(cuda_graphs, graph_api)
        self._check_compile(compile, graphs)
        self._step_parts(model, vision, build)
        per_token = paged_kv_bytes_per_token(model, self.kv_dtype)
        num_blocks = self._make_pool(
            kv_tokens,
            per_token + shared_kv_bytes_per_token,
            max_sequences * max_sequence_tokens,
            memory_fraction,
            weight_copies_bytes(self.weight_bytes) if compile else 0,
            graphs,
        )
        # What runs over the pool: built at warmup.
        if compile:
            self.compiled = CompiledDecode(self.path, max_sequences, packages, autotune)
        if graphs:
            self.graphs = self._graphs(graph_api, max_sequences, max_sequence_tokens, num_blocks)
        self._capacity = self._capacity_of(max_sequences, num_blocks, per_token)
        logger.info(
            "paged torch backend on %s (%s): %d blocks x %d tokens, %d bytes/token",
            self.device,
            self.dtype,
            num_blocks,
            self.block_size,
            per_token,
        )

    def _adopt(
        self,
        model: PreTrainedModel,
        traits: DeviceTraits | None,
        parallel: TensorParallel | None,
        max_sequence_tokens: int,
        max_prefill_tokens: int,
        block_size: int | None,
    ) -> None:
        """The model's device, dtype, vocabulary and KV shape, and the step's shape on it."""
        self.model = model.eval()
        self.device_obj = next(model.parameters()).device
        self.device = str(self.device_obj)
        self.name = self.device_obj.type
        self.dtype = next(model.parameters()).dtype
        self.traits = traits or device_traits(self.device_obj)
        # Under tensor parallelism `model` is this rank's slices (paged/tensor_parallel.py).
        self.parallel = parallel
        self.vocab_size = (
            parallel.vocab_size
            if parallel is not None
            else int(model.get_output_embeddings().weight.shape[0])
        )
        self.max_sequence_tokens = max_sequence_tokens
        cap = self.traits.prefill_step_tokens
        self.prefill_chunk = max_prefill_tokens if cap is None else min(max_prefill_tokens, cap)
        self.prompt_logit_tokens = self.traits.prompt_logit_tokens(
            self.vocab_size, self.prefill_chunk
        )
        self.block_size = block_size or self.traits.block_size
        self.kv_shape = native_kv_shape(model)

    def _make_pool(
        self,
        kv_tokens: int | None,
        per_token: int,
        most: int,
        fraction: float | None,
        reserved: int,
        graphs: bool,
    ) -> int:
        """Size the pool (`_size_pool`; every rank's the same) and allocate it under the
        forward; returns its blocks as the scheduler knows them: with graphs, one more block
        is allocated, where padding rows write."""
        num_blocks = self._size_pool(kv_tokens, per_token, most, fraction, reserved, int(graphs))
        if self.parallel is not None:
            num_blocks = self.parallel.agree_min(num_blocks)
        with torch.inference_mode():
            self.path.pool = self._allocate_pool(num_blocks + int(graphs))
        return num_blocks

    def _step_parts(
        self, model: PreTrainedModel, vision: VisionEncoder | None, build: BuildRecipe | None
    ) -> None:
        """The step's own parts (LoRA stacks, the vision tower), so that from here on
        `_forward_packed` runs as it serves (the profiling forward that sizes the pool too);
        no compiled decode or graphs yet, and how they are built later."""
        self.lora = LoraStacks(LoraShapes.of(model.config), self.path.fuse_gate_up)
        self.vision = vision
        self.compiled: CompiledDecode | None = None
        self.graphs: DecodeGraphs | None = None
        self.build_recipe = build
        self.background: BackgroundBuild | None = None
        # Called with `runtime()` when it changes after start-up (a build in the background).
        self._runtime_watchers: list[Callable[[dict[str, Any]], None]] = []
        # Runs model work on the model's thread (`run_model_work_on`); None: where it is found,
        # as the adapter and prefix stores' `model_thread`.
        self._model_thread: Callable[[Callable[[], Any]], Any] | None = None
        # Why an earlier build of the compiled decode's packages failed (the store keeps it).
        self.compile_failure: str | None = None
        # Seconds of warmup's parts (attention race, compile, plan, graphs), its last run.
        self.warmup_phases: dict[str, float] = {}

    def _graphs(
        self, api: GraphApi | None, max_sequences: int, max_sequence_tokens: int, scratch: int
    ) -> DecodeGraphs:
        """The decode graphs' recorder (they are recorded at warmup); padding rows write to
        the pool's block `scratch`, the one beyond the scheduler's."""
        return DecodeGraphs(
            self.path,
            api or CudaGraphApi(),
            max_sequences,
            max_blocks=-(-max_sequence_tokens // self.block_size),
            max_kv_len=max_sequence_tokens,
            scratch_block=scratch,
        )

    def _capacity_of(self, max_sequences: int, num_blocks: int, per_token: int) -> BackendCapacity:
        """What the scheduler may plan with on this backend."""
        step_cap = self.traits.prefill_step_tokens
        return BackendCapacity(
            max_sequences=max_sequences,
            max_sequence_tokens=self.max_sequence_tokens,
            kv_tokens=num_blocks * self.block_size,
            kv_bytes_per_token=per_token,
            prefill_step_tokens=None if step_cap is None else self.prefill_chunk,
            prompt_logit_tokens=self.prompt_logit_tokens,
            kv_budget_tokens=self._memory_tokens,
            block_size=self.block_size,
            sliding_window=_common_window(self.path.windows),
            # Adapters are not sharded: tensor parallelism serves the base model only.
            lora=self.parallel is None,
            images=self.vision is not None,
            whole_images=self.bidirectional,
            # A rank's forward is driven by items sent to it: the ids stay on rank 0's device.
            fed_tokens=self.parallel is None,
        )

    def _choose_attention(
        self,
        model: PreTrainedModel,
        vision: VisionEncoder | None,
        bidirectional_images: bool,
        kv_cache_dtype: torch.dtype | None,
        requested: str | None,
    ) -> None:
        """The pool's dtype and the attention path (`kernel`): the one `requested`, or (None)
        the Triton kernels on CUDA where they run, else flash attention where it runs and the
        model's attention allows it (`model_needs` says why not), else plain torch."""
        self.model_needs = torch_attention_reason(model.config)
        # Gemma 3's image rows attend to each other both ways: masks flash attention's varlen
        # kernel has no form for.
        self.bidirectional = bidirectional_images or (
            vision is not None and vision.family.bidirectional
        )
        if self.bidirectional:
            self.model_needs = "its image rows attend to each other both ways"
        self.kv_dtype = kv_cache_dtype or self.dtype
        if kv_cache_dtype is not None and kv_cache_dtype != self.dtype:
            self.model_needs = (
                f"the KV cache is {str(kv_cache_dtype).removeprefix('torch.')}, which flash "
                "attention's varlen_attn does not read"
            )
        flash = self.model_needs is None and flash_paged_available(self.device_obj, self.dtype)
        triton_why = triton_available(self.device_obj, self.kv_dtype)
        if triton_why is None and self.bidirectional:
            triton_why = "its image rows attend to each other both ways (causal kernels only)"
        if requested == "flash" and not flash:
            raise ConfigError(
                f"--attention-backend flash: here the paged engine could attend only with "
                f"{attention_path(self.device_obj, self.dtype, self.model_needs)}",
                "use --attention-backend triton or torch (TGIS_ATTENTION_BACKEND)",
            )
        if requested == "triton" and triton_why is not None:
            raise ConfigError(
                f"--attention-backend triton: tgis's Triton kernels cannot run here: {triton_why}",
                "use --attention-backend torch (TGIS_ATTENTION_BACKEND), or install triton on a "
                "CUDA machine",
            )
        self._requested, self._triton_why = requested, triton_why
        # Kernels `auto` times against each other at warmup (paged/race.py), and their times.
        self.contenders: tuple[str, ...] = ()
        self.race_times: dict[str, float] = {}
        if requested is not None:
            self.kernel = requested
        elif self.traits.triton_attention and triton_why is None:
            self.kernel = "triton"
            # Under tensor parallelism every rank keeps the Triton kernels: ranks timing
            # apart could choose apart.
            self.contenders = ("triton", "flash") if flash and self.parallel is None else ()
        else:
            self.kernel = "flash" if flash else "torch"
        # Pages (flash attention's and the Triton kernels' layout), or head-major blocks.
        self.flash = self.kernel != "torch"

    def _load_weights(
        self,
        model: PreTrainedModel,
        quantization: Quantization | None,
        packed_weights: bool | None,
        compile: bool,
    ) -> None:
        """The forward over the model's weights in their serving layout and its rope tables
        (`self.path`, over a one-block pool until the pool is sized): weights first, the pool
        takes what memory is left. `self.quantization`: the quantization the weights carry."""
        # A pre-quantized checkpoint's model carries its own (common/quant_checkpoint.py).
        quantization = quantization or model_quantization(model)
        if compile and quantization is not None and quantization.method in BNB_METHODS:
            raise ConfigError(
                f"--compile and --quantize {quantization.method}: bitsandbytes' kernels run "
                "eagerly",
                "drop --compile (TGIS_COMPILE), or use --quantize int8 or int4",
            )
        packed = quantization is None and self._packing(packed_weights, compile, model)
        with torch.inference_mode():
            self.path = PagedForward(
                model,
                self._allocate_pool(1),
                self.max_sequence_tokens,
                fuse_gate_up=self.traits.fuse_gate_up,
                packed=packed,
                quantization=quantization,
            )
        self.quantization = quantization
        if quantization is not None:
            self.weights = f"quantized: {quantization.describe()}"
        self.weight_bytes = self.path.weight_bytes()
        logger.info("weights: %s, %.1f MiB", self.weights, self.weight_bytes / 2**20)
        self.path.parallel = self.parallel

    def _check_compile(self, compile: bool, graphs: bool) -> None:
        """--compile compiles the plain-torch path's decode on one device: refused where the
        step attends otherwise."""
        if compile and (graphs or self.flash or self.parallel is not None):
            raise ConfigError(
                "--compile compiles the decode step of the plain-torch attention path on one "
                f"device; here the paged engine attends with {self.attention}"
                f"{' under tensor parallelism' if self.parallel is not None else ''}",
                "drop --compile (TGIS_COMPILE): CUDA graphs record the decode step where flash "
                "attention runs",
            )

    def runtime(self) -> dict[str, Any]:
        """What the start-up log and /info say of this backend beside its capacity: its
        attention path, the batch sizes whose decode replays a CUDA graph or runs a compiled
        graph (none: eager)."""
        return {
            "attention": self.attention,
            "cuda_graphs": list(self.graphs.captured) if self.graphs is not None else [],
            "compiled_decode": self.compiled.graphs if self.compiled is not None else [],
            "compiled_decode_state": self.compile_state,
            "attention_backend": self.kernel,
            # Where auto timed two kernels at warmup: each one's milliseconds.
            "attention_race_ms": {k: round(s * 1e3, 3) for k, s in self.race_times.items()},
            "weights": self.weights,
            "quantization": self.quantization.method if self.quantization else None,
            "weight_bytes": self.weight_bytes,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
        }

    @property
    def compile_state(self) -> str:
        """Where the compiled decode stands: "off", "eager" (not compiled yet), "building"
        (in a process of its own; eager meanwhile), "failed" (eager; the build's log says
        why) or "ready"."""
        if self.compiled is None:
            return "off"
        if self.compiled.graphs:
            return "ready"
        if self.background is not None:
            return "building" if self.background.running else "failed"
        return "failed" if self.compile_failure is not None else "eager"

    def _packing(self, requested: bool | None, compile: bool, model: PreTrainedModel) -> bool:
        """Whether the projections run over oneDNN-packed weights (common/gemm.py), and
        `self.weights` saying which and why. None: where the probe measures them faster, on
        a CPU and without --compile (whose graphs pack the plain weights themselves); under
        tensor parallelism only where every rank measured it so."""
        eager_cpu = self.name == "cpu" and not compile
        if requested and not eager_cpu:
            raise ValueError("packed weights are for the eager forward on a CPU")
        packed, why = bool(requested), None
        if requested is None and eager_cpu:
            hidden, intermediate = layer_shape(model.config.to_dict())
            packed, why = choose_packing(self.dtype, hidden, intermediate)
            if self.parallel is not None:  # one layout on every rank: packed where all measured so
                agreed = bool(self.parallel.agree_min(int(packed)))
                if packed and not agreed:
                    why = f"{why}; another rank measured plain weights faster"
                packed = agreed
        layout = "oneDNN packed" if packed else "plain [out, in]"
        self.weights = layout if why is None else f"{layout} ({why})"
        return packed

    @property
    def attention(self) -> str:
        """How this backend attends, and why (the start-up log, /info, refusals)."""
        if self.kernel == "triton":
            how = " (Triton's interpreter)" if interpreted() else ""
            return f"tgis's Triton kernels over KV pages{how}"
        if self.kernel == "torch" and self._requested == "torch":
            return "plain torch over head-major KV blocks (--attention-backend torch)"
        path = attention_path(self.device_obj, self.dtype, self.model_needs)
        if self.kernel == "torch" and self.name == "cuda":
            path = f"{path}; tgis's Triton kernels cannot run: {self._triton_why}"
        return path

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: str = "cpu",
        dtype: str | None = None,
        *,
        max_sequences: int,
        max_sequence_tokens: int,
        max_prefill_tokens: int,
        kv_tokens: int | None = None,
        memory_fraction: float | None = None,
        num_threads: int | None = None,
        cuda_graphs: bool | None = None,
        shared_kv_bytes_per_token: int = 0,
        compile: bool = False,
        compile_cache: Path | None = None,
        packed_weights: bool | None = None,
        quantization: Quantization | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        attention_backend: str | None = None,
        block_size: int | None = None,
        packages: PackageStore | None = None,
        autotune: bool = True,
        compile_in_background: bool = False,
    ) -> PagedTorchBackend:
        """Load the model in `model_dir` onto `device` ("cpu", "cuda", "cuda:1"); the rest
        as `__init__` takes it (the weight layout measured on a CPU by default: nothing else
        holds the model). With `compile` on a CPU, the compiled graphs are packages in the
        store under `compile_cache` (default: paged/packages.py's `default_root`) keyed for
        this model and these settings, unless `packages` names the store; the ones missing
        are built at warmup, or with `compile_in_background` by a process of its own while
        this one serves eagerly. On CUDA, `compile_cache` keeps inductor's caches."""
        model, vision = load_model(model_dir, torch.device(device), dtype, num_threads)
        recipe = None
        if compile and torch.device(device).type == "cpu":
            recipe = BuildRecipe(
                model_dir,
                dtype,
                quantization.method if quantization is not None else None,
                quantization.group_size if quantization is not None else None,
                None if kv_cache_dtype is None else str(kv_cache_dtype).removeprefix("torch."),
                block_size or device_traits(torch.device(device)).block_size,
                max_sequence_tokens,
            )
            packages = packages or PackageStore.of(compile_cache or default_root(), recipe)
        elif compile and compile_cache is not None:
            use_inductor_cache(compile_cache)
        return cls(
            model,
            max_sequences=max_sequences,
            max_sequence_tokens=max_sequence_tokens,
            max_prefill_tokens=max_prefill_tokens,
            kv_tokens=kv_tokens,
            memory_fraction=memory_fraction,
            cuda_graphs=cuda_graphs,
            shared_kv_bytes_per_token=shared_kv_bytes_per_token,
            compile=compile,
            packed_weights=packed_weights,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            vision=vision,
            attention_backend=attention_backend,
            block_size=block_size,
            packages=packages,
            autotune=autotune,
            build=recipe if compile_in_background else None,
        )

    @property
    def capacity(self) -> BackendCapacity:
        return self._capacity

    def _allocate_pool(self, num_blocks: int) -> KVPool:
        shape = self.kv_shape
        return KVPool.allocate(
            shape.num_layers, num_blocks, self.block_size, shape.num_heads, shape.head_dim,
            self.kv_dtype, self.device_obj, self.flash, self.kernel == "triton",
        )  # fmt: skip

    def _use_graphs(self, requested: bool | None, api: GraphApi | None) -> bool:
        """Whether decode runs through recorded graphs (see __init__)."""
        possible = api is not None or self.flash
        if self.quantization is not None and self.quantization.method == "bitsandbytes":
            if requested:
                raise ConfigError(
                    "--cuda-graphs and --quantize bitsandbytes: LLM.int8()'s kernel finds "
                    "each step's outlier columns on the host, which a graph cannot record",
                    "drop --cuda-graphs (TGIS_CUDA_GRAPHS), or use --quantize "
                    "bitsandbytes-nf4, int8 or int4",
                )
            possible = False
        if requested and not possible:
            raise ConfigError(
                "--cuda-graphs needs attention over KV pages (tgis's Triton kernels, or flash "
                "attention: CUDA, torch >= 2.12 with varlen_attn's block_table, a float16 or "
                f"bfloat16 model); here the paged engine attends with {self.attention}",
                "drop --cuda-graphs (TGIS_CUDA_GRAPHS), or serve on a GPU with Triton installed",
            )
        self._graphs_required = bool(requested)
        return possible if requested is None else requested

    # --- the pool's size ---------------------------------------------------------------------

    def _size_pool(
        self,
        kv_tokens: int | None,
        per_token: int,
        most: int,
        fraction: float | None,
        reserved: int = 0,
        spare_blocks: int = 0,
    ) -> int:
        """Blocks of the pool: `kv_tokens` when given, else what memory holds (module doc)
        less `reserved` bytes that other copies will take, never more than the sequences
        could fill (`most` tokens, whole blocks each). Either way no layer's tensor of the
        pool (with `spare_blocks` more) outgrows 32-bit indexing."""
        self._memory_tokens: int | None = None
        self.profile_s = 0.0  # the profiling forward's seconds (none: 0)
        fraction = self.traits.kv_memory_fraction if fraction is None else fraction
        whole = -(-most // self.block_size) * self.block_size
        memory = self.traits.memory
        if kv_tokens is not None:
            source = f"--max-batch-total-tokens {kv_tokens}"
            budget = kv_tokens
        elif memory is not None:
            start = time.perf_counter()
            free = max(0, self._free_after_peak(memory, fraction) - reserved)
            self.profile_s = time.perf_counter() - start
            source = f"{fraction:.0%} of the device less weights and the prefill peak"
            self._memory_tokens = free // per_token
            budget = min(self._memory_tokens, whole)
        else:
            free = max(0, available_memory(self.device_obj) - reserved)
            source = f"{fraction:.0%} of {free / 2**30:.1f} GiB available"
            self._memory_tokens = int(free * fraction) // per_token
            budget = min(self._memory_tokens, whole)
        blocks = min(budget // self.block_size, self._indexable_blocks() - spare_blocks)
        if blocks * self.block_size < self.max_sequence_tokens:
            raise ConfigError(
                f"the KV cache ({source}: {budget} tokens at {per_token} bytes each) cannot "
                f"hold one sequence of {self.max_sequence_tokens} tokens",
                "lower --max-total-tokens, raise --max-batch-total-tokens or free memory",
            )
        return blocks

    def _indexable_blocks(self) -> int:
        """The most blocks one layer's key (or value) tensor holds within 32-bit indexing
        (kernels index the pool's elements with int32)."""
        shape = self.kv_shape
        return (2**31 - 1) // (self.block_size * shape.num_heads * shape.head_dim)

    def _free_after_peak(self, memory: DeviceMemory, fraction: float) -> int:
        """Bytes of the device the pool may take: `fraction` of its memory, less the peak of
        the largest step (the weights included, as they are allocated): `prefill_chunk`
        prompt tokens, as sequences of at most `max_sequence_tokens` (the rope tables'
        length), with logits at as many positions as a step may return (`prompt_logit_tokens`
        rows of [vocab] in float32, what requests for prompt logprobs cost: the engine takes
        each chunk's details before the next step) and at each other sequence's last."""
        items = self._profiling_items()
        saved = self.path.pool
        self.path.pool = self._allocate_pool(sum(len(i.block_table) for i in items))
        try:
            peak = memory.peak_of(lambda: self._forward_packed(items))
        finally:
            self.path.pool = saved
        return max(0, int(memory.total() * fraction) - peak)

    def _profiling_items(self) -> list[PackedItem]:
        """The largest step's prompt chunks: `prefill_chunk` tokens over as few sequences as
        hold them, each within `max_sequence_tokens` and blocks of its own; the first
        `prompt_logit_tokens` of them (all when uncapped) in sequences that return logits at
        every position."""
        items: list[PackedItem] = []
        left, block = self.prefill_chunk, 0
        logit_rows = (
            self.prefill_chunk if self.prompt_logit_tokens is None else self.prompt_logit_tokens
        )
        while left > 0:
            tokens = min(left, self.max_sequence_tokens, logit_rows or left)
            blocks = -(-tokens // self.block_size)
            items.append(
                PackedItem(
                    -1 - len(items),
                    tuple(i % self.vocab_size for i in range(tokens)),
                    0,
                    tuple(range(block, block + blocks)),
                    prompt_logits=logit_rows > 0,
                )
            )
            logit_rows = max(0, logit_rows - tokens)
            left, block = left - tokens, block + blocks
        return items

    # --- steps -------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """The images' features from the vision tower (a vision-language model's backend)."""
        if self.vision is None:
            raise ValueError("this model takes no images: it has no vision tower")
        return self.vision.encode(images)

    def forward(self, items: Sequence[PackedItem], fed: FedTokens | None = None) -> PackedOutput:
        """Run one packed step. Raises ValueError (before any write) for token ids outside the
        vocabulary, positions beyond max_sequence_tokens or block tables too short. `fed`:
        the items whose last token is read on the device from the step before's sampled ids
        (written into the step's ids after its one copy up)."""
        if not items:
            return PackedOutput(torch.empty((0, self.vocab_size), device=self.device_obj), ())
        self._check(items, fed)
        graphed = self._graphed(items, fed)
        if graphed is not None:
            return PackedOutput(graphed, (None,) * len(items))
        return self._forward_packed(items, fed)

    @torch.inference_mode()
    def _forward_packed(
        self, items: Sequence[PackedItem], fed: FedTokens | None = None
    ) -> PackedOutput:
        """`forward` without checks or CUDA graphs: the compiled decode graph where one runs
        the step, else the eager forward (also the profiling run, before capacity)."""
        query_lens = [len(item.token_ids) for item in items]
        kv_lens = [item.start + n for item, n in zip(items, query_lens, strict=True)]
        ids: list[int] = []
        rows: list[int] = []
        offsets: list[int] = []
        for item, n in zip(items, query_lens, strict=True):
            offset = len(ids)
            offsets.append(offset)
            ids.extend(item.token_ids)
            if item.prompt_logits:
                rows.extend(range(offset, offset + n))
            elif item.sample:
                rows.append(offset + n - 1)
        positions = rope_positions(items, query_lens)
        streams = len(positions) // len(ids)
        # Where the fed tokens go among the ids, then which of the earlier step's rows.
        feeding = [*fed.flat(query_lens), *fed.rows] if fed is not None else []
        device = self.device_obj
        windows = self.path.windows
        pool = self.path.pool
        # The step's token ids, positions and logit rows go up in the metadata's copy.
        meta = step_metadata(
            query_lens,
            kv_lens,
            [item.block_table for item in items],
            self.block_size,
            self.device_obj,
            windows,
            pool.num_blocks,
            pool.kv_heads,
            pool.flash,
            [item.spans for item in items] if self.bidirectional else None,
            pool.triton,
            torch.tensor([*ids, *positions, *rows, *feeding], dtype=torch.long),
        )
        if meta.fresh_blocks is not None:
            pool.clear(meta.fresh_blocks)
        inputs = meta.inputs
        assert inputs is not None
        tokens = len(ids)
        if fed is not None:
            fed.write(inputs[:tokens], inputs[inputs.shape[0] - len(feeding) :])
        at = inputs[tokens : (1 + streams) * tokens]
        if self.compiled is not None and self._plain_decode(items) and streams == 1:
            logits = self.compiled.run(inputs[:tokens], at, meta)
            return PackedOutput(logits, (None,) * len(items))
        logits = self.path.forward(
            inputs[:tokens],
            at if streams == 1 else at.view(streams, tokens),
            meta,
            inputs[(1 + streams) * tokens : (1 + streams) * tokens + len(rows)],
            [
                (o + at, rows)
                for o, item in zip(offsets, items, strict=True)
                for at, rows in item.embeds
            ],
            self.lora.step([item.adapter for item in items], query_lens),
        )
        if not any(item.prompt_logits for item in items):
            # One row per sampling chunk, in order: the logits are the sampled rows already.
            return PackedOutput(logits, (None,) * len(items))
        last: list[int] = []
        prompt: list[torch.Tensor | None] = []
        row = 0
        for item, n in zip(items, query_lens, strict=True):
            taken = n if item.prompt_logits else int(item.sample)
            if item.sample:
                last.append(row + taken - 1)
            prompt.append(logits[row : row + n] if item.prompt_logits else None)
            row += taken
        chosen = logits[to_device(last, torch.long, device)] if last else logits[:0]
        return PackedOutput(chosen, tuple(prompt))

    def _graphed(
        self, items: Sequence[PackedItem], fed: FedTokens | None = None
    ) -> torch.Tensor | None:
        """Logits of a decode step replayed from its graph; None when the step runs eagerly
        (no graphs, a prefill chunk, prompt logits, prompt-prefix embeddings, a LoRA adapter,
        or more rows than the largest bucket)."""
        graphs = self.graphs
        if graphs is None or not self._plain_decode(items):
            return None
        if graphs.graph_for(len(items)) is None:
            return None
        size = self.block_size
        return graphs.run(
            [item.token_ids[0] for item in items],
            [item.start for item in items],
            [slots_of(item.block_table, item.start, item.start + 1, size)[0] for item in items],
            [item.block_table for item in items],
            rope_positions(items, [1] * len(items)) if any(i.grids for i in items) else None,
            fed,
        )

    @staticmethod
    def _plain_decode(items: Sequence[PackedItem]) -> bool:
        """Whether every item samples one token from one token of input, with no prompt
        logits, prompt-prefix embeddings or LoRA adapter: a step graphs can run."""
        return not any(
            len(i.token_ids) != 1
            or not i.sample
            or i.prompt_logits
            or i.embeds
            or i.adapter is not None
            for i in items
        )

    def _check(self, items: Sequence[PackedItem], fed: FedTokens | None = None) -> None:
        limit, size = self.max_sequence_tokens, self.block_size
        blocks = self._capacity.num_blocks
        if fed is not None and not self._capacity.fed_tokens:
            raise ValueError(f"the {self.name} backend reads no tokens on the device (fed)")
        feeds = set(fed.items) if fed is not None else set()
        if fed is not None and fed.rows:
            sampled = fed.source().shape[0]
            if min(fed.rows) < 0 or max(fed.rows) >= sampled:
                raise ValueError(
                    f"fed tokens from rows {min(fed.rows)}..{max(fed.rows)} of a step that "
                    f"sampled {sampled}"
                )
        for index, item in enumerate(items):
            end = item.start + len(item.token_ids)
            if not item.token_ids or item.start < 0 or end > limit:
                raise ValueError(
                    f"sequence {item.seq_id}: positions {item.start}..{end - 1} outside "
                    f"0..{limit - 1} (max_sequence_tokens)"
                )
            if len(item.block_table) * size < end:
                raise ValueError(
                    f"sequence {item.seq_id}: {len(item.block_table)} blocks of {size} "
                    f"cannot hold {end} positions"
                )
            if min(item.block_table) < 0 or max(item.block_table) >= blocks:
                raise ValueError(f"sequence {item.seq_id}: block ids outside [0, {blocks})")
            known = item.token_ids[:-1] if index in feeds else item.token_ids
            if known and (min(known) < 0 or max(known) >= self.vocab_size):
                raise ValueError(
                    f"sequence {item.seq_id}: token ids outside [0, {self.vocab_size})"
                )

    # --- warmup ------------------------------------------------------------------------------

    @property
    def _warmup_prompt(self) -> int:
        """The prompt warmup's decode steps follow: WARMUP_PROMPT tokens, fewer where a
        sequence holds fewer."""
        return min(WARMUP_PROMPT, self.max_sequence_tokens - 1)

    def warmup_plan(self, max_batch_size: int, max_input_tokens: int) -> list[Shape]:
        """The shapes the scheduler can send: the largest prefill chunk it allows (the
        longest prompt, capped by the chunk budget), then a decode step per power-of-two
        batch size up to the largest batch the pool holds."""
        longest = max(1, min(max_input_tokens, self.prefill_chunk, self.max_sequence_tokens - 1))
        per_seq = -(-(self._warmup_prompt + 1) // self.block_size)
        rows = max(1, min(max_batch_size, self._capacity.max_sequences))
        rows = min(rows, max(1, self._capacity.num_blocks // per_seq))
        plan = [Shape("prefill", 1, longest)]
        return plan + [Shape("decode", n, 1) for n in powers_of_two(1, rows)]

    def run_shape(self, shape: Shape) -> ShapeTiming:
        """Run one step of `shape` on dummy tokens in blocks of the pool (serving has not
        started: nothing else owns them)."""
        per_seq = -(-max(shape.length, self._warmup_prompt + 1) // self.block_size)
        blocks = iter(range(self._capacity.num_blocks))
        tables = [tuple(next(blocks) for _ in range(per_seq)) for _ in range(shape.rows)]

        def tokens(n: int) -> tuple[int, ...]:
            return tuple(j % self.vocab_size for j in range(n))

        if shape.phase == "prefill":
            items = [PackedItem(-1 - i, tokens(shape.length), 0, t) for i, t in enumerate(tables)]
        else:
            items = [
                PackedItem(-1 - i, (1 % self.vocab_size,), self._warmup_prompt, t)
                for i, t in enumerate(tables)
            ]
        start = time.perf_counter()
        out = self.forward(items)
        out.last.sum().item()  # wait for the device
        return ShapeTiming(shape, time.perf_counter() - start, 0)

    def warmup(
        self,
        max_batch_size: int,
        max_input_tokens: int,
        on_shape: Callable[[ShapeTiming], None] | None = None,
    ) -> list[ShapeTiming]:
        """Compile the decode graphs (with --compile), then run the plan once: pays the
        one-off costs (allocator growth, kernel selection, thread pools) before serving; then
        records the CUDA graphs of decode, one shape each, largest first (they share one
        memory pool)."""
        plan = self.warmup_plan(max_batch_size, max_input_tokens)
        timings: list[ShapeTiming] = []

        def timed(batch: int, action: Callable[[int], None]) -> None:
            """Run `action(batch)`, which builds one decode graph, as a warmup shape."""
            start = time.perf_counter()
            action(batch)
            seconds = time.perf_counter() - start
            timings.append(ShapeTiming(Shape("decode", batch, 1), seconds, 1))
            if on_shape is not None:
                on_shape(timings[-1])

        clock = PhaseClock()
        self.warmup_phases = clock.seconds
        done = clock.done
        self._race_attention()
        if self.race_times:
            done("attention race")
        if self.compiled is not None:
            rows = max(shape.rows for shape in plan if shape.phase == "decode")
            self.compiled.load_packages()
            if self.build_recipe is not None and not self.compiled.packaged():
                self._build_in_background()
            else:
                for batch in (g for g in GRAPHS if g <= rows):
                    timed(batch, self.compiled.compile)
            done("compile")
        timings += run_plan(plan, self.run_shape, on_shape)
        done("plan")
        if self.graphs is not None:
            for bucket in sorted(self.graphs.buckets, reverse=True):
                try:
                    timed(bucket, self.graphs.capture)
                except RuntimeError as exc:
                    self._graph_capture_failed(bucket, exc)
                    break
            done("graphs")
        return timings

    def _build_in_background(self) -> None:
        """Start the process that builds the missing packages; decode runs eagerly until it
        ends, then through the packages it built (loaded on its watcher's thread). Where the
        store keeps an earlier build's failure, decode stays eager without trying again (`tgis
        warmup` builds in the foreground and shows why, or the store's folder removed)."""
        compiled, recipe = self.compiled, self.build_recipe
        assert compiled is not None and compiled.packages is not None and recipe is not None
        store = compiled.packages
        if (failure := store.failure) is not None:
            self.compile_failure = failure
            logger.warning(
                "the compiled decode's last build failed (%s; log: %s): decode stays eager; "
                "`tgis warmup` with these flags builds it again, or remove %s",
                failure.strip().splitlines()[-1] if failure.strip() else "no reason kept",
                store.log,
                store.directory,
            )
            return

        def done(code: int) -> None:
            try:
                if code == 0:
                    # On the model's thread, between two steps: a second thread's OpenMP
                    # team would slow both, and the race would time that instead.
                    load = compiled.load_packages
                    load() if self._model_thread is None else self._model_thread(load)
                elif not (self.background is not None and self.background.stopped):
                    logger.warning(
                        "building the compiled decode failed (exit %d; see %s): decode stays eager",
                        code,
                        store.log,
                    )
            finally:
                runtime = self.runtime()
                for watcher in self._runtime_watchers:
                    watcher(runtime)

        self.background = BackgroundBuild(recipe.command(store, compiled.autotune), store.log, done)
        self.background.start()
        logger.info(
            "compiled decode: building in a process of its own (log: %s); decode runs "
            "eagerly until it is ready",
            store.log,
        )

    def run_model_work_on(self, call: Callable[[Callable[[], Any]], Any]) -> None:
        """Run the backend's later work on the model (`call(work)`: the engine's `call`, on
        the thread that runs its steps) instead of on whichever thread finds it (the
        compiled decode's packages loaded and timed when their build ends)."""
        self._model_thread = call

    def watch_runtime(self, watcher: Callable[[dict[str, Any]], None]) -> None:
        """Call `watcher` with `runtime()` whenever it changes after start-up (the compiled
        decode built in the background, or its build failed): what /info shows follows."""
        self._runtime_watchers.append(watcher)

    def close(self) -> None:
        """The server stops: a build in its own process stops too (the packages it finished
        stay in the store)."""
        if self.background is not None:
            self.background.stop()

    def _race_attention(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """Where `auto` has two kernels that run (`contenders`), time a decode step and a
        prefill chunk with each (paged/race.py) and keep the faster: before any graph records
        the kernel in use."""
        if len(self.contenders) < 2:
            return
        steps = self._race_steps()

        def run(kernel: str) -> None:
            self._use_kernel(kernel)
            for items in steps:
                self._forward_packed(items).last.sum().item()  # waits for the device

        self.race_times = race(self.contenders, run, clock)
        self._use_kernel(winner(self.race_times))
        logger.info(
            "attention: %s measured fastest at warmup (%s)",
            self.kernel,
            ", ".join(f"{k} {s * 1e3:.2f} ms" for k, s in self.race_times.items()),
        )

    def _use_kernel(self, kernel: str) -> None:
        """Attend with `kernel` ("triton" or "flash": the same pages pool) from now on."""
        self.kernel = kernel
        self.path.pool = dataclasses.replace(self.path.pool, triton=kernel == "triton")

    def _race_steps(self) -> list[list[PackedItem]]:
        """What the kernels race over: a decode step of up to RACE_BATCH rows at up to
        RACE_CONTEXT tokens of context each, and one prompt chunk of up to RACE_PREFILL tokens,
        all in blocks of the pool (serving has not started: nothing else owns them)."""
        blocks = self._capacity.num_blocks
        context = max(
            1, min(RACE_CONTEXT, self.max_sequence_tokens - 1, blocks * self.block_size - 1)
        )
        per_seq = -(-(context + 1) // self.block_size)
        rows = max(1, min(RACE_BATCH, self._capacity.max_sequences, blocks // per_seq))
        decode = [
            PackedItem(
                -1 - i,
                (1 % self.vocab_size,),
                context,
                tuple(range(i * per_seq, (i + 1) * per_seq)),
            )
            for i in range(rows)
        ]
        length = max(
            1,
            min(
                RACE_PREFILL, self.prefill_chunk, self.max_sequence_tokens, blocks * self.block_size
            ),
        )
        table = tuple(range(-(-length // self.block_size)))
        prompt = PackedItem(-1 - rows, tuple(j % self.vocab_size for j in range(length)), 0, table)
        return [decode, [prompt]]

    def _graph_capture_failed(self, bucket: int, exc: RuntimeError) -> None:
        """Recording a graph failed: an error when --cuda-graphs asked for them, else decode
        runs eagerly (correct, slower) and the log says why."""
        if self._graphs_required:
            raise ConfigError(
                f"--cuda-graphs: recording the decode graph of batch {bucket} failed: {exc}",
                "serve with --no-cuda-graphs (TGIS_CUDA_GRAPHS=false)",
            ) from exc
        logger.warning(
            "recording the decode graph of batch %d failed (%s): decode runs eagerly", bucket, exc
        )
        self.graphs = None
