"""Quantized weights of the paged forward's projections: what they hold, how they are made, the
kernels that multiply by them, and the pure-torch arithmetic each kernel must equal.

A quantized weight exists in two forms:

- a **canonical** one (`Int8Channels`, `Int4Groups`, `Fp8Channels`): plain tensors in one
  layout whatever the source, so that q, k and v (or gate and up) concatenate into one fused
  projection, a tensor-parallel rank can take its rows or columns, and `dequantize()` gives the
  float weight it stands for. Quantizing a checkpoint's float weights at load (`--quantize
  int8|int4|fp8`) and reading a pre-quantized checkpoint's tensors both end here;
- a **kernel** one (`QuantLinear`): the canonical tensors moved into the layout one kernel reads
  on one device, called as `gemm.linear` calls a plain weight. `reference(weight, x, dtype)`
  computes in float32 from the canonical form what the kernel computes, rounding where the
  kernel rounds: the tests hold each kernel to it.

The kernels are torch's own:

| method | CPU | CUDA |
|---|---|---|
| int8 (weight-only, per output channel) | `aten._weight_int8pack_mm`, bfloat16 activations | the same op at decode's rows, a dequantized weight and cuBLAS beyond them |
| int4 (weight-only, group-wise) | `aten._weight_int4pack_mm_for_cpu`, bfloat16 activations | `aten._weight_int4pack_mm` (tinygemm), bfloat16 activations |
| fp8 (W8A8, per-channel weights, per-token activations) | refused | `torch._scaled_mm` (compute capability 8.9+) |

Activations enter the CPU kernels in bfloat16 whatever the model's dtype: both run ~10x slower
over float32 activations on the 2-core AVX2 CPU of docs/performance.md (a 135M model's decode
matmuls at one row: 94 ms in float32 against 9.6 ms in bfloat16), and the result is cast back
to the model's dtype. Norms, attention and the residual stream stay in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import torch
import torch.nn.functional as F

from tgis.backends.common import quant_bnb
from tgis.backends.common.quant_bnb import BNB_METHODS, BnbWeight
from tgis.backends.common.quant_kernel import QuantLinear
from tgis.backends.common.quant_kernel import add_bias as _add_bias
from tgis.backends.common.quant_kernel import rows as _rows
from tgis.backends.common.quant_kernel import tensor_bytes as _bytes
from tgis.config.checkpoint_quant import CheckpointQuant
from tgis.config.types import QUANTIZE_GROUP_SIZES, QUANTIZE_METHODS, ServeConfig
from tgis.errors import ConfigError

# The widest batch (rows) the int8 weight-only kernel takes: a dot product per output, fast
# where reading the weight is the cost (decode), not where the matmul's arithmetic is (prefill).
# Beyond it the weight is dequantized into the model's dtype for the dense GEMM (cuBLAS, MKL):
# on the 2-core AVX2 CPU the two cross at ~32 rows, and at 256 rows the dense GEMM takes half
# the kernel's time (docs/quantization.md).
INT8_KERNEL_ROWS = 32
# The most a dequantized slice of an int8 weight takes at once on that dense path.
DENSE_SLICE_BYTES = 64 << 20
# The largest finite float8 e4m3 value, and the smallest scale (an all-zero row or token).
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
MIN_SCALE = 1e-12
# The CUDA compute capability whose tensor cores multiply float8 (torch._scaled_mm).
FP8_CAPABILITY = (8, 9)
# CPU kernels' activation dtype (module doc).
CPU_ACTIVATION_DTYPE = torch.bfloat16


# --- canonical forms -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Channels:
    """Weights with one float32 scale per output channel: w[n, k] = q[n, k] * scale[n]."""

    q: torch.Tensor  # [out, in], the subclass's storage dtype
    scale: torch.Tensor  # float32 [out]

    @classmethod
    def cat(cls, parts: Sequence[Self]) -> Self:
        """The parts' rows stacked (a fused projection)."""
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        return self.q.float() * self.scale[:, None]


@dataclass(frozen=True)
class Int8Channels(_Channels):
    """Symmetric int8 per output channel (q int8)."""

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int8Channels:
        """Round `weight` [out, in] to int8 with each row's absolute maximum at 127."""
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=MIN_SCALE)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return Int8Channels(q, scale)


