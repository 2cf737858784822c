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
reads the pages through `block_table` and `seqused_k`): the path on CUDA where the installed
torch has it (`flash_paged_available`). `paged_attention_reference` is a plain-torch computation
of the same result over a pages pool, one sequence at a time: what the flash kernel and the
plain-torch path (`attend`) are tested against; no serving step runs it.

A forward builds one `StepMetadata` per step (`step_metadata`, on the host, from the scheduler's
block tables) and every layer reuses it: the flash path's tensors, and for the plain-torch path
the gather indices and masks precomputed once (`attend`): the one-query rows of decodes as one
SDPA over their gathered pages, each longer query run through SDPA. `attend` is what
the cpu backend runs; it is tested against `paged_attention_reference`.

Padding cannot make NaN. The plain-torch path gathers whole blocks and masks what a row must
not see, and a masked score still sees what a slot holds (NaN + -inf is NaN, 0 x NaN is NaN).
A pool is never cleared: a block may hold anything (uninitialised memory, a freed block of a
sequence whose forward produced NaN). So a step reads only slots its own sequences wrote or
zeroed: a block a sequence enters (its first position written) is zeroed first, in every
layer, before the step writes into it (`StepMetadata.fresh_blocks`), which covers the tail
of a sequence's last block; the pages that pad a shorter table, and the blocks behind the
sliding window that went back to the pool (`block_manager`), are read as a page the row
holds instead, masked all the same. The masks SDPA takes are boolean (a float mask of another
dtype than the query's is misread by some of SDPA's CUDA backends).

Two layouts of a layer's pool (`pool_shape`): flash attention reads pages
[num_blocks, block_size, kv_heads, head_dim]; the plain-torch path keeps each KV head's pages
together, [kv_heads, num_blocks, block_size, head_dim], so that gathering a batch's pages
(`index_select` of whole blocks) yields keys already laid out for one attention call per step
with no further copy: three times faster than gathering per token on a CPU. A model whose
attention flash attention cannot compute (`torch_attention_reason`: soft-capped logits) takes
the plain-torch path on CUDA too.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from tgis.backends.common.kv import FLOAT8_KV, to_cache
from tgis.backends.common.masks import causal_mask
from tgis.backends.paged.triton_attention import paged_attention_triton
from tgis.engine.transfer import host_to_device_all, stays_on_host


def pool_shape(
    flash: bool, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """The shape of one layer's key (or value) pool: pages for flash attention, head-major
    for the plain-torch path (module doc)."""
    if flash:
        return (num_blocks, block_size, kv_heads, head_dim)
    return (kv_heads, num_blocks, block_size, head_dim)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    heads_first: bool = False,
) -> None:
    """Store new keys/values [tokens, kv_heads, head_dim] at flat slots (block * size +
    offset) of a pages pool, or of a head-major one (`heads_first`), in the pool's dtype
    (`kv.to_cache`: a float8 pool saturates)."""
    if heads_first:
        kv_heads, dim = k_cache.shape[0], k_cache.shape[-1]
        for cache, new in ((k_cache, key), (v_cache, value)):
            heads_major = to_cache(new.transpose(0, 1), cache.dtype)
            # index_copy_ has no float8 kernel: a float8 pool is copied into as its bytes.
            target = cache.view(kv_heads, -1, dim)
            if cache.dtype in FLOAT8_KV.values():
                target, heads_major = target.view(torch.uint8), heads_major.view(torch.uint8)
            target.index_copy_(1, slot_mapping, heads_major)
        return
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = to_cache(key, k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = to_cache(value, v_cache.dtype)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seq_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' pages; [tokens, heads, dim].

    Scores and softmax in float32; the output has the query's dtype. `window` keeps the last
    `window` positions up to and including the query's own (Mistral's sliding window);
    `softcap` caps the scaled scores at +-softcap through tanh (Gemma 2).
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
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(query.dtype)
    return out


