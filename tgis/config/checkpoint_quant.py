"""Pre-quantized checkpoints: what config.json's `quantization_config` declares, read once into
a `CheckpointQuant` that the rules check (tgis.config.rules.quantization) and the paged engine's
loader follows (tgis.backends.common.quant_checkpoint).

The formats read, as vLLM and TGI read them:

| quant_method | what the config names | weights |
|---|---|---|
| `gptq` (AutoGPTQ, GPTQModel) | bits 4, group_size (-1: per channel), desc_act, sym, checkpoint_format gptq / gptq_v2 | int4 in groups, zero points (stored less one in v1), act-order g_idx |
| `awq` (AutoAWQ, version gemm) | bits 4, group_size, zero_point | int4 in groups, zero points, AWQ's interleaved packing |
| `compressed-tensors` (llm-compressor) | format pack-quantized, int-quantized, naive-quantized, float-quantized; config_groups' weights | int4 in groups or channels (W4A16), int8 per channel (W8A8 and W8A16), fp8 per channel or tensor (W8A8) |
| `fp8` (Qwen3-FP8, DeepSeek-V3 style) | weight_block_size, activation_scheme dynamic, fmt e4m3 | fp8 with one scale per block (or per tensor) |

Which projections are quantized is read from the checkpoint's tensors (a projection with
`qweight`, `weight_packed` or a `weight_scale` is; `ignore` lists and `modules_to_not_convert`
only name the rest), so a checkpoint that quantizes some layers and not others loads as stored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgis.errors import ConfigError

# quant_method values tgis loads; the name /info reports is the same.
CHECKPOINT_QUANTIZATIONS = ("gptq", "awq", "compressed-tensors", "fp8")
# compressed-tensors formats read, -> the weights they store.
COMPRESSED_FORMATS = {
    "pack-quantized": "int4 packed in int32 words",
    "int-quantized": "int8",
    "naive-quantized": "int8",
    "float-quantized": "fp8 e4m3",
}
_FLOAT_CHECKPOINT = "serve the model's float checkpoint with --quantize int8 or int4"
# AutoGPTQ's own file beside config.json, in checkpoints whose config.json does not declare it.
AUTOGPTQ_CONFIG = "quantize_config.json"


def declared_quantization(model_dir: Path, config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The quantization_config of the checkpoint in `model_dir`: config.json's, or AutoGPTQ's
    quantize_config.json read as a GPTQ one; None when neither is there."""
    declared = config.get("quantization_config")
    if declared is not None:
        return dict(declared) if isinstance(declared, Mapping) else declared
    path = model_dir / AUTOGPTQ_CONFIG
    if not path.is_file():
        return None
    autogptq = json.loads(path.read_text())
    return {"quant_method": "gptq", **autogptq} if isinstance(autogptq, dict) else None


def vision_checkpoint_refusal(model_type: str | None, method: str | None) -> ConfigError:
    """Why a pre-quantized vision-language checkpoint is not served: the loader
    (tgis.backends.common.quant_checkpoint) builds a text model's causal LM and reads its
    projections by a text model's tensor names, and a vision-language checkpoint names its
    language model's under its own prefix, beside a vision tower it may have quantized too."""
    kind = model_type or "this model"
    return ConfigError(
        f"config.json's quantization_config ({method or 'no quant_method'}): tgis reads "
        f"pre-quantized checkpoints of text models; {kind} is a vision-language model, whose "
        "checkpoint stores its language model's (and maybe its vision tower's) quantized "
        "weights under names the loader does not read",
        f"serve {kind}'s float checkpoint, with --quantize int8 or int4 to quantize its "
        "language model at load",
    )