@dataclass(frozen=True)
class Int4Groups:
    """Asymmetric 4-bit weights in groups of `group` input columns:
    w[n, perm[k]] = (q[n, k] - zero[k // group, n]) * scale[k // group, n].

    `perm` (GPTQ's act-order, None: the identity) lists the input columns in the order the
    groups cover them: a kernel multiplies x[:, perm] by the groups laid end to end."""

    q: torch.Tensor  # uint8 [out, in], values 0..15
    scale: torch.Tensor  # float32 [in / group, out]
    zero: torch.Tensor  # float32 [in / group, out], values 0..15 (integers in every format read)
    group: int
    perm: torch.Tensor | None = None  # int64 [in]

    @staticmethod
    def quantize(weight: torch.Tensor, group: int) -> Int4Groups:
        """Round `weight` [out, in] group by group to 16 levels spanning its min and max (the
        range widened to hold 0, so a zero weight stays zero), with an integer zero point."""
        out, cols = weight.shape
        if cols % group:
            raise ValueError(f"{cols} input columns are not a multiple of group size {group}")
        w = weight.float().reshape(out, cols // group, group)
        low = w.amin(dim=-1).clamp(max=0.0)
        high = w.amax(dim=-1).clamp(min=0.0)
        scale = ((high - low) / 15.0).clamp(min=MIN_SCALE)
        zero = torch.round(-low / scale).clamp(0, 15)
        q = (torch.round(w / scale[..., None]) + zero[..., None]).clamp(0, 15)
        return Int4Groups(
            q.reshape(out, cols).to(torch.uint8), scale.t().contiguous(), zero.t().contiguous(),
            group,
        )  # fmt: skip

    @staticmethod
    def cat(parts: Sequence[Int4Groups]) -> Int4Groups:
        """The parts' rows stacked: they must share the group size and the column order."""
        first = parts[0]
        for p in parts[1:]:
            if p.group != first.group or not _same_perm(p.perm, first.perm):
                raise ValueError("fused projections must share their group size and column order")
        return Int4Groups(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts], dim=1),
            torch.cat([p.zero for p in parts], dim=1),
            first.group,
            first.perm,
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in], columns in the input's order."""
        scale = self.scale.t().repeat_interleave(self.group, dim=1)
        zero = self.zero.t().repeat_interleave(self.group, dim=1)
        w = (self.q.float() - zero) * scale
        if self.perm is None:
            return w
        ordered = torch.empty_like(w)
        ordered[:, self.perm] = w
        return ordered


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(torch.equal(a, b))


@dataclass(frozen=True)
class Fp8Channels(_Channels):
    """float8 e4m3 per output channel (q float8_e4m3fn)."""

    @staticmethod
    def quantize(weight: torch.Tensor) -> Fp8Channels:
        """Scale each row of `weight` [out, in] so its absolute maximum is e4m3's largest value."""
        w = weight.float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Fp8Channels(q, scale)


@dataclass(frozen=True)
class Fp8Blocks:
    """float8 e4m3 with one float32 scale per block of `block` = (rows, columns):
    w[n, k] = q[n, k] * scale[n // rows, k // columns] (Qwen3-FP8's and DeepSeek-V3's layout;
    edge blocks may be partial). Served as `to_channels()` makes it."""

    q: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [ceil(out / rows), ceil(in / columns)]
    block: tuple[int, int]

    def scales(self) -> torch.Tensor:
        """Each weight's scale, float32 [out, in]."""
        rows, cols = self.block
        out, width = self.q.shape
        scale = self.scale.float().repeat_interleave(rows, dim=0)[:out]
        return scale.repeat_interleave(cols, dim=1)[:, :width]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        return self.q.float() * self.scales()

    def to_channels(self) -> Fp8Channels:
        """The same weights with one scale per output channel, the largest of the row's
        blocks: the values of the other blocks are rounded to e4m3 once more (float8 keeps its
        relative precision down to 2**-6 of the range, so the loss is one more rounding).
        torch's block-scaled GEMM takes the activations in blocks too, and only on Hopper."""
        scales = self.scales()
        channel = scales.amax(dim=1).clamp(min=MIN_SCALE)
        q = (self.q.float() * scales / channel[:, None]).clamp(-FP8_MAX, FP8_MAX)
        return Fp8Channels(q.to(torch.float8_e4m3fn), channel)


Canonical = Int8Channels | Int4Groups | Fp8Channels | BnbWeight

# The group sizes torch's int4 kernels take (CPU and CUDA alike).
INT4_KERNEL_GROUPS = (32, 64, 128, 256)


