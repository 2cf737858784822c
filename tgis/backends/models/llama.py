"""The llama family (llama, mistral, qwen2): which models the lean forwards run, and their
weights in the layouts those forwards compute with.

`LlamaWeights` takes the HF model's weights, not its modules: per layer one fused QKV matmul
(with qwen2's biases), rotary embedding from precomputed cos/sin tables, a gate/up matmul (fused
on CUDA), RMSNorm's scales. The paged forward (paged/forward.py) and the fixed-shape forward
(static/kv.py) subclass it and differ only in how attention reads the cache.

Fusing re-points the HF modules' weights at slices of the fused tensors, so the model keeps
working (and tests can compare against it) without a second copy of the weights.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from tgis.backends.common.kv import KVShape, sliding_windows

if TYPE_CHECKING:
    from tgis.backends.models.parallel import TensorParallel

NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Rope types whose frequencies do not depend on the sequence length (tables are exact).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Fuse gate and up into one matmul on CUDA (fewer launches). On CPU two fp32 GEMMs of
# [intermediate, hidden] beat one of [2 * intermediate, hidden] by ~5% from 32 rows up and tie
# below (MKL, AVX-512, 2 cores; SmolLM2-135M shape), so they stay apart there.
FUSE_GATE_UP = {"cuda": True}


class LayerUpdate(Protocol):
    """A per-step update of a layer's projections (the paged engine's LoRA: paged.lora)."""

    def add(self, out: torch.Tensor, x: torch.Tensor, name: str) -> None:
        """out [N, out] += the update of projection `name` from its input x [N, in]."""
        ...


def unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why the llama family's forwards (paged and fixed-shape) cannot run the model this
    config.json describes (None when they can): another architecture, or a rope whose
    frequencies change with the sequence's length."""
    model_type = config.get("model_type")
    if model_type not in NATIVE_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {NATIVE_MODEL_TYPES}"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = (
        rope.get("rope_type", rope.get("type", "default"))
        if isinstance(rope, Mapping)
        else "default"
    )
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} depends on the sequence length"
    return None


def native_kv_shape(model: PreTrainedModel) -> KVShape:
    """What one layer of `model` keeps per token in a KV cache."""
    config = model.config
    attn = model.model.layers[0].self_attn
    return KVShape(
        config.num_hidden_layers, config.num_key_value_heads, attn.head_dim, attn.head_dim
    )


