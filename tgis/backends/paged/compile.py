"""Decode steps of the paged forward through torch.compile, on the plain-torch attention path.

A decode step (every sequence computes one token) runs as one graph that inductor compiles at
warmup: the weights folded in as constants (`freezing`) and, on CPU, packed for inductor's own
GEMM kernels, timed at compile time against ATen's (`max_autotune` with the CPP and ATEN
backends; at a few rows they read the weights at close to the memory's bandwidth where MKL's
GEMM does not); norms, rope, residuals and activations fused around them. Attention stays one
opaque op per layer (`tgis::paged_decode_attention`: the new keys and values written into the
pool, then `paged_attention.decode_attention` over the rows' blocks), so the graph's shapes
are the batch alone: a context length varies only inside the op, never the graph.

Two graphs: batch 1 (the latency case, static shapes) and every batch from 2 up (dynamic),
each compiled once at warmup from inputs of several KV blocks, so no length is specialised. A
step that neither graph accepts runs the same function eagerly (`eager_on_recompile`):
serving never compiles. Prefill and mixed steps, rows with a LoRA adapter or prompt-prefix
embeddings, and prompt logprobs run the eager forward.

A packaged graph of batch 2 and up serves up to the most rows at which it ran faster than the
eager step, timed as it loads (`race_rows`): its GEMMs are blocked for the few rows it was
tuned at, and past a machine's crossover ATen's win (the demo model on 2 cores of an AVX-512
CPU, one build: 1.2 ms against 4.2 at 2 rows, 6.3 against 8.1 at 32, and about even at 48).

Memory: each graph holds its packed copy of the weights, and the eager forward keeps the
originals for prefill, so the weights take three times their size.

Compiled in process (`torch.compile`), the graphs last as long as the process: their frozen
weights keep inductor's caches out. With a `PackageStore` (paged/packages.py) each graph is
instead exported and compiled ahead of time into a package on disk, which the next start
loads in seconds; the pool's tensors are the package's inputs (any number of blocks), the
weights its constants.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tgis.backends.models.decoder import LayerWeights
from tgis.backends.paged.attention import StepMetadata, decode_attention, step_metadata, write_kv
from tgis.backends.paged.forward import PagedForward
from tgis.backends.paged.race import race, winner

if TYPE_CHECKING:
    from tgis.backends.paged.packages import PackageStore

logger = logging.getLogger(__name__)


# Defined through torch.library's low-level registration rather than `custom_op`, whose Python
# wrapper costs ~25 us a call on a CPU: six layers of the demo model paid 0.15 ms a step for it.
_LIBRARY = torch.library.Library("tgis", "FRAGMENT")
_LIBRARY.define(
    "paged_decode_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor slot_mapping, Tensor blocks, Tensor mask, float scale, "
    "float softcap) -> Tensor"
)


def _paged_decode_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    blocks: Tensor,
    mask: Tensor,
    scale: float,
    softcap: float,
) -> Tensor:
    """One layer's decode attention over head-major pools: write key/value [rows, kv_heads,
    dim] at `slot_mapping`, then attend query [rows, heads, dim] over the rows' `blocks` with
    the boolean `mask` (`paged_attention.decode_attention`); `softcap` 0: none."""
    write_kv(k_cache, v_cache, key, value, slot_mapping, heads_first=True)
    return decode_attention(query, k_cache, v_cache, blocks, mask, scale, softcap or None)


_LIBRARY.impl("paged_decode_attention", _paged_decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("tgis::paged_decode_attention", lib=_LIBRARY)
def _paged_decode_attention_shape(query: Tensor, *_: object) -> Tensor:
    return torch.empty_like(query)


paged_decode_attention = torch.ops.tgis.paged_decode_attention.default


# The graphs compiled at warmup, by the smallest batch each serves: batch 1 alone, then every
# batch from 2 up. Each holds a packed copy of the weights.
GRAPHS = (1, 2)
# The most rows a packaged graph takes (its batch is free up to this, whatever the server's
# --max-batch-size, so one package serves them all).
PACKAGE_ROWS = 4096
# The batches at which the packaged graph of batch 2 and up races the eager step
# (`CompiledDecode.race_rows`), up to the first the eager step wins, within RACE_SECONDS.
RACE_ROWS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
RACE_SECONDS = 10.0


def weight_copies_bytes(weight_bytes: int) -> int:
    """Memory the compiled graphs' packed copies of weights of `weight_bytes` take."""
    return len(GRAPHS) * weight_bytes


