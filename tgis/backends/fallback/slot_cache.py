"""The slot-compacted KV cache of the fallback engine.

Per layer, one K and one V tensor of shape [max_sequences, num_kv_heads, max_sequence_tokens,
head_dim] is allocated once. A running sequence owns one slot (a row of dim 0) and its tokens
occupy positions [0, length) of that row. The backend keeps the running sequences in slots
0..n-1: releasing a sequence moves the last slot into the hole, copying one sequence's tokens,
never the whole cache. A decode step over slots 0..n-1 then reads the cache through the views
`K[:n, :, :T]` (T = longest sequence + 1) with no gather copy.

`KVStep` tells a forward pass which rows it touches and where its new tokens go; the forward
(through a `transformers` Cache) writes and reads the cache with the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgis.backends.common.kv import kv_bytes_per_token


@dataclass(frozen=True)
class KVStep:
    """Where one forward pass writes its new K/V and which cache prefix it reads.

    Rows of the batch map to slots either as a contiguous range (`slot_start` .. `slot_start +
    batch`, read through views) or through `slots` ([batch] long tensor on the cache's device,
    read through a gather copy). New tokens are written either at one position per row
    (`positions`, [batch] long, a decode step with one token per row) or as a block of
    `query_len` tokens starting at `start` for every row (prefill). Every row then reads
    positions [0, kv_len).
    """

    batch: int
    query_len: int
    kv_len: int
    slot_start: int = 0
    slots: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    start: int = 0

    @property
    def past_len(self) -> int:
        """Tokens in the read window before this step's tokens (what HF calls the past)."""
        return self.kv_len - self.query_len


class SlotKVCache:
    """Preallocated per-layer K/V tensors [max_sequences, heads, max_tokens, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        max_sequences: int,
        num_heads: int,
        max_tokens: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        value_head_dim: int | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.max_sequences = max_sequences
        self.num_heads = num_heads
        self.max_tokens = max_tokens
        self.head_dim = head_dim
        self.value_head_dim = value_head_dim or head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # torch.zeros, not empty: padding positions inside a read window are masked, but a
        # masked NaN/inf left over from uninitialised memory would still poison 0 * x products
        # in some attention kernels.
        k_shape = (max_sequences, num_heads, max_tokens, head_dim)
        v_shape = (max_sequences, num_heads, max_tokens, self.value_head_dim)
        self.keys = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Row indices for decode writes into the running prefix, sliced instead of rebuilt.
        self._rows = torch.arange(max_sequences, device=device)

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(
            self.num_layers, self.num_heads, self.head_dim, self.dtype, self.value_head_dim
        )

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, step: KVStep) -> None:
        """Store this step's new key/value states [batch, heads, query_len, head_dim]."""
        k_cache, v_cache = self.keys[layer], self.values[layer]
        if step.positions is not None:
            # Decode: one token per row, each at its own position. Advanced indexing with a
            # slice in the middle writes [batch, heads, head_dim] and nothing else.
            rows = step.slots
            if rows is None:
                rows = self._rows[step.slot_start : step.slot_start + step.batch]
            k_cache[rows, :, step.positions] = key[:, :, 0]
            v_cache[rows, :, step.positions] = value[:, :, 0]
            return
        window = slice(step.start, step.start + step.query_len)
        if step.slots is None:
            rows = slice(step.slot_start, step.slot_start + step.batch)
            k_cache[rows, :, window] = key
            v_cache[rows, :, window] = value
        else:
            k_cache[step.slots, :, window] = key
            v_cache[step.slots, :, window] = value

    def read(self, layer: int, step: KVStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys/values [batch, heads, kv_len, head_dim] the step attends to.

        Views for a contiguous slot range; a gather copy when `step.slots` is given.
        """
        k_cache, v_cache = self.keys[layer], self.values[layer]
        if step.slots is None:
            rows = slice(step.slot_start, step.slot_start + step.batch)
            return k_cache[rows, :, : step.kv_len], v_cache[rows, :, : step.kv_len]
        return k_cache[step.slots, :, : step.kv_len], v_cache[step.slots, :, : step.kv_len]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` tokens of slot `src` into slot `dst` (every layer)."""
        if src == dst or length == 0:
            return
        for k_cache, v_cache in zip(self.keys, self.values, strict=True):
            k_cache[dst, :, :length] = k_cache[src, :, :length]
            v_cache[dst, :, :length] = v_cache[src, :, :length]
