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

Memory: each graph holds its packed copy of the weights, and the eager forward keeps the
originals for prefill, so the weights take three times their size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from tgis.backends.models.decoder import LayerWeights
from tgis.backends.paged.attention import StepMetadata, decode_attention, step_metadata, write_kv
from tgis.backends.paged.forward import PagedForward

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


def weight_copies_bytes(weight_bytes: int) -> int:
    """Memory the compiled graphs' packed copies of weights of `weight_bytes` take."""
    return len(GRAPHS) * weight_bytes


def compile_options(device: torch.device) -> dict[str, Any]:
    """Inductor's settings for the decode graphs on `device` (module doc)."""
    options: dict[str, Any] = {"freezing": True}
    if device.type == "cpu":
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    return options


class CompiledDecode:
    """The compiled decode steps of `path` for batches up to `max_batch` (module doc)."""

    def __init__(self, path: PagedForward, max_batch: int) -> None:
        if path.pool.flash:
            raise ValueError("compiled decode runs the plain-torch attention path's pool")
        self.path = path
        self.max_batch = max_batch
        self._weights = path.as_constants()
        self._window = {w: i for i, w in enumerate(path.windows)}
        self._compiled = torch.compile(self._step)
        self._graphs: set[int] = set()  # of GRAPHS, those compiled
        self.eager_steps = 0  # serving steps no compiled graph accepted

    @property
    def graphs(self) -> list[str]:
        """The batch sizes each compiled graph serves, as /info shows them."""
        return [self._label(g) for g in sorted(self._graphs)]

    def _label(self, graph: int) -> str:
        return "1" if graph == 1 else f"{graph}-{self.max_batch}"

    def _step(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slot_mapping: Tensor,
        blocks: Tensor,
        masks: tuple[Tensor, ...],
    ) -> Tensor:
        if not torch.compiler.is_compiling():
            self.eager_steps += 1
        weights, pool = self._weights, self.path.pool

        def attention(index: int, layer: LayerWeights, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return paged_decode_attention(
                q,
                k,
                v,
                pool.keys[index],
                pool.values[index],
                slot_mapping,
                blocks,
                masks[self._window[layer.window]],
                weights.scaling,
                weights.attn_softcap or 0.0,
            )

        x = weights._inputs(weights._embed(input_ids))
        return weights._logits(weights.layers_over(x, positions, attention))

    def _inputs(
        self, input_ids: Tensor, positions: Tensor, meta: StepMetadata
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, ...]]:
        decode = meta.decode
        if decode is None or not decode.whole:
            raise ValueError("a compiled decode step takes decode rows only")
        masks = tuple(decode.masks[w] for w in self.path.windows)
        return input_ids, positions, meta.slot_mapping, decode.blocks, masks

    @torch.inference_mode()
    def compile(self, batch: int) -> None:
        """Compile the graph that serves `batch` rows (one of GRAPHS) from a dummy
        step over the pool's first blocks (nothing owns them before serving). The batch (from
        2 up) and the KV length are marked dynamic, so later steps do not specialise them."""
        pool = self.path.pool
        size = pool.block_size
        pages = max(1, min(3, pool.num_blocks // batch))
        tables = [tuple(range(i * pages, (i + 1) * pages)) for i in range(batch)]
        kv_len = pages * size
        meta = step_metadata(
            [1] * batch,
            [kv_len] * batch,
            tables,
            size,
            self.path.device,
            self.path.windows,
            pool.num_blocks,
            pool.kv_heads,
            flash=False,
        )
        ids = torch.zeros(batch, dtype=torch.long, device=self.path.device)
        positions = torch.full_like(ids, kv_len - 1)
        inputs = self._inputs(ids, positions, meta)
        *per_row, blocks, masks = inputs
        if blocks.shape[0] > 1:
            torch._dynamo.mark_dynamic(blocks, 0)
        for mask in masks:  # [rows, 1, 1, KV length]
            if pages > 1:
                torch._dynamo.mark_dynamic(mask, 3)
        if batch > 1:
            for tensor in (*per_row, *masks):
                torch._dynamo.mark_dynamic(tensor, 0)
        # Inductor reads these while it compiles, which happens inside this first call.
        with torch._inductor.config.patch(compile_options(self.path.device)):
            self._compiled(*inputs)
        graph = max(g for g in GRAPHS if g <= batch)
        self._graphs.add(graph)
        logger.info("decode of batch %s compiled", self._label(graph))

    @torch.inference_mode()
    def run(self, input_ids: Tensor, positions: Tensor, meta: StepMetadata) -> Tensor:
        """Float32 logits [rows, vocab] of a decode step (every row one token, its K/V
        written into the pool), through the compiled graph that accepts it, else eagerly
        (counted in `eager_steps`)."""
        inputs = self._inputs(input_ids, positions, meta)
        if not self._graphs:
            return self._step(*inputs)
        with torch.compiler.set_stance("eager_on_recompile"):
            return self._compiled(*inputs)
