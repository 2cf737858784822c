"""Attention masks and embedding overrides every forward uses: the paged, the fixed-shape and
the fallback ones."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
