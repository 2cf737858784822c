"""The CPU's GEMM for a decoder's projections: ATen's (MKL) over [out, in] weights, or oneDNN's
over weights packed once at load into its own blocked layout.

A token's cost on a CPU is reading the weights, so what counts is the rate a GEMM reads them at
decode's few rows. On the 2-core AMD EPYC (AVX2) of docs/performance.md, MKL's float32 GEMM
reads a [3072, 1024] weight at ~6 GB/s for 16 rows and ~18 GB/s for one; oneDNN's packed kernel
at ~12 and ~25 GB/s (both ~7% slower than MKL at prefill's 512 rows). Other CPUs order them
differently, so `choose_packing` times both on a decoder layer's matmuls at decode's batch
sizes, as the dtype probe (common/device.py) times float32 against bfloat16, and packs only
where oneDNN is clearly faster.

A packed weight is an opaque oneDNN tensor: `linear` is the only thing that reads it. Packing is
for the eager forwards on a CPU: CUDA runs cuBLAS over [out, in] weights, and the compiled
decode (paged/compile.py) folds the plain weights into its graphs and packs them itself.
"""

from __future__ import annotations

import functools
import math
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tgis.backends.common.quant import QuantLinear

# The decode-shaped work the probes time: batch sizes, and rounds of each (the fastest counts).
PROBE_BATCHES = (1, 16)
PROBE_ROUNDS = 5
# The smallest layer the packing probe times, (hidden, intermediate): below it a matmul takes
# microseconds and the order of two kernels is noise (the tests' tiny models get the choice a
# 0.5B model would).
PACKING_PROBE_FLOOR = (1024, 2816)
# oneDNN must beat MKL by this factor to be chosen: a packed weight also costs prefill ~7% and a
# second copy of a tied lm_head.
PACKING_MARGIN = 0.9
# The batch size oneDNN packs for (its blocking suits a few rows to a few dozen).
PACK_BATCH = 16


def packing_available() -> bool:
    """Whether this torch has oneDNN's packed linear (the CPU builds on PyPI do)."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] on the CPU in oneDNN's blocked layout, what `linear` reads. A dtype
    the CPU's oneDNN cannot run (bfloat16 without AVX-512 or AVX-NE-CONVERT) is a
    RuntimeError naming what is missing."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH)


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantLinear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear over a plain [out, in] weight, a packed one (`pack`) or a quantized one
    (common/quant.py): x [..., in] -> [..., out]."""
    if not isinstance(weight, torch.Tensor):
        return weight(x, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")
    return F.linear(x, weight, bias)


def decode_matmul_seconds(
    dtype: torch.dtype, hidden: int, intermediate: int, packed: bool = False
) -> float:
    """Seconds one decoder layer's matmuls (fused q/k/v, o, fused gate/up, down) take in
    `dtype` at each of PROBE_BATCHES, the fastest of PROBE_ROUNDS rounds each, added up; over
    packed weights with `packed`. Random weights: only the time counts."""
    generator = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(rows, cols, generator=generator).to(dtype)
        for rows, cols in (
            (3 * hidden, hidden),  # fused q/k/v (at most; GQA makes it smaller)
            (hidden, hidden),  # o
            (2 * intermediate, hidden),  # fused gate/up
            (hidden, intermediate),  # down
        )
    ]
    total = 0.0
    with torch.inference_mode():
        if packed:
            weights = [pack(w) for w in weights]
        for batch in PROBE_BATCHES:
            x = torch.randn(batch, hidden, generator=generator).to(dtype)
            wide = torch.randn(batch, intermediate, generator=generator).to(dtype)
            best = math.inf
            for _ in range(PROBE_ROUNDS + 1):  # the first round warms the kernels up
                start = time.perf_counter()
                for w in weights:
                    linear(wide if w.shape[1] == intermediate else x, w)
                best = min(best, time.perf_counter() - start)
            total += best
    return total


@functools.cache
def choose_packing(dtype: torch.dtype, hidden: int, intermediate: int) -> tuple[bool, str]:
    """Whether a model whose layers are `hidden` wide with an MLP of `intermediate` should run
    its projections over packed weights on this CPU in `dtype`, and why: both GEMMs time a
    layer's matmuls (at least PACKING_PROBE_FLOOR's) at decode's batch sizes on this thread and
    its OpenMP team; oneDNN is chosen where it takes at most PACKING_MARGIN of MKL's time.
    Measured once per process and shape."""
    name = str(dtype).removeprefix("torch.")
    if not packing_available():
        return False, "this torch has no oneDNN packed linear"
    hidden = max(hidden, PACKING_PROBE_FLOOR[0])
    intermediate = max(intermediate, PACKING_PROBE_FLOOR[1])
    try:
        onednn = decode_matmul_seconds(dtype, hidden, intermediate, packed=True)
    except RuntimeError as exc:
        return False, f"oneDNN cannot pack {name} weights here ({str(exc).splitlines()[0]})"
    aten = decode_matmul_seconds(dtype, hidden, intermediate)
    measured = f"decode-shaped {name} matmuls: oneDNN packed {onednn * 1e3:.2f} ms, MKL {aten * 1e3:.2f} ms"
    if onednn <= aten * PACKING_MARGIN:
        return True, f"{measured}; packed is {aten / onednn:.2f}x faster here"
    return False, f"{measured}; packed is not {1 / PACKING_MARGIN:.2f}x faster here"
