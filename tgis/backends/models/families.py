"""The model families the lean forwards run, and what each changes from Llama: the one table.

A family is named by config.json's `model_type`. `paged_unsupported_reason` reads a config.json
(no weights) and says why the paged engine's forward (models/decoder.py) cannot run it, or
None: the chooser (backends/choose.py), the draft-model check and `serve --check` ask it. The
fixed-shape forward of the static backends (tpu, gaudi) runs the llama family alone
(`static_unsupported_reason`).

Each `Family` says where its norms sit, whether they scale by (1 + w), whether its checkpoint
fuses projections, its multipliers and soft-caps (read from its config by `traits`), which
rope types it may use, which rotary embeddings its layers rotate with, and its projections as LoRA
adapters name them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

# Rope types whose frequencies do not depend on the sequence length (tables are exact).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Phi-3's LongRoPE (older configs call it "su"): short factors, then long ones past
# original_max_position_embeddings, per position (models/decoder.py).
LONG_ROPE_TYPES = ("longrope", "su")

NormLayout = Literal["pre", "sandwich", "post"]


@dataclass(frozen=True)
class Traits:
    """A family's multipliers and soft-caps, from its config (1.0 / None: it has none)."""

    embed_scale: float = 1.0
    # Whether the scale applies to every input embedding (prompt prefixes' too) or to the
    # token embeddings alone (Gemma 3 scales inside its embedding module).
    embed_scale_prefixes: bool = True
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # q/k RMSNorm over the whole projection (OLMo 2), not per head (Qwen3, Gemma 3); under
    # tensor parallelism a rank's share of it may be one head wide.
    projection_qk_norm: bool = False


@dataclass(frozen=True)
class Norms:
    """A decoder layer's RMSNorm modules by where they act (None: not in this family)."""

    input: nn.Module | None  # before attention
    attn_out: nn.Module | None  # on attention's output, before the residual
    mlp: nn.Module | None  # before the MLP
    mlp_out: nn.Module | None  # on the MLP's output, before the residual


@dataclass(frozen=True)
class Family:
    """One family of decoder-only models the paged forward runs (module doc)."""

    name: str
    model_types: tuple[str, ...]
    # What differs from Llama, as docs/models.md and `serve --check` say it.
    differs: str
    norm_layout: NormLayout = "pre"
    norm_offset: bool = False  # norms scale by (1 + w)
    # Embeddings scaled by sqrt(hidden): of every input ("inputs") or of tokens ("tokens").
    sqrt_hidden_embeddings: Literal["inputs", "tokens"] | None = None
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    moe: bool = False
    local_rope: bool = False  # sliding layers rotate with their own base (Gemma 3)
    rope_types: tuple[str, ...] = STATIC_ROPE_TYPES
    static: bool = False  # the static backends' fixed-shape forward runs it too
    # Why tensor parallelism cannot split it (None: it can, where the widths divide).
    unshardable: str | None = None
    projection_qk_norm: bool = False  # Traits.projection_qk_norm

    def traits(self, config: Any) -> Traits:
        """The multipliers and soft-caps of a model of this family with `config`."""
        embed = float(getattr(config, "embedding_multiplier", 1.0) or 1.0)
        if self.sqrt_hidden_embeddings is not None:
            embed = float(config.hidden_size) ** 0.5
        return Traits(
            embed_scale=embed,
            embed_scale_prefixes=self.sqrt_hidden_embeddings != "tokens",
            residual_scale=float(getattr(config, "residual_multiplier", 1.0) or 1.0),
            logits_divisor=float(getattr(config, "logits_scaling", 1.0) or 1.0),
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            projection_qk_norm=self.projection_qk_norm,
        )

    def norms(self, layer: nn.Module) -> Norms:
        """`layer`'s norms by where they act."""
        if self.norm_layout == "sandwich":
            return Norms(
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm,
            )
        if self.norm_layout == "post":
            return Norms(
                None, layer.post_attention_layernorm, None, layer.post_feedforward_layernorm
            )
        return Norms(layer.input_layernorm, None, layer.post_attention_layernorm, None)

    def rotaries(self, model: nn.Module) -> list[nn.Module]:
        """The rotary embeddings the layers rotate with: the model's, then Gemma 3's local."""
        base = model.model  # type: ignore[union-attr]
        return [base.rotary_emb, base.rotary_emb_local] if self.local_rope else [base.rotary_emb]

    def rope_index(self, layer: nn.Module, tables: int) -> int:
        """Which of `rotaries`' tables `layer` uses: Gemma 3's sliding layers the local one."""
        if self.local_rope and getattr(layer.self_attn, "is_sliding", False):
            return tables - 1
        return 0

    def lora_modules(self, config: Any) -> dict[str, tuple[int, int]]:
        """The projections a LoRA adapter may adapt, as its files name them, with their
        (in, out) sizes: attention's and the dense MLP's (not the experts')."""
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        q, kv = heads * head_dim, config.num_key_value_heads * head_dim
        inter = config.intermediate_size
        if self.fused_checkpoint:
            attention = {"qkv_proj": (hidden, q + 2 * kv), "o_proj": (q, hidden)}
            return {**attention, "gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}
        attention = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
        attention["o_proj"] = (q, hidden)
        if self.moe:
            return attention
        mlp = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter)}
        return {**attention, **mlp, "down_proj": (inter, hidden)}

    def lora_groups(self, fuse_gate_up: bool) -> dict[str, tuple[str, ...]]:
        """The forward's projections (as LoRA stacks name them) -> the adapter modules whose
        outputs each concatenates, in order."""
        if self.fused_checkpoint:
            return {
                "qkv": ("qkv_proj",),
                "o_proj": ("o_proj",),
                "gate_up": ("gate_up_proj",),
                "down_proj": ("down_proj",),
            }
        groups: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj")}
        groups["o_proj"] = ("o_proj",)
        if self.moe:
            return groups
        mlp = (
            {"gate_up": ("gate_proj", "up_proj")}
            if fuse_gate_up
            else {
                "gate_proj": ("gate_proj",),
                "up_proj": ("up_proj",),
            }
        )
        return {**groups, **mlp, "down_proj": ("down_proj",)}


