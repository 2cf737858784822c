"""Pre-quantized checkpoints built by hand in each format's layout (GPTQ v1 and v2 with and
without act-order, AWQ, compressed-tensors int4 / int8 / fp8, block-wise fp8): the loader reads
each projection back to exactly the weight the test quantized, and the served greedy tokens are
the dequantized reference model's."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS
from tests.backends.models.test_families import family_model, hf_logits
from tests.backends.models.test_quantized import (
    PROJECTIONS,
    TOLERANCE,
    _computing,
    check_greedy_choices,
    llama,
)
from tests.backends.paged_driver import greedy
from tgis.backends.common.quant import (
    Canonical,
    Fp8Blocks,
    Fp8Channels,
    Int4Groups,
    Int4Linear,
    Int8Channels,
)
from tgis.backends.common.quant_checkpoint import AWQ_ORDER, stored
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine.backend import PackedItem
from tgis.errors import ConfigError

NEW = 8
GROUP = 32
# Projections that read one input (and so share an act-order).
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up"}  # fmt: skip
FP8_BLOCK = (32, 32)


# --- packing by hand ---------------------------------------------------------------------


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 words, value j in bits 4j (as the formats store them)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (nibbles.to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_last(values: torch.Tensor) -> torch.Tensor:
    """[rows, 8m] -> [rows, m]: column 8c + j in nibble j of word c."""
    return _words(values.reshape(values.shape[0], -1, 8))


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, 8m] -> [rows, m]: nibble i of word c holds column 8c + AWQ_ORDER[i]."""
    grouped = values.reshape(values.shape[0], -1, 8)
    return _words(grouped[..., list(AWQ_ORDER)])


# --- quantizing by hand ------------------------------------------------------------------


@dataclass
class Int4:
    """A weight quantized in groups: q [out, in] (0..15, input order), zero and scale
    [groups, out], g_idx [in] (each column's group), order (columns in group order)."""

    q: torch.Tensor
    zero: torch.Tensor
    scale: torch.Tensor
    g_idx: torch.Tensor
    order: torch.Tensor | None

    def dequantized(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.q.float() - self.zero[g].t().float()) * self.scale[g].t().float()

    def canonical(self) -> Int4Groups:
        order = self.order
        q = self.q if order is None else self.q[:, order]
        return Int4Groups(q.to(torch.uint8), self.scale.float(), self.zero.float(), GROUP, order)


def int4_levels(w: torch.Tensor, act_order: bool, seed: int, symmetric: bool = False) -> Int4:
    out, cols = w.shape
    order = (
        torch.randperm(cols, generator=torch.Generator().manual_seed(seed)) if act_order else None
    )
    columns = order if order is not None else torch.arange(cols)
    grouped = w[:, columns].reshape(out, cols // GROUP, GROUP)
    if symmetric:
        scale = (grouped.abs().amax(-1) / 7.5).clamp(min=1e-4).half()
        zero = torch.full_like(scale, 8.0, dtype=torch.float32)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-4).half()
        zero = torch.round(-low / scale.float()).clamp(1, 15)  # >= 1: v1 stores zero - 1
    q = (torch.round(grouped / scale.float()[..., None]) + zero[..., None]).clamp(0, 15)
    q_input = torch.empty(out, cols)
    q_input[:, columns] = q.reshape(out, cols)
    g_idx = torch.empty(cols, dtype=torch.int32)
    g_idx[columns] = (torch.arange(cols) // GROUP).to(torch.int32)
    return Int4(q_input.long(), zero.t().long(), scale.t().contiguous(), g_idx, order)


# --- the formats -----------------------------------------------------------------------------

# A format: its quantization_config, and (float weight, seed) -> (stored tensors by suffix,
# the canonical weight the test computed, the float weight it stands for).
Written = tuple[dict[str, torch.Tensor], Canonical, torch.Tensor]


def gptq(version: str, act_order: bool) -> tuple[dict[str, Any], Callable[..., Written]]:
    config = {
        "quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order,
        "sym": False, "checkpoint_format": version,
    }  # fmt: skip

    def write(w: torch.Tensor, seed: int) -> Written:
        levels = int4_levels(w, act_order, seed)
        stored_zero = levels.zero - (1 if version == "gptq" else 0)
        tensors = {
            # [in / 8, out]: input row 8i + j in nibble j of word (i, n).
            "qweight": _words(levels.q.t().reshape(-1, 8, w.shape[0]).transpose(1, 2)),
            "qzeros": pack_along_last(stored_zero),
            "scales": levels.scale,
            "g_idx": levels.g_idx,
        }
        return tensors, levels.canonical(), levels.dequantized()

    return config, write


def awq() -> tuple[dict[str, Any], Callable[..., Written]]:
    config = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
              "version": "gemm"}  # fmt: skip

    def write(w: torch.Tensor, seed: int) -> Written:
        levels = int4_levels(w, False, seed)
        tensors = {
            "qweight": pack_awq(levels.q.t().contiguous()),
            "qzeros": pack_awq(levels.zero),
            "scales": levels.scale,
        }
        return tensors, levels.canonical(), levels.dequantized()

    return config, write