def _fuse(linears: list[nn.Linear], transposed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `linears` along the output dimension, then make
    each module's parameters views of the fused tensors (one copy of the weights in memory).

    Returns the weight as F.linear takes it, [out, in]. With `transposed` it is a view of a
    contiguous [in, out] tensor: MKL's fp32 GEMM is faster on that layout for the few-row
    inputs of decode (~20% at one row, ~5% at 16 measured on AVX-512); bf16 and CUDA GEMMs
    are not, so they keep [out, in].
    """
    if transposed:
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
        m.weight = nn.Parameter(weight[offset : offset + rows], requires_grad=False)
        if m.bias is not None and bias is not None:
            m.bias = nn.Parameter(bias[offset : offset + rows], requires_grad=False)
        offset += rows
    return weight, bias


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors: fused [out, in] weights and the norms' scales."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_w: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, hidden]
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    # One fused [2 * intermediate, hidden] weight, or gate's and up's apart (see FUSE_GATE_UP).
    gate_up_w: tuple[torch.Tensor, ...]
    gate_up_b: tuple[torch.Tensor | None, ...]
    down_w: torch.Tensor
    down_b: torch.Tensor | None
    window: int | None  # sliding window (None: full attention)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as HF applies it: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaWeights:
    """A llama-family model's weights in the layouts the lean forwards run: fused QKV (and
    gate/up where faster), norms' scales, rope tables. The forwards over a paged pool
    (paged/forward.py) and over a static cache (static/kv.py) share it and differ only in how
    attention reads the cache."""

    @torch.no_grad()
    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        max_positions: int,
        fuse_gate_up: bool | None = None,
        transposed: bool | None = None,
    ) -> None:
        """Take `model`'s weights (re-pointing its modules at the fused copies) and precompute
        rope tables for `max_positions` positions. fuse_gate_up / transposed: weight
        layouts, by default the faster ones measured for the device and dtype (see _fuse)."""
        reason = unsupported_reason(model.config.to_dict())
        if reason is not None:
            raise ValueError(f"the native llama path cannot run this model: {reason}")
        config, base = model.config, model.model
        self.device = device
        attn = base.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.hidden = config.hidden_size
        self.eps = base.norm.variance_epsilon
        self.act = base.layers[0].mlp.act_fn
        dtype = base.embed_tokens.weight.dtype
        if transposed is None:
            transposed = self.device.type == "cpu" and dtype == torch.float32
        self.transposed = transposed
        if fuse_gate_up is None:
            fuse_gate_up = FUSE_GATE_UP.get(self.device.type, False)
        self.fuse_gate_up = fuse_gate_up
        windows = sliding_windows(model) or [None] * config.num_hidden_layers
        self.layers = [self._layer(layer, windows[i]) for i, layer in enumerate(base.layers)]
        self.windows = sorted({layer.window for layer in self.layers}, key=lambda w: w or 0)
        self.embed = base.embed_tokens.weight
        # Tensor parallelism (paged/tensor_parallel.py): this rank's slices, and the collectives.
        self.parallel: TensorParallel | None = None
        self.final_norm = base.norm.weight
        self.lm_head = model.get_output_embeddings().weight
        self.cos, self.sin = self._rope_tables(model, max_positions)

    def _layer(self, layer: nn.Module, window: int | None) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.variance_epsilon != self.eps:
                raise ValueError("the llama forward needs one RMSNorm epsilon for all norms")
        t = self.transposed
        qkv_w, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], t)
        if self.fuse_gate_up:
            gate_up_w, gate_up_b = _fuse([mlp.gate_proj, mlp.up_proj], t)
            gate_up = ((gate_up_w,), (gate_up_b,))
        else:
            gate, up = _fuse([mlp.gate_proj], t), _fuse([mlp.up_proj], t)
            gate_up = ((gate[0], up[0]), (gate[1], up[1]))
        o_w, o_b = _fuse([attn.o_proj], t)
        down_w, down_b = _fuse([mlp.down_proj], t)
        return LayerWeights(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            qkv_w,
            qkv_b,
            o_w,
            o_b,
            *gate_up,
            down_w,
            down_b,
            window,
        )

    def as_constants(self) -> LlamaWeights:
        """A shallow copy whose tensors are `nn.Parameter`s over the same storage: what
        torch.compile's freezing folds into a graph as constants (and packs for its GEMMs)."""

        def constant(value: object) -> object:
            if isinstance(value, torch.Tensor):
                return nn.Parameter(value, requires_grad=False)
            if isinstance(value, tuple):
                return tuple(constant(v) for v in value)
            return value

        frozen = copy.copy(self)
        frozen.layers = [
            replace(layer, **{f.name: constant(getattr(layer, f.name)) for f in fields(layer)})
            for layer in self.layers
        ]
        for name in ("embed", "final_norm", "lm_head", "cos", "sin"):
            setattr(frozen, name, constant(getattr(self, name)))
        return frozen

    def _rope_tables(
        self, model: PreTrainedModel, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [length, head_dim], computed in float32 exactly as HF's rotary embedding."""
        rotary = model.model.rotary_emb
        positions = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.to(self.device).float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed.dtype
        scale = rotary.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def _qkv(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LayerUpdate | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden], cos/sin [N, 1, head_dim] -> q [N, heads, d], k and v [N, kv_heads, d].
        `lora`: the step's LoRA updates of this layer (paged.lora's LayerLora), or None."""
        h = F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps)
        qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
        if lora is not None:
            lora.add(qkv, h, "qkv")
        qkv = qkv.view(x.shape[0], -1, self.head_dim)
        qk_heads = self.num_heads + self.num_kv_heads
        qk = _rotate(qkv[:, :qk_heads], cos, sin)  # q and k rotated together: one op chain
        return qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, qk_heads:]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, hidden] (a vocab-parallel lookup under tensor parallelism)."""
        if self.parallel is not None:
            return self.parallel.embed(ids, self.embed)
        return F.embedding(ids, self.embed)

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel projection (itself on one device)."""
        return t if self.parallel is None else self.parallel.all_reduce(t)

    def _finish(
        self,
        layer: LayerWeights,
        x: torch.Tensor,
        attn: torch.Tensor,
        lora: LayerUpdate | None = None,
    ) -> torch.Tensor:
        """Output projection, residual, MLP, residual: x [N, hidden], attn [N, heads * d];
        `lora` as in _qkv."""
        out = F.linear(attn, layer.o_w, layer.o_b)
        if lora is not None:
            lora.add(out, attn, "o_proj")
        x = x + self._reduce(out)
        h = F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps)
        if len(layer.gate_up_w) == 1:
            fused = F.linear(h, layer.gate_up_w[0], layer.gate_up_b[0])
            if lora is not None:
                lora.add(fused, h, "gate_up")
            gate, up = fused.chunk(2, dim=-1)
        else:
            gate, up = (
                F.linear(h, w, b) for w, b in zip(layer.gate_up_w, layer.gate_up_b, strict=True)
            )
            if lora is not None:
                lora.add(gate, h, "gate_proj")
                lora.add(up, h, "up_proj")
        if lora is None:
            return x + self._reduce(F.linear(self.act(gate) * up, layer.down_w, layer.down_b))
        mid = self.act(gate) * up
        down = F.linear(mid, layer.down_w, layer.down_b)
        lora.add(down, mid, "down_proj")
        return x + self._reduce(down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: x [rows, hidden] -> float32 logits [rows, vocab]."""
        h = F.rms_norm(x, (self.hidden,), self.final_norm, self.eps)
        logits = F.linear(h, self.lm_head)
        if self.parallel is not None:
            logits = self.parallel.gather_logits(logits)
        return logits.float()
