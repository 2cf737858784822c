"""The cuda backend with CUDA graphs (--cuda-graphs): decode steps replayed from a graph per
batch-size bucket, the way TGI and vLLM cut the kernel-launch cost of small decode batches.

A CUDA graph needs fixed shapes and fixed memory, so this mode serves from the static batch
(static_batch.py) over the fixed-shape llama forward (static_kv.py) instead of the dynamic slot
cache: `slots` rows of `max_total_tokens` positions on the GPU, a new request in the lowest free
slot, decode over the smallest power-of-two bucket of rows covering the slots in use (one graph
each, recorded at warmup), prefill eager (its shapes vary; padded to power-of-two lengths).
Decode attends over all `max_total_tokens` positions of a row (masked), a fixed cost that the
dynamic path avoids, so graphs pay off where launches dominate: small models, small batches.

The slots are sized from free GPU memory like the dynamic backend's KV budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tgis.backends.buckets import MIN_LENGTH_BUCKET, ShapePolicy, powers_of_two
from tgis.backends.static_batch import StaticBatchBackend, pad_token_id
from tgis.config import ServeConfig
from tgis.errors import ConfigError

logger = logging.getLogger(__name__)


class CudaGraphApi:
    """GraphApi for CUDA graphs (torch.cuda.CUDAGraph). Recording only records, so the step
    runs once eagerly on a side stream first (as PyTorch requires before capture: lazy
    initializations must not be recorded) and the graph is replayed once after recording to
    produce the output. All graphs share one memory pool."""

    def __init__(self) -> None:
        self.pool: Any = None

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # idempotent: the same inputs write the same KV values at the same places
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()
        self.pool = graph.pool()
        graph.replay()
        return graph, output

    def replay(self, graph: Any) -> None:
        graph.replay()


def graph_policy(slots: int, max_length: int, max_input_tokens: int) -> ShapePolicy:
    """Decode over power-of-two row buckets up to `slots`; prefill (eager) padded to
    power-of-two rows and lengths."""
    return ShapePolicy(
        slots,
        max_length,
        "insert",
        powers_of_two(MIN_LENGTH_BUCKET, max_input_tokens),
        powers_of_two(1, slots),
        powers_of_two(1, slots),
    )


def fit_slots(requested: int, max_length: int, bytes_per_token: int, free_bytes: int) -> int:
    """Slots of `max_length` tokens that `free_bytes` holds besides the cache's scratch row, at
    most `requested`; ConfigError when not even one fits."""
    fits = free_bytes // (max_length * bytes_per_token) - 1  # the static cache's scratch row
    if fits < 1:
        raise ConfigError(
            f"free GPU memory ({free_bytes / 2**30:.1f} GiB for the KV cache) cannot hold one "
            f"sequence of {max_length} tokens at {bytes_per_token} bytes each",
            "lower --max-total-tokens, or serve without --cuda-graphs",
        )
    if fits < requested:
        logger.warning("KV memory holds %d slots of %d tokens, not %d", fits, max_length, requested)
    return min(requested, fits)


def load_cuda_graph_backend(config: ServeConfig, model_dir: Path) -> StaticBatchBackend:
    """Load a llama-family model onto the GPU with graph-replayed decode (see module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tgis.backends.graphs import GraphedStaticModel, GraphOps
    from tgis.backends.llama_native import (
        NATIVE_MODEL_TYPES,
        native_kv_shape,
        native_unsupported_reason,
    )
    from tgis.backends.slot_cache import kv_bytes_per_token
    from tgis.backends.static_kv import StaticLlamaForward
    from tgis.backends.torch_device import KV_MEMORY_FRACTION, available_memory, resolve_dtype

    if not torch.cuda.is_available():
        raise ConfigError("CUDA is not available on this machine", "drop --cuda-graphs")
    device = torch.device("cuda")
    hf_config = AutoConfig.from_pretrained(model_dir)
    dtype = resolve_dtype(device, config.dtype, getattr(hf_config, "dtype", None))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    reason = native_unsupported_reason(model)
    if reason is not None:
        raise ConfigError(
            f"--cuda-graphs cannot run {model_dir.name}: {reason}",
            f"use a {'/'.join(NATIVE_MODEL_TYPES)} model, or serve without --cuda-graphs",
        )
    shape = native_kv_shape(model)
    per_token = kv_bytes_per_token(shape.num_layers, shape.num_heads, shape.head_dim, dtype)
    requested = config.max_batch_size or config.max_concurrent_requests
    fraction = config.cuda_memory_fraction or KV_MEMORY_FRACTION["cuda"]
    free = int(available_memory(device) * fraction)
    slots = fit_slots(requested, config.max_total_tokens, per_token, free)
    forward = StaticLlamaForward(model, slots, config.max_total_tokens)
    graphed = GraphedStaticModel(forward, CudaGraphApi())
    policy = graph_policy(slots, config.max_total_tokens, config.max_input_tokens)
    logger.info(
        "cuda backend with CUDA graphs: %d slots x %d tokens, decode buckets %s",
        slots,
        config.max_total_tokens,
        policy.decode_batches,
    )
    ops = GraphOps("cuda", graphed)
    return StaticBatchBackend(graphed, policy, ops, "cuda", pad_token_id(model.config), dtype)
