"""tgis.backends.paged.attention: packed attention over a paged cache equals plain attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tgis.backends.paged import attention as paged_attention_module
from tgis.backends.paged.attention import (
    attend,
    attention_path,
    flash_paged_available,
    paged_attention,
    paged_attention_reference,
    step_metadata,
    write_kv,
)

BLOCK = 4
HEAD_DIM = 8


def causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Plain attention of one sequence's last q tokens over its k contiguous keys (float64)."""
    n_q, n_k = q.shape[0], k.shape[0]
    q_pos = torch.arange(n_k - n_q, n_k)[:, None]
    k_pos = torch.arange(n_k)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().transpose(0, 1),
        v.double().transpose(0, 1),
        attn_mask=mask,
        scale=HEAD_DIM**-0.5,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)


def packed_case(
    q_lens: list[int],
    k_lens: list[int],
    heads: int,
    kv_heads: int,
    seed: int = 0,
    block: int = BLOCK,
    head_dim: int = HEAD_DIM,
) -> tuple:
    """Random sequences written into a shuffled page pool; returns the packed step's inputs and
    each sequence's contiguous keys/values for the plain reference."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-k // block) for k in k_lens]
    num_blocks = sum(pages) + 3  # spare pages that must never be read
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen) * 100  # garbage the pages' owners overwrite
    v_cache = torch.randn(shape, generator=gen) * 100
    table = torch.zeros(len(k_lens), max(pages), dtype=torch.int32)
    keys, values = [], []
    for i, k_len in enumerate(k_lens):
        own = [order.pop() for _ in range(pages[i])]
        table[i, : len(own)] = torch.tensor(own)
        k = torch.randn(k_len, kv_heads, head_dim, generator=gen)
        v = torch.randn(k_len, kv_heads, head_dim, generator=gen)
        slots = torch.tensor([own[p // block] * block + p % block for p in range(k_len)])
        write_kv(k_cache, v_cache, k, v, slots)
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(q_lens), heads, head_dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    return query, k_cache, v_cache, cu, torch.tensor(k_lens), table, keys, values


@pytest.mark.parametrize(
    ("q_lens", "k_lens", "heads", "kv_heads", "window"),
    [
        ([7, 1, 5], [7, 9, 5], 4, 4, None),  # a prefill, a decode, a prefill
        ([1, 1, 1, 1], [3, 4, 8, 13], 4, 2, None),  # decodes at block edges, GQA
        ([3, 6], [11, 6], 6, 2, None),  # a prefill chunk after 8 earlier tokens
        ([9, 1], [9, 14], 4, 1, 4),  # sliding window, multi-query
    ],
)
def test_reference_equals_plain_attention(
    q_lens: list[int], k_lens: list[int], heads: int, kv_heads: int, window: int | None
) -> None:
    query, k_cache, v_cache, cu, used, table, keys, values = packed_case(
        q_lens, k_lens, heads, kv_heads
    )
    out = paged_attention_reference(
        query, k_cache, v_cache, cu, used, table, HEAD_DIM**-0.5, window
    )
    expected = torch.cat(
        [
            causal_sdpa(query[cu[i] : cu[i + 1]], keys[i], values[i], window)
            for i in range(len(q_lens))
        ]
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("q_lens", "k_lens", "heads", "kv_heads", "windows"),
    [
        ([7, 1, 5, 1], [7, 9, 5, 4], 4, 4, [None]),  # prefills and decodes mixed
        ([1, 1, 1, 1], [3, 4, 8, 13], 4, 2, [None]),  # only decodes, ragged, GQA
        ([3, 6, 1], [11, 6, 2], 6, 2, [None]),  # a chunk after earlier tokens
        ([9, 1, 2], [9, 14, 10], 4, 1, [None, 4]),  # layers with and without a window
    ],
)
def test_step_attention_equals_the_reference(
    q_lens: list[int], k_lens: list[int], heads: int, kv_heads: int, windows: list[int | None]
) -> None:
    query, k_cache, v_cache, cu, used, table, *_ = packed_case(q_lens, k_lens, heads, kv_heads)
    tables = [[int(b) for b in row[: -(-k // BLOCK)]] for row, k in zip(table, k_lens, strict=True)]
    meta = step_metadata(
        q_lens, k_lens, tables, BLOCK, torch.device("cpu"), windows, k_cache.shape[0], kv_heads
    )
    assert not meta.flash and meta.cu_seq_q.tolist() == cu.tolist()
    # the new tokens' slots: the last q positions of each sequence
    expected_slots = [
        t[p // BLOCK] * BLOCK + p % BLOCK
        for t, q, k in zip(tables, q_lens, k_lens, strict=True)
        for p in range(k - q, k)
    ]
    assert meta.slot_mapping.tolist() == expected_slots
    scale = HEAD_DIM**-0.5
    # the plain-torch path keeps each KV head's pages together
    k_heads, v_heads = (c.permute(2, 0, 1, 3).contiguous() for c in (k_cache, v_cache))
    for window in windows:
        out = attend(query, k_heads, v_heads, meta, scale, window)
        ref = paged_attention_reference(query, k_cache, v_cache, cu, used, table, scale, window)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("kv_heads", "window"), [(2, None), (4, 3)])
def test_decode_rows_in_bfloat16_equal_the_reference(kv_heads: int, window: int | None) -> None:
    """A bfloat16 pool: the decode rows' fused attention takes the float32 additive mask with
    bfloat16 queries, and matches the float32 reference to bfloat16's precision."""
    k_lens = [3, 9, 13]
    query, k_cache, v_cache, cu, used, table, *_ = packed_case([1, 1, 1], k_lens, 4, kv_heads)
    tables = [[int(b) for b in row[: -(-k // BLOCK)]] for row, k in zip(table, k_lens, strict=True)]
    meta = step_metadata(
        [1, 1, 1], k_lens, tables, BLOCK, torch.device("cpu"), [window], k_cache.shape[0], kv_heads
    )
    k_heads, v_heads = (c.permute(2, 0, 1, 3).contiguous().bfloat16() for c in (k_cache, v_cache))
    scale = HEAD_DIM**-0.5
    out = attend(query.bfloat16(), k_heads, v_heads, meta, scale, window)
    assert out.dtype == torch.bfloat16
    ref = paged_attention_reference(
        query.bfloat16().float(), k_cache.bfloat16().float(), v_cache.bfloat16().float(),
        cu, used, table, scale, window,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_window_and_gqa_change_the_result() -> None:
    """The cases above would pass on an implementation that ignored window or head groups if
    these did not differ."""
    query, k_cache, v_cache, cu, used, table, *_ = packed_case([9], [9], 4, 2)
    scale = HEAD_DIM**-0.5
    full = paged_attention_reference(query, k_cache, v_cache, cu, used, table, scale)
    windowed = paged_attention_reference(query, k_cache, v_cache, cu, used, table, scale, 3)
    assert not torch.allclose(full[4:], windowed[4:])
    torch.testing.assert_close(full[:3], windowed[:3])  # the first 3 see no more than 3 keys
    swapped = k_cache.flip(2)  # the other KV head for each query group
    assert not torch.allclose(
        full, paged_attention_reference(query, swapped, v_cache, cu, used, table, scale)
    )


def test_write_kv_touches_only_its_slots() -> None:
    k_cache = torch.zeros(3, BLOCK, 1, 2)
    v_cache = torch.zeros(3, BLOCK, 1, 2)
    key = torch.ones(2, 1, 2)
    write_kv(k_cache, v_cache, key, key * 2, torch.tensor([5, 11]))
    assert k_cache.flatten(0, 1)[:, 0, 0].nonzero().flatten().tolist() == [5, 11]
    assert v_cache[2, 3, 0].tolist() == [2.0, 2.0]


def test_write_kv_head_major_equals_pages_transposed() -> None:
    pages = [torch.zeros(3, BLOCK, 2, 4) for _ in range(2)]
    heads = [torch.zeros(2, 3, BLOCK, 4) for _ in range(2)]
    key, value = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    slots = torch.tensor([1, 6, 11])
    write_kv(*pages, key, value, slots)
    write_kv(*heads, key, value, slots, heads_first=True)
    for page, head in zip(pages, heads, strict=True):
        assert torch.equal(page.permute(2, 0, 1, 3), head)


def test_flash_attention_is_offered_only_on_cuda_in_half_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch whose varlen_attn takes block_table: flash attention for float16 / bfloat16
    models on CUDA, plain torch for float32 (flash does not compute in it) and off CUDA; the
    path says why."""
    monkeypatch.setattr(
        paged_attention_module, "varlen_parameters", lambda: frozenset({"block_table"})
    )
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert flash_paged_available(cuda, torch.bfloat16)
    assert flash_paged_available(cuda, torch.float16)
    assert not flash_paged_available(cuda, torch.float32)
    assert not flash_paged_available(cpu, torch.bfloat16)
    assert attention_path(cuda, torch.bfloat16).startswith("flash attention")
    assert "needs float16 or bfloat16; the model is float32" in attention_path(cuda, torch.float32)
    assert "needs CUDA; this is cpu" in attention_path(cpu, torch.float32)
    monkeypatch.setattr(paged_attention_module, "varlen_parameters", lambda: frozenset())
    assert not flash_paged_available(cuda, torch.bfloat16)
    assert "needs torch >= 2.12" in attention_path(cuda, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 4])
def test_flash_paged_equals_the_reference_on_cuda(window: int | None) -> None:
    if not flash_paged_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("this torch's varlen_attn has no block_table")
    # Flash attention's paged mode reads pages of 256 tokens; head_dim 64 as real models have.
    case = packed_case([300, 1, 5, 1], [300, 9, 517, 256], 8, 2, block=256, head_dim=64)
    query, k_cache, v_cache, cu, used, table = (
        t.to("cuda", torch.bfloat16) if t.is_floating_point() else t.to("cuda") for t in case[:6]
    )
    scale = 64**-0.5
    out = paged_attention(query, k_cache, v_cache, cu, used, table, scale, 300, 517, window)
    ref = paged_attention_reference(query, k_cache, v_cache, cu, used, table, scale, window)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("q_lens", "k_lens", "kv_heads", "window"),
    [
        ([1, 1, 1, 1], [3, 4, 9, 13], 2, None),  # decodes: short tables padded, tails unwritten
        ([1, 1, 4], [14, 5, 13], 2, 5),  # decodes and a chunk past released pages
        ([6, 1], [6, 15], 1, 3),  # a prefill and a decode whose first 3 pages went back
    ],
)
def test_nan_where_a_step_owns_nothing_never_reaches_its_output(
    q_lens: list[int], k_lens: list[int], kv_heads: int, window: int | None
) -> None:
    """Every page no sequence holds is NaN (the pool's spare pages), the rest of a sequence's
    last page zero (as the step that entered it left it: `fresh_blocks`), and with a sliding
    window the pages wholly behind every query's window are in the tables as another
    sequence's NaN page (released: `block_manager` gives them back as a sequence advances):
    attention gives the reference's output over clean pages."""
    query, k_cache, v_cache, cu, used, table, *_ = packed_case(q_lens, k_lens, 4, kv_heads)
    scale = HEAD_DIM**-0.5
    expected = paged_attention_reference(query, k_cache, v_cache, cu, used, table, scale, window)
    held = {int(b) for i, k in enumerate(k_lens) for b in table[i, : -(-k // BLOCK)]}
    spare = min(set(range(k_cache.shape[0])) - held)
    owned = torch.zeros(k_cache.shape[0] * BLOCK, dtype=torch.bool)
    entered = owned.clone()
    tables = []
    for i, (q, k) in enumerate(zip(q_lens, k_lens, strict=True)):
        pages = [int(b) for b in table[i, : -(-k // BLOCK)]]
        for p in range(k):
            owned[pages[p // BLOCK] * BLOCK + p % BLOCK] = True
        for page in pages:
            entered[page * BLOCK : (page + 1) * BLOCK] = True
        if window is not None:
            behind = max(0, k - q - window + 1) // BLOCK
            pages[:behind] = [spare] * behind
        tables.append(pages)
    for cache in (k_cache, v_cache):
        cache.view(-1, kv_heads, HEAD_DIM)[entered & ~owned] = 0
        cache.view(-1, kv_heads, HEAD_DIM)[~entered] = float("nan")
    meta = step_metadata(
        q_lens, k_lens, tables, BLOCK, torch.device("cpu"), [window], k_cache.shape[0], kv_heads
    )
    k_heads, v_heads = (c.permute(2, 0, 1, 3).contiguous() for c in (k_cache, v_cache))
    out = attend(query, k_heads, v_heads, meta, scale, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_a_step_names_the_blocks_it_enters() -> None:
    """`fresh_blocks`: the block of every position a step writes at a block's first slot
    (zeroed before the step writes); none where every write continues a block."""
    meta = step_metadata(
        [6, 1, 1], [6, 9, 7], [[5, 2], [0, 3, 4], [1, 6]], BLOCK, torch.device("cpu")
    )
    assert meta.fresh_blocks is not None and meta.fresh_blocks.tolist() == [5, 2, 4]
    assert step_metadata([1], [7], [[1, 6]], BLOCK, torch.device("cpu")).fresh_blocks is None