def compressed_int4(symmetric: bool) -> tuple[dict[str, Any], Callable[..., Written]]:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": GROUP, "dynamic": False}  # fmt: skip
    config = _compressed("pack-quantized", weights)

    def write(w: torch.Tensor, seed: int) -> Written:
        levels = int4_levels(w, False, seed, symmetric=symmetric)
        # The format stores signed values plus 8: q - 8, and the signed zero point zero - 8.
        tensors = {
            "weight_packed": pack_along_last(levels.q),
            "weight_scale": levels.scale.t().contiguous(),
            "weight_shape": torch.tensor(list(w.shape)),
        }
        if not symmetric:
            tensors["weight_zero_point"] = pack_along_last(levels.zero).t().contiguous()
        return tensors, levels.canonical(), levels.dequantized()

    return config, write


def _compressed(fmt: str, weights: dict[str, Any]) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors", "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None}},
        "ignore": ["lm_head"], "quantization_status": "compressed",
    }  # fmt: skip


def compressed_int8() -> tuple[dict[str, Any], Callable[..., Written]]:
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    config = _compressed("int-quantized", weights)

    def write(w: torch.Tensor, seed: int) -> Written:
        canon = Int8Channels.quantize(w)
        scale = canon.scale.to(torch.bfloat16).float()  # stored in bf16, as llm-compressor does
        tensors = {"weight": canon.q, "weight_scale": scale.to(torch.bfloat16)[:, None]}
        return tensors, Int8Channels(canon.q, scale), canon.q.float() * scale[:, None]

    return config, write


def compressed_fp8(strategy: str) -> tuple[dict[str, Any], Callable[..., Written]]:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy}
    config = _compressed("float-quantized", weights)

    def write(w: torch.Tensor, seed: int) -> Written:
        if strategy == "tensor":
            scale = (w.abs().amax() / 448.0).expand(w.shape[0]).contiguous()
        else:
            scale = w.abs().amax(dim=1) / 448.0
        q = (w / scale[:, None]).to(torch.float8_e4m3fn)
        stored_scale = scale[:1] if strategy == "tensor" else scale[:, None]
        tensors = {"weight": q, "weight_scale": stored_scale.contiguous()}
        return tensors, Fp8Channels(q, scale), q.float() * scale[:, None]

    return config, write


