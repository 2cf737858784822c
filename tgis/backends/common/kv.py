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


# `--kv-cache-dtype`'s float8 names (tgis.config.types.KV_CACHE_DTYPES) -> torch's dtypes.
FLOAT8_KV = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a `--kv-cache-dtype` name; None (the model's dtype) for None."""
    return None if name is None else FLOAT8_KV[name]


def to_cache(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` as a cache of `dtype` stores them. Into float8 with a scale of 1 (as vLLM's
    pool without calibrated scales): beyond the format's largest finite value a value
    saturates to it, where a plain cast would give NaN (e4m3fn has no infinity)."""
    if dtype in FLOAT8_KV.values():
        limit = torch.finfo(dtype).max
        return values.clamp(-limit, limit).to(dtype)
    return values.to(dtype)
