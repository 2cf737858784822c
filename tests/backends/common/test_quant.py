"""tgis.backends.common.quant: the canonical forms round and dequantize as their formats say, and
every kernel computes what its pure-torch reference does from the same values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tgis.backends.common.gemm import linear
from tgis.backends.common.quant import (
    FP8_MAX,
    INT8_KERNEL_ROWS,
    Fp8Blocks,
    Fp8Channels,
    Fp8Linear,
    Int4Groups,
    Int4Linear,
    Int8Channels,
    Int8Linear,
    Quantization,
    cat,
    kernel,
    kernel_groups,
    narrow,
    reference,
)
from tgis.errors import ConfigError

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """The activations drawn in each test are the same in every run and every order."""
    torch.manual_seed(0)


def _weight(out: int = 48, cols: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, cols, generator=torch.Generator().manual_seed(seed))


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out - expected).norm() / expected.norm())


def test_int8_rounds_each_row_to_its_own_scale() -> None:
    w = _weight()
    w[3] = 0.0  # an all-zero row keeps a finite scale and dequantizes to zeros
    canon = Int8Channels.quantize(w)
    assert canon.q.dtype == torch.int8 and canon.q.abs().max() == 127
    assert torch.equal(canon.scale[:3], w[:3].abs().amax(dim=1) / 127)
    error = (canon.dequantize() - w).abs()
    assert torch.all(error <= canon.scale[:, None] / 2 + 1e-7)
    assert torch.equal(canon.dequantize()[3], torch.zeros(128))


def test_int4_groups_round_within_half_a_step_and_keep_zero() -> None:
    w = _weight()
    w[:, 5] = 0.0
    canon = Int4Groups.quantize(w, 32)
    assert canon.q.dtype == torch.uint8 and int(canon.q.max()) <= 15
    assert canon.scale.shape == (4, 48) and canon.zero.shape == (4, 48)
    assert torch.equal(canon.zero, canon.zero.round())
    restored = canon.dequantize()
    step = canon.scale.t().repeat_interleave(32, dim=1)
    # Rounding moves a weight by half a step at most; the integer zero point by half again.
    assert torch.all((restored - w).abs() <= step + 1e-6)
    assert torch.equal(restored[:, 5], torch.zeros(48))
    with pytest.raises(ValueError, match="not a multiple of group size 64"):
        Int4Groups.quantize(_weight(16, 96), 64)


def test_fp8_rows_reach_e4m3s_largest_value() -> None:
    w = _weight()
    canon = Fp8Channels.quantize(w)
    assert canon.q.dtype == torch.float8_e4m3fn
    assert torch.equal(canon.q.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))
    # e4m3 keeps 3 mantissa bits: each weight within 1/16 of its magnitude.
    assert torch.all((canon.dequantize() - w).abs() <= w.abs() / 16 + canon.scale[:, None])


def test_fusing_quantized_parts_equals_quantizing_the_fused_weight() -> None:
    """Per-row scales and per-row groups: q, k and v quantized apart then stacked are the fused
    projection quantized whole (a checkpoint's parts and tgis's fused weight agree)."""
    parts = [_weight(16, 64, seed) for seed in range(3)]
    whole = torch.cat(parts)
    for quantize in (Int8Channels.quantize, lambda w: Int4Groups.quantize(w, 32)):
        fused = cat([quantize(p) for p in parts])
        direct = quantize(whole)
        assert torch.equal(fused.dequantize(), direct.dequantize())
    with pytest.raises(ValueError, match="quantized differently"):
        cat([Int8Channels.quantize(parts[0]), Int4Groups.quantize(parts[1], 32)])
    with pytest.raises(ValueError, match="group size"):
        cat([Int4Groups.quantize(parts[0], 32), Int4Groups.quantize(parts[1], 64)])


def test_act_order_columns_dequantize_in_the_inputs_order() -> None:
    """GPTQ's act-order: the groups cover the input columns in `perm`'s order; dequantize puts
    each column back, and the kernel permutes x to match."""
    w = _weight(32, 64)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    grouped = Int4Groups.quantize(w[:, perm], 32)
    ordered = Int4Groups(grouped.q, grouped.scale, grouped.zero, 32, perm)
    restored = ordered.dequantize()
    assert torch.equal(restored[:, perm], grouped.dequantize())
    x = torch.randn(3, 64)
    op = Int4Linear(ordered, CPU)
    torch.testing.assert_close(op(x), reference(ordered, x, torch.float32), atol=0, rtol=0)
    assert _relative_error(op(x), x @ restored.t()) < 0.01


@pytest.mark.parametrize("rows", [1, 5, 32, 33, 200])
def test_int8_kernel_equals_its_reference(rows: int) -> None:
    """Up to INT8_KERNEL_ROWS rows through the kernel (bfloat16 activations), beyond them the
    weight dequantized into the model's float32: each within its own rounding of the
    reference, which follows the same split."""
    w = _weight(48, 96)
    canon = Int8Channels.quantize(w)
    op = Int8Linear(canon, CPU, torch.bfloat16, torch.float32)
    x = torch.randn(rows, 96)
    out = op(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 48)
    expected = reference(canon, x, torch.float32)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    if rows > INT8_KERNEL_ROWS:  # float32 throughout: no bfloat16 rounding (~4e-3) left
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    # And near the float weight's product: int8's per-row rounding moves it by ~0.7% on average
    # (up to ~1.2% for a single row), bfloat16 activations by ~0.3% more.
    assert _relative_error(out, x @ w.t()) < 0.02


def test_int8_traced_for_a_compiled_graph_keeps_one_graph_for_every_batch() -> None:
    """Inside a compiled graph the kernel takes every batch (inductor lowers it): no branch on
    the rows, so a dynamic graph traced at 4 rows serves 40 without compiling again, and it
    computes the kernel's product there."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    canon = Int8Channels.quantize(_weight(48, 96))
    op = Int8Linear(canon, CPU, torch.bfloat16, torch.float32)
    counter = CompileCounter()
    traced = torch.compile(lambda x: op(x), backend=counter, dynamic=True)
    for rows in (4, 8, 40):
        x = torch.randn(rows, 96)
        expected = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), op.q, op.scale).float()
        torch.testing.assert_close(traced(x), expected)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_int8_wide_batches_dequantize_a_slice_of_channels_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tgis.backends.common import quant

    canon = Int8Channels.quantize(_weight(48, 96))
    op = Int8Linear(canon, CPU, torch.bfloat16, torch.float32)
    x = torch.randn(40, 96)
    whole = op(x)
    monkeypatch.setattr(quant, "DENSE_SLICE_BYTES", 96 * 4 * 5)  # 5 channels a slice
    torch.testing.assert_close(op(x), whole, atol=1e-4, rtol=1e-4)  # MKL blocks N otherwise


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_kernel_equals_its_reference(group: int) -> None:
    w = _weight(32, 256)
    canon = Int4Groups.quantize(w, group)
    op = Int4Linear(canon, CPU)
    x = torch.randn(2, 7, 256)
    out = op(x)
    assert out.shape == (2, 7, 32)
    torch.testing.assert_close(out, reference(canon, x, torch.float32), atol=1e-2, rtol=1e-2)


