"""bitsandbytes' quantization, TGI's `--quantize bitsandbytes`, `bitsandbytes-nf4` and
`bitsandbytes-fp4`: the weights quantized at load by the bitsandbytes package (the
`bitsandbytes` extra; never imported unless one of these is asked for) and multiplied by its
kernels, on CUDA and, since bitsandbytes 0.48, on a CPU.

| method | weight | activations | kernel |
|---|---|---|---|
| bitsandbytes (LLM.int8()) | int8 per output row, absmax scales | int8 per row, float16; input columns with a value of magnitude >= 6.0 (outliers) in float16 against the dequantized weight | `bitsandbytes::int8_mixed_scaled_mm` |
| bitsandbytes-nf4 / -fp4 | 4-bit NormalFloat / float codes in blocks of 64 values, absmax scales | the model's dtype | `bitsandbytes.matmul_4bit` (a GEMV at one row on CUDA) |

Like the methods of common/quant.py, each weight has a canonical form (`LlmInt8Weight`,
`FourBitWeight`: what bitsandbytes stores, and `dequantize()`) and a kernel form
(`QuantLinear`); `reference` computes in plain torch what the kernel computes, which the tests
hold the kernels to. These methods quantize float weights at load only: their canonical forms
neither concatenate nor narrow (the decoder concatenates fused projections before quantizing,
and a tensor-parallel rank quantizes its own slice).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tgis.backends.common.quant_kernel import QuantLinear, add_bias, rows, tensor_bytes
from tgis.errors import ConfigError

# `--quantize` values served by bitsandbytes -> its 4-bit code (None: LLM.int8()).
BNB_METHODS: dict[str, str | None] = {
    "bitsandbytes": None,
    "bitsandbytes-nf4": "nf4",
    "bitsandbytes-fp4": "fp4",
}
# LLM.int8()'s outlier threshold: transformers', TGI's and bitsandbytes' Linear8bitLt default
# for inference.
LLM_INT8_THRESHOLD = 6.0
# Values per absmax scale of the 4-bit codes (bitsandbytes' default).
FOUR_BIT_BLOCK = 64
INSTALL = "pip install 'tgis[bitsandbytes]'"


def _bnb() -> ModuleType:
    """The bitsandbytes package, or a ConfigError naming the extra that installs it."""
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError as err:
        raise ConfigError(
            f"bitsandbytes' quantization needs the bitsandbytes package ({err})", INSTALL
        ) from err


@dataclass(frozen=True)
class LlmInt8Weight:
    """LLM.int8()'s weight: int8 rows with their absolute maxima (bitsandbytes' CB and SCB),
    w[n, k] = cb[n, k] * scb[n] / 127, quantized from the float16 weight as bitsandbytes'
    Int8Params quantizes it."""

    cb: torch.Tensor  # int8 [out, in]
    scb: torch.Tensor  # float32 [out]

    @staticmethod
    def quantize(weight: torch.Tensor) -> LlmInt8Weight:
        functional = _bnb().functional
        cb, scb, _ = functional.int8_vectorwise_quant(weight.to(torch.float16).contiguous())
        return LlmInt8Weight(cb, scb)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.cb.shape[0], self.cb.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        return self.cb.float() * self.scb.float()[:, None] / 127.0


@dataclass(frozen=True)
class FourBitWeight:
    """A 4-bit weight as bitsandbytes stores it: two codes a byte over the flattened weight,
    and its QuantState (each block's absmax, the code book, the shape and the dtype it was
    quantized from, which its kernel computes in)."""

    packed: torch.Tensor  # uint8 [out * in / 2, 1]
    state: Any  # bitsandbytes.functional.QuantState
    quant_type: str  # "nf4" or "fp4"

    @staticmethod
    def quantize(weight: torch.Tensor, quant_type: str) -> FourBitWeight:
        functional = _bnb().functional
        packed, state = functional.quantize_4bit(
            weight.contiguous(), blocksize=FOUR_BIT_BLOCK, quant_type=quant_type
        )
        return FourBitWeight(packed, state, quant_type)

    @property
    def shape(self) -> tuple[int, int]:
        out, cols = self.state.shape
        return (int(out), int(cols))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] (each code times its block's absmax)."""
        return _bnb().functional.dequantize_4bit(self.packed, self.state).float()


