"""A `transformers` Cache (4.57 API) whose layers live in the slot cache.

A transformers model calls `cache.update(key, value, layer_idx, ...)` in every attention layer
and asks the cache for mask sizes (`get_mask_sizes`) and for the number of tokens already seen
(`get_seq_length`). `SlotCache` answers all three from the `KVStep` the forward path sets
before each model call:

- `update` writes the new states [batch, heads, query_len, head_dim] into the slot cache and
  returns the keys/values [batch, heads, kv_len, head_dim] the step attends to (views of the
  running prefix in decode, so no gather copy);
- `get_mask_sizes` returns (kv_len, 0): the 2D attention mask passed alongside has kv_len
  columns and masks each row's padding;
- `get_seq_length` returns kv_len - query_len, what a DynamicCache would report as the past.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tgis.backends.fallback.slot_cache import KVStep, SlotKVCache


class _SlotLayer(CacheLayerMixin):
    """One attention layer's view of the slot cache."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: SlotCache, layer_idx: int) -> None:
        super().__init__()
        self._owner = owner
        self._layer_idx = layer_idx
        self.is_initialized = True
        self.dtype, self.device = owner.kv.dtype, owner.kv.device

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        # The slot cache is allocated up front; nothing to do.
        return None

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._owner.require_step()
        kv = self._owner.kv
        kv.write(self._layer_idx, key_states, value_states, step)
        self.keys, self.values = kv.read(self._layer_idx, step)
        return self.keys, self.values

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self._owner.require_step().kv_len, 0

    def get_seq_length(self) -> int:
        step = self._owner.step
        return 0 if step is None else step.past_len

    def get_max_cache_shape(self) -> int:
        return self._owner.kv.max_tokens

    def reset(self) -> None:
        # The slot cache is the backend's: a model never wipes it.
        return None


class SlotCache(Cache):
    """A transformers Cache over a `SlotKVCache`; set `step` before each model call."""

    def __init__(self, kv: SlotKVCache) -> None:
        self.kv = kv
        self.step: KVStep | None = None
        super().__init__(layers=[_SlotLayer(self, index) for index in range(kv.num_layers)])

    def require_step(self) -> KVStep:
        if self.step is None:
            raise RuntimeError("SlotCache used outside a forward step: set `step` first")
        return self.step

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers):
            raise IndexError(
                f"the model wrote KV for layer {layer_idx}, the slot cache has {len(self.layers)}"
            )
        return self.layers[layer_idx].update(key_states, value_states, cache_kwargs)

    # Beam search and cropping reorder a private batch; the backend owns slot order instead.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("SlotCache is driven by the backend, not by generate()")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("SlotCache is driven by the backend, not by generate()")
