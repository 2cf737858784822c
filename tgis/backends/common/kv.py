"""What a model's KV cache holds per token, whichever design keeps it: the shape of one layer's
keys and values, the sliding window of each layer, and the bytes one token takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicSlidingWindowLayer

from tgis.config import dtype_bytes


@dataclass(frozen=True)
class KVShape:
    """What one layer stores per token: heads x head_dim for keys (and values)."""

    num_layers: int
    num_heads: int
    head_dim: int
    value_head_dim: int


def sliding_windows(model: PreTrainedModel) -> list[int | None]:
    """Per-layer sliding window of `model` (None = full attention), as transformers sees it."""
    layers = DynamicCache(config=model.config).layers
    return [
        layer.sliding_window if isinstance(layer, DynamicSlidingWindowLayer) else None
        for layer in layers
    ]


def kv_bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | str,
    value_head_dim: int = 0,
) -> int:
    """Bytes of K and V that one token takes over all layers (`dtype` a torch dtype or its
    name; values `value_head_dim` wide where that differs from the keys' head_dim)."""
    element = dtype.itemsize if isinstance(dtype, torch.dtype) else dtype_bytes(dtype)
    return num_layers * num_kv_heads * (head_dim + (value_head_dim or head_dim)) * element
