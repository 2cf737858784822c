"""Quantized weights in the paged forward of every family: the served greedy tokens are those of
the dequantized reference model (transformers' own forward with each projection computing its
quantized weight's pure-torch arithmetic, common/quant.py's `reference`), and its logits agree
with that model's; LoRA adapters stay in the model's dtype on top of the quantized projections;
the HF model's float weights leave memory."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from tests.backends.conftest import PROMPTS
from tests.backends.models.test_families import NEW_FAMILIES, _store, family_model, hf_logits
from tests.backends.paged_driver import greedy, paged
from tests.factories import make_lora_adapter
from tgis.backends.common.quant import Canonical, Int4Linear, Int8Linear, Quantization, reference
from tgis.backends.common.quant_bnb import FourBitLinear, LlmInt8Linear
from tgis.backends.models.moe import MoeMlp
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.config.types import BITSANDBYTES_METHODS
from tgis.engine.backend import PackedItem

NEW = 8
# How far the served logits may be from the dequantized reference's (whose logits spread with
# a standard deviation of ~0.16 in these tiny models): the CPU kernels read bfloat16 activations
# and write bfloat16 outputs, the fp8 kernel rounds each token's activations to e4m3, and HF's
# attention sums in another order than the paged forward's.
TOLERANCE = 2e-2
# The projections the forward quantizes, by module name: attention's, the MLP's and every
# expert's (routers and shared-expert gates stay in the model's dtype).
PROJECTIONS = {
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
    "gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3",
}  # fmt: skip
METHODS = [
    pytest.param(Quantization("int8"), id="int8"),
    pytest.param(Quantization("int4", 32), id="int4-g32"),
    # The fp8 kernel (CUDA's) runs on the CPU through torch._scaled_mm's CPU implementation.
    pytest.param(Quantization("fp8"), id="fp8"),
]


def llama(seed: int = 0) -> PreTrainedModel:
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def model_of(name: str, seed: int) -> PreTrainedModel:
    return llama(seed) if name == "llama" else family_model(name, seed=seed)


def quantized_reference(model: PreTrainedModel, quantization: Quantization) -> PreTrainedModel:
    """A copy of `model` whose projections (and lm_head, as `quantization` says) compute their
    quantized weight's reference arithmetic, each quantized on its own."""
    model_copy = copy.deepcopy(model)
    dtype = next(model.parameters()).dtype
    for name, module in model_copy.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if name == "lm_head":
            canon = quantization.head(module.weight.detach())
        elif leaf in PROJECTIONS:
            canon = quantization.quantize(module.weight.detach())
        else:
            continue
        if canon is None:
            continue
        module.forward = _computing(canon, dtype, module.bias)  # type: ignore[method-assign]
    return model_copy


