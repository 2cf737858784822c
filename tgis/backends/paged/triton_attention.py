"""Triton kernels over a paged KV cache: the cache write, and attention for a packed step.

The step is the one `attention` describes (its module doc): queries of several sequences back
to back, `cu_seq_q` [n + 1] their cumulative counts, `seqused_k` [n] each sequence's KV length
once this step's tokens are written, `block_table` [n, max_blocks] its pages; query j of a
sequence with q queries and k keys sits at position k - q + j and sees keys 0..that position,
within the last `window` positions if the layer has a sliding window. The kernels compute what
`attention.paged_attention_reference` computes, and do it over either pool layout
(`attention.pool_shape`): they take the pool's strides along blocks, offsets in a block, KV
heads and head dims, so the engine keeps whichever layout suits its other readers.

`write_kv_triton` stores the step's keys and values at flat slots (block * block_size +
offset): one program per token, every KV head at once; a slot < 0 (the padding of a captured
batch) is skipped. A float8 pool saturates as `kv.to_cache` does (clamped to the format's
largest finite value before the cast, where a plain cast gives NaN), so both write paths agree.

`paged_attention_triton` is one kernel for prefill chunks and decode rows together. A program
takes a tile of consecutive queries of one sequence and one KV head, with every query head of
that KV head's group as rows of the tile (row r: query r // group, head r % group), so each
tile of keys and values is loaded once for the whole group (GQA, MQA). It walks the keys its
tile can see, `TILE_N` keys at a time, looking each key's page up in the block table (any
block size from 16 to 256: the key tile need not match a page), with an online softmax in
float32: scores, running maximum and sum are float32 whatever the dtypes; keys and values of a
float8 pool are widened to the query's dtype as they are loaded. Head sizes that are not a
power of two (80, 96) run on a tile padded to the next one, the extra dims masked.

Reads stay inside what the step owns. A key tile's loads are masked to the keys the query
tile's rows can see: below the sequence's KV length (the tail of its last page, and the pages
that pad a shorter table, are never read) and at or after the first position the earliest of
its queries sees through the window (blocks behind the window may already be back in the
pool). So a slot outside holds whatever it holds, NaN included, and cannot reach the output;
nor can the masked scores, which are replaced by -inf (never added to: NaN + -inf is NaN). A
row whose keys in a tile are all masked keeps its running state exactly (exp(0) = 1, p = 0).

A row's result does not depend on the rest of the batch. The tile shapes depend only on the
model (its group size, head size and dtype), never on the step: a program's rows are always
`_ROWS` wide (a decode row pads its tile; its cost is bandwidth, not the idle rows' math), and
the key tiles of a sequence start at the same multiples of `TILE_N` whoever else runs. There
are no atomics; each output is written by one program.

Split-KV (`split_kv_count`): a decode step of a few rows over long contexts gives too few
programs to fill the GPU (rows x KV heads of them), each walking a long KV alone. Then each
program's keys are cut into `splits` runs of whole key tiles, one program each; they write
their running maximum, sum and unnormalised output (float32) for every row, and a second
kernel combines the runs of each row in a fixed order. For a given split count a row's result
still does not depend on the rest of the batch (the cut depends only on its sequence's own
lengths).

Under Triton's CPU interpreter (TRITON_INTERPRET=1, set before this module is imported: it
decides at `triton.jit` time whether a kernel is compiled or interpreted) the same kernels run
on CPU tensors, which is how the tests run them without a GPU. The interpreter multiplies
bfloat16 tiles as their raw bits (Triton 3.x), so there a bfloat16 product is computed from the
same bfloat16 operands widened to float32, the products and float32 sums a GPU's tensor cores
give; and it emulates float casts narrower than float32 inexactly (truncation, or a rounding
whose carry can corrupt the exponent), so values it writes into a narrower pool may differ from
torch's round-to-nearest-even, which the GPU's conversion instructions do match.
"""

from __future__ import annotations

import functools

import torch