def test_int4_kernel_refuses_widths_it_cannot_pack() -> None:
    with pytest.raises(ValueError, match=r"multiples of 16 .* \[40, 64\]"):
        Int4Linear(Int4Groups.quantize(_weight(40, 64), 32), CPU)


def test_fp8_kernel_scales_each_token_on_its_own() -> None:
    """Per-token activation scales: a row's output does not depend on the other rows (one
    huge row beside it changes nothing but the GEMM's summation order)."""
    w = _weight(32, 64)
    canon = Fp8Channels.quantize(w)
    op = Fp8Linear(canon, CPU, torch.float32)
    x = torch.randn(4, 64)
    alone = op(x[:1])
    beside_huge = op(torch.cat([x[:1], 1000 * x[1:]]))[:1]
    torch.testing.assert_close(alone, beside_huge, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(op(x), reference(canon, x, torch.float32), atol=1e-4, rtol=1e-4)
    assert _relative_error(op(x), x @ w.t()) < 0.05


def test_linear_adds_the_bias_and_dispatches_quantized_weights() -> None:
    w, bias = _weight(32, 64), torch.randn(32)
    op = kernel(Int8Channels.quantize(w), CPU, torch.float32)
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x, op, bias), op(x) + bias)
    torch.testing.assert_close(linear(x, w, bias), F.linear(x, w, bias))


def test_quantization_names_its_method_and_group() -> None:
    assert Quantization("int4", 64).describe() == "int4 weight-only, groups of 64; lm_head int8"
    assert isinstance(Quantization("int4", 64).head(_weight()), Int8Channels)
    assert Quantization("int8").head(_weight()) is None
    assert Quantization("fp8").head(_weight()) is None
    with pytest.raises(ValueError, match="int4 groups"):
        Quantization("int4", 48)
    with pytest.raises(ValueError, match="not one of"):
        Quantization("nf4")


