"""A fixed-shape llama-family forward over a static KV cache, for compiled devices.

Every tensor shape depends only on the step's bucket (rows, padded length), never on the data:
positions, prompt lengths and target rows travel as tensors. Under torch-xla (or an HPU graph)
each bucket therefore compiles once and is replayed for every later step of that bucket.

The cache holds, per layer, K and V of shape [batch_size + 1, kv_heads, max_length, head_dim]:
row r is static slot r; the extra last row is scratch, the target of padding rows in a prefill
(so padding never touches a live slot). Prefill runs prompts from position 0 and writes
positions [0, length) of their rows; decode writes one token per row at that row's position
and attends positions [0, position]. Positions past a row's length may hold stale values
(padding, an earlier occupant): the masks never let a query see them.

Weights come from DecoderWeights (fused QKV, rope tables, RMSNorm): llama, mistral and
qwen2 checkpoints. Attention is two batched matmuls with grouped-query heads stacked, softmax
in float32, so it lowers to plain dot/reduce ops on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from tgis.backends.common.kv import kv_bytes_per_token
from tgis.backends.common.masks import additive_mask
from tgis.backends.models.decoder import DecoderWeights, native_kv_shape


@dataclass
class StaticKVCache:
    """Per-layer K/V tensors [batch_size + 1, kv_heads, max_tokens, head_dim] (last row: scratch)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    batch_size: int
    max_tokens: int
    device: torch.device

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_tokens: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> StaticKVCache:
        shape = (batch_size + 1, num_kv_heads, max_tokens, head_dim)
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            batch_size,
            max_tokens,
            device,
        )

    @property
    def scratch_row(self) -> int:
        """The row padding writes go to."""
        return self.batch_size


class StaticLlamaForward(DecoderWeights):
    """The native llama weights, run with fixed shapes over a `StaticKVCache`."""

    name = "static"

    @torch.no_grad()
    def __init__(self, model: PreTrainedModel, batch_size: int, max_length: int) -> None:
        """`model` is loaded, in eval mode, on its device and dtype. Allocates the cache."""
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        shape = native_kv_shape(model)
        cache = StaticKVCache.allocate(
            shape.num_layers,
            batch_size,
            shape.num_heads,
            max_length,
            shape.head_dim,
            dtype,
            device,
        )
        # One weight layout on every device: [out, in] (the CPU GEMM tuning of the dynamic
        # path is irrelevant for a compiled graph).
        super().__init__(model, device, max_length, fuse_gate_up=False, transposed=False)
        self.static_cache = cache
        self.vocab_size = int(self.lm_head.shape[0])
        self.kv_bytes_per_token = kv_bytes_per_token(
            shape.num_layers, shape.num_heads, shape.head_dim, dtype
        )
        # Prefill attention through SDPA (fused kernels, no [b, heads, L, L] float32 scores) on
        # CUDA, where eager prefill runs long padded prompts; elsewhere the two matmuls, which
        # lower to plain ops on XLA and HPU.
        self.sdpa_prefill = device.type == "cuda"

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [b, L, heads, d], keys/values [b, kv_heads, T, d], additive mask [b, 1, 1, L, T]
        -> [b, L, heads * d]."""
        b, length = q.shape[0], q.shape[1]
        group = self.num_heads // self.num_kv_heads
        # [b, kv_heads, group, L, d]: the query heads sharing a KV head side by side.
        q = q.view(b, length, self.num_kv_heads, group, self.head_dim).permute(0, 2, 3, 1, 4)
        scores = torch.matmul(q, keys.unsqueeze(2).transpose(-1, -2)).float()
        probs = torch.softmax(scores * self.scaling + mask, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.unsqueeze(2))  # [b, kv_heads, group, L, d]
        return out.permute(0, 3, 1, 2, 4).reshape(b, length, -1)

    def _attend_sdpa(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """As `_attend` through scaled_dot_product_attention; `mask` is boolean [b, 1, L, T]."""
        b, length = q.shape[0], q.shape[1]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            values,
            attn_mask=mask,
            scale=self.scaling,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [b, heads, L, d]
        return out.transpose(1, 2).reshape(b, length, -1)

    def _allowed(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> dict:
        """Boolean masks (True = attend) per sliding window: query positions [b, L], key
        positions [T], valid keys [b, T] -> {window: [b, L, T]}."""
        q, k = query[:, :, None], keys[None, None, :]
        base = (k <= q) & valid[:, None, :]
        return {w: base if w is None else base & (k > q - w) for w in self.windows}

    def _mask(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> dict:
        """Additive masks per sliding window -> {window: [b, 1, 1, L, T]} (see `_allowed`)."""
        return {
            w: additive_mask(m[:, None, None]) for w, m in self._allowed(query, keys, valid).items()
        }

    @torch.no_grad()
    def prefill_static(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        rows: torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run padded prompts from position 0 into cache rows.

        input_ids [b, L] (right-padded), lengths [b] (real tokens per row, >= 1), rows [b]
        (cache row per prompt; padding prompts point at the scratch row). Returns float32
        logits [b, vocab] after each prompt's last token, or [b, L, vocab] with `all_logits`.
        """
        b, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)
        allowed = self._allowed(
            positions.expand(b, length), positions, positions[None, :] < lengths[:, None]
        )
        if self.sdpa_prefill:
            masks = {w: m[:, None] for w, m in allowed.items()}  # boolean [b, 1, L, L]
        else:
            masks = {w: additive_mask(m[:, None, None]) for w, m in allowed.items()}
        attend = self._attend_sdpa if self.sdpa_prefill else self._attend
        cos = self.cos[:length][None, :, None]  # [1, L, 1, d]
        sin = self.sin[:length][None, :, None]
        x = F.embedding(input_ids, self.embed).view(b * length, self.hidden)
        cos, sin = cos.expand(b, length, 1, -1), sin.expand(b, length, 1, -1)
        cos = cos.reshape(b * length, 1, -1)
        sin = sin.reshape(b * length, 1, -1)
        cache = self.static_cache
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)  # [b*L, heads, d], [b*L, kv_heads, d]
            k = k.view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
            cache.keys[index][rows, :, :length] = k
            cache.values[index][rows, :, :length] = v
            q = q.view(b, length, self.num_heads, self.head_dim)
            out = attend(q, k, v, masks[layer.window])
            x = self._finish(layer, x, out.reshape(b * length, -1))
        x = x.view(b, length, self.hidden)
        if all_logits:
            return self.logits(x.reshape(b * length, -1)).view(b, length, -1)
        last = (lengths - 1).clamp(min=0)
        return self.logits(x[torch.arange(b, device=x.device), last])

    @torch.no_grad()
    def decode_static(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """One token for each of cache rows [0, rows): input_ids and positions [rows].
        Returns float32 logits [rows, vocab]."""
        cache = self.static_cache
        keys_at = torch.arange(cache.max_tokens, device=input_ids.device)
        masks = self._mask(
            positions[:, None], keys_at, torch.ones_like(keys_at, dtype=torch.bool)[None]
        )
        row_index = torch.arange(rows, device=input_ids.device)
        cos = self.cos[positions].unsqueeze(1)  # [rows, 1, d]
        sin = self.sin[positions].unsqueeze(1)
        x = F.embedding(input_ids, self.embed)  # [rows, hidden]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.keys[index][row_index, :, positions] = k
            cache.values[index][row_index, :, positions] = v
            keys, values = cache.keys[index][:rows], cache.values[index][:rows]
            out = self._attend(q[:, None], keys, values, masks[layer.window])
            x = self._finish(layer, x, out[:, 0])
        return self.logits(x)
