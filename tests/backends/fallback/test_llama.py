"""The native llama-family forward: the same logits as the HF model, for every variant it
accepts, and a clear refusal (or the generic path) for the ones it does not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, VARIANTS, greedy_reference, make_backend
from tests.factories import tiny_model
from tgis.backends.fallback.backend import TorchDynamicBackend
from tgis.backends.fallback.forward import DecodeBatch, PrefillSegment
from tgis.backends.fallback.llama import LlamaNativeForward
from tgis.backends.fallback.slot_cache import SlotKVCache
from tgis.backends.models.llama import native_unsupported_reason
from tgis.engine.backend import PrefillItem
from tgis.errors import ConfigError

CONTINUATION = (11, 250, 4, 4, 97)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# name -> (variant, overrides, give every linear layer a random bias)
CASES: dict[str, tuple[str, dict[str, object], bool]] = {
    "llama-tied": ("llama", {}, False),
    "llama-untied": ("llama", {"tie_word_embeddings": False}, False),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}, True),
    "llama-head-dim-32": ("llama", {"head_dim": 32}, False),
    "llama3-rope": (
        "llama",
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
        False,
    ),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, False),
    "mistral": ("mistral", {"rope_theta": 1e6}, False),
    "qwen2-untied-biases": ("qwen2", {"tie_word_embeddings": False}, True),
    "qwen2-tied-biases": ("qwen2", {"tie_word_embeddings": True}, True),
}


def build(case: str) -> PreTrainedModel:
    """A fresh model for `case` (not the session's shared ones: biases are set in place)."""
    variant, overrides, biases = CASES[case]
    arch, fields = VARIANTS[variant]
    model = tiny_model(arch, seed=1, **{**fields, **overrides})  # type: ignore[arg-type]
    if biases:
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
    return model


def hf_logits(model: PreTrainedModel, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("case", CASES)
def test_native_logits_equal_hf_logits(case: str) -> None:
    model = build(case)
    if CASES[case][2]:
        assert any(
            m.bias is not None and m.bias.abs().sum() > 0
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
        )
    backend = make_backend(model, native=True)
    assert isinstance(backend.path, LlamaNativeForward)
    out = backend.prefill([PrefillItem(i, p, prompt_logprobs=True) for i, p in enumerate(PROMPTS)])
    expected = [hf_logits(model, p + CONTINUATION) for p in PROMPTS]
    for i, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(out.prompt[i], expected[i][: len(prompt)], atol=1e-4, rtol=0)
    # Teacher-forced decode of a fixed continuation, rows of different lengths together.
    for step, token in enumerate(CONTINUATION[:-1]):
        logits = backend.decode([2, 0, 1], [token] * 3)
        for row, i in enumerate([2, 0, 1]):
            position = len(PROMPTS[i]) + step
            torch.testing.assert_close(logits[row], expected[i][position], atol=1e-4, rtol=0)


def test_fused_weights_are_shared_with_the_hf_modules(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    model = build("qwen2-untied-biases")  # this test's own model: the backend takes it
    before = sum(p.numel() for p in model.parameters())
    path = TorchDynamicBackend(
        model, max_sequences=2, max_sequence_tokens=32, kv_tokens=64, native=True
    ).path
    assert isinstance(path, LlamaNativeForward)
    attn = model.model.layers[1].self_attn
    fused = path.layers[1].qkv_w
    q_rows = attn.q_proj.weight.shape[0]
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert attn.k_proj.weight.data_ptr() == fused[q_rows:].data_ptr()
    assert (
        attn.v_proj.bias.data_ptr() == path.layers[1].qkv_b[-attn.v_proj.bias.numel() :].data_ptr()
    )
    assert sum(p.numel() for p in model.parameters()) == before
    # The HF modules still compute what they did: generate agrees with the backend.
    backend = make_backend(model)
    expected = greedy_reference(model, PROMPTS[0], 5)
    out = backend.prefill([PrefillItem(0, PROMPTS[0])])
    tokens = [int(out.last[0].argmax())]
    for _ in range(4):
        tokens.append(int(backend.decode([0], [tokens[-1]])[0].argmax()))
    assert tokens == expected


def test_models_the_native_path_refuses(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    assert "model_type 'gpt2'" in (native_unsupported_reason(tiny_lm("gpt2")) or "")
    dynamic = tiny_lm("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "rope type 'dynamic'" in (native_unsupported_reason(dynamic) or "")
    # Left to choose, the backend serves it on the generic path, still exactly.
    backend = make_backend(dynamic)
    assert backend.path.name == "hf"
    out = backend.prefill([PrefillItem(0, PROMPTS[2])])
    assert int(out.last[0].argmax()) == greedy_reference(dynamic, PROMPTS[2], 1)[0]


def test_sliding_window_attention_is_exact() -> None:
    """mistral with a 6-token window, prompts longer than it, prefilled in chunks of 4 and
    decoded as a ragged batch: logits equal HF's full forward (which applies the window)."""
    arch, fields = VARIANTS["mistral"]
    model = tiny_model(arch, seed=2, **{**fields, "sliding_window": 6})  # type: ignore[arg-type]
    prompts = (PROMPTS[0], PROMPTS[2])
    backend = TorchDynamicBackend(
        model,
        max_sequences=2,
        max_sequence_tokens=32,
        kv_tokens=64,
        native=True,
        prefill_chunk_tokens=4,
    )
    out = backend.prefill([PrefillItem(i, p, prompt_logprobs=True) for i, p in enumerate(prompts)])
    expected = [hf_logits(model, p + CONTINUATION) for p in prompts]
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(out.prompt[i], expected[i][: len(prompt)], atol=1e-4, rtol=0)
    for step, token in enumerate(CONTINUATION[:-1]):
        logits = backend.decode([0, 1], [token, token])
        for i, prompt in enumerate(prompts):
            torch.testing.assert_close(
                logits[i], expected[i][len(prompt) + step], atol=1e-4, rtol=0
            )
    with pytest.raises(ConfigError, match="sliding window of 6 tokens"):
        make_backend(model, native=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gate_up_and_weight_layouts(dtype: torch.dtype) -> None:
    """The CUDA defaults (fused gate/up, [out, in] weights) and bf16, through the ForwardPath
    interface directly: prefill segments into chosen slots, then decode them as a batch."""
    model = build("qwen2-untied-biases")
    reference = [hf_logits(model, p + CONTINUATION) for p in PROMPTS]
    model = model.to(dtype)
    cache = SlotKVCache(2, 4, 2, 32, 16, dtype, "cpu")
    path = LlamaNativeForward(model, cache, fuse_gate_up=True)
    assert path.transposed == (dtype == torch.float32)
    assert len(path.layers[0].gate_up_w) == 1
    atol = 1e-4 if dtype == torch.float32 else 0.02  # bf16 logits differ by ~4e-3 (std 0.16)
    slots = [3, 0, 1]  # any slots: the path does what the backend tells it
    segments = [
        PrefillSegment(s, 0, p, all_logits=True) for s, p in zip(slots, PROMPTS, strict=True)
    ]
    for logits, expected, prompt in zip(path.prefill(segments), reference, PROMPTS, strict=True):
        torch.testing.assert_close(logits, expected[: len(prompt)], atol=atol, rtol=0)
    lengths = [len(p) for p in PROMPTS]
    batch = DecodeBatch(
        input_ids=torch.tensor([CONTINUATION[0]] * 3),
        positions=torch.tensor(lengths),
        kv_len=max(lengths) + 1,
        ragged=True,
        slots=torch.tensor(slots),
    )
    logits = path.decode(batch)
    for row, expected in enumerate(reference):
        torch.testing.assert_close(logits[row], expected[lengths[row]], atol=atol, rtol=0)