def checkpoint_scheme(model_dir: Path, config: Mapping[str, Any]) -> CheckpointQuant | None:
    """The quantization the checkpoint in `model_dir` (its config.json `config`) declares."""
    declared = declared_quantization(model_dir, config)
    return None if declared is None else CheckpointQuant.of({"quantization_config": declared})


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization as tgis loads it (module doc)."""

    method: str  # one of CHECKPOINT_QUANTIZATIONS
    bits: int  # 4 or 8
    # Input columns per scale where the format fixes one (int4 groups; None: read per tensor).
    group_size: int | None = None
    # GPTQ v1 stores each zero point less one: the loader adds it back.
    zero_offset: int = 0
    act_order: bool = False
    block: tuple[int, int] | None = None  # fp8 block-wise: rows x columns per scale
    float8: bool = False  # some weights are float8 (CUDA only)

    @staticmethod
    def of(model_config: Mapping[str, Any]) -> CheckpointQuant | None:
        """The quantization config.json declares, or None; a ConfigError naming the field when
        tgis cannot load it."""
        declared = model_config.get("quantization_config")
        if declared is None:
            return None
        if not isinstance(declared, Mapping):
            raise ConfigError(
                "config.json's quantization_config is not an object",
                "fix the checkpoint's config.json",
            )
        method = str(declared.get("quant_method") or "").lower()
        if method == "gptq":
            return _gptq(declared)
        if method == "awq":
            return _awq(declared)
        if method == "compressed-tensors":
            return _compressed(declared)
        if method == "fp8":
            return _fp8(declared)
        raise ConfigError(
            f"config.json's quantization_config.quant_method is {method or 'missing'!r}: tgis "
            f"loads {', '.join(CHECKPOINT_QUANTIZATIONS)} checkpoints",
            _FLOAT_CHECKPOINT,
        )

    def describe(self) -> str:
        """One line for the start-up log and /info."""
        if self.method == "fp8":
            kind = f"blocks of {self.block[0]}x{self.block[1]}" if self.block else "per tensor"
            return f"fp8 checkpoint, weight scales {kind}, activations per token"
        if self.bits == 8:
            kind = "fp8" if self.float8 else "int8"
            return f"{self.method} checkpoint, {kind} weights per output channel or tensor"
        groups = f"groups of {self.group_size}" if self.group_size else "groups as stored"
        order = ", act-order" if self.act_order else ""
        return f"{self.method} checkpoint, 4-bit weights in {groups}{order}"


def _refuse(field: str, value: object, why: str) -> ConfigError:
    return ConfigError(
        f"config.json's quantization_config.{field} is {value!r}: {why}", _FLOAT_CHECKPOINT
    )


def _group(declared: Mapping[str, Any], field: str = "group_size") -> int | None:
    """A group size as stored; -1 (per output channel) is None: the loader reads it per tensor."""
    group = declared.get(field)
    if group in (None, -1):
        return None
    if not isinstance(group, int) or group <= 0:
        raise _refuse(field, group, "a group size is a positive number of input columns or -1")
    return group


def _gptq(declared: Mapping[str, Any]) -> CheckpointQuant:
    bits = declared.get("bits")
    if bits != 4:
        raise _refuse(
            "bits", bits, "tgis's GPTQ kernels take 4-bit weights (int4 group-wise, W4A16)"
        )
    fmt = str(declared.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "tgis reads the gptq and gptq_v2 layouts")
    return CheckpointQuant(
        "gptq",
        4,
        _group(declared),
        zero_offset=1 if fmt == "gptq" else 0,
        act_order=bool(declared.get("desc_act")),
    )


def _awq(declared: Mapping[str, Any]) -> CheckpointQuant:
    bits = declared.get("bits", declared.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, "AWQ checkpoints hold 4-bit weights")
    version = str(declared.get("version") or "gemm").lower()
    if version != "gemm":
        raise _refuse("version", version, "tgis reads AWQ's gemm layout (the common one)")
    if declared.get("zero_point") is False:
        raise _refuse("zero_point", False, "tgis reads AWQ's asymmetric weights (zero points)")
    field = "group_size" if "group_size" in declared else "q_group_size"
    return CheckpointQuant("awq", 4, _group(declared, field))


def _compressed(declared: Mapping[str, Any]) -> CheckpointQuant:
    fmt = str(declared.get("format") or "").lower()
    if fmt not in COMPRESSED_FORMATS:
        raise _refuse("format", fmt, f"tgis reads the {', '.join(COMPRESSED_FORMATS)} formats")
    sparsity = declared.get("sparsity_config")
    if sparsity:
        raise _refuse("sparsity_config", "set", "tgis reads dense quantized weights, not sparse")
    groups = declared.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse("config_groups", groups, "a compressed-tensors scheme names its weights")
    bits: set[int] = set()
    float8 = False
    group_sizes: set[int] = set()
    act_order = False
    for name, scheme in groups.items():
        group_format = str(scheme.get("format") or fmt).lower()
        if group_format not in COMPRESSED_FORMATS:
            raise _refuse(
                f"config_groups.{name}.format",
                group_format,
                f"tgis reads the {', '.join(COMPRESSED_FORMATS)} formats",
            )
        weights = scheme.get("weights")
        if not isinstance(weights, Mapping):
            raise _refuse(f"config_groups.{name}.weights", weights, "no weight scheme")
        field = f"config_groups.{name}.weights"
        kind, num_bits = weights.get("type"), weights.get("num_bits")
        strategy = str(weights.get("strategy") or "").lower()
        if weights.get("dynamic"):
            raise _refuse(f"{field}.dynamic", True, "weights are stored quantized, not dynamic")
        if (kind, num_bits) not in (("int", 4), ("int", 8), ("float", 8)):
            raise _refuse(
                f"{field}.num_bits", num_bits,
                f"tgis reads int4, int8 and fp8 weights, not {kind} {num_bits}-bit",
            )  # fmt: skip
        allowed = ("group", "channel") if num_bits == 4 else ("channel", "tensor")
        if strategy not in allowed:
            raise _refuse(
                f"{field}.strategy", strategy,
                f"{kind} {num_bits}-bit weights are read with {' or '.join(allowed)} scales",
            )  # fmt: skip
        if num_bits == 8 and not weights.get("symmetric", True):
            raise _refuse(f"{field}.symmetric", False, "8-bit weights are read symmetric")
        bits.add(num_bits)
        float8 = float8 or kind == "float"
        if strategy == "group" and (size := _group(weights)) is not None:
            group_sizes.add(size)
        act_order = act_order or weights.get("actorder") == "group"
    return CheckpointQuant(
        "compressed-tensors",
        min(bits),
        group_sizes.pop() if len(group_sizes) == 1 else None,
        act_order=act_order,
        float8=float8,
    )


def _fp8(declared: Mapping[str, Any]) -> CheckpointQuant:
    fmt = str(declared.get("fmt") or "e4m3").lower()
    if fmt != "e4m3":
        raise _refuse("fmt", fmt, "tgis reads float8 e4m3 weights")
    block = declared.get("weight_block_size")
    if block is not None:
        if (
            not isinstance(block, list | tuple)
            or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise _refuse("weight_block_size", block, "a block is [rows, columns]")
        return CheckpointQuant("fp8", 8, block=(int(block[0]), int(block[1])), float8=True)
    return CheckpointQuant("fp8", 8, float8=True)