def test_kernels_report_the_bytes_they_hold() -> None:
    w = _weight(64, 128)
    # int8 weights, bfloat16 scales for the kernel and float32 ones for wide batches.
    assert kernel(Int8Channels.quantize(w), CPU, torch.float32).nbytes == 64 * 128 + 64 * (2 + 4)
    int4 = kernel(Int4Groups.quantize(w, 64), CPU, torch.float32)
    assert int4.nbytes == 64 * 128 // 2 + 2 * 64 * 2 * 2  # packed nibbles, bf16 scale/offset pairs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 64])
def test_cuda_kernels_equal_their_references(rows: int) -> None:
    cuda = torch.device("cuda")
    w = _weight(64, 256)
    x = torch.randn(rows, 256, device=cuda, dtype=torch.bfloat16)
    weights: list[Int8Channels | Int4Groups | Fp8Channels] = [
        Int8Channels.quantize(w),
        Int4Groups.quantize(w, 64),
    ]
    if torch.cuda.get_device_capability() >= (8, 9):
        weights.append(Fp8Channels.quantize(w))
    for canon in weights:
        op = kernel(canon, cuda, torch.bfloat16)
        expected = reference(canon, x, torch.bfloat16)
        torch.testing.assert_close(op(x).float(), expected, atol=0.05, rtol=0.02)


def test_wide_groups_are_cut_into_kernel_groups_exactly() -> None:
    """A per-channel int4 weight (GPTQ's group_size -1) runs in groups torch's kernels take,
    each sharing the row's scale and zero point: the same weight, the same kernel output."""
    whole = Int4Groups.quantize(_weight(cols=384), 384)
    cut = kernel_groups(whole)
    assert cut.group == 128 and cut.scale.shape == (3, 48)
    assert torch.equal(cut.dequantize(), whole.dequantize())
    x = torch.randn(3, 384)
    torch.testing.assert_close(
        kernel(cut, torch.device("cpu"), torch.float32)(x), reference(cut, x, torch.float32)
    )
    with pytest.raises(ValueError, match="groups of 16 columns"):
        kernel_groups(Int4Groups.quantize(_weight(cols=128), 16))


def test_a_shard_narrows_rows_and_whole_groups_of_columns() -> None:
    weight = Int4Groups.quantize(_weight(out=64, cols=128), 32)
    rows = narrow(weight, 0, ((0, 16), (32, 48)))
    expected = torch.cat([weight.dequantize()[0:16], weight.dequantize()[32:48]])
    assert torch.equal(rows.dequantize(), expected)
    cols = narrow(weight, 1, ((64, 128),))
    assert torch.equal(cols.dequantize(), weight.dequantize()[:, 64:128])
    with pytest.raises(ValueError, match="splits a quantization group of 32 columns"):
        narrow(weight, 1, ((48, 96),))
    int8 = Int8Channels.quantize(_weight())
    assert torch.equal(narrow(int8, 1, ((0, 64),)).dequantize(), int8.dequantize()[:, :64])
    act_order = Int4Groups(weight.q, weight.scale, weight.zero, 32, torch.randperm(128))
    with pytest.raises(ValueError, match="act-order"):
        narrow(act_order, 1, ((0, 64),))


def test_fp8_blocks_fold_into_channel_scales_within_one_rounding() -> None:
    w = _weight(out=64, cols=128) * torch.linspace(0.01, 1, 128)  # blocks of unequal range
    blocks = w.reshape(2, 32, 4, 32)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(64, 128).to(torch.float8_e4m3fn)
    stored = Fp8Blocks(q, scale, (32, 32))
    channels = stored.to_channels()
    assert channels.scale.shape == (64,)
    assert torch.equal(channels.scale, scale.repeat_interleave(32, dim=0).amax(dim=1))
    torch.testing.assert_close(channels.dequantize(), stored.dequantize(), rtol=0.07, atol=1e-6)


def test_fp8_is_refused_on_gpus_older_than_ada(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Ampere GPU (8.0) has no float8 matmul: one line naming its capability and the fix,
    before anything reaches the device."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8.9 or later .* cuda:0 is 8.0"):
        kernel(Fp8Channels.quantize(_weight()), torch.device("cuda", 0), torch.bfloat16)