def compile_options(device: torch.device, autotune: bool = True) -> dict[str, Any]:
    """Inductor's settings for the decode graphs on `device` (module doc); `autotune` False
    keeps ATen's GEMMs without timing inductor's (minutes less to compile, slower at few
    rows)."""
    options: dict[str, Any] = {"freezing": True}
    if device.type == "cpu" and autotune:
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return options


class _DecodeStep(torch.nn.Module):
    """One decode step of `decode`'s path, with the pool's tensors as inputs: what
    torch.compile compiles and torch.export traces, and what runs eagerly (counted in
    `CompiledDecode.eager_steps`) where no graph takes the step."""

    def __init__(self, decode: CompiledDecode) -> None:
        super().__init__()
        self.decode = decode

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slot_mapping: Tensor,
        blocks: Tensor,
        masks: tuple[Tensor, ...],
        keys: tuple[Tensor, ...],
        values: tuple[Tensor, ...],
    ) -> Tensor:
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            self.decode.eager_steps += 1
        weights, window = self.decode._weights, self.decode._window

        def attention(index: int, layer: LayerWeights, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return paged_decode_attention(
                q,
                k,
                v,
                keys[index],
                values[index],
                slot_mapping,
                blocks,
                masks[window[layer.window]],
                weights.scaling,
                weights.attn_softcap or 0.0,
            )

        x = weights.embedded(input_ids)
        return weights.logits(weights.layers_over(x, positions, attention))


class CompiledDecode:
    """The compiled decode steps of `path` for batches up to `max_batch` (module doc)."""

    def __init__(
        self,
        path: PagedForward,
        max_batch: int,
        packages: PackageStore | None = None,
        autotune: bool = True,
    ) -> None:
        """packages: where each graph is kept as a package (built there if missing, loaded
        from there if not; module doc); None: compiled in this process. autotune: as
        `compile_options`."""
        if path.pool.flash:
            raise ValueError("compiled decode runs the plain-torch attention path's pool")
        self.path = path
        self.max_batch = max_batch
        self.packages, self.autotune = packages, autotune
        self._weights = path.as_constants()
        self._window = {w: i for i, w in enumerate(path.windows)}
        self._step = _DecodeStep(self)
        self._compiled = torch.compile(self._step)
        self._graphs: set[int] = set()  # of GRAPHS, those compiled in this process
        # Of GRAPHS, those loaded from packages: what runs them (set by another thread).
        self._loaded: dict[int, Callable[..., Tensor]] = {}
        # The most rows the loaded graph of batch 2 and up serves (`race_rows`).
        self.rows = PACKAGE_ROWS
        self.race_seconds: dict[int, dict[str, float]] = {}  # its race, by batch
        self.eager_steps = 0  # serving steps no compiled graph accepted

    @property
    def graphs(self) -> list[str]:
        """The batch sizes each compiled graph serves, as /info shows them."""
        return [self._label(g) for g in sorted(self._graphs | set(self._loaded))]

    def packaged(self) -> bool:
        """Whether every graph's package is in the store."""
        return self.packages is not None and all(self.packages.has(g) for g in GRAPHS)

    def load_packages(self) -> list[int]:
        """Load the graphs whose packages are in the store (and are not loaded yet); from the
        next step on, decode runs through them, the graph of batch 2 and up for the rows it
        won in its race (`race_rows`; none: not used). Returns those loaded now."""
        store = self.packages
        if store is None:
            return []
        loaded = []
        for graph in GRAPHS:
            lost = graph > 1 and bool(self.race_seconds) and self.rows < graph
            if graph in self._loaded or lost or not store.has(graph):
                continue  # loaded, or raced already and slower than the eager step
            path = store.path(graph)
            try:
                runner = torch._inductor.aoti_load_package(str(path))
            except Exception:  # a bad copy: decode stays eager, a new build replaces it
                logger.exception("loading %s failed; it is removed", path)
                path.unlink(missing_ok=True)
                continue
            if graph > 1:
                # Set before the graph is: another thread's steps read both.
                self.rows, self.race_seconds = self.race_rows(runner)
                logger.info(
                    "decode of batch 2 and up: the graph serves up to %d rows (%s)",
                    self.rows,
                    "; ".join(f"{b}: {t['graph'] * 1e3:.1f} ms, eager {t['eager'] * 1e3:.1f}"
                              for b, t in self.race_seconds.items()),
                )  # fmt: skip
                if self.rows < graph:
                    continue
            self._loaded[graph] = runner
            loaded.append(graph)
            logger.info("decode of batch %s loaded from %s", self._label(graph), path)
        return loaded

    def _label(self, graph: int) -> str:
        return "1" if graph == 1 else f"{graph}-{min(self.rows, self.max_batch)}"

    def _inputs(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: StepMetadata,
        pool: tuple[tuple[Tensor, ...], tuple[Tensor, ...]] | None = None,
    ) -> tuple[Any, ...]:
        """The graph's inputs for a step over the path's pool (or `pool`: keys, values)."""
        decode = meta.decode
        if decode is None or not decode.whole:
            raise ValueError("a compiled decode step takes decode rows only")
        masks = tuple(decode.masks[w] for w in self.path.windows)
        keys, values = pool or (self.path.pool.keys, self.path.pool.values)
        return input_ids, positions, meta.slot_mapping, decode.blocks, masks, keys, values

    def _dummy(
        self, batch: int, num_blocks: int, pool: tuple[tuple[Tensor, ...], tuple[Tensor, ...]]
    ) -> tuple[tuple[Any, ...], int]:
        """A decode step of `batch` rows over the first blocks of `pool` (of `num_blocks`),
        several each (so no KV length is specialised); and the pages each row reads."""
        size = self.path.pool.block_size
        pages = max(1, min(3, num_blocks // batch))
        tables = [tuple(range(i * pages, (i + 1) * pages)) for i in range(batch)]
        kv_len = pages * size
        meta = step_metadata(
            [1] * batch,
            [kv_len] * batch,
            tables,
            size,
            self.path.device,
            self.path.windows,
            num_blocks,
            self.path.pool.kv_heads,
            flash=False,
        )
        ids = torch.zeros(batch, dtype=torch.long, device=self.path.device)
        positions = torch.full_like(ids, kv_len - 1)
        return self._inputs(ids, positions, meta, pool), pages

    @torch.inference_mode()
    def compile(self, batch: int) -> None:
        """Make the graph that serves `batch` rows (one of GRAPHS): from its package when
        the store has it, else built into the store and loaded (`_package`), else (no
        store) compiled in this process from a dummy step over the pool's first blocks
        (nothing owns them before serving). The batch (from 2 up) and the KV length are
        marked dynamic, so later steps do not specialise them."""
        graph = max(g for g in GRAPHS if g <= batch)
        if self.packages is not None:
            self.build(graph)
            self.load_packages()
            return
        pool = self.path.pool
        inputs, pages = self._dummy(batch, pool.num_blocks, (pool.keys, pool.values))
        *per_row, blocks, masks, _, _ = inputs
        if blocks.shape[0] > 1:
            torch._dynamo.mark_dynamic(blocks, 0)
        for mask in masks:  # [rows, 1, 1, KV length]
            if pages > 1:
                torch._dynamo.mark_dynamic(mask, 3)
        if batch > 1:
            for tensor in (*per_row, *masks):
                torch._dynamo.mark_dynamic(tensor, 0)
        # Inductor reads these while it compiles, which happens inside this first call.
        with torch._inductor.config.patch(compile_options(self.path.device, self.autotune)):
            self._compiled(*inputs)
        self._graphs.add(graph)
        logger.info("decode of batch %s compiled", self._label(graph))

    def build(self, graph: int) -> None:
        """Put `graph`'s package in the store unless it is there (not loaded here)."""
        assert self.packages is not None
        if not self.packages.has(graph):
            self._package(graph)

    @torch.inference_mode()
    def race_rows(
        self, graph: Callable[..., Tensor], clock: Callable[[], float] = time.perf_counter
    ) -> tuple[int, dict[int, dict[str, float]]]:
        """Time `graph` (of batch 2 and up) against the eager step at RACE_ROWS over a scratch
        pool that no sequence owns (paged/race.py), up to the first batch the eager step wins
        or RACE_SECONDS: the most rows the graph ran faster (PACKAGE_ROWS where it won at
        every one up to `max_batch`; 0 where it lost at 2), and the race's seconds by
        batch."""
        sizes = [b for b in RACE_ROWS if b <= max(2, self.max_batch)]
        blocks = 2 * sizes[-1] + 2
        pool = self._scratch(blocks)
        served, raced = PACKAGE_ROWS, [0]
        seconds: dict[int, dict[str, float]] = {}

        def eager(*inputs: Any) -> Tensor:
            raced[0] += 1
            return self._step(*inputs)

        run = {"graph": graph, "eager": eager}
        began = clock()
        try:
            for batch in sizes:
                inputs, _ = self._dummy(batch, blocks, pool)
                seconds[batch] = race(
                    tuple(run), lambda name, inputs=inputs: run[name](*inputs), clock
                )
                if winner(seconds[batch]) != "graph":
                    served = max((b for b in seconds if b < batch), default=0)
                    break
                if clock() - began > RACE_SECONDS and batch != sizes[-1]:
                    served = batch  # the rest not timed: steps of more rows run eagerly
                    break
        finally:
            self.eager_steps -= raced[0]  # the race's eager steps served nobody
        return served, seconds

    def _scratch(self, blocks: int) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Keys and values of `blocks` blocks shaped as the pool's, which no sequence owns."""
        pool, device = self.path.pool, self.path.device
        shape = (pool.kv_heads, blocks, *pool.keys[0].shape[2:])
        keys = tuple(torch.zeros(shape, dtype=k.dtype, device=device) for k in pool.keys)
        values = tuple(torch.zeros(shape, dtype=v.dtype, device=device) for v in pool.values)
        return keys, values

    def _package(self, graph: int) -> None:
        """Export `graph` over a scratch pool of a few blocks (the pool's length is one of the
        package's free sizes, as the batch from 2 up and the KV length are) and compile it
        ahead of time into the store."""
        assert self.packages is not None
        device = self.path.device
        scratch = 3 * max(GRAPHS) + 2
        keys, values = self._scratch(scratch)
        batch = max(g for g in GRAPHS if g >= graph) if graph > 1 else 1
        inputs, _ = self._dummy(batch, scratch, (keys, values))
        rows = torch.export.Dim("rows", min=2, max=PACKAGE_ROWS) if graph > 1 else None
        length = torch.export.Dim("kv_length", min=2, max=1 << 24)
        # One page of one KV head at batch 1 (an MQA model's first decode) gathers one block.
        gathered = torch.export.Dim("gathered", min=1, max=1 << 30)
        blocks = torch.export.Dim("blocks", min=2, max=1 << 30)
        row = {0: rows} if rows is not None else {}
        dynamic = (
            row, row, row, {0: gathered},
            tuple({**row, 3: length} for _ in inputs[4]),
            tuple({1: blocks} for _ in keys), tuple({1: blocks} for _ in values),
        )  # fmt: skip
        program = torch.export.export(self._step, inputs, dynamic_shapes=dynamic)
        options = compile_options(device, self.autotune)
        self.packages.save(
            graph,
            lambda path: torch._inductor.aoti_compile_and_package(
                program, package_path=str(path), inductor_configs=options
            ),
        )
        logger.info("decode of batch %s compiled into %s", self._label(graph),
                    self.packages.path(graph))  # fmt: skip

    @torch.inference_mode()
    def run(self, input_ids: Tensor, positions: Tensor, meta: StepMetadata) -> Tensor:
        """Float32 logits [rows, vocab] of a decode step (every row one token, its K/V
        written into the pool), through the compiled graph that accepts it, else eagerly
        (counted in `eager_steps`)."""
        inputs = self._inputs(input_ids, positions, meta)
        rows = input_ids.shape[0]
        loaded = self._loaded.get(1 if rows == 1 else 2) if rows <= self.rows else None
        if loaded is not None:
            return loaded(*inputs)
        if not self._graphs:
            return self._step(*inputs)
        with torch.compiler.set_stance("eager_on_recompile"):
            return self._compiled(*inputs)
