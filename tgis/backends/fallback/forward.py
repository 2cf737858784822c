"""The steps `TorchDynamicBackend` hands its forward (`HFForward`, hf_forward.py: any causal LM
through the model's own forward and a `transformers` Cache that writes into the slot cache).

The backend owns sequences, slots and lengths; the forward only runs the model over the slot
cache: `prefill` appends prompt segments (`PrefillSegment`) to given slots, `decode` appends one
token to each of a set of slots (`DecodeBatch`). Both return float32 logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgis.backends.fallback.slot_cache import KVStep


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


def group_by_start(segments: Sequence[PrefillSegment]) -> dict[int, list[int]]:
    """Indices of `segments` grouped by start position (padded batches need one start)."""
    groups: dict[int, list[int]] = {}
    for index, segment in enumerate(segments):
        groups.setdefault(segment.start, []).append(index)
    return groups
