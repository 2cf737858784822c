"""A decoder-only model's weights in the layouts the lean forwards compute with, and the pieces
of its forward every family shares.

`DecoderWeights` takes the HF model's weights, not its modules: per layer one fused QKV matmul
(with biases where the family has them), rotary embedding from precomputed cos/sin tables, a
gate/up matmul (fused on CUDA and wherever the checkpoint fuses it), the norms' scales, and the
MLP: dense, or a mixture of experts (models/moe.py). What a family changes is read from its
config and modules once, at load (models/families.py names the families and their traits):

- where the norms sit: before attention and MLP (llama), before and after both (Gemma's
  sandwich), or after both only (OLMo 2); Gemma's norms scale by (1 + w);
- q/k RMSNorm per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2);
- multipliers: the embeddings' (Gemma's sqrt(hidden), Granite's), the residual's (Granite), the
  softmax scale (Gemma's query_pre_attn_scalar, Granite's attention_multiplier), the logits'
  divisor (Granite) and soft-capping of attention and final logits (Gemma 2);
- rope: one table per rope the layers use (Gemma 3's local and global bases), partial rotary
  (Phi), and LongRoPE's short and long factors (Phi-3): positions below
  original_max_position_embeddings take the short factors, later ones the long, a rule of the
  position alone, so a key is the same whichever step computed it (prefix caching, chunked
  prefill and batching stay exact). transformers' forward over a KV cache does the same step
  by step; its generate() instead recomputes a sequence's whole cache with the long factors
  once the sequence crosses that length (keys no cached prefix could share), so the two
  agree token for token while a sequence stays below it.

The paged forward (paged/forward.py) and the fixed-shape forward (static/kv.py) subclass it and
differ only in how attention reads the cache. Fusing re-points the HF modules' weights at slices
of the fused tensors, so the model keeps working (and tests can compare against it) without a
second copy of the weights.

With `packed` (a CPU whose oneDNN GEMM reads weights faster than MKL's: common/gemm.py) the
projections and the lm_head are packed into oneDNN's layout instead, and the HF modules' packed
weights move to the meta device: one copy of the weights stays, and the HF model no longer
runs. A tied lm_head is packed as a second copy beside the embeddings it shares.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from tgis.backends.common import quant
from tgis.backends.common.gemm import linear, pack
from tgis.backends.common.kv import KVShape, sliding_windows
from tgis.backends.common.quant import Quantization, QuantLinear, kernel
from tgis.backends.common.quant_checkpoint import model_quantization, stored
from tgis.backends.models.families import Family, family_of_model
from tgis.backends.models.moe import MoeMlp, moe_block, released
from tgis.backends.models.mrope import rotate_tables, sections

if TYPE_CHECKING:
    from tgis.backends.models.parallel import TensorParallel
    from tgis.backends.paged.lora import LoraStep

# Fuse gate and up into one matmul on CUDA (fewer launches). On CPU two fp32 GEMMs of
# [intermediate, hidden] beat one of [2 * intermediate, hidden] by ~5% from 32 rows up and tie
# below (MKL, AVX-512, 2 cores; SmolLM2-135M shape), so they stay apart there unless the
# checkpoint stores them fused (Phi-3).
FUSE_GATE_UP = {"cuda": True}


class LayerUpdate(Protocol):
    """A per-step update of a layer's projections (the paged engine's LoRA: paged.lora)."""

    def add(self, out: torch.Tensor, x: torch.Tensor, name: str) -> None:
        """out [N, out] += the update of projection `name` from its input x [N, in]."""
        ...


def native_kv_shape(model: PreTrainedModel) -> KVShape:
    """What one layer of `model` keeps per token in a KV cache."""
    config = model.config
    attn = model.model.layers[0].self_attn
    return KVShape(
        config.num_hidden_layers, config.num_key_value_heads, attn.head_dim, attn.head_dim
    )


# A projection's weight as `gemm.linear` takes it: a tensor [out, in] (plain or oneDNN-packed) or
# a quantized one (common/quant.py).
Weight = torch.Tensor | QuantLinear


def _fuse(
    linears: list[nn.Linear],
    transposed: bool,
    convert: Callable[[list[nn.Linear]], Weight] | None = None,
) -> tuple[Weight, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `linears` along the output dimension, then make
    each module's parameters views of the fused tensors (one copy of the weights in memory).

    Returns the weight as `gemm.linear` takes it, [out, in]. With `transposed` it is a view of a
    contiguous [in, out] tensor: MKL's fp32 GEMM is faster on that layout for the few-row
    inputs of decode (~20% at one row, ~5% at 16 measured on AVX-512); bf16 and CUDA GEMMs
    are not, so they keep [out, in]. With `convert` it is what that makes of the linears
    (oneDNN's packed copy of their fused weight, gemm.pack, or a quantized one, common/quant.py,
    from their float weights or from what a pre-quantized checkpoint stored for them), and the
    modules' weights move to the meta device (module doc).
    """
    weight: Weight
    if convert is not None:
        weight = convert(linears)
    elif transposed:
        storage = torch.cat([m.weight.t() for m in linears], dim=1)  # [in, out], contiguous
        weight = storage.t()
    else:
        weight = torch.cat([m.weight for m in linears])
    bias = None
    if any(m.bias is not None for m in linears):
        bias = torch.cat(
            [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
        )
    offset = 0
    for m in linears:
        rows = m.out_features
        if convert is not None:
            m.weight = released(m.weight)
        else:
            assert isinstance(weight, torch.Tensor)
            m.weight = nn.Parameter(weight[offset : offset + rows], requires_grad=False)
        if m.bias is not None and bias is not None:
            m.bias = nn.Parameter(bias[offset : offset + rows], requires_grad=False)
        offset += rows
    return weight, bias


@dataclass(frozen=True)
class DenseMlp:
    """A gated MLP: one fused [2 * intermediate, hidden] gate/up weight, or gate's and up's
    apart (see FUSE_GATE_UP), and down's."""

    gate_up_w: tuple[Weight, ...]
    gate_up_b: tuple[torch.Tensor | None, ...]
    down_w: Weight
    down_b: torch.Tensor | None


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors: fused [out, in] weights and the norms' scales (None where
    the family has no such norm)."""

    input_norm: torch.Tensor | None  # before attention
    qkv_w: Weight  # [(heads + 2 kv_heads) * head_dim, hidden]
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim] per head, or [heads * head_dim] whole
    k_norm: torch.Tensor | None
    o_w: Weight
    o_b: torch.Tensor | None
    attn_out_norm: torch.Tensor | None  # on attention's output, before the residual
    mlp_norm: torch.Tensor | None  # before the MLP
    mlp: DenseMlp | MoeMlp
    mlp_out_norm: torch.Tensor | None  # on the MLP's output, before the residual
    window: int | None  # sliding window (None: full attention)
    rope: int = 0  # which of the model's rope tables the layer rotates with


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as HF applies it: x * cos + rotate_half(x) * sin, over the first
    cos.shape[-1] dimensions of x (partial rotary), the rest passed through."""
    width = cos.shape[-1]
    if width != x.shape[-1]:
        return torch.cat((_rotate(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    half = width // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _constant(value: object) -> object:
    """`value` with every tensor inside it (tuples, dataclasses and quantized kernels) an
    `nn.Parameter`."""
    if isinstance(value, torch.Tensor):
        return nn.Parameter(value, requires_grad=False)
    if isinstance(value, QuantLinear):
        return value.as_constants()
    if isinstance(value, tuple):
        return tuple(_constant(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Fields set in __post_init__ (init=False) are derived again by replace.
        fields = [f for f in dataclasses.fields(value) if f.init]
        return dataclasses.replace(
            value, **{f.name: _constant(getattr(value, f.name)) for f in fields}
        )
    return value


def _epsilon(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


# One layer's attention inside `DecoderWeights.layers_over`: (index, layer, q, k, v) -> out.
LayerAttention = Callable[
    [int, LayerWeights, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


class DecoderWeights:
    """A decoder-only model's weights in the layouts the lean forwards run (see the module
    doc). The forwards over a paged pool (paged/forward.py) and over a static cache
    (static/kv.py) share it and differ only in how attention reads the cache."""

    @torch.no_grad()
    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        max_positions: int,
        fuse_gate_up: bool | None = None,
        transposed: bool | None = None,
        packed: bool = False,
        quantization: Quantization | None = None,
    ) -> None:
        """Take `model`'s weights (re-pointing its modules at the fused copies) and precompute
        rope tables for `max_positions` positions. fuse_gate_up / transposed: weight
        layouts, by default the faster ones measured for the device and dtype (see _fuse).
        packed: the projections and lm_head in oneDNN's layout (module doc; CPU only).
        quantization: the projections (and lm_head, as it says) quantized at load."""
        self.family: Family = family_of_model(model)
        config, base = model.config, model.model
        self.device = device
        attn = base.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.hidden = config.hidden_size
        self.eps = _epsilon(base.norm)
        self.dtype = base.embed_tokens.weight.dtype
        if packed and self.device.type != "cpu":
            raise ValueError(f"packed weights are for the CPU's oneDNN GEMM, not {self.device}")
        # A pre-quantized checkpoint's model carries its quantization (common/quant_checkpoint.py).
        loaded = model_quantization(model)
        if loaded is not None and quantization is not None and quantization != loaded:
            raise ValueError(
                f"the model's checkpoint is quantized ({loaded.describe()}); it cannot be "
                f"quantized again as {quantization.method}"
            )
        quantization = quantization or loaded
        if packed and quantization is not None:
            raise ValueError("quantized weights have their own kernels' layouts; pack plain ones")
        self.packed = packed
        self.quantization = quantization
        if transposed is None:
            transposed = self.device.type == "cpu" and self.dtype == torch.float32
        self.transposed = transposed and not packed
        if fuse_gate_up is None:
            fuse_gate_up = FUSE_GATE_UP.get(self.device.type, False)
        # Quantized kernels take gate and up fused: one call and one activation cast.
        self.fuse_gate_up = fuse_gate_up or self.family.fused_checkpoint or quantization is not None
        # Multipliers (1.0 and None: the family has none).
        traits = self.family.traits(config)
        self.embed_scale = float(torch.tensor(traits.embed_scale, dtype=self.dtype).item())
        self.embed_scale_prefixes = traits.embed_scale_prefixes
        self.residual_scale = traits.residual_scale
        self.logits_divisor = traits.logits_divisor
        self.attn_softcap = traits.attn_softcap
        self.final_softcap = traits.final_softcap
        self.projection_qk_norm = traits.projection_qk_norm
        self.act: Callable[[torch.Tensor], torch.Tensor] = self._activation(base.layers[0])
        windows = sliding_windows(model) or [None] * config.num_hidden_layers
        self.ropes = self._rope_tables(model, max_positions)
        # Multimodal rope (models/mrope.py): the stream of each rotary dimension; None: the
        # model rotates with one position per row.
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        section = rope.get("mrope_section") if isinstance(rope, dict) else None
        self.mrope = sections(section, self.ropes[0][0].shape[1]) if section else None
        self.layers = [self._layer(layer, windows[i]) for i, layer in enumerate(base.layers)]
        self.windows = sorted({layer.window for layer in self.layers}, key=lambda w: w or 0)
        self.embed = base.embed_tokens.weight
        # Tensor parallelism (paged/tensor_parallel.py): this rank's slices, and the collectives.
        self.parallel: TensorParallel | None = None
        self.final_norm = self._norm_scale(base.norm)
        self.lm_head = self._head(model)

    def _head(self, model: PreTrainedModel) -> Weight:
        """The lm_head's weight [vocab, hidden], packed with `packed` or quantized as
        `quantization` says (a tied one as a copy); a `*ForSequenceClassification` model's
        `score` [labels, hidden], the head it has over the same final norm."""
        head = model.get_output_embeddings()
        if head is None:
            head = model.score
        weight: Weight
        if self.packed:
            weight = pack(head.weight)
        else:
            canon = stored(head)
            if canon is None and self.quantization is not None:
                canon = self.quantization.head(head.weight)
            if canon is None:
                return head.weight
            weight = kernel(canon, self.device, self.dtype)
        if head.weight is not model.get_input_embeddings().weight:
            head.weight = released(head.weight)
        return weight

    def _quantizer(self) -> Callable[[list[nn.Linear]], Weight] | None:
        """Linears -> their fused weight's kernel under `quantization` (None: unquantized): the
        float weights quantized, or what a pre-quantized checkpoint stored for them (a fused
        group the checkpoint left in float stays float)."""
        method = self.quantization
        if method is None:
            return None

        def quantize(linears: list[nn.Linear]) -> Weight:
            parts = [stored(m) for m in linears]
            if method.scheme is None:
                canon = method.quantize(torch.cat([m.weight for m in linears]))
            elif all(p is not None for p in parts):
                canon = quant.cat([p for p in parts if p is not None])
            elif any(p is not None for p in parts):
                raise ValueError(
                    "the checkpoint stores some of the projections fused here quantized and "
                    "others in float"
                )
            else:
                return torch.cat([m.weight for m in linears])
            return kernel(canon, self.device, self.dtype)

        return quantize

    def _fused(self, linears: list[nn.Linear]) -> tuple[Weight, torch.Tensor | None]:
        """`linears` fused into one projection in this model's weight layout (see _fuse)."""
        if self.packed:
            return _fuse(
                linears, self.transposed, lambda ls: pack(torch.cat([m.weight for m in ls]))
            )
        return _fuse(linears, self.transposed, self._quantizer())

    @property
    def cos(self) -> torch.Tensor:
        """The first rope table's cos [positions, rotary_dim] (the only one of the llama
        family's models)."""
        return self.ropes[0][0]

    @property
    def sin(self) -> torch.Tensor:
        return self.ropes[0][1]

    @staticmethod
    def _activation(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        block = moe_block(layer)
        mlp = block.experts[0] if block is not None else layer.mlp
        act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
        if act is None:
            raise ValueError(f"{type(mlp).__name__} has no activation the forward can call")
        return act

    def _norm_scale(self, norm: nn.Module | None) -> torch.Tensor | None:
        """The scale RMSNorm `norm` multiplies by: its weight, or 1 + weight (Gemma)."""
        if norm is None:
            return None
        if _epsilon(norm) != self.eps:
            raise ValueError("the forward needs one RMSNorm epsilon for all norms")
        if self.family.norm_offset:
            return (1.0 + norm.weight.float()).to(norm.weight.dtype)
        return norm.weight

    def _layer(self, layer: nn.Module, window: int | None) -> LayerWeights:
        attn = layer.self_attn
        if hasattr(attn, "qkv_proj"):  # fused in the checkpoint (Phi-3)
            qkv_w, qkv_b = self._fused([attn.qkv_proj])
        else:
            qkv_w, qkv_b = self._fused([attn.q_proj, attn.k_proj, attn.v_proj])
        o_w, o_b = self._fused([attn.o_proj])
        block = moe_block(layer)
        mlp = MoeMlp.of(block, self._quantizer()) if block is not None else self._dense(layer.mlp)
        norms = self.family.norms(layer)
        return LayerWeights(
            input_norm=self._norm_scale(norms.input),
            qkv_w=qkv_w,
            qkv_b=qkv_b,
            q_norm=self._norm_scale(getattr(attn, "q_norm", None)),
            k_norm=self._norm_scale(getattr(attn, "k_norm", None)),
            o_w=o_w,
            o_b=o_b,
            attn_out_norm=self._norm_scale(norms.attn_out),
            mlp_norm=self._norm_scale(norms.mlp),
            mlp=mlp,
            mlp_out_norm=self._norm_scale(norms.mlp_out),
            window=window,
            rope=self.family.rope_index(layer, len(self.ropes)),
        )

    def _dense(self, mlp: nn.Module) -> DenseMlp:
        if hasattr(mlp, "gate_up_proj"):  # fused in the checkpoint (Phi-3): gate rows first
            w, b = self._fused([mlp.gate_up_proj])
            gate_up: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]] = (
                (w,),
                (b,),
            )
        elif self.fuse_gate_up:
            w, b = self._fused([mlp.gate_proj, mlp.up_proj])
            gate_up = ((w,), (b,))
        else:
            gate, up = self._fused([mlp.gate_proj]), self._fused([mlp.up_proj])
            gate_up = ((gate[0], up[0]), (gate[1], up[1]))
        down_w, down_b = self._fused([mlp.down_proj])
        return DenseMlp(*gate_up, down_w, down_b)

    def weight_bytes(self) -> int:
        """Bytes the forward's weights hold on their device: projections (plain, packed or
        quantized), experts, norms, embeddings and lm_head, each tensor counted once (a tied
        lm_head's storage is the embeddings'; rope tables are not weights)."""
        seen: set[tuple[int, int]] = set()
        total = 0

        def visit(value: object) -> None:
            nonlocal total
            if isinstance(value, torch.Tensor):
                if value.is_meta:
                    return
                if value.is_mkldnn:
                    total += value.numel() * value.element_size()
                    return
                key = (value.untyped_storage().data_ptr(), value.storage_offset())
                if key not in seen:
                    seen.add(key)
                    total += value.numel() * value.element_size()
            elif isinstance(value, tuple):
                for item in value:
                    visit(item)
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                for f in dataclasses.fields(value):
                    visit(getattr(value, f.name))
            elif isinstance(value, QuantLinear):
                total += value.nbytes

        for part in (*self.layers, self.embed, self.final_norm, self.lm_head):
            visit(part)
        return total

    def as_constants(self) -> DecoderWeights:
        """A shallow copy whose tensors are `nn.Parameter`s over the same storage: what
        torch.compile's freezing folds into a graph as constants (and packs for its GEMMs),
        quantized kernels' tensors included."""
        if self.packed:
            raise ValueError(
                "compiled graphs fold plain or quantized weights; these are packed for oneDNN"
            )
        frozen = copy.copy(self)
        frozen.layers = [_constant(layer) for layer in self.layers]  # type: ignore[misc]
        frozen.ropes = [_constant(rope) for rope in self.ropes]  # type: ignore[misc]
        for name in ("embed", "final_norm", "lm_head"):
            setattr(frozen, name, _constant(getattr(self, name)))
        return frozen

    def _rope_tables(
        self, model: PreTrainedModel, length: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin [length, rotary_dim] of each rotary embedding the layers use, computed in
        float32 exactly as HF's rotary embedding (module doc for LongRoPE)."""
        tables = []
        for rotary in self.family.rotaries(model):
            positions = torch.arange(length, device=self.device, dtype=torch.float32)
            inv_freq = rotary.original_inv_freq.to(self.device).float()
            freqs = positions[:, None] * inv_freq[None, :]
            if getattr(rotary, "rope_type", "default") == "longrope":
                original = getattr(rotary.config, "original_max_position_embeddings", None)
                original = original or rotary.config.max_position_embeddings
                long_freq, _ = rotary.rope_init_fn(rotary.config, self.device, seq_len=original + 1)
                long = positions[:, None] * long_freq.to(self.device).float()[None, :]
                freqs = torch.where(positions[:, None] < original, freqs, long)
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = rotary.attention_scaling
            tables.append(((emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)))
        return tables

    def _rms(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), scale, self.eps)

    def _rms_sharded(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the whole of a projection x [N, width] whose columns are split over
        the ranks (OLMo 2's q/k norms under tensor parallelism): the mean square summed over
        them."""
        if self.parallel is None:
            return self._rms(x, scale)
        square = self.parallel.all_reduce(x.float().pow(2).sum(-1, keepdim=True))
        mean = square / (x.shape[-1] * self.parallel.world)
        return (x.float() * torch.rsqrt(mean + self.eps)).to(x.dtype) * scale

    def _qkv(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LayerUpdate | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden], cos/sin [N, 1, rotary_dim] -> q [N, heads, d], k and v [N, kv_heads,
        d]. `lora`: the step's LoRA updates of this layer (paged.lora's LayerLora), or None."""
        h = x if layer.input_norm is None else self._rms(x, layer.input_norm)
        qkv = linear(h, layer.qkv_w, layer.qkv_b)
        if lora is not None:
            lora.add(qkv, h, "qkv")
        n, d = x.shape[0], self.head_dim
        if layer.q_norm is None or layer.k_norm is None:
            qkv = qkv.view(n, -1, d)
            qk_heads = self.num_heads + self.num_kv_heads
            qk = _rotate(qkv[:, :qk_heads], cos, sin)  # q and k rotated together: one op chain
            return qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, qk_heads:]
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        if self.projection_qk_norm:  # over the whole projection (OLMo 2)
            q, k = self._rms_sharded(q, layer.q_norm), self._rms_sharded(k, layer.k_norm)
            q, k = q.view(n, -1, d), k.view(n, -1, d)
        else:  # per head (Qwen3, Gemma 3)
            q = self._rms(q.reshape(n, -1, d), layer.q_norm)
            k = self._rms(k.reshape(n, -1, d), layer.k_norm)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v.reshape(n, -1, d)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, hidden] (a vocab-parallel lookup under tensor parallelism),
        scaled where the family scales its token embeddings alone."""
        if self.parallel is not None:
            x = self.parallel.embed(ids, self.embed)
        else:
            x = F.embedding(ids, self.embed)
        if self.embed_scale != 1.0 and not self.embed_scale_prefixes:
            x = x * self.embed_scale
        return x

    def embedded(self, ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for token ids [N]: their embeddings, scaled where the
        family scales them."""
        return self._inputs(self._embed(ids))

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The first layer's input from the embeddings (prompt prefixes' rows included):
        scaled where the family scales every input embedding."""
        if self.embed_scale != 1.0 and self.embed_scale_prefixes:
            return x * self.embed_scale
        return x

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel projection (itself on one device)."""
        return t if self.parallel is None else self.parallel.all_reduce(t)

    def _residual(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return x + out if self.residual_scale == 1.0 else x + out * self.residual_scale

    def _finish(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        attn: torch.Tensor,
        lora: LayerUpdate | None = None,
    ) -> torch.Tensor:
        """Output projection, residual, MLP, residual: x [N, hidden], attn [N, heads * d];
        `lora` as in _qkv."""
        out = linear(attn, layer.o_w, layer.o_b)
        if lora is not None:
            lora.add(out, attn, "o_proj")
        out = self._reduce(out)
        if layer.attn_out_norm is not None:
            out = self._rms(out, layer.attn_out_norm)
        x = self._residual(x, out)
        h = x if layer.mlp_norm is None else self._rms(x, layer.mlp_norm)
        mlp = layer.mlp
        out = self._dense_mlp(mlp, h, lora) if isinstance(mlp, DenseMlp) else mlp(h, self.act)
        out = self._reduce(out)
        if layer.mlp_out_norm is not None:
            out = self._rms(out, layer.mlp_out_norm)
        return self._residual(x, out)

    def _dense_mlp(self, mlp: DenseMlp, h: torch.Tensor, lora: LayerUpdate | None) -> torch.Tensor:
        if len(mlp.gate_up_w) == 1:
            fused = linear(h, mlp.gate_up_w[0], mlp.gate_up_b[0])
            if lora is not None:
                lora.add(fused, h, "gate_up")
            gate, up = fused.chunk(2, dim=-1)
        else:
            gate, up = (linear(h, w, b) for w, b in zip(mlp.gate_up_w, mlp.gate_up_b, strict=True))
            if lora is not None:
                lora.add(gate, h, "gate_proj")
                lora.add(up, h, "up_proj")
        mid = self.act(gate) * up
        down = linear(mid, mlp.down_w, mlp.down_b)
        if lora is not None:
            lora.add(down, mid, "down_proj")
        return down

    def layers_over(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attention: LayerAttention,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """Every decoder layer over x [tokens, hidden] at `positions` ([tokens], or [3, tokens]
        for a model with multimodal rope), each one's attention
        (its new K/V written into the pool, q attended) done by `attention(index, layer, q, k,
        v)` -> [tokens, heads, dim]: the eager step's `attend`, or the compiled decode's op."""
        # Each rope table's rows of the step's positions, [tokens, 1, rotary_dim].
        if positions.dim() == 2:  # three streams [3, tokens]: multimodal rope
            if self.mrope is None:
                raise ValueError("three-stream positions for a model without multimodal rope")
            ropes = [rotate_tables(cos, sin, positions, self.mrope) for cos, sin in self.ropes]
        else:
            ropes = [
                (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                for cos, sin in self.ropes
            ]
        for index, layer in enumerate(self.layers):
            adapted = lora.layer(index) if lora is not None else None
            q, k, v = self._qkv(layer, x, *ropes[layer.rope], adapted)
            out = attention(index, layer, q, k, v)
            x = self._finish(layer, x, out.view(x.shape[0], -1), adapted)
        return x

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm over the last layer's output x [rows, hidden]: the hidden states
        the lm_head reads, and what a pooling model pools (transformers' last_hidden_state)."""
        return self._rms(x, self.final_norm)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: x [rows, hidden] -> float32 logits [rows, vocab], scaled
        and soft-capped where the family does."""
        logits = linear(self.normed(x), self.lm_head)
        if self.parallel is not None:
            logits = self.parallel.gather_logits(logits)
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()
