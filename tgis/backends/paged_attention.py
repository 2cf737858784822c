"""Attention over a paged KV cache for packed batches (no padding), and the cache writes.

The cache of one layer is a pool of pages: keys and values of shape
[num_blocks, block_size, kv_heads, head_dim]. A packed step holds the new tokens of several
sequences back to back: queries [tokens, heads, head_dim], `cu_seq_q` their cumulative counts
per sequence ([n + 1], starting at 0), `seqused_k` each sequence's KV length once this step's
tokens are written ([n]), and `block_table` [n, max_blocks] (int32) the pages of each sequence
in order (tgis.engine.block_manager hands them out). A sequence's queries are its last tokens:
query j of a sequence with q tokens and k keys sits at position k - q + j and sees keys 0..that
position (within the sliding window, if any). That covers prefill (q = k), a prefill chunk after
cached or earlier tokens (q < k) and decode (q = 1) in one call.

`paged_attention` runs PyTorch's flash attention (`torch.nn.attention.varlen.varlen_attn`, which
reads the pages through `block_table` and `seqused_k`) on CUDA where the installed torch has it,
and `paged_attention_reference` everywhere else: a plain-torch computation that is also what the
CUDA kernel is tested against.
"""

from __future__ import annotations

import functools
import inspect

import torch

from tgis.backends.forward import causal_mask


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values [tokens, kv_heads, head_dim] at flat slots (block * size + offset)."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = key.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = value.to(v_cache.dtype)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seq_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' pages; [tokens, heads, dim].

    Scores and softmax in float32; the output has the query's dtype. `window` keeps the last
    `window` positions up to and including the query's own (Mistral's sliding window).
    """
    heads, block_size = query.shape[1], k_cache.shape[1]
    group = heads // k_cache.shape[2]
    out = torch.empty(query.shape[:2] + v_cache.shape[3:], dtype=query.dtype, device=query.device)
    starts, lengths = cu_seq_q.tolist(), seqused_k.tolist()
    for i, kv_len in enumerate(lengths):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end == q_start:
            continue
        pages = block_table[i, : -(-kv_len // block_size)].long()
        keys = k_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
        values = v_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, dim=1)
        q = query[q_start:q_end]
        q_pos = torch.arange(kv_len - (q_end - q_start), kv_len, device=query.device)
        visible = causal_mask(q_pos[None], kv_len, window)[0, 0]  # [queries, keys]
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(query.dtype)
    return out


def flash_paged_available(device: torch.device) -> bool:
    """Whether `varlen_attn` with a paged cache can run on `device` (CUDA, torch >= 2.12)."""
    return device.type == "cuda" and _varlen_takes_block_table()


@functools.cache
def _varlen_takes_block_table() -> bool:
    """The installed torch's answer, looked up once (every attention call asks)."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "block_table" in inspect.signature(varlen_attn).parameters


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seq_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_q: int,
    max_k: int,
    window: int | None = None,
) -> torch.Tensor:
    """As `paged_attention_reference`, through flash attention where `flash_paged_available`.

    `max_q` / `max_k` are the longest query run and KV length of the step, known on the host
    (passing them avoids a device sync).
    """
    if not flash_paged_available(query.device):
        return paged_attention_reference(
            query, k_cache, v_cache, cu_seq_q, seqused_k, block_table, scale, window
        )
    from torch.nn.attention.varlen import varlen_attn

    # Flash attention's window counts the keys left of the query's own position.
    left = -1 if window is None else window - 1
    seqused = seqused_k.int()
    cu_seq_k = torch.nn.functional.pad(seqused.cumsum(0, dtype=torch.int32), (1, 0))
    return varlen_attn(
        query,
        k_cache,
        v_cache,
        cu_seq_q.int(),
        cu_seq_k,
        max_q,
        max_k,
        scale=scale,
        window_size=(left, 0),
        enable_gqa=query.shape[1] != k_cache.shape[2],
        seqused_k=seqused,
        block_table=block_table.int(),
    )  # type: ignore[return-value]
