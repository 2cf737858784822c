"""The small interface between `TorchDynamicBackend` and its two forward implementations.

The backend owns sequences, slots and lengths; a `ForwardPath` only runs the model over the
slot cache: `prefill` appends prompt segments to given slots, `decode` appends one token to
each of a set of slots. Both return float32 logits.

- `HFForward` (hf_forward.py): any causal LM, through the model's own forward and a
  `transformers` Cache that writes into the slot cache.
- `LlamaNativeForward` (llama_native.py): a lean forward for llama, mistral and qwen2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tgis.backends.slot_cache import KVStep, SlotKVCache


@dataclass(frozen=True)
class PrefillSegment:
    """A run of prompt tokens for one slot, at positions [start, start + len(input_ids)).

    Positions before `start` are already in the cache (an earlier chunk of the same prompt).
    `all_logits` asks for logits at every position of the segment, else only at its last.
    """

    slot: int
    start: int
    input_ids: tuple[int, ...]
    all_logits: bool = False
    # Embeddings [k, hidden] that replace the first k tokens' (a prompt prefix), or None.
    embeds: torch.Tensor | None = None


def place_embeds(
    x: torch.Tensor, overrides: Sequence[tuple[int, torch.Tensor | None]]
) -> torch.Tensor:
    """Token embeddings `x` [N, hidden] (packed tokens) with rows `offset`.. replaced by each
    override [k, hidden] (a prompt prefix's virtual tokens); `x` itself when there are none."""
    given = [(offset, e) for offset, e in overrides if e is not None and e.shape[0]]
    if not given:
        return x
    rows = torch.cat([torch.arange(o, o + e.shape[0]) for o, e in given]).to(x.device)
    x = x.clone()
    x[rows] = torch.cat([e for _, e in given]).to(device=x.device, dtype=x.dtype)
    return x


@dataclass(frozen=True)
class DecodeBatch:
    """One token per row. Row i is slot i when `slots` is None (the running prefix, read
    through views), else slot `slots[i]` (read through a gather copy)."""

    input_ids: torch.Tensor  # [n] long, on the device
    positions: torch.Tensor  # [n] long, on the device: where each row's token goes
    kv_len: int  # max(positions) + 1
    ragged: bool  # some row is shorter than kv_len - 1: padding must be masked
    slots: torch.Tensor | None = None  # [n] long, on the device

    def step(self) -> KVStep:
        """The slot cache step of this batch."""
        n = self.input_ids.shape[0]
        return KVStep(
            batch=n, query_len=1, kv_len=self.kv_len, slots=self.slots, positions=self.positions
        )


class ForwardPath(Protocol):
    """A model forward over a `SlotKVCache`."""

    name: str
    cache: SlotKVCache

    def prefill(self, segments: Sequence[PrefillSegment]) -> list[torch.Tensor]:
        """Run the segments, write their K/V, return per segment float32 logits
        [len(input_ids), vocab] if `all_logits` else [1, vocab]."""
        ...

    def decode(self, batch: DecodeBatch) -> torch.Tensor:
        """Append one token per row, return float32 logits [n, vocab]."""
        ...


def group_by_start(segments: Sequence[PrefillSegment]) -> dict[int, list[int]]:
    """Indices of `segments` grouped by start position (padded batches need one start)."""
    groups: dict[int, list[int]] = {}
    for index, segment in enumerate(segments):
        groups.setdefault(segment.start, []).append(index)
    return groups


def causal_mask(
    query_positions: torch.Tensor, kv_len: int, window: int | None = None
) -> torch.Tensor:
    """Boolean attention mask (True = attend) [rows, 1, queries, kv_len] from absolute query
    positions [rows, queries]: key j is visible to a query at position p when j <= p (and
    j > p - window for sliding-window attention)."""
    keys = torch.arange(kv_len, device=query_positions.device)
    query = query_positions[:, None, :, None]
    mask = keys <= query
    if window is not None:
        mask &= keys > query - window
    return mask


def additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean mask (True = attend) -> 0 / the dtype's lowest finite value, to add to scores.

    Finite rather than -inf: a fully masked row (a padded slot of a static batch) stays a valid
    softmax instead of NaN on every device, and a row with any visible key gives the same
    probabilities as with -inf."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=mask.device)
    return torch.where(mask, zero, low)