def fp8_blocks() -> tuple[dict[str, Any], Callable[..., Written]]:
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": list(FP8_BLOCK)}  # fmt: skip

    def write(w: torch.Tensor, seed: int) -> Written:
        rows, cols = FP8_BLOCK
        blocks = w.reshape(w.shape[0] // rows, rows, w.shape[1] // cols, cols)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
        canon = Fp8Blocks(q, scale, FP8_BLOCK)
        return {"weight": q, "weight_scale_inv": scale}, canon.to_channels(), canon.dequantize()

    return config, write


FORMATS = {
    "gptq-v1": gptq("gptq", act_order=False),
    "gptq-v1-act-order": gptq("gptq", act_order=True),
    "gptq-v2": gptq("gptq_v2", act_order=False),
    "awq": awq(),
    "compressed-int4-sym": compressed_int4(symmetric=True),
    "compressed-int4-asym": compressed_int4(symmetric=False),
    "compressed-int8": compressed_int8(),
    "compressed-fp8-channel": compressed_fp8("channel"),
    "compressed-fp8-tensor": compressed_fp8("tensor"),
    "fp8-blocks": fp8_blocks(),
}


@dataclass
class HandMade:
    model_dir: Path
    canonical: dict[str, Canonical]  # module name -> what the test quantized
    dequantized: dict[str, torch.Tensor]


def write_checkpoint(model: PreTrainedModel, directory: Path, fmt: str) -> HandMade:
    """`model`'s checkpoint in `fmt`, every projection quantized by hand and packed in the
    format's layout; the float tensors (embeddings, norms, lm_head) as they are."""
    config, write = FORMATS[fmt]
    directory.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    canonical: dict[str, Canonical] = {}
    dequantized: dict[str, torch.Tensor] = {}
    inputs: dict[str, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        # Projections of one input share GPTQ's act-order (it follows that input's statistics).
        parent, leaf = name.rsplit(".", 1)
        seed = inputs.setdefault(f"{parent}.{SHARED_INPUT.get(leaf, leaf)}", len(inputs))
        tensors, canon, w = write(module.weight.detach().float(), seed)
        del state[f"{name}.weight"]
        state.update({f"{name}.{suffix}": t.contiguous() for suffix, t in tensors.items()})
        canonical[name], dequantized[name] = canon, w
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config_dict = model.config.to_dict()
    config_dict["quantization_config"] = config
    (directory / "config.json").write_text(json.dumps(config_dict))
    return HandMade(directory, canonical, dequantized)


def reference_model(model: PreTrainedModel, written: HandMade) -> PreTrainedModel:
    """`model` with each projection computing the test's quantized weight as its kernel does."""
    copy_ = copy.deepcopy(model)
    for name, module in copy_.named_modules():
        if name in written.canonical:
            module.forward = _computing(written.canonical[name], torch.float32, module.bias)  # type: ignore[method-assign]
    return copy_


def backend_over(model_dir: Path) -> PagedTorchBackend:
    return PagedTorchBackend.load(
        model_dir, "cpu", "float32", max_sequences=16, max_sequence_tokens=64,
        max_prefill_tokens=64, kv_tokens=128,
    )  # fmt: skip


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_served_greedy_tokens_are_the_dequantized_references(tmp_path: Path, fmt: str) -> None:
    model = llama(seed=31)
    written = write_checkpoint(model, tmp_path / fmt, fmt)
    backend = backend_over(written.model_dir)
    loaded = backend.model
    for name, w in written.dequantized.items():
        canon = stored(loaded.get_submodule(name))
        assert canon is not None, name
        if fmt == "fp8-blocks":
            # Served per channel: one more e4m3 rounding of each block (quant.Fp8Blocks).
            torch.testing.assert_close(canon.dequantize(), w, rtol=0.07, atol=1e-6)
        else:
            assert torch.equal(canon.dequantize(), w), name
    assert backend.runtime()["quantization"] == FORMATS[fmt][0]["quant_method"]
    reference = reference_model(model, written)
    for prompt, served in zip(PROMPTS, greedy(backend, PROMPTS, NEW), strict=True):
        check_greedy_choices(reference, prompt, served)
    out = backend.forward([PackedItem(0, PROMPTS[2], 0, tuple(range(4)), prompt_logits=True)])
    assert out.prompt[0] is not None
    torch.testing.assert_close(
        out.prompt[0], hf_logits(reference, PROMPTS[2]), atol=TOLERANCE, rtol=0
    )


def test_act_order_columns_are_permuted_into_their_groups(tmp_path: Path) -> None:
    written = write_checkpoint(llama(seed=32), tmp_path / "g", "gptq-v1-act-order")
    backend = backend_over(written.model_dir)
    qkv = backend.path.layers[0].qkv_w
    assert isinstance(qkv, Int4Linear) and qkv.perm is not None
    q_proj = stored(backend.model.get_submodule("model.layers.0.self_attn.q_proj"))
    assert isinstance(q_proj, Int4Groups) and q_proj.perm is not None


def test_a_moe_checkpoint_serves_its_experts_from_the_stored_weights(tmp_path: Path) -> None:
    model = family_model("mixtral", seed=33)
    written = write_checkpoint(model, tmp_path / "moe", "gptq-v2")
    backend = backend_over(written.model_dir)
    mlp = backend.path.layers[0].mlp
    assert mlp.expert_kernels is not None
    reference = reference_model(model, written)
    for prompt, served in zip(PROMPTS, greedy(backend, PROMPTS, NEW), strict=True):
        check_greedy_choices(reference, prompt, served)


def test_weights_stay_quantized_and_are_counted(tmp_path: Path) -> None:
    model = llama(seed=34)
    float_bytes = sum(p.numel() * 4 for p in model.parameters())
    written = write_checkpoint(model, tmp_path / "awq", "awq")
    backend = backend_over(written.model_dir)
    assert backend.model.model.layers[0].self_attn.q_proj.weight.is_meta
    assert backend.weight_bytes < 0.7 * float_bytes  # embeddings and lm_head stay float32
    assert backend.weights.startswith("quantized: awq checkpoint, 4-bit weights in groups of 32")


def test_a_checkpoint_that_stores_nothing_quantized_is_refused(tmp_path: Path) -> None:
    model = llama(seed=35)
    directory = tmp_path / "plain"
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = FORMATS["gptq-v2"][0]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no projection of the checkpoint is stored quantized"):
        backend_over(directory)


def test_autogptqs_quantize_config_json_declares_the_checkpoint(tmp_path: Path) -> None:
    """AutoGPTQ checkpoints may declare their quantization only in quantize_config.json (no
    quant_method in it): the model's facts and the loader read it as GPTQ."""
    from tgis.hub import read_model_facts

    written = write_checkpoint(llama(seed=36), tmp_path / "autogptq", "gptq-v1")
    config_path = written.model_dir / "config.json"
    config = json.loads(config_path.read_text())
    declared = config.pop("quantization_config")
    del declared["quant_method"], declared["checkpoint_format"]
    config_path.write_text(json.dumps(config))
    (written.model_dir / "quantize_config.json").write_text(json.dumps(declared))
    facts = read_model_facts(written.model_dir)
    assert facts.config["quantization_config"]["quant_method"] == "gptq"
    backend = backend_over(written.model_dir)
    assert backend.runtime()["quantization"] == "gptq"
    q_proj = stored(backend.model.get_submodule("model.layers.0.self_attn.q_proj"))
    assert q_proj is not None
    assert torch.equal(q_proj.dequantize(), written.dequantized["model.layers.0.self_attn.q_proj"])