BnbWeight = LlmInt8Weight | FourBitWeight


def quantize(method: str, weight: torch.Tensor) -> BnbWeight:
    """`weight` [out, in] in `method`'s canonical form (a BNB_METHODS key)."""
    code = BNB_METHODS[method]
    return LlmInt8Weight.quantize(weight) if code is None else FourBitWeight.quantize(weight, code)


def describe(method: str) -> str:
    """One line for the start-up log and /info."""
    code = BNB_METHODS[method]
    if code is None:
        return (
            f"bitsandbytes LLM.int8(): int8 weights per row, int8 activations with outliers "
            f"beyond {LLM_INT8_THRESHOLD} in float16; lm_head unquantized"
        )
    return f"bitsandbytes {code}, blocks of {FOUR_BIT_BLOCK}; lm_head unquantized"


class LlmInt8Linear(QuantLinear):
    """LLM.int8() (module doc): the output in float16, cast to x's dtype."""

    method = "bitsandbytes"

    def __init__(self, weight: LlmInt8Weight, device: torch.device) -> None:
        _bnb()  # registers the bitsandbytes:: ops
        self.out_features, self.in_features = weight.shape
        self.cb = weight.cb.to(device).contiguous()
        self.scb = weight.scb.to(device=device, dtype=torch.float32)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        a = rows(x).to(torch.float16)
        ops = torch.ops.bitsandbytes
        ca, sca, outliers = ops.int8_vectorwise_quant(a, LLM_INT8_THRESHOLD)
        out, _ = ops.int8_mixed_scaled_mm(a, ca, self.cb, sca, self.scb, outliers, None)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return add_bias(out, bias)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.cb, self.scb)


class FourBitLinear(QuantLinear):
    """4-bit NormalFloat or float codes (module doc), computed in the dtype they were
    quantized from."""

    def __init__(self, weight: FourBitWeight, device: torch.device) -> None:
        self.method = f"bitsandbytes-{weight.quant_type}"
        self.out_features, self.in_features = weight.shape
        self.packed = weight.packed.to(device)
        self.state = copy.copy(weight.state)  # QuantState.to moves its tensors in place
        self.state.to(device)
        self.dtype = weight.state.dtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        bnb = _bnb()
        out = bnb.matmul_4bit(rows(x).to(self.dtype), self.packed.t(), quant_state=self.state)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return add_bias(out, bias)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.packed, self.state.absmax, self.state.code)


def kernel(weight: BnbWeight, device: torch.device) -> QuantLinear:
    """The kernel form of canonical `weight` on `device`."""
    if isinstance(weight, LlmInt8Weight):
        return LlmInt8Linear(weight, device)
    return FourBitLinear(weight, device)


def reference(weight: BnbWeight, x: torch.Tensor) -> torch.Tensor:
    """What `kernel(weight, device)` computes for x [..., in], in plain float32 torch,
    rounded where bitsandbytes rounds: float32 [..., out].

    LLM.int8(): the values of magnitude >= the threshold (outliers) are set aside, each row
    of the rest quantized to int8 (its absmax at 127) with the outliers' columns then zeroed,
    and multiplied exactly in integers, then scaled back; the outliers' columns, whole,
    multiply the dequantized weight in float16."""
    inputs = rows(x)
    if isinstance(weight, LlmInt8Weight):
        a = inputs.to(torch.float16).float()
        large = a.abs() >= LLM_INT8_THRESHOLD
        outliers = large.any(dim=0)
        rest = a.masked_fill(large, 0.0)
        row_max = rest.abs().amax(dim=1, keepdim=True)
        qa = torch.round(rest * (127.0 / row_max.clamp(min=1e-30)))
        qa = qa.masked_fill(outliers[None, :], 0.0)
        exact = qa @ weight.cb.float().t()
        out = exact * row_max * weight.scb.float()[None, :] / (127.0 * 127.0)
        if outliers.any():
            w = weight.dequantize().to(torch.float16).float()
            out = out + a[:, outliers] @ w[:, outliers].t()
        out = out.to(torch.float16)
    else:
        dtype = weight.state.dtype
        w = weight.dequantize().to(dtype).float()
        out = (inputs.to(dtype).float() @ w.t()).to(dtype)
    return out.float().reshape(*x.shape[:-1], weight.shape[0])