from tgis.backends.common.kv import FLOAT8_KV

try:
    import triton
    import triton.language as tl
except ImportError:  # `triton_available` says why the kernels cannot run
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

# Rows (query x group head pairs) of one attention program: fixed, never chosen per step, so
# a row's arithmetic is the same in any batch (module doc). Wider when a group is wider.
_ROWS = 64
# Keys per split run below which the extra pass of the combine costs more than the added
# programs buy, and the most runs a row is cut into.
_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 16
# Programs that keep a GPU busy where its multiprocessor count is unknown (an H100 has 132).
_DEFAULT_TARGET_PROGRAMS = 256


def triton_available(
    device: torch.device | None = None, kv_dtype: torch.dtype | None = None
) -> str | None:
    """Why the kernels cannot run here (None: they can): Triton missing, no CUDA device while
    the kernels are compiled rather than interpreted, or a float8 e4m3 pool (`kv_dtype`) on a
    GPU older than compute capability 8.9, which has no conversion from that format."""
    if triton is None:
        return "triton is not installed"
    if interpreted():
        return None
    if not torch.cuda.is_available():
        return (
            "Triton compiles for CUDA and there is no CUDA device (TRITON_INTERPRET=1 set before "
            "import runs the kernels on the CPU through Triton's interpreter)"
        )
    if device is not None and device.type != "cuda":
        return f"Triton's kernels run on CUDA; this is {device.type}"
    if kv_dtype == torch.float8_e4m3fn:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (
                f"a float8 e4m3 KV cache needs compute capability 8.9 or later in Triton; this "
                f"GPU has {major}.{minor}"
            )
    return None


def interpreted() -> bool:
    """Whether the kernels were defined under Triton's interpreter (they run on CPU tensors)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_write_kv_kernel, InterpretedFunction)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pool_strides(cache: torch.Tensor, heads_first: bool) -> tuple[int, int, int, int]:
    """A pool's strides along (block, offset in block, KV head, head dim), either layout."""
    if heads_first:  # [kv_heads, num_blocks, block_size, head_dim]
        return cache.stride(1), cache.stride(2), cache.stride(0), cache.stride(3)
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)


def _pool_dims(cache: torch.Tensor, heads_first: bool) -> tuple[int, int, int]:
    """(block_size, kv_heads, head_dim) of a pool in either layout."""
    if heads_first:
        return cache.shape[2], cache.shape[0], cache.shape[3]
    return cache.shape[1], cache.shape[2], cache.shape[3]


