"""tgis.backends.common.quant_bnb: bitsandbytes' kernels (its CPU ones here) compute what the
pure-torch reference computes from the package's stored weights, LLM.int8()'s outlier columns
included; the weights are the float ones within each format's rounding; the package's absence
is a ConfigError naming the extra that installs it."""

from __future__ import annotations

import importlib

import pytest
import torch

from tgis.backends.common import quant_bnb
from tgis.backends.common.quant import Quantization, kernel, reference
from tgis.backends.common.quant_bnb import (
    BNB_METHODS,
    LLM_INT8_THRESHOLD,
    FourBitWeight,
    LlmInt8Weight,
)
from tgis.config.types import BITSANDBYTES_METHODS
from tgis.errors import ConfigError

CPU = torch.device("cpu")


def weight_and_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randn(96, 128) * 0.05, torch.randn(2, 3, 128)


def test_the_methods_are_the_configs() -> None:
    assert tuple(BNB_METHODS) == BITSANDBYTES_METHODS


@pytest.mark.parametrize("method", BITSANDBYTES_METHODS)
def test_each_kernel_computes_its_reference(method: str) -> None:
    weight, x = weight_and_inputs()
    canon = Quantization(method).quantize(weight)
    assert canon.shape == (96, 128)
    linear = kernel(canon, CPU, torch.float32)
    out = linear(x)
    assert out.shape == (2, 3, 96) and out.dtype == torch.float32
    # LLM.int8() writes float16: its reference agrees to that rounding.
    atol = 4e-3 if method == "bitsandbytes" else 1e-5
    torch.testing.assert_close(out, reference(canon, x, torch.float32), atol=atol, rtol=0)
    bias = torch.randn(96)
    torch.testing.assert_close(linear(x, bias), out + bias)
    exact = x @ weight.t()
    # int8 rows lose ~1/254 of each row's range; 4-bit codes far more.
    bound = 0.05 if method == "bitsandbytes" else 0.6
    assert (out - exact).abs().max() < bound
    assert linear.in_features == 128 and linear.out_features == 96


def test_llm_int8_multiplies_outlier_columns_in_float16() -> None:
    """A column holding a value beyond the threshold is taken out of the int8 product: the
    kernel's output matches the reference's, and is far closer to the float product than an
    int8 quantization of that row would be."""
    weight, x = weight_and_inputs(1)
    x = x.reshape(-1, 128)
    x[0, 7] = 4 * LLM_INT8_THRESHOLD
    x[1, 7] = 0.9 * LLM_INT8_THRESHOLD  # row 1's absmax, in the outlier column: it sets the scale
    canon = LlmInt8Weight.quantize(weight)
    out = kernel(canon, CPU, torch.float32)(x)
    torch.testing.assert_close(out, reference(canon, x, torch.float32), atol=4e-3, rtol=0)
    exact = x @ canon.dequantize().t()
    # Without the decomposition, row 0's step would be 24/127: errors of ~0.1 and more.
    assert (out[0] - exact[0]).abs().max() < 0.02


@pytest.mark.parametrize("code", ["nf4", "fp4"])
def test_four_bit_weights_dequantize_within_their_blocks_range(code: str) -> None:
    weight, _ = weight_and_inputs(2)
    canon = FourBitWeight.quantize(weight, code)
    assert canon.packed.dtype == torch.uint8 and canon.packed.numel() == 96 * 128 // 2
    error = (canon.dequantize() - weight).abs().reshape(-1, quant_bnb.FOUR_BIT_BLOCK)
    blocks = weight.abs().reshape(-1, quant_bnb.FOUR_BIT_BLOCK).amax(dim=1, keepdim=True)
    # The widest gap between neighbouring codes is under 1/3 of the absmax for both books.
    assert (error <= blocks / 6 + 1e-6).all()
    assert kernel(canon, CPU, torch.float32).nbytes < weight.nbytes / 6


def test_llm_int8_weights_are_rows_at_127() -> None:
    weight, _ = weight_and_inputs(3)
    canon = LlmInt8Weight.quantize(weight)
    assert canon.cb.dtype == torch.int8
    assert (canon.cb.abs().amax(dim=1) == 127).all()
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    # Half a step, and the float16 rounding of the weight and its scale on the way.
    assert ((canon.dequantize() - weight).abs() <= 0.6 * step).all()


def test_describe_names_the_method() -> None:
    assert Quantization("bitsandbytes").describe().startswith("bitsandbytes LLM.int8()")
    assert Quantization("bitsandbytes-nf4").describe() == (
        "bitsandbytes nf4, blocks of 64; lm_head unquantized"
    )
    assert Quantization("bitsandbytes-fp4").head(torch.zeros(4, 4)) is None


def test_without_the_package_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def missing(name: str, *args: object) -> object:
        if name == "bitsandbytes":
            raise ImportError("No module named 'bitsandbytes'")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(quant_bnb.importlib, "import_module", missing)
    with pytest.raises(ConfigError, match=r"pip install 'tgis\[bitsandbytes\]'"):
        Quantization("bitsandbytes-nf4").quantize(torch.zeros(4, 64))
