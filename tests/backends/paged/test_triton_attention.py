"""tgis.backends.paged.triton_attention: the Triton cache write equals `write_kv`, and Triton
attention over KV pages equals `paged_attention_reference`, over pools that hold NaN in every
slot the step does not own.

Without a CUDA device the kernels run on the CPU through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET before anything imports them), so the shapes here are small."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

import pytest
import torch

from tgis.backends.paged import triton_attention
from tgis.backends.paged.attention import paged_attention_reference, pool_shape, write_kv
from tgis.backends.paged.triton_attention import (
    interpreted,
    paged_attention_triton,
    split_kv_count,
    triton_available,
    write_kv_triton,
)

REASON = triton_available()
# On a GPU `make gpu-check` runs them compiled (`pytest -m cuda`); on a CPU, interpreted.
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(REASON is not None, reason=f"Triton kernels cannot run: {REASON}"),
]
DEVICE = torch.device("cpu" if REASON is not None or interpreted() else "cuda")

FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
HALF_TOL = {"rtol": 1.6e-2, "atol": 2e-2}  # bfloat16's, for float16 too


@dataclass
class Step:
    """A packed step over pages pools (as the reference reads them) whose every slot the step
    does not own is NaN: the tails of last pages, spare pages, the pages that pad the table and
    the positions behind each sequence's window."""

    query: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    cu_seq_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_q: int
    unwritten: torch.Tensor  # [num_blocks, block_size] bool: slots left NaN

    def pools(self, heads_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not heads_first:
            return self.k_pages, self.v_pages
        return (
            self.k_pages.permute(2, 0, 1, 3).contiguous(),
            self.v_pages.permute(2, 0, 1, 3).contiguous(),
        )

    def reference(self, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """The reference over the pools with NaN read as 0 (it multiplies masked slots by 0,
        where NaN would spread: the kernels must not read them at all)."""
        return paged_attention_reference(
            self.query,
            self.k_pages.float().nan_to_num(),
            self.v_pages.float().nan_to_num(),
            self.cu_seq_q,
            self.seqused_k,
            self.block_table,
            self.query.shape[-1] ** -0.5,
            window,
            softcap,
        )

    def triton(
        self,
        window: int | None = None,
        softcap: float | None = None,
        heads_first: bool = False,
        splits: int | None = 1,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pools(heads_first)
        return paged_attention_triton(
            self.query,
            k_cache,
            v_cache,
            self.cu_seq_q,
            self.seqused_k,
            self.block_table,
            self.query.shape[-1] ** -0.5,
            self.max_q,
            window,
            softcap,
            heads_first=heads_first,
            splits=splits,
        )


def make_step(
    q_lens: list[int],
    k_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int = 64,
    block: int = 16,
    dtype: torch.dtype = torch.float32,
    pool_dtype: torch.dtype | None = None,
    window: int | None = None,
    query_scale: float = 1.0,
    seed: int = 0,
) -> Step:
    """Sequences over shuffled pages of a NaN pool, written only where the step may read."""
    gen = torch.Generator().manual_seed(seed)
    pool_dtype = pool_dtype or dtype
    pages = [-(-k // block) for k in k_lens]
    num_blocks = sum(pages) + 2  # spare pages, NaN, which also pad the shorter tables
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block, kv_heads, head_dim)
    k_pages = torch.full(shape, float("nan"), dtype=pool_dtype)
    v_pages = torch.full(shape, float("nan"), dtype=pool_dtype)
    spare = order[-1]
    table = torch.full((len(k_lens), max(pages)), spare, dtype=torch.int32)
    for i, (q_len, k_len) in enumerate(zip(q_lens, k_lens, strict=True)):
        own = [order.pop(0) for _ in range(pages[i])]
        table[i, : len(own)] = torch.tensor(own)
        # Positions before the first query's window may be back in the pool: left NaN.
        seen_from = 0 if window is None else max(0, k_len - q_len - window + 1)
        positions = range(seen_from, k_len)
        slots = torch.tensor([own[p // block] * block + p % block for p in positions])
        k = torch.randn(len(positions), kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(len(positions), kv_heads, head_dim, generator=gen).to(dtype)
        write_kv(k_pages, v_pages, k, v, slots)
    query = (torch.randn(sum(q_lens), heads, head_dim, generator=gen) * query_scale).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    unwritten = k_pages.float().isnan().any(-1).any(-1)
    return Step(
        query.to(DEVICE),
        k_pages.to(DEVICE),
        v_pages.to(DEVICE),
        cu.to(DEVICE),
        torch.tensor(k_lens, dtype=torch.int32, device=DEVICE),
        table.to(DEVICE),
        max(q_lens),
        unwritten,
    )


# A prefill, a decode, a sequence with nothing this step, a chunk after 17 earlier tokens and a
# decode at a block's first slot.
Q_LENS, K_LENS = [5, 1, 0, 3, 1], [5, 40, 7, 20, 17]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block", "dtype", "pool_dtype", "window", "softcap", "hf"),
    [
        pytest.param(4, 2, 64, 16, torch.float32, None, None, None, False, id="gqa-pages"),
        pytest.param(4, 2, 64, 16, torch.float32, None, None, None, True, id="gqa-head-major"),
        pytest.param(4, 1, 64, 16, torch.float32, None, 8, 2.0, False, id="mqa-window-softcap"),
        pytest.param(6, 2, 80, 256, torch.float32, None, None, None, True, id="dim80-block256"),
        pytest.param(4, 2, 96, 16, torch.bfloat16, None, 6, None, False, id="dim96-bf16"),
        pytest.param(2, 2, 128, 16, torch.float16, None, None, 2.0, True, id="dim128-fp16"),
        pytest.param(4, 1, 256, 256, torch.bfloat16, None, None, None, False, id="dim256-bf16"),
        pytest.param(
            4, 2, 64, 16, torch.bfloat16, torch.float8_e4m3fn, 8, None, True, id="e4m3-pool"
        ),
        pytest.param(
            4, 4, 64, 16, torch.float16, torch.float8_e5m2, None, 2.0, False, id="e5m2-pool"
        ),
    ],
)
def test_attention_equals_the_reference(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block: int,
    dtype: torch.dtype,
    pool_dtype: torch.dtype | None,
    window: int | None,
    softcap: float | None,
    hf: bool,
) -> None:
    if pool_dtype is not None and (why := triton_available(DEVICE, pool_dtype)) is not None:
        pytest.skip(why)
    step = make_step(
        Q_LENS, K_LENS, heads, kv_heads, head_dim, block, dtype, pool_dtype, window,
        query_scale=3.0 if softcap is not None else 1.0,
    )  # fmt: skip
    out = step.triton(window, softcap, heads_first=hf)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
    torch.testing.assert_close(out.float(), step.reference(window, softcap).float(), **tol)


def test_nan_in_slots_the_step_does_not_own_stays_out_of_the_output() -> None:
    """The pools hold NaN where the step must not read (so the check below is not vacuous):
    the tail of a last page, a spare page padding a shorter table, and positions behind a
    window in a page whose later positions are seen."""
    window = 6
    step = make_step([1, 4], [30, 35], 4, 2, block=16, window=window)
    table, unwritten = step.block_table.cpu(), step.unwritten
    assert unwritten[table[0, 1], 30 - 16 :].all()  # the decode's last page, after 30 keys
    assert unwritten[table[0, 2]].all()  # the page padding its table
    assert unwritten[table[1, 1], : 35 - 4 - window + 1 - 16].all()  # behind the chunk's window
    assert not unwritten[table[1, 1], 35 - 4 - window + 1 - 16 :].any()
    for splits in (1, 2):
        out = step.triton(window, splits=splits)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, step.reference(window), **FP32_TOL)


@pytest.mark.parametrize("window", [None, 100])
def test_split_kv_equals_the_unsplit_kernel(window: int | None) -> None:
    """Decodes and a short chunk over long KV, cut into 3 runs and into more runs than some
    rows have key tiles (empty runs must weigh nothing)."""
    step = make_step([1, 1, 4], [300, 129, 250], 4, 2, block=16, window=window)
    unsplit = step.triton(window, splits=1)
    torch.testing.assert_close(unsplit, step.reference(window), **FP32_TOL)
    for splits in (3, 6):
        split = step.triton(window, splits=splits, heads_first=splits == 6)
        assert torch.isfinite(split).all()
        torch.testing.assert_close(split, unsplit, rtol=1e-6, atol=1e-6)


def test_split_kv_in_half_precision() -> None:
    step = make_step([1, 1], [200, 70], 4, 1, dtype=torch.bfloat16)
    unsplit = step.triton(splits=1)
    torch.testing.assert_close(step.triton(splits=4).float(), unsplit.float(), **HALF_TOL)
    torch.testing.assert_close(unsplit.float(), step.reference().float(), **HALF_TOL)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(splits: int) -> None:
    step = make_step([6, 1, 2, 1], [6, 150, 90, 33], 4, 2, window=64)
    batch = step.triton(64, splits=splits)
    cu = step.cu_seq_q.tolist()
    for i in range(len(cu) - 1):
        alone = paged_attention_triton(
            step.query[cu[i] : cu[i + 1]],
            step.k_pages,
            step.v_pages,
            torch.tensor([0, cu[i + 1] - cu[i]], dtype=torch.int32, device=DEVICE),
            step.seqused_k[i : i + 1],
            step.block_table[i : i + 1],
            step.query.shape[-1] ** -0.5,
            cu[i + 1] - cu[i],
            64,
            splits=splits,
        )
        assert torch.equal(alone, batch[cu[i] : cu[i + 1]]), f"sequence {i}"


def test_a_strided_query_and_a_given_output() -> None:
    """Queries sliced out of a wider projection (not contiguous), into a given output."""
    step = make_step(Q_LENS, K_LENS, 4, 2)
    wide = torch.randn(step.query.shape[0], 4, 128, device=DEVICE)
    wide[..., 32:96] = step.query
    query = wide[..., 32:96]
    assert not query.is_contiguous()
    out = torch.full_like(step.query, float("nan"))
    got = paged_attention_triton(
        query, step.k_pages, step.v_pages, step.cu_seq_q, step.seqused_k, step.block_table,
        64**-0.5, step.max_q, out=out,
    )  # fmt: skip
    assert got is out
    torch.testing.assert_close(out, step.reference(), **FP32_TOL)


def test_split_kv_count_splits_only_small_steps_over_long_contexts() -> None:
    assert split_kv_count(programs=8, longest_kv=8192, target=256) == 16  # capped
    assert split_kv_count(programs=64, longest_kv=8192, target=256) == 4  # fills the target
    assert split_kv_count(programs=8, longest_kv=1536, target=256) == 3  # >= 512 keys a run
    assert split_kv_count(programs=8, longest_kv=900, target=256) == 1  # too short to cut
    assert split_kv_count(programs=256, longest_kv=32768, target=256) == 1  # a full GPU
    assert split_kv_count(programs=0, longest_kv=32768, target=256) == 1


def test_the_heuristic_decides_when_splits_is_not_given() -> None:
    """A decode row over a long KV is split by default, and gets the forced split's result."""
    step = make_step([1], [1100], 2, 1)
    assert split_kv_count(1, 1100) == 2
    by_default = paged_attention_triton(
        step.query, step.k_pages, step.v_pages, step.cu_seq_q, step.seqused_k, step.block_table,
        64**-0.5, 1, max_k=1100,
    )  # fmt: skip
    assert torch.equal(by_default, step.triton(splits=2))
    torch.testing.assert_close(by_default, step.reference(), **FP32_TOL)


# Float8 pools take values their format holds exactly where the interpreter writes them: its
# emulated narrowing casts do not round as torch does (the GPU's do: the test below).
POOL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("heads_first", [False, True], ids=["pages", "head-major"])
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
def test_write_equals_write_kv_and_skips_padding(
    pool_dtype: torch.dtype, heads_first: bool
) -> None:
    if (why := triton_available(DEVICE, pool_dtype)) is not None:
        pytest.skip(why)
    gen = torch.Generator().manual_seed(1)
    num_blocks, block, kv_heads, head_dim = 5, 16, 2, 80
    shape = pool_shape(not heads_first, num_blocks, block, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=pool_dtype)
    v_cache = torch.full(shape, float("nan"), dtype=pool_dtype)
    slots = torch.randperm(num_blocks * block, generator=gen)[:12]
    slots[[2, 7, 11]] = -1  # padding: the last slot, were -1 an index
    float8 = pool_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    source = torch.bfloat16 if float8 else pool_dtype
    # Keys sliced out of a wider projection (strided), as a model's K/V often are.
    key = (torch.randn(12, kv_heads, 2 * head_dim, generator=gen) * 50)[..., :head_dim]
    value = torch.randn(12, kv_heads, head_dim, generator=gen) * 50
    if float8:
        key, value = key.to(pool_dtype).float(), value.to(pool_dtype).float()
        key[0, 0, :4] = torch.tensor([1e5, -1e5, 3e4, -7e4])  # saturate
    key, value = key.to(source), value.to(source)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kept = slots >= 0
    write_kv(expected_k, expected_v, key[kept], value[kept], slots[kept], heads_first)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    write_kv_triton(
        k_cache, v_cache, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), heads_first
    )
    assert torch.equal(k_cache.cpu().view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter's narrowing casts are inexact")
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES[1:], ids=str)
def test_write_rounds_as_torch_does(pool_dtype: torch.dtype) -> None:
    if (why := triton_available(DEVICE, pool_dtype)) is not None:
        pytest.skip(why)
    shape = pool_shape(True, 4, 16, 2, 64)
    k_cache = torch.zeros(shape, dtype=pool_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(64, 2, 64, device=DEVICE) * 300  # float32, some beyond e4m3's range
    value = torch.randn(64, 2, 64, device=DEVICE)
    slots = torch.arange(64, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(expected_k, expected_v, key, value, slots)
    write_kv_triton(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


def test_write_then_attend() -> None:
    """The write and the attention together, over a head-major pool: a prefill then a decode."""
    kv_heads, head_dim, block = 1, 64, 16
    gen = torch.Generator().manual_seed(2)
    shape = pool_shape(False, 3, block, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=DEVICE)
    v_cache = torch.full(shape, float("nan"), device=DEVICE)
    keys = torch.randn(21, kv_heads, head_dim, generator=gen).to(DEVICE)
    values = torch.randn(21, kv_heads, head_dim, generator=gen).to(DEVICE)
    query = torch.randn(21, 2, head_dim, generator=gen).to(DEVICE)
    table = torch.tensor([[2, 0]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2 * block + p if p < block else p - block for p in range(21)])
    pages_k = torch.full((3, block, kv_heads, head_dim), float("nan"), device=DEVICE)
    pages_v = torch.full_like(pages_k, float("nan"))
    for rows in (slice(0, 20), slice(20, 21)):
        q_len = rows.stop - rows.start
        write_kv_triton(
            k_cache, v_cache, keys[rows], values[rows], slots[rows].to(DEVICE), heads_first=True
        )
        write_kv(pages_k, pages_v, keys[rows], values[rows], slots[rows].to(DEVICE))
        args = (
            torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE),
            torch.tensor([rows.stop], dtype=torch.int32, device=DEVICE),
            table,
            head_dim**-0.5,
        )
        out = paged_attention_triton(query[rows], k_cache, v_cache, *args, q_len, heads_first=True)
        expected = paged_attention_reference(
            query[rows], pages_k.nan_to_num(), pages_v.nan_to_num(), *args
        )
        torch.testing.assert_close(out, expected, **FP32_TOL)


def test_the_module_imports_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine imports the module wherever it runs; only the kernels need Triton."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location(
        "triton_attention_without_triton", triton_attention.__file__
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.triton_available() == "triton is not installed"
    assert not module.interpreted()