_GEMMA = {"norm_offset": True, "sqrt_hidden_embeddings": "inputs"}
FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "the reference: pre-norm RMSNorm, SwiGLU, rope", static=True),
    Family("mistral", ("mistral",), "a sliding window over every layer", static=True),
    Family("qwen2", ("qwen2",), "biases on q, k and v", static=True),
    Family(
        "qwen2_vl",
        ("qwen2_vl_text", "qwen2_5_vl_text"),
        "Qwen2's, rotating with multimodal rope: three position streams (temporal, height, "
        "width) over sections of the rotary dimensions (the language model of Qwen2-VL and "
        "Qwen2.5-VL)",
        rope_types=(*STATIC_ROPE_TYPES, "mrope"),
    ),
    Family("qwen3", ("qwen3",), "RMSNorm on q and k per head; head_dim of its own"),
    Family(
        "gemma", ("gemma",), "norms scale by (1 + w); embeddings by sqrt(hidden); GeGLU", **_GEMMA
    ),
    Family(
        "gemma2",
        ("gemma2",),
        "Gemma's, plus norms before and after attention and MLP, soft-capped attention and "
        "final logits, sliding-window layers alternating with global ones, "
        "query_pre_attn_scalar",
        norm_layout="sandwich",
        **_GEMMA,
    ),
    Family(
        "gemma3",
        ("gemma3_text",),
        "Gemma 2's layout with q/k norms per head, a local rope base for its sliding layers",
        norm_layout="sandwich",
        norm_offset=True,
        sqrt_hidden_embeddings="tokens",
        local_rope=True,
    ),
    Family(
        "phi3",
        ("phi3",),
        "fused qkv_proj and gate_up_proj; LongRoPE; partial rotary",
        fused_checkpoint=True,
        rope_types=STATIC_ROPE_TYPES + LONG_ROPE_TYPES,
    ),
    Family(
        "granite",
        ("granite",),
        "embedding, residual and attention multipliers; logits divided by logits_scaling",
    ),
    Family(
        "olmo2",
        ("olmo2",),
        "norms after attention and MLP, not before; q/k RMSNorm over the whole projection",
        norm_layout="post",
        projection_qk_norm=True,
    ),
    Family("mixtral", ("mixtral",), "experts: top-k of a softmax router, renormalized", moe=True),
    Family(
        "qwen2_moe",
        ("qwen2_moe",),
        "experts (top-k, renormalized as norm_topk_prob says) and a gated shared expert; "
        "biases on q, k and v",
        moe=True,
        unshardable="transformers' Qwen2-MoE attention derives its head size from "
        "hidden_size / heads, so a rank's share of the heads cannot be built",
    ),
    Family(
        "qwen3_moe",
        ("qwen3_moe",),
        "experts (top-k, renormalized as norm_topk_prob says); Qwen3's q/k norms",
        moe=True,
    ),
)
_BY_TYPE = {t: family for family in FAMILIES for t in family.model_types}
PAGED_MODEL_TYPES = tuple(_BY_TYPE)
STATIC_MODEL_TYPES = tuple(t for family in FAMILIES if family.static for t in family.model_types)


def family_of(config: Mapping[str, Any]) -> Family | None:
    """The family of a config.json's model (None: not one the forwards run)."""
    return _BY_TYPE.get(str(config.get("model_type")))


def family_of_model(model: nn.Module) -> Family:
    """The family of a loaded model; ValueError with the reason for one the paged forward
    cannot run."""
    config = model.config.to_dict()  # type: ignore[union-attr, operator]
    reason = paged_unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"the paged forward cannot run this model: {reason}")
    family = family_of(config)
    assert family is not None
    return family


def _rope_type(config: Mapping[str, Any]) -> str:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        return "default"
    return str(rope.get("rope_type", rope.get("type", "default")))


def paged_unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why the paged forward cannot run the model this config.json describes (None when it
    can): another architecture, or a rope or setting its family's forward does not have."""
    model_type = config.get("model_type")
    family = family_of(config)
    if family is None:
        return (
            f"model_type {model_type!r} is not one of the families it runs "
            f"({', '.join(PAGED_MODEL_TYPES)})"
        )
    rope_type = _rope_type(config)
    if rope_type not in family.rope_types:
        why = (
            "depends on the sequence length"
            if rope_type not in STATIC_ROPE_TYPES + LONG_ROPE_TYPES
            else f"is not one {family.name} uses"
        )
        return f"rope type {rope_type!r} {why}"
    return None


def static_unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why the static backends' fixed-shape forward (the llama family's) cannot run the model
    this config.json describes, or None."""
    model_type = config.get("model_type")
    if model_type not in STATIC_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {STATIC_MODEL_TYPES}"
    return paged_unsupported_reason(config)
