"""Loading a pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors, block-wise fp8) for the
paged forward: each quantized projection's stored tensors are read into a canonical form
(common/quant.py), the rest of the model as float tensors.

The model is built from its config with its parameters on the meta device (its buffers, such
as rotary tables, are real); float tensors are then assigned from the safetensors files, and
each quantized nn.Linear keeps a meta weight of its shape with the canonical form beside it
(`stored()`), which the paged forward's weights turn into kernels (models/decoder.py).
transformers' own loading is not used: it needs the format's package (optimum, autoawq,
compressed-tensors) and would build float or packed modules tgis does not run.

The layouts read (`read_linear`), with w the float weight [out, in] each stands for:

- GPTQ: `qweight` int32 [in / 8, out], eight 4-bit values along the input per word (the
  lowest nibble first); `qzeros` int32 [groups, out / 8], eight along the output; `scales`
  [groups, out]; `g_idx` [in], each input column's group (act-order when not ascending).
  w[n, k] = (q[k, n] - z[g(k), n]) * s[g(k), n], where checkpoint_format gptq (v1) stores
  z - 1.
- AWQ (gemm): `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], eight 4-bit
  values along the output per word in the order 0, 2, 4, 6, 1, 3, 5, 7; `scales`
  [groups, out]. w[n, k] = (q[k, n] - z[k / group, n]) * s[k / group, n].
- compressed-tensors pack-quantized: `weight_packed` int32 [out, in / 8], eight along the
  input (lowest first), each the signed value plus 8; `weight_scale` [out, groups];
  `weight_zero_point` (asymmetric) int32 [out / 8, groups], packed along the output likewise;
  `weight_g_idx` (act-order). int-quantized / naive-quantized: `weight` int8 and
  `weight_scale` [out, 1] or one per tensor. float-quantized: `weight` float8_e4m3fn and
  `weight_scale` likewise.
- fp8 (quant_method fp8): `weight` float8_e4m3fn and `weight_scale_inv` [out / rows,
  in / columns] per block (or `weight_scale`, one per tensor).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tgis.backends.common.quant import (
    Canonical,
    Fp8Blocks,
    Fp8Channels,
    Int4Groups,
    Int8Channels,
    Quantization,
    kernel_groups,
    narrow,
)
from tgis.config.checkpoint_quant import CheckpointQuant
from tgis.errors import ConfigError

logger = logging.getLogger(__name__)

# The attribute of an nn.Linear holding its canonical quantized weight (its own is meta).
STORED = "tgis_quantized"
# The attribute of a model loaded here: its Quantization.
QUANTIZATION = "tgis_quantization"
# AWQ's order of the eight 4-bit values in a word: nibble i holds output AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# A tensor-parallel rank's part of a projection: (dim, ranges), as tensor_parallel slices.
Part = tuple[int, tuple[tuple[int, int], ...]]


def stored(module: nn.Module) -> Canonical | None:
    """The canonical quantized weight a checkpoint stored for `module`, or None."""
    return getattr(module, STORED, None)


def model_quantization(model: nn.Module) -> Quantization | None:
    """The quantization a model loaded by `load_quantized` carries, or None."""
    return getattr(model, QUANTIZATION, None)


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in mapping.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ConfigError(
            f"{model_dir} has no safetensors weights: tgis reads quantized and sharded "
            "checkpoints tensor by tensor from them",
            "convert the weights first: tgis convert-to-safetensors MODEL",
        )
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


class Checkpoint:
    """A checkpoint's safetensors files, opened as their tensors are read (a context manager:
    the files close on exit)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.files = weight_files(model_dir)
        self._opened: dict[Path, Any] = {}

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._opened.values():
            handle.__exit__(None, None, None)
        self._opened.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        path = self.files[name]
        handle = self._opened.get(path)
        if handle is None:
            handle = self._opened[path] = safe_open(path, "pt").__enter__()
        return handle

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def view(self, name: str) -> Any:
        """A lazy slice of the tensor (safetensors' get_slice)."""
        return self._handle(name).get_slice(name)


# --- the formats -----------------------------------------------------------------------------


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] -> their eight 4-bit values [..., n, 8], the lowest nibble first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.to(torch.int32)[..., None] >> shifts) & 0xF).to(torch.uint8)


def _along_last(words: torch.Tensor) -> torch.Tensor:
    """Words packing eight values along their last dimension -> the values [..., 8n]."""
    return _nibbles(words).flatten(-2)


def _group_of(columns: int, scale_rows: int, name: str) -> int:
    if scale_rows <= 0 or columns % scale_rows:
        raise ConfigError(
            f"{name}: {scale_rows} scale rows do not divide {columns} input columns",
            "check the checkpoint",
        )
    return columns // scale_rows