def write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    heads_first: bool = False,
) -> None:
    """As `attention.write_kv`: keys/values [tokens, kv_heads, head_dim] into the pools at flat
    slots `slot_mapping` [tokens] (block * block_size + offset; < 0: padding, not written), in
    the pool's dtype (a float8 pool saturates). `heads_first`: the pools are head-major."""
    tokens = key.shape[0]
    if tokens == 0:
        return
    block_size, kv_heads, head_dim = _pool_dims(k_cache, heads_first)
    if key.shape[1:] != (kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"keys {tuple(key.shape)} and values {tuple(value.shape)} do not fit a pool of "
            f"{kv_heads} KV heads of {head_dim}"
        )
    saturate = k_cache.dtype in FLOAT8_KV.values()
    limit = torch.finfo(k_cache.dtype).max if saturate else 0.0
    _write_kv_kernel[(tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *_pool_strides(k_cache, heads_first),
        *_pool_strides(v_cache, heads_first),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=_next_pow2(kv_heads),
        DIM_PAD=max(16, _next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        SATURATE=saturate,
        LIMIT=float(limit),
    )


def split_kv_count(programs: int, longest_kv: int, target: int = _DEFAULT_TARGET_PROGRAMS) -> int:
    """Into how many runs each program's keys are cut (1: not split), for a step of `programs`
    attention programs (query tiles x KV heads) whose longest KV is `longest_kv`.

    Split only while the step leaves the GPU short of `target` programs (about two per
    multiprocessor): a large batch fills it without the combine's extra pass. Then as many runs
    as bring it to `target`, but no run shorter than `_KEYS_PER_SPLIT` keys (short runs cost
    more in partial results than they save) and no more than `_MAX_SPLITS`."""
    if programs <= 0 or programs >= target:
        return 1
    return max(1, min(_MAX_SPLITS, target // programs, longest_kv // _KEYS_PER_SPLIT))


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Programs that fill `device`: two per multiprocessor on CUDA."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_TARGET_PROGRAMS


def _tile_shape(group: int, head_dim: int) -> tuple[int, int, int]:
    """(rows per program, queries per program, keys per tile) for a model: fixed per model so
    that a row's result is the same in any batch (module doc). Half as many keys a tile for
    head size 256, so that its key and value tiles take the registers 128's do."""
    rows = max(_ROWS, _next_pow2(group))
    return rows, rows // group, 64 if head_dim <= 128 else 32


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seq_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_q: int,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    *,
    heads_first: bool = False,
    max_k: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """As `attention.paged_attention_reference`, over pages or (`heads_first`) head-major pools:
    queries [tokens, heads, head_dim] -> [tokens, heads, head_dim] in the query's dtype,
    written into `out` when given.

    `max_q`: the longest query run of the step (the grid's size; known on the host, so no
    device sync). `window`: the last `window` positions up to the query's own; `softcap`: the
    scaled scores capped at +-softcap through tanh. `splits`: into how many runs each
    program's keys are cut (1: no split-KV; None: `split_kv_count` decides, from the step's
    size and `max_k`, the longest KV, or where not given the block table's reach, a bound
    known on the host)."""
    tokens, heads, head_dim = query.shape
    block_size, kv_heads, pool_dim = _pool_dims(k_cache, heads_first)
    if pool_dim != head_dim or _pool_dims(v_cache, heads_first)[2] != head_dim:
        raise ValueError(f"queries of {head_dim} dims over pools of {pool_dim}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    if head_dim > 256:
        raise ValueError(f"head size {head_dim}: the kernel's tiles reach 256")
    if out is None:
        out = torch.empty_like(query)
    if tokens == 0:
        return out
    group = heads // kv_heads
    rows, per_tile, tile_n = _tile_shape(group, head_dim)
    seqs = cu_seq_q.shape[0] - 1
    q_tiles = -(-max_q // per_tile)
    if splits is None:
        longest = max_k if max_k is not None else block_table.shape[1] * block_size
        splits = split_kv_count(seqs * q_tiles * kv_heads, longest, _target_programs(query.device))
    if splits < 1:
        raise ValueError(f"splits must be at least 1, not {splits}")
    # Products in float32 for float32 queries (no TF32: the reference's precision), and for
    # bfloat16 under the interpreter, which multiplies bfloat16 tiles as raw bits (module doc).
    dot_f32 = query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and interpreted())
    if splits > 1:
        partial_max = torch.empty(tokens, heads, splits, device=query.device, dtype=torch.float32)
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty(
            tokens, heads, splits, head_dim, device=query.device, dtype=torch.float32
        )
    else:  # unused: the kernel writes the output itself
        partial_max = partial_sum = partial_out = out
    _attention_kernel[(q_tiles, seqs, kv_heads * splits)](
        query,
        k_cache,
        v_cache,
        out,
        cu_seq_q,
        seqused_k,
        block_table,
        partial_max,
        partial_sum,
        partial_out,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        int(window) if window is not None else 0,
        heads,
        *query.stride(),
        *out.stride(),
        *_pool_strides(k_cache, heads_first),
        *_pool_strides(v_cache, heads_first),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, _next_pow2(head_dim)),
        GROUP=group,
        ROWS=rows,
        QUERIES=per_tile,
        TILE_N=tile_n,
        BLOCK_SIZE=block_size,
        SPLITS=splits,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        DOT_F32=dot_f32,
    )
    if splits > 1:
        _combine_kernel[(tokens, heads)](
            partial_max,
            partial_sum,
            partial_out,
            out,
            *out.stride(),
            HEAD_DIM=head_dim,
            DIM_PAD=max(16, _next_pow2(head_dim)),
            SPLITS=splits,
            SPLITS_PAD=_next_pow2(splits),
        )
    return out


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_kcb,
        stride_kco,
        stride_kch,
        stride_kcd,
        stride_vcb,
        stride_vco,
        stride_vch,
        stride_vcd,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SATURATE: tl.constexpr,
        LIMIT: tl.constexpr,
    ):
        """One token's keys and values, every KV head, into its slot (none if padding)."""
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot < 0:
            return
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, HEADS_PAD).to(tl.int64)
        dims = tl.arange(0, DIM_PAD)
        mask = (heads < KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        new_k = tl.load(
            key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
            mask=mask,
        )
        new_v = tl.load(
            value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
            mask=mask,
        )
        if SATURATE:
            # As kv.to_cache: clamp, keeping NaN, then cast. In float32, which holds every
            # source value and the limit exactly (and which the interpreter compares as
            # numbers: it compares bfloat16 as raw bits).
            new_k = new_k.to(tl.float32)
            new_v = new_v.to(tl.float32)
            new_k = tl.minimum(
                tl.maximum(new_k, -LIMIT, propagate_nan=tl.PropagateNan.ALL),
                LIMIT,
                propagate_nan=tl.PropagateNan.ALL,
            )
            new_v = tl.minimum(
                tl.maximum(new_v, -LIMIT, propagate_nan=tl.PropagateNan.ALL),
                LIMIT,
                propagate_nan=tl.PropagateNan.ALL,
            )
        k_at = (
            k_cache_ptr
            + block * stride_kcb
            + offset * stride_kco
            + heads[:, None] * stride_kch
            + dims[None, :] * stride_kcd
        )
        v_at = (
            v_cache_ptr
            + block * stride_vcb
            + offset * stride_vco
            + heads[:, None] * stride_vch
            + dims[None, :] * stride_vcd
        )
        tl.store(k_at, new_k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_at, new_v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dot(a, b, DOT_F32: tl.constexpr):
        """a @ b accumulated in float32; from float32 operands without TF32 where `DOT_F32`."""
        if DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        cu_seq_q_ptr,
        seqused_k_ptr,
        table_ptr,
        max_ptr,
        sum_ptr,
        partial_ptr,
        scale,
        softcap,
        window,
        heads,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_kb,
        stride_ko,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vo,
        stride_vh,
        stride_vd,
        stride_table,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        ROWS: tl.constexpr,
        QUERIES: tl.constexpr,
        TILE_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):
        """Queries QUERIES * tile.. of sequence program_id(1), every head of KV head
        program_id(2) // SPLITS, over the keys of split run program_id(2) % SPLITS."""
        tile = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
        q_start = tl.load(cu_seq_q_ptr + seq)
        q_len = tl.load(cu_seq_q_ptr + seq + 1) - q_start
        if tile * QUERIES >= q_len:
            return
        kv_len = tl.load(seqused_k_ptr + seq)

        rows = tl.arange(0, ROWS)
        q_index = tile * QUERIES + rows // GROUP  # within the sequence's queries
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows // GROUP < QUERIES) & (q_index < q_len)
        position = kv_len - q_len + q_index
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        token = (q_start + q_index).to(tl.int64)
        q = tl.load(
            q_ptr
            + token[:, None] * stride_qt
            + head[:, None] * stride_qh
            + dims[None, :] * stride_qd,
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )

        # The keys some row of the tile sees: [first, end).
        first_position = kv_len - q_len + tile * QUERIES
        end = tl.minimum(first_position + QUERIES, kv_len)
        first = 0
        if HAS_WINDOW:
            first = tl.maximum(first_position - window + 1, 0)
        # Whole key tiles from a multiple of TILE_N, this split's run of them.
        begin = (first // TILE_N) * TILE_N
        per_split = tl.cdiv(tl.cdiv(end - begin, TILE_N), SPLITS) * TILE_N
        run_start = begin + split * per_split
        run_end = tl.minimum(run_start + per_split, end)

        row_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, DIM_PAD], dtype=tl.float32)
        k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
        v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
        for start in range(run_start, run_end, TILE_N):
            keys = start + tl.arange(0, TILE_N)
            key_ok = (keys >= first) & (keys < end)  # never a slot the step does not own
            page = tl.load(
                table_ptr + seq.to(tl.int64) * stride_table + keys // BLOCK_SIZE,
                mask=key_ok,
                other=0,
            ).to(tl.int64)
            offset = keys % BLOCK_SIZE
            k_at = page * stride_kb + offset * stride_ko
            v_at = page * stride_vb + offset * stride_vo
            k = tl.load(
                k_base + k_at[None, :] + dims[:, None] * stride_kd,
                mask=key_ok[None, :] & dim_ok[:, None],
                other=0.0,
            ).to(q.dtype)  # [DIM_PAD, TILE_N]; a float8 pool widened
            scores = _dot(q, k, DOT_F32) * scale
            if HAS_SOFTCAP:  # softcap * tanh(scores / softcap), tanh from exp
                capped = scores / softcap
                e = tl.exp(-2.0 * tl.abs(capped))
                scores = softcap * tl.where(capped < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
            visible = key_ok[None, :] & (keys[None, :] <= position[:, None])
            if HAS_WINDOW:
                visible = visible & (keys[None, :] > position[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            # A row with nothing visible yet subtracts 0: exp(-inf) = 0, not NaN.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            p = tl.exp(scores - shift[:, None])
            alpha = tl.exp(row_max - shift)
            row_sum = row_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_base + v_at[:, None] + dims[None, :] * stride_vd,
                mask=key_ok[:, None] & dim_ok[None, :],
                other=0.0,
            ).to(q.dtype)
            acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_F32)
            row_max = new_max

        store_ok = row_ok[:, None] & dim_ok[None, :]
        if SPLITS == 1:
            result = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
            tl.store(
                out_ptr
                + token[:, None] * stride_ot
                + head[:, None] * stride_oh
                + dims[None, :] * stride_od,
                result.to(out_ptr.dtype.element_ty),
                mask=store_ok,
            )
        else:  # partial results [tokens, heads, SPLITS(, HEAD_DIM)], combined after
            at = (token * heads + head) * SPLITS + split
            tl.store(max_ptr + at, row_max, mask=row_ok)
            tl.store(sum_ptr + at, row_sum, mask=row_ok)
            tl.store(partial_ptr + at[:, None] * HEAD_DIM + dims[None, :], acc, mask=store_ok)

    @triton.jit
    def _combine_kernel(
        max_ptr,
        sum_ptr,
        partial_ptr,
        out_ptr,
        stride_ot,
        stride_oh,
        stride_od,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        """One (token, head): its split runs' partial softmax results, rescaled to their
        common maximum and summed in run order."""
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        heads = tl.num_programs(1)
        runs = tl.arange(0, SPLITS_PAD)
        run_ok = runs < SPLITS
        at = (token * heads + head) * SPLITS + runs
        run_max = tl.load(max_ptr + at, mask=run_ok, other=float("-inf"))
        run_sum = tl.load(sum_ptr + at, mask=run_ok, other=0.0)
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        partial = tl.load(
            partial_ptr + at[:, None] * HEAD_DIM + dims[None, :],
            mask=run_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        top = tl.max(run_max, axis=0)
        # A run that saw no key (max -inf) weighs 0; every row sees its own position.
        weight = tl.exp(run_max - tl.where(top == float("-inf"), 0.0, top))
        total = tl.sum(run_sum * weight, axis=0)
        result = tl.sum(partial * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(
            out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
            result.to(out_ptr.dtype.element_ty),
            mask=dim_ok,
        )