def _computing(
    canon: Canonical, dtype: torch.dtype, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = reference(canon, x, dtype).to(x.dtype)
        return out if bias is None else out + bias

    return forward


def quantized(model: PreTrainedModel, quantization: Quantization) -> PagedTorchBackend:
    return PagedTorchBackend(
        model, max_sequences=16, max_sequence_tokens=64, max_prefill_tokens=64,
        kv_tokens=128, block_size=4, quantization=quantization,
    )  # fmt: skip


def check_greedy_choices(
    reference: PreTrainedModel, prompt: tuple[int, ...], served: list[int]
) -> None:
    """Each token served after `prompt` is a greedy choice of the reference over the same
    tokens: its logit within TOLERANCE of the reference's best at that step (the kernels'
    bfloat16 rounding may swap two logits that close; HF's attention sums in another order)."""
    logits = hf_logits(reference, (*prompt, *served))[len(prompt) - 1 : -1]
    for step, (row, token) in enumerate(zip(logits, served, strict=True)):
        best = int(row.argmax())
        assert row[token] >= row[best] - TOLERANCE, (
            f"step {step}: served {token} (logit {row[token]:.4f}) where the reference's best "
            f"is {best} ({row[best]:.4f})"
        )


@pytest.mark.parametrize("quantization", METHODS)
@pytest.mark.parametrize("name", ["llama", *NEW_FAMILIES])
def test_greedy_tokens_are_the_dequantized_references(
    name: str, quantization: Quantization
) -> None:
    """Alone and batched, every served token is the reference's greedy choice (up to a
    near-tie), and the prompt's logits are the reference's within TOLERANCE."""
    model = model_of(name, seed=21)
    reference = quantized_reference(model, quantization)
    prompt_logits = hf_logits(reference, PROMPTS[2])
    backend = quantized(model, quantization)
    batched = greedy(backend, PROMPTS, NEW)
    alone = [greedy(backend, [p], NEW)[0] for p in PROMPTS]
    for prompt, served in [*zip(PROMPTS, batched, strict=True), *zip(PROMPTS, alone, strict=True)]:
        check_greedy_choices(reference, prompt, served)
    out = backend.forward([PackedItem(0, PROMPTS[2], 0, tuple(range(4)), prompt_logits=True)])
    assert out.prompt[0] is not None
    torch.testing.assert_close(out.prompt[0], prompt_logits, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("method", BITSANDBYTES_METHODS)
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_bitsandbytes_methods_serve_the_dequantized_references_tokens(
    name: str, method: str
) -> None:
    """--quantize bitsandbytes (LLM.int8()), -nf4 and -fp4 through bitsandbytes' own kernels
    (its CPU ones here): every projection and expert holds the package's weights, the lm_head
    stays in the model's dtype, and the served tokens and prompt logits are the reference
    model's, whose projections compute quant_bnb.reference."""
    model = model_of(name, seed=24)
    quantization = Quantization(method)
    reference = quantized_reference(model, quantization)
    prompt_logits = hf_logits(reference, PROMPTS[1])
    backend = quantized(model, quantization)
    layer = backend.path.layers[0]
    kind = LlmInt8Linear if method == "bitsandbytes" else FourBitLinear
    assert isinstance(layer.qkv_w, kind) and layer.qkv_w.method == method
    if isinstance(layer.mlp, MoeMlp):
        assert layer.mlp.expert_kernels is not None
        assert all(isinstance(k, kind) for pair in layer.mlp.expert_kernels for k in pair)
    assert isinstance(backend.path.lm_head, torch.Tensor)
    assert backend.runtime()["quantization"] == method
    assert backend.weights.startswith("quantized: bitsandbytes")
    for prompt, served in zip(PROMPTS, greedy(backend, PROMPTS, NEW), strict=True):
        check_greedy_choices(reference, prompt, served)
    out = backend.forward([PackedItem(0, PROMPTS[1], 0, tuple(range(4)), prompt_logits=True)])
    assert out.prompt[0] is not None
    torch.testing.assert_close(out.prompt[0], prompt_logits, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen2_moe"])
def test_the_weights_are_quantized_and_the_floats_released(name: str) -> None:
    model = model_of(name, seed=22)
    full = paged(copy.deepcopy(model)).weight_bytes
    backend = quantized(model, Quantization("int8"))
    layer = backend.path.layers[0]
    assert isinstance(layer.qkv_w, Int8Linear) and isinstance(layer.o_w, Int8Linear)
    assert isinstance(backend.path.lm_head, torch.Tensor)  # int8 keeps it in the model's dtype
    if isinstance(layer.mlp, MoeMlp):
        assert layer.mlp.expert_kernels is not None and not layer.mlp.runs_grouped
        assert layer.mlp.gate_up.is_meta and layer.mlp.down.is_meta
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta
    # int8 projections: under 60% of float32's bytes, with the embeddings and lm_head whole.
    assert backend.weight_bytes < 0.6 * full
    assert backend.runtime()["quantization"] == "int8"
    assert backend.runtime()["weight_bytes"] == backend.weight_bytes
    assert backend.weights.startswith("quantized: int8")


def test_int4_packs_every_projection_and_keeps_lm_head_int8() -> None:
    backend = quantized(llama(), Quantization("int4", 64))
    layer = backend.path.layers[0]
    assert isinstance(layer.qkv_w, Int4Linear) and layer.qkv_w.group == 64
    assert len(layer.mlp.gate_up_w) == 1  # gate and up fused: one kernel call
    assert isinstance(backend.path.lm_head, Int8Linear)


def test_lora_adapters_stay_in_the_models_dtype_over_quantized_projections(
    tmp_path: Path,
) -> None:
    """An adapter's update adds to the quantized projection's output: the served logits are the
    dequantized reference's with each adapted projection's float delta (merged weight less
    base weight, in float32) added to its output; rows without the adapter are the
    reference's alone."""
    base = llama(seed=23)
    quantization = Quantization("int8")
    merged = make_lora_adapter(base, tmp_path / "a", seed=7)
    adapter = _store(base, {"a": tmp_path / "a"}).get("a")
    plain = quantized_reference(base, quantization)
    adapted = quantized_reference(base, quantization)
    merged_weights = dict(merged.named_parameters())
    for name, module in adapted.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            delta = merged_weights[f"{name}.weight"].detach() - module.weight.detach()
            module.forward = _plus(module.forward, delta)  # type: ignore[method-assign]
    prompt = PROMPTS[0]
    backend = quantized(base, quantization)
    out = backend.forward(
        [
            PackedItem(0, prompt, 0, (0, 1), prompt_logits=True, adapter=adapter),
            PackedItem(1, prompt, 0, (2, 3), prompt_logits=True),
        ]
    ).prompt
    assert out[0] is not None and out[1] is not None
    torch.testing.assert_close(out[0], hf_logits(adapted, prompt), atol=2e-3, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(plain, prompt), atol=2e-3, rtol=0)
    assert not torch.allclose(out[0], out[1], atol=0.1)


def _plus(
    forward: Callable[[torch.Tensor], torch.Tensor], delta: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    def adapted(x: torch.Tensor) -> torch.Tensor:
        return forward(x) + F.linear(x, delta)

    return adapted


def test_llm_int8_decodes_without_graphs_and_refuses_to_record_them() -> None:
    """LLM.int8()'s kernel reads its outlier columns on the host: where decode graphs would be
    recorded they are not (and asking for them is a ConfigError); nf4's kernel records."""
    from tests.backends.paged.test_backend import EagerDecodeApi
    from tgis.errors import ConfigError

    def backend(method: str, cuda_graphs: bool | None = None) -> PagedTorchBackend:
        return PagedTorchBackend(
            llama(), max_sequences=2, max_sequence_tokens=64, max_prefill_tokens=64,
            kv_tokens=128, block_size=4, graph_api=EagerDecodeApi(), cuda_graphs=cuda_graphs,
            quantization=Quantization(method),
        )  # fmt: skip

    assert backend("bitsandbytes").graphs is None
    assert backend("bitsandbytes-nf4").graphs is not None
    with pytest.raises(ConfigError, match="outlier columns on the host"):
        backend("bitsandbytes", cuda_graphs=True)


def test_compile_is_refused_with_bitsandbytes_weights() -> None:
    """torch's kernels fold into compiled graphs (tests/backends/paged/test_compile.py);
    bitsandbytes' run eagerly, and the backend says so."""
    from tgis.errors import ConfigError

    with pytest.raises(ConfigError, match="bitsandbytes' kernels run eagerly"):
        PagedTorchBackend(
            llama(), max_sequences=2, max_sequence_tokens=64, max_prefill_tokens=64,
            kv_tokens=128, block_size=4, compile=True,
            quantization=Quantization("bitsandbytes-nf4"),
        )  # fmt: skip