def _act_order(g_idx: torch.Tensor, group: int, name: str) -> torch.Tensor | None:
    """The input columns in the order the groups cover them (None: already in order)."""
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, torch.arange(g_idx.numel()) // group):
        return None
    counts = torch.bincount(g_idx, minlength=g_idx.numel() // group)
    if not bool((counts == group).all()):
        raise ConfigError(
            f"{name}: act-order groups hold {sorted(set(counts.tolist()))} columns, not "
            f"{group} each",
            "check the checkpoint",
        )
    return torch.argsort(g_idx, stable=True)


def _int4(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group: int,
    perm: torch.Tensor | None,
) -> Int4Groups:
    """Canonical int4 from q [out, in] in the input's order and scale/zero [groups, out]."""
    if perm is not None:
        q = q[:, perm]
    return kernel_groups(
        Int4Groups(
            q.contiguous(), scale.float().contiguous(), zero.float().contiguous(), group, perm
        )
    )


def _gptq(checkpoint: Checkpoint, prefix: str, scheme: CheckpointQuant) -> Int4Groups:
    qweight = checkpoint.tensor(f"{prefix}.qweight")  # [in / 8, out]
    scales = checkpoint.tensor(f"{prefix}.scales")  # [groups, out]
    q = _nibbles(qweight.t()).flatten(-2)  # [out, in]
    zero = _along_last(checkpoint.tensor(f"{prefix}.qzeros"))[:, : scales.shape[1]]
    zero = zero.float() + scheme.zero_offset
    group = _group_of(q.shape[1], scales.shape[0], prefix)
    perm = None
    if f"{prefix}.g_idx" in checkpoint:
        perm = _act_order(checkpoint.tensor(f"{prefix}.g_idx"), group, prefix)
    return _int4(q, scales, zero, group, perm)


def _awq_values(words: torch.Tensor) -> torch.Tensor:
    """AWQ words [rows, n] -> values [rows, 8n] in output order (AWQ_ORDER undone)."""
    nibbles = _nibbles(words)  # [rows, n, 8], nibble i = output AWQ_ORDER[i]
    ordered = torch.empty_like(nibbles)
    ordered[..., list(AWQ_ORDER)] = nibbles
    return ordered.flatten(-2)


def _awq(checkpoint: Checkpoint, prefix: str) -> Int4Groups:
    q = _awq_values(checkpoint.tensor(f"{prefix}.qweight")).t()  # [out, in]
    scales = checkpoint.tensor(f"{prefix}.scales")
    zero = _awq_values(checkpoint.tensor(f"{prefix}.qzeros"))
    group = _group_of(q.shape[1], scales.shape[0], prefix)
    return _int4(q, scales, zero, group, None)


def _channel_scale(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-channel ([out], [out, 1]) or per-tensor ([], [1]) scale as float32 [out]."""
    return scale.float().reshape(-1).expand(rows).contiguous()


def _compressed(checkpoint: Checkpoint, prefix: str) -> Canonical | None:
    if f"{prefix}.weight_packed" in checkpoint:
        packed = checkpoint.tensor(f"{prefix}.weight_packed")  # [out, in / 8]
        out, cols = (int(v) for v in checkpoint.tensor(f"{prefix}.weight_shape").tolist())
        q = _along_last(packed)[:, :cols]
        scale = checkpoint.tensor(f"{prefix}.weight_scale").float()  # [out, groups]
        group = _group_of(cols, scale.shape[1], prefix)
        if f"{prefix}.weight_zero_point" in checkpoint:
            zero = _along_last(checkpoint.tensor(f"{prefix}.weight_zero_point").t())
            zero = zero[:, :out].float()  # [groups, out]: the signed zero point plus 8
        else:
            zero = torch.full((scale.shape[1], out), 8.0)
        perm = None
        if f"{prefix}.weight_g_idx" in checkpoint:
            perm = _act_order(checkpoint.tensor(f"{prefix}.weight_g_idx"), group, prefix)
        return _int4(q, scale.t(), zero, group, perm)
    if f"{prefix}.weight_scale" not in checkpoint:
        return None
    weight = checkpoint.tensor(f"{prefix}.weight")
    scale = _channel_scale(checkpoint.tensor(f"{prefix}.weight_scale"), weight.shape[0])
    if weight.dtype == torch.int8:
        return Int8Channels(weight, scale)
    if weight.dtype == torch.float8_e4m3fn:
        return Fp8Channels(weight, scale)
    raise ConfigError(
        f"{prefix}.weight is {weight.dtype} beside a weight_scale: tgis reads int8 and "
        "float8_e4m3fn weights",
        "check the checkpoint",
    )


def _fp8(checkpoint: Checkpoint, prefix: str, scheme: CheckpointQuant) -> Canonical | None:
    weight_name = f"{prefix}.weight"
    if weight_name not in checkpoint:
        return None
    if f"{prefix}.weight_scale_inv" in checkpoint:
        if scheme.block is None:
            raise ConfigError(
                f"{prefix} stores block scales and config.json names no weight_block_size",
                "check the checkpoint",
            )
        scale = checkpoint.tensor(f"{prefix}.weight_scale_inv").float()
        return Fp8Blocks(checkpoint.tensor(weight_name), scale, scheme.block).to_channels()
    if f"{prefix}.weight_scale" in checkpoint:
        weight = checkpoint.tensor(weight_name)
        scale = _channel_scale(checkpoint.tensor(f"{prefix}.weight_scale"), weight.shape[0])
        return Fp8Channels(weight, scale)
    return None


def read_linear(checkpoint: Checkpoint, prefix: str, scheme: CheckpointQuant) -> Canonical | None:
    """The canonical weight the checkpoint stores quantized for the nn.Linear at `prefix`, or
    None where it stores that projection in float."""
    if scheme.method in ("gptq", "awq"):
        if f"{prefix}.qweight" not in checkpoint:
            return None
        return (
            _gptq(checkpoint, prefix, scheme)
            if scheme.method == "gptq"
            else _awq(checkpoint, prefix)
        )
    if scheme.method == "compressed-tensors":
        return _compressed(checkpoint, prefix)
    return _fp8(checkpoint, prefix, scheme)


# --- the model -------------------------------------------------------------------------------


def attach_stored(
    model: nn.Module,
    checkpoint: Checkpoint,
    scheme: CheckpointQuant,
    part_of: Callable[[str], Part | None] | None = None,
) -> set[str]:
    """Read every quantized projection of `model` into its module's STORED attribute (the part
    `part_of(weight name)` names, under tensor parallelism); the names of the parameters they
    stand for, which stay on the meta device."""
    taken: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        try:
            canon = read_linear(checkpoint, name, scheme)
            if canon is None:
                continue
            part = part_of(f"{name}.weight") if part_of is not None else None
            if part is not None:
                canon = narrow(canon, *part)
            if canon.shape != (module.out_features, module.in_features):
                raise ConfigError(
                    f"{name}: the checkpoint stores a {list(canon.shape)} weight (this rank's "
                    f"part) for a [{module.out_features}, {module.in_features}] projection",
                    "check that config.json matches the weights",
                )
        except ValueError as e:
            raise ConfigError(f"{name}: {e}", "serve the model's float checkpoint") from e
        setattr(module, STORED, canon)
        taken.add(f"{name}.weight")
    if not taken:
        raise ConfigError(
            f"config.json declares {scheme.method} quantization and no projection of the "
            "checkpoint is stored quantized",
            "check the checkpoint, or remove its quantization_config",
        )
    return taken


def empty_model(config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The causal LM of `config` with its parameters on the meta device and its buffers on
    `device` (rotary tables and the like, which no checkpoint holds)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False), torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def float_state(
    model: nn.Module,
    checkpoint: Checkpoint,
    quantized: set[str],
    read: Callable[[str, str, torch.Tensor], torch.Tensor],
    rename: Callable[[str], str] | None = None,
) -> dict[str, torch.Tensor]:
    """`model`'s float tensors from `checkpoint`: `read(name, source, target)` for each entry
    of its state but the `quantized` ones (a tied lm_head read from the embeddings); a
    ConfigError naming the parameters the checkpoint lacks. `rename`: the checkpoint's name of
    the model's tensor (a vision-language checkpoint's language model); None: the same."""
    tied = bool(model.config.tie_word_embeddings)
    named = rename or (lambda name: name)
    state: dict[str, torch.Tensor] = {}
    for name, target in model.state_dict().items():
        if name in quantized:
            continue
        source = named(name)
        if source not in checkpoint and name == "lm_head.weight" and tied:
            source = named("model.embed_tokens.weight")
        if source in checkpoint:  # buffers (rotary tables) are built by the model itself
            state[name] = read(name, source, target)
    missing = [n for n, _ in model.named_parameters() if n not in state and n not in quantized]
    if missing:
        raise ConfigError(
            f"{checkpoint.model_dir}: the weights lack {missing[:3]}", "check the checkpoint"
        )
    return state


def load_quantized(
    model_dir: Path, config: Any, device: torch.device, dtype: torch.dtype, scheme: CheckpointQuant
) -> nn.Module:
    """The causal LM in `model_dir`, pre-quantized as `scheme` says, on `device`: float tensors
    in `dtype`, quantized projections as stored."""
    model = empty_model(config, dtype, device)
    with Checkpoint(model_dir) as checkpoint:
        quantized = attach_stored(model, checkpoint, scheme)

        def read(name: str, source: str, target: torch.Tensor) -> torch.Tensor:
            return checkpoint.tensor(source).to(device=device, dtype=target.dtype)

        state = float_state(model, checkpoint, quantized, read)
    return finish(model, state, quantized, scheme)


def finish(
    model: nn.Module, state: dict[str, torch.Tensor], quantized: set[str], scheme: CheckpointQuant
) -> nn.Module:
    """`model` (from `empty_model`, its quantized projections attached) with the float
    tensors of `state` assigned, ties restored, and its Quantization on it."""
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_word_embeddings and "lm_head.weight" not in quantized:
        model.tie_weights()
    setattr(model, QUANTIZATION, Quantization(scheme.method, scheme.group_size, scheme))
    logger.info("read %d quantized projections (%s)", len(quantized), scheme.describe())
    return model.eval()