# The dtypes flash attention computes in; float32 models attend through plain torch.
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_paged_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `varlen_attn` with a paged cache can run on `device` for a model in `dtype`:
    CUDA, torch >= 2.12 (varlen_attn's block_table), float16 or bfloat16."""
    return device.type == "cuda" and dtype in FLASH_DTYPES and "block_table" in varlen_parameters()


def attention_path(device: torch.device, dtype: torch.dtype, model_needs: str | None = None) -> str:
    """How the paged engine attends on `device` in `dtype`, and why, for the start-up log and
    /info. `model_needs`: why the model itself needs the plain-torch path (`torch_attention_reason`)."""
    if model_needs is None and flash_paged_available(device, dtype):
        return "flash attention over KV pages (varlen_attn with block_table)"
    if model_needs is not None:
        why = f"cannot run it: {model_needs}"
    elif device.type != "cuda":
        why = f"needs CUDA; this is {device.type}"
    elif dtype not in FLASH_DTYPES:
        why = f"needs float16 or bfloat16; the model is {str(dtype).removeprefix('torch.')}"
    else:
        why = (
            "needs torch >= 2.12, whose varlen_attn takes block_table; this is torch "
            f"{torch.__version__}"
        )
    return f"plain torch over head-major KV blocks (flash attention {why})"


def torch_attention_reason(config: object) -> str | None:
    """Why a model with transformers config `config` must attend through plain torch even
    where flash attention runs (None: it need not): varlen_attn has no logit soft-capping."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        return f"the model soft-caps its attention scores at {softcap}, which varlen_attn cannot"
    return None


@functools.cache
def varlen_parameters() -> frozenset[str]:
    """The installed torch's `varlen_attn` parameters (none without CUDA or the function),
    looked up once: every attention call asks."""
    if not torch.cuda.is_available():
        return frozenset()
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


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
    """As `paged_attention_reference`, through flash attention: the pools are pages (as
    `pool_shape` lays them out where `flash_paged_available`), and only there can this run;
    `attend` calls it for the steps whose metadata says so (`StepMetadata.flash`). Elsewhere
    the pools are head-major and `attend` takes the plain-torch path.

    `max_q` / `max_k` are the longest query run and KV length of the step, known on the host
    (passing them avoids a device sync).
    """
    from torch.nn.attention.varlen import varlen_attn

    # Flash attention's window counts the keys left of the query's own position.
    left = -1 if window is None else window - 1
    seqused = seqused_k.int()
    cu_seq_k = torch.nn.functional.pad(seqused.cumsum(0, dtype=torch.int32), (1, 0))
    # One split of the KV length per sequence: the result of a sequence then does not depend
    # on the rest of the batch (the kernel's split-KV choice does), so greedy tokens are the
    # same alone and in any batch. Older torch has no choice to make.
    splits = {"num_splits": 1} if "num_splits" in varlen_parameters() else {}
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
        **splits,
    )  # type: ignore[return-value]


@dataclass(frozen=True)
class _DecodeRows:
    """The one-query sequences of a step, attended together: their rows in the packed
    queries; `blocks` [rows * kv_heads * pages] the head-major pool's blocks to gather
    (head h's copy of block b is block h * num_blocks + b; a short table padded, and blocks
    behind the sliding window replaced, with the row's last page: module doc) and a boolean
    mask [rows, 1, 1, pages * block_size] (True: the row sees the key) per sliding window.
    `whole`: they
    are every row of the step, in order (a decode step: no gather of queries, no scatter of
    results)."""

    rows: torch.Tensor
    blocks: torch.Tensor
    masks: dict[int | None, torch.Tensor]
    whole: bool = False


@dataclass(frozen=True)
class _PrefillRun:
    """A sequence with several queries: rows q_start..q_end of the packed queries over the
    keys at `slots` [kv_len] (those behind every layer's window read as the last one: module
    doc); a boolean mask [1, 1, q, kv_len] per window, or None where plain causal attention
    over its own tokens is exact."""

    q_start: int
    q_end: int
    slots: torch.Tensor
    masks: dict[int | None, torch.Tensor | None]


@dataclass(frozen=True)
class StepMetadata:
    """What attention needs of one packed step, shared by every layer (see module doc)."""

    slot_mapping: torch.Tensor  # [tokens] long: where each new token's K/V goes
    cu_seq_q: torch.Tensor  # [n + 1] int32
    seqused_k: torch.Tensor  # [n] int32
    block_table: torch.Tensor  # [n, max_blocks] int32
    max_q: int
    max_k: int
    flash: bool
    decode: _DecodeRows | None = None
    prefill: tuple[_PrefillRun, ...] = ()
    # Blocks whose first position the step writes (long), zeroed before it does; None: none.
    fresh_blocks: torch.Tensor | None = None
    # The pages pool is read by tgis's Triton kernels rather than flash attention.
    triton: bool = False
    # The caller's own tensor (token ids, positions, logit rows) sent up with the step's.
    inputs: torch.Tensor | None = None


def slots_of(blocks: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat pool slots (block * block_size + offset) of positions start..end-1 of a sequence
    whose block table is `blocks`."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


def step_metadata(
    query_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    windows: Sequence[int | None] = (None,),
    num_blocks: int = 0,
    kv_heads: int = 1,
    flash: bool = False,
    spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    triton: bool = False,
    inputs: torch.Tensor | None = None,
) -> StepMetadata:
    """Metadata of a step whose sequence i computes its last `query_lens[i]` tokens of
    `kv_lens[i]`, its pages listed in `block_tables[i]`. `windows`: the sliding windows the
    model's layers use (None: full attention); `num_blocks` / `kv_heads`: the pool's, which
    the plain-torch path's gather indices need; `flash`: the pool is laid out for flash
    attention (`KVPool.flash`). `spans[i]`: (start, length) position runs of sequence i whose
    rows attend to each other both ways (a Gemma 3 image's; plain torch only). `triton`: the
    pages are read by tgis's Triton kernels (paged/triton_attention.py) instead. `inputs`: a
    host tensor of the caller's that goes up with the step's (`StepMetadata.inputs`).

    Built on the host, then sent to `device` in one copy (engine/transfer.py's
    `to_device_all`)."""
    if triton and not flash:
        raise ValueError("the Triton kernels read a pages pool (flash=True)")
    if spans is not None and flash:
        raise ValueError("attention over KV pages has only causal masks")
    width = max(len(t) for t in block_tables)
    table = torch.tensor(
        [list(blocks) + [0] * (width - len(blocks)) for blocks in block_tables], dtype=torch.int32
    )
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slot_mapping = torch.tensor(
        [
            s
            for blocks, q, kv in zip(block_tables, query_lens, kv_lens, strict=True)
            for s in slots_of(blocks, kv - q, kv, block_size)
        ]
    )
    fresh = [
        blocks[p // block_size]
        for blocks, q, kv in zip(block_tables, query_lens, kv_lens, strict=True)
        for p in range(-(-(kv - q) // block_size) * block_size, kv, block_size)
    ]
    decode, prefill = None, ()
    if not flash:
        decode = _decode_rows(
            query_lens, kv_lens, block_tables, block_size, starts, windows, num_blocks,
            kv_heads,
        )  # fmt: skip
        prefill = tuple(
            _prefill_run(
                starts[i],
                starts[i + 1],
                slots_of(block_tables[i], 0, kv_lens[i], block_size),
                windows,
                spans[i] if spans is not None else (),
                _all_within(windows),
            )
            for i, q in enumerate(query_lens)
            if q > 1
        )
    host = StepMetadata(
        slot_mapping=slot_mapping,
        cu_seq_q=torch.tensor(starts, dtype=torch.int32),
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32),
        block_table=table,
        max_q=max(query_lens),
        max_k=max(kv_lens),
        flash=flash,
        decode=decode,
        prefill=prefill,
        fresh_blocks=torch.tensor(fresh, dtype=torch.long) if fresh else None,
        triton=triton,
        inputs=inputs,
    )
    if stays_on_host(device):
        return host
    tensors: list[torch.Tensor] = []
    _gather_tensors(host, tensors)
    return _with_tensors(host, iter(host_to_device_all(tensors, device)))


def _gather_tensors(value: object, into: list[torch.Tensor]) -> None:
    """Every tensor in `value` (the metadata's fields, their dicts, tuples and dataclasses),
    in the order `_with_tensors` puts them back."""
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, (StepMetadata, _DecodeRows, _PrefillRun)):
        for field in fields(value):
            _gather_tensors(getattr(value, field.name), into)
    elif isinstance(value, dict):
        for item in value.values():
            _gather_tensors(item, into)
    elif isinstance(value, tuple):
        for item in value:
            _gather_tensors(item, into)


def _with_tensors(value: Any, sent: Iterator[torch.Tensor]) -> Any:
    """`value` with its tensors replaced, in `_gather_tensors`'s order, by `sent`'s."""
    if isinstance(value, torch.Tensor):
        return next(sent)
    if isinstance(value, (StepMetadata, _DecodeRows, _PrefillRun)):
        changes = {f.name: _with_tensors(getattr(value, f.name), sent) for f in fields(value)}
        return replace(value, **changes)
    if isinstance(value, dict):
        return {key: _with_tensors(item, sent) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_with_tensors(item, sent) for item in value)
    return value


def _all_within(windows: Sequence[int | None]) -> int | None:
    """The window every layer attends within (the widest), None when a layer sees all."""
    return None if None in windows else max(w for w in windows if w is not None)


def _decode_rows(
    query_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    starts: list[int],
    windows: Sequence[int | None],
    num_blocks: int,
    kv_heads: int,
) -> _DecodeRows | None:
    picked = [i for i, q in enumerate(query_lens) if q == 1]
    if not picked:
        return None
    pages = max(-(-kv_lens[i] // block_size) for i in picked)
    widest = _all_within(windows)
    padded = []
    for i in picked:
        used = list(block_tables[i][: -(-kv_lens[i] // block_size)])
        if widest is not None:  # pages wholly before the first position the row sees
            behind = max(0, kv_lens[i] - widest) // block_size
            used[:behind] = [used[-1]] * min(behind, len(used) - 1)
        padded.append(used + [used[-1]] * (pages - len(used)))
    table = torch.tensor(padded, dtype=torch.long)
    heads = torch.arange(kv_heads)[None, :, None] * num_blocks
    blocks = (heads + table[:, None]).flatten()
    positions = torch.tensor([kv_lens[i] - 1 for i in picked])[:, None]
    length = pages * block_size
    masks = {
        w: causal_mask(positions, length, w).view(len(picked), 1, 1, length) for w in set(windows)
    }
    rows = torch.tensor([starts[i] for i in picked])
    return _DecodeRows(rows, blocks, masks, whole=len(picked) == len(query_lens))


def _prefill_run(
    q_start: int,
    q_end: int,
    slots: list[int],
    windows: Sequence[int | None],
    spans: Sequence[tuple[int, int]] = (),
    widest: int | None = None,
) -> _PrefillRun:
    kv_len, q = len(slots), q_end - q_start
    if widest is not None:  # no query sees a key before its first query's window
        behind = max(0, kv_len - q - widest + 1)
        slots = [slots[-1]] * behind + slots[behind:]
    positions = torch.arange(kv_len - q, kv_len)[None]
    # Rows of a span among the queries see the span's every row (both ways).
    both = [(lo, lo + n) for lo, n in spans if lo + n > kv_len - q and lo < kv_len]
    masks: dict[int | None, torch.Tensor | None] = {}
    for w in set(windows):
        masks[w] = None
        if not both and q == kv_len and (w is None or q <= w):
            continue
        mask = causal_mask(positions, kv_len, w)
        for lo, hi in both:
            rows = slice(max(lo - (kv_len - q), 0), min(hi, kv_len) - (kv_len - q))
            mask[..., rows, lo : min(hi, kv_len)] = True
        masks[w] = mask
    return _PrefillRun(q_start, q_end, torch.tensor(slots, dtype=torch.long), masks)


def sdpa(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of query [B, heads, Q, dim] over keys / values [B, kv_heads, T, dim] (grouped
    heads), `mask` boolean (True: attend), broadcast to [B, heads, Q, T]; None:
    causal over the query's own tokens (Q == T). Through SDPA's fused kernels; with `softcap`
    (which SDPA has no argument for) scores are computed, capped through tanh and softmaxed in
    float32, as transformers' eager attention does for Gemma 2."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=heads != kv_heads,
        )
    if heads != kv_heads:
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(query.dtype)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per row [rows, heads, dim] over head-major pools: `blocks` and `visible` as
    `_DecodeRows` holds them (each row's whole blocks, gathered per KV head, and the boolean
    mask of the layer's window) -> [rows, heads, dim]. One gather per pool and one fused
    attention (softmax accumulated in float32 for every dtype); `softcap` as `sdpa` takes
    it. A float8 pool's blocks are widened to the query's dtype once gathered."""
    rows, heads, dim = query.shape
    kv_heads = k_cache.shape[0]
    block_elems = k_cache.shape[2] * dim
    # [rows, kv_heads, T, dim]: whole blocks, already in attention's layout.
    keys = k_cache.view(-1, block_elems).index_select(0, blocks).view(rows, kv_heads, -1, dim)
    values = v_cache.view(-1, block_elems).index_select(0, blocks).view(rows, kv_heads, -1, dim)
    keys, values = keys.to(query.dtype), values.to(query.dtype)
    attended = sdpa(query.view(rows, heads, 1, dim), keys, values, visible, scale, softcap)
    return attended.view(rows, heads, dim)


def attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StepMetadata,
    scale: float,
    window: int | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Packed queries [tokens, heads, dim] over the pool (this step's K/V already written)
    -> [tokens, heads, dim]: over a pages pool where `meta.flash`, tgis's Triton kernels
    (`meta.triton`) or flash attention, else plain torch over a head-major pool
    (`pool_shape`). `key` / `value`: this step's new keys and
    values [tokens, kv_heads, dim], which a prompt computed whole in this step attends to
    directly instead of gathering them back from the pool. `softcap`: scores capped through
    tanh (the Triton kernels and plain torch: flash attention's varlen_attn has no
    soft-capping, `torch_attention_reason`)."""
    if meta.flash:  # pages: tgis's Triton kernels or flash attention read them
        step = (query, k_cache, v_cache, meta.cu_seq_q, meta.seqused_k, meta.block_table)
        if meta.triton:
            return paged_attention_triton(
                *step, scale, meta.max_q, window, softcap, max_k=meta.max_k
            )
        if softcap is not None:
            raise ValueError("flash attention over KV pages has no logit soft-capping")
        return paged_attention(*step, scale, meta.max_q, meta.max_k, window)
    # Head-major pools: [kv_heads, num_blocks, block_size, dim].
    heads, dim = query.shape[1], v_cache.shape[-1]
    kv_heads = k_cache.shape[0]
    out = query.new_empty(query.shape[0], heads, dim)
    if meta.decode is not None:
        d = meta.decode
        picked = query if d.whole else query[d.rows]
        decoded = decode_attention(
            picked, k_cache, v_cache, d.blocks, d.masks[window], scale, softcap
        )
        if d.whole:
            return decoded
        out[d.rows] = decoded
    keys_flat = k_cache.view(kv_heads, -1, dim)
    values_flat = v_cache.view(kv_heads, -1, dim)
    for run in meta.prefill:
        mask = run.masks[window]
        rows = slice(run.q_start, run.q_end)
        if key is not None and value is not None and run.slots.shape[0] == run.q_end - run.q_start:
            keys, values = key[rows].transpose(0, 1), value[rows].transpose(0, 1)
            if k_cache.dtype != keys.dtype:  # what the pool holds: float8's rounding
                keys = to_cache(keys, k_cache.dtype).to(query.dtype)
                values = to_cache(values, v_cache.dtype).to(query.dtype)
        else:
            keys = keys_flat[:, run.slots].to(query.dtype)
            values = values_flat[:, run.slots].to(query.dtype)
        out[rows] = sdpa(
            query[rows].transpose(0, 1)[None], keys[None], values[None], mask, scale, softcap
        )[0].transpose(0, 1)
    return out