def kernel_groups(weight: Int4Groups) -> Int4Groups:
    """`weight` in groups torch's int4 kernels take: a group wider than they take (or a whole
    row, one scale per output channel) is cut into equal groups sharing its scale and zero
    point, which is exact. A ValueError where no kernel group size divides the stored one."""
    if weight.group in INT4_KERNEL_GROUPS:
        return weight
    size = next((g for g in reversed(INT4_KERNEL_GROUPS) if weight.group % g == 0), None)
    if size is None:
        raise ValueError(
            f"int4 groups of {weight.group} columns: torch's int4 kernels take groups of "
            f"{', '.join(map(str, INT4_KERNEL_GROUPS))} (or a multiple of one)"
        )
    times = weight.group // size
    return Int4Groups(
        weight.q,
        weight.scale.repeat_interleave(times, dim=0),
        weight.zero.repeat_interleave(times, dim=0),
        size,
        weight.perm,
    )


def narrow(weight: Canonical, dim: int, ranges: Sequence[tuple[int, int]]) -> Canonical:
    """The part of canonical `weight` a tensor-parallel rank holds: the (start, stop) ranges of
    its output rows (dim 0) or input columns (dim 1), concatenated in order. Scales follow
    their rows or columns; a range must hold whole groups or blocks."""

    def take(t: torch.Tensor, axis: int, unit: int = 1) -> torch.Tensor:
        for a, b in ranges:
            if a % unit or (b % unit and b != weight.shape[dim]):
                raise ValueError(
                    f"a shard's range {a}:{b} splits a quantization group of {unit} "
                    f"{'rows' if dim == 0 else 'columns'}"
                )
        pieces = [t.narrow(axis, a // unit, -(-b // unit) - a // unit) for a, b in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=axis)

    if isinstance(weight, Int4Groups):
        if dim == 0:
            return Int4Groups(
                take(weight.q, 0), take(weight.scale, 1), take(weight.zero, 1), weight.group,
                weight.perm,
            )  # fmt: skip
        if weight.perm is not None:
            raise ValueError(
                "act-order int4 weights (GPTQ desc_act) cannot be split by input columns: "
                "their groups cover columns in another order"
            )
        return Int4Groups(
            take(weight.q, 1),
            take(weight.scale, 0, weight.group),
            take(weight.zero, 0, weight.group),
            weight.group,
        )
    if dim == 0:
        return type(weight)(take(weight.q, 0), take(weight.scale, 0))
    return type(weight)(take(weight.q, 1), weight.scale)


def cat(parts: Sequence[Canonical]) -> Canonical:
    """Concatenate canonical weights of one kind along their output rows."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        raise ValueError(
            f"cannot fuse weights quantized differently: {sorted(k.__name__ for k in kinds)}"
        )
    return parts[0].cat(parts)  # type: ignore[arg-type]


# --- kernels -------------------------------------------------------------------------------


def _int8_activations(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the int8 kernel reads activations and scales in (module doc)."""
    return CPU_ACTIVATION_DTYPE if device.type == "cpu" else dtype


def _scales_and_offsets(weight: Int4Groups) -> torch.Tensor:
    """int4's scales and offsets as torch's kernels take them, [in / group, out, 2] bfloat16:
    both compute w = (q - 8) * scale + offset per group, so a zero point z is the offset
    (8 - z) * scale, rounded with the scale to bfloat16 once."""
    offset = (8.0 - weight.zero) * weight.scale
    return torch.stack([weight.scale, offset], dim=-1).to(torch.bfloat16).contiguous()


def _fp8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, in] -> e4m3 rows and their float32 scales [M, 1] (one per token)."""
    scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    q = (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Int8Linear(QuantLinear):
    """int8 weight-only GEMM (module doc's table). On the CPU the kernel reads bfloat16
    activations and scales; on CUDA the model's dtype. Beyond INT8_KERNEL_ROWS rows the weight
    is dequantized into the model's `dtype` and multiplied densely, except inside a compiled
    decode graph: there inductor lowers the kernel's op into its own GEMM for every batch, and
    a branch on the batch would guard the graph at the threshold (paged/compile.py)."""

    method = "int8"

    def __init__(
        self,
        weight: Int8Channels,
        device: torch.device,
        act_dtype: torch.dtype,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.device = device
        self.act_dtype = act_dtype
        self.dtype = dtype or act_dtype
        self.q = weight.q.to(device).contiguous()
        # The kernel multiplies by the scale in the activations' dtype: round it once here.
        self.scale = weight.scale.to(device=device, dtype=act_dtype)
        self.dense_scale = weight.scale.to(device=device, dtype=self.dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = _rows(x)
        # is_compiling first: a shape test traced in a graph would guard it on the batch.
        if not torch.compiler.is_compiling() and rows.shape[0] > INT8_KERNEL_ROWS:
            out = self._dense(rows.to(self.dtype))
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows.to(self.act_dtype), self.q, self.scale)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return _add_bias(out, bias)

    def _dense(self, rows: torch.Tensor) -> torch.Tensor:
        """rows @ the dequantized weight, a slice of output channels at a time so that the
        dequantized copy stays under DENSE_SLICE_BYTES (a vocabulary's int8 lm_head)."""
        per_channel = self.in_features * rows.element_size()
        width = max(1, DENSE_SLICE_BYTES // per_channel)
        parts = [
            F.linear(rows, self.q[start : start + width].to(rows.dtype))
            * self.dense_scale[start : start + width]
            for start in range(0, self.out_features, width)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    @property
    def nbytes(self) -> int:
        return _bytes(self.q, self.scale, self.dense_scale)


def _inner_k_tiles(cols: int) -> int:
    """tinygemm's tiles along the input (CUDA int4): the most of 8, 4, 2 that divide it in 16s."""
    for tiles in (8, 4, 2):
        if cols % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"CUDA's int4 kernel needs input widths in multiples of 32, not {cols}")


class Int4Linear(QuantLinear):
    """Group-wise int4 weight-only GEMM (module doc's table), bfloat16 activations and the
    scales and offsets of `_scales_and_offsets`."""

    method = "int4"

    def __init__(self, weight: Int4Groups, device: torch.device) -> None:
        out, cols = weight.shape
        self.out_features, self.in_features = out, cols
        self.device = device
        self.group = weight.group
        if out % 16 or cols % weight.group:
            raise ValueError(
                f"int4 kernels need output widths in multiples of 16 and input widths in "
                f"multiples of the group size {weight.group}; this projection is [{out}, {cols}]"
            )
        self.scales_and_zeros = _scales_and_offsets(weight).to(device)
        self.perm = None if weight.perm is None else weight.perm.to(device)
        q = weight.q.to(device)
        if device.type == "cuda":
            self.tiles = _inner_k_tiles(cols)
            pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, self.tiles)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = _rows(x).to(torch.bfloat16)
        if self.perm is not None:
            rows = rows[:, self.perm]
        if self.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(
                rows, self.packed, self.group, self.scales_and_zeros
            )
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.packed, self.group, self.scales_and_zeros
            )
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return _add_bias(out, bias)

    @property
    def nbytes(self) -> int:
        return _bytes(self.packed, self.scales_and_zeros, self.perm)


class Fp8Linear(QuantLinear):
    """W8A8 float8 GEMM through torch._scaled_mm: each token's activations scaled to e4m3's
    range on the fly (per-token scales), the weight's scale per output channel. The result is
    in the model's dtype."""

    method = "fp8"

    def __init__(self, weight: Fp8Channels, device: torch.device, out_dtype: torch.dtype) -> None:
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < FP8_CAPABILITY:
                raise ConfigError(
                    f"fp8 weights multiply through torch._scaled_mm on GPUs of compute "
                    f"capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later (Ada, Hopper, "
                    f"Blackwell); {device} is {major}.{minor}",
                    "use --quantize int8 or int4 on this GPU, or serve the float checkpoint",
                )
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        # _scaled_mm takes the weight as the column-major [in, out] operand: a transposed view.
        self.q = weight.q.to(device).contiguous()
        self.scale = weight.scale.to(device=device, dtype=torch.float32)[None, :]  # [1, out]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        q, scale = _fp8_rows(_rows(x))
        out = torch._scaled_mm(
            q, self.q.t(), scale_a=scale, scale_b=self.scale, out_dtype=self.out_dtype
        )
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return _add_bias(out, bias)

    @property
    def nbytes(self) -> int:
        return _bytes(self.q, self.scale)


@dataclass(frozen=True)
class Quantization:
    """How a model's projections are quantized: `method` (`--quantize`'s value, or the format
    of a pre-quantized checkpoint) and, for int4, the group size. The lm_head of int4 models is
    int8 (4 bits cost a vocabulary's logits too much); int8 and fp8 keep it in the model's
    dtype, as vLLM does (an int8 lm_head turns near-tied greedy choices: docs/quantization.md).
    `scheme`: a pre-quantized checkpoint's (common/quant_checkpoint.py),
    whose projections are read as stored and whose lm_head stays as stored."""

    method: str
    group_size: int | None = None
    scheme: CheckpointQuant | None = None

    def __post_init__(self) -> None:
        if self.scheme is not None:
            if self.method != self.scheme.method:
                raise ValueError(f"{self.method!r} is not the checkpoint's {self.scheme.method!r}")
            return
        if self.method not in QUANTIZE_METHODS:
            raise ValueError(f"{self.method!r} is not one of {', '.join(QUANTIZE_METHODS)}")
        if self.method == "int4" and self.group_size not in QUANTIZE_GROUP_SIZES:
            raise ValueError(
                f"int4 groups are {QUANTIZE_GROUP_SIZES} columns, not {self.group_size}"
            )

    @classmethod
    def of(cls, config: ServeConfig) -> Quantization | None:
        """The quantization `config` asks the paged engine to compute at load (`--quantize`),
        or None (a pre-quantized checkpoint's is read with its weights)."""
        if config.quantize is None or config.quantized_checkpoint:
            return None
        return cls(config.quantize, config.quantize_group_size)

    def quantize(self, weight: torch.Tensor) -> Canonical:
        """A projection's float weight [out, in] in this method's canonical form."""
        if self.scheme is not None:
            raise ValueError(f"a {self.method} checkpoint's projections are read as stored")
        if self.method == "int8":
            return Int8Channels.quantize(weight)
        if self.method == "int4":
            assert self.group_size is not None
            return Int4Groups.quantize(weight, self.group_size)
        if self.method in BNB_METHODS:
            return quant_bnb.quantize(self.method, weight)
        return Fp8Channels.quantize(weight)

    def head(self, weight: torch.Tensor) -> Canonical | None:
        """The lm_head's canonical form, or None where it stays in the model's dtype."""
        if self.method != "int4" or self.scheme is not None:
            return None
        return Int8Channels.quantize(weight)

    def describe(self) -> str:
        """One line for the start-up log and /info."""
        if self.scheme is not None:
            return f"{self.scheme.describe()}; lm_head as stored"
        if self.method == "int4":
            return f"int4 weight-only, groups of {self.group_size}; lm_head int8"
        if self.method == "int8":
            return "int8 weight-only, per output channel; lm_head unquantized"
        if self.method in BNB_METHODS:
            return quant_bnb.describe(self.method)
        return "fp8 e4m3 weights per output channel, activations per token; lm_head unquantized"


def kernel(weight: Canonical, device: torch.device, dtype: torch.dtype) -> QuantLinear:
    """The kernel form of canonical `weight` on `device` for a model computing in `dtype`."""
    if isinstance(weight, Int8Channels):
        return Int8Linear(weight, device, _int8_activations(device, dtype), dtype)
    if isinstance(weight, Int4Groups):
        return Int4Linear(weight, device)
    if isinstance(weight, Fp8Channels):
        return Fp8Linear(weight, device, dtype)
    return quant_bnb.kernel(weight, device)


def reference(
    weight: Canonical, x: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """What `kernel(weight, device, dtype)` computes for x [..., in], in plain float32 torch
    from the canonical values, rounded where the kernel rounds (activations, scales and
    outputs to the dtype it reads and writes): float32 [..., out]. `device`: x's by default."""
    if isinstance(weight, quant_bnb.LlmInt8Weight | quant_bnb.FourBitWeight):
        return quant_bnb.reference(weight, x)
    device = device or x.device
    rows = _rows(x)
    if isinstance(weight, Int8Channels):
        wide = rows.shape[0] > INT8_KERNEL_ROWS
        act = dtype if wide else _int8_activations(device, dtype)
        w = weight.q.float() * weight.scale.to(act).float()[:, None]
        out = (rows.to(act).float() @ w.t()).to(act)
    elif isinstance(weight, Int4Groups):
        pairs = _scales_and_offsets(weight).float()
        scale, offset = (pairs[..., i].t().repeat_interleave(weight.group, dim=1) for i in (0, 1))
        w = (weight.q.float() - 8.0) * scale + offset
        inputs = rows.to(torch.bfloat16).float()
        if weight.perm is not None:
            inputs = inputs[:, weight.perm]
        out = (inputs @ w.t()).to(torch.bfloat16)
    else:
        q, scale = _fp8_rows(rows)
        out = ((q.float() * scale) @ weight.dequantize().t()).to(dtype)
    return out.float().reshape(*x.shape[:-1], weight.shape[0])
