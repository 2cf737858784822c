"""What every quantized kernel is (`QuantLinear`: a weight in one kernel's layout, called as
`gemm.linear` calls a plain weight), and the small helpers kernels share. The kernels themselves
live with their methods: torch's in common/quant.py, bitsandbytes' in common/quant_bnb.py."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Self

import torch
from torch import nn


class QuantLinear(ABC):
    """A quantized [out, in] weight in one kernel's layout: what `gemm.linear` multiplies by."""

    method: str
    in_features: int
    out_features: int

    @abstractmethod
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the weight holds on its device."""

    def as_constants(self) -> Self:
        """A shallow copy whose tensors are `nn.Parameter`s over the same storage: what
        torch.compile's freezing folds into a graph as constants (inductor then lowers the
        kernel's op into its own weight-only GEMM where it has one: paged/compile.py)."""
        frozen = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(frozen, name, nn.Parameter(value, requires_grad=False))
        return frozen


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as the 2-D [rows, in] the kernels take."""
    return x.reshape(-1, x.shape[-1])


def add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias
