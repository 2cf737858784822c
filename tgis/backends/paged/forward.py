"""The decoder forward of every family models/families.py names, over packed tokens and a
paged KV pool.

One call runs any mix of prefill chunks and decodes: the step's tokens back to back
([tokens, hidden], no padding), each with its own position; every layer writes the new keys
and values at their slots of the pool and attends through `paged_attention.attend` with the
step's metadata (flash attention on CUDA, plain torch elsewhere). Weights, rope tables and what each
family changes come from `DecoderWeights` (models/decoder.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from tgis.backends.common.masks import place_embeds
from tgis.backends.common.quant import Quantization
from tgis.backends.models.decoder import DecoderWeights, LayerWeights
from tgis.backends.paged.attention import (
    StepMetadata,
    attend,
    pool_shape,
    write_kv,
)
from tgis.backends.paged.lora import LoraStep
from tgis.backends.paged.triton_attention import write_kv_triton


@dataclass(frozen=True)
class KVPool:
    """Per layer one key and one value tensor, allocated once: pages [num_blocks,
    block_size, kv_heads, head_dim] for flash attention, head-major [kv_heads, num_blocks,
    block_size, head_dim] otherwise (`paged_attention.pool_shape`). A step reads only slots
    its sequences wrote or zeroed (`clear`; paged_attention's module doc), never what the
    allocation left."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    flash: bool
    # Pages read and written by tgis's Triton kernels (paged/triton_attention.py).
    triton: bool = False

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        flash: bool,
        triton: bool = False,
    ) -> KVPool:
        """`flash`: pages for flash attention or the Triton kernels (`triton`), else
        head-major."""
        shape = pool_shape(flash, num_blocks, block_size, kv_heads, head_dim)

        def make() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            tuple(make() for _ in range(num_layers)),
            tuple(make() for _ in range(num_layers)),
            flash,
            triton,
        )

    def clear(self, blocks: torch.Tensor) -> None:
        """Zero `blocks` [n] (long) in every layer: blocks a step enters before writing into
        them (`StepMetadata.fresh_blocks`), so that their unwritten slots read as zero."""
        dim = 0 if self.flash else 1
        for tensor in (*self.keys, *self.values):
            # index_fill_ has no float8 kernel: zero bytes are float8's zero.
            target = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
            target.index_fill_(dim, blocks, 0)

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0 if self.flash else 1]

    @property
    def block_size(self) -> int:
        return self.keys[0].shape[1 if self.flash else 2]

    @property
    def kv_heads(self) -> int:
        return self.keys[0].shape[2 if self.flash else 0]


class PagedForward(DecoderWeights):
    """`forward` over a `KVPool`; see the module docstring."""

    name = "paged"

    def __init__(
        self,
        model: PreTrainedModel,
        pool: KVPool,
        max_positions: int,
        fuse_gate_up: bool | None = None,
        transposed: bool | None = None,
        packed: bool = False,
        quantization: Quantization | None = None,
    ) -> None:
        device = pool.keys[0].device
        super().__init__(
            model, device, max_positions, fuse_gate_up, transposed, packed, quantization
        )
        self.pool = pool

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: StepMetadata,
        logits_rows: torch.Tensor,
        embeds: Sequence[tuple[int, torch.Tensor]] = (),
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """input_ids / positions [tokens] (long, on the device) -> float32 logits of the
        token rows `logits_rows` [m] -> [m, vocab]. `embeds`: (row, [k, hidden]) pairs whose
        rows take those embeddings instead of their tokens' (prompt prefixes, image features); `lora`: the
        step's rows that go through LoRA adapters."""
        flash, triton = self.pool.flash, self.pool.triton

        def attention(
            index: int, layer: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            keys, values = self.pool.keys[index], self.pool.values[index]
            if triton:
                write_kv_triton(keys, values, k, v, meta.slot_mapping)
            else:
                write_kv(keys, values, k, v, meta.slot_mapping, heads_first=not flash)
            return attend(
                q, keys, values, meta, self.scaling, layer.window, k, v, self.attn_softcap
            )

        x = self._inputs(place_embeds(self._embed(input_ids), embeds))  # [tokens, hidden]
        return self.logits(self.layers_over(x, positions, attention, lora)[logits_rows])
