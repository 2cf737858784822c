"""tgis.backends.models.llama: which models the llama forwards run, and their weights in the
fused layouts — shared with the HF modules, every layout giving HF's logits. The model variants
and their HF reference logits here are what the paged and static forwards' tests compare to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, VARIANTS, greedy_reference, make_backend
from tests.backends.paged_driver import greedy, paged
from tests.factories import tiny_model
from tgis.backends.common.gemm import packing_available
from tgis.backends.models import decoder
from tgis.backends.models.families import paged_unsupported_reason as unsupported_reason
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine.backend import PackedItem, PrefillItem

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
        assert any(
            m.bias is not None and m.bias.abs().sum() > 0
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
        )
    return model


def check_packed_logits(
    backend: PagedTorchBackend,
    prompts: Sequence[tuple[int, ...]],
    continuation: tuple[int, ...],
    expected: Sequence[torch.Tensor],
) -> None:
    """`prompts` prefilled in one packed step (every position's logits), then the tokens of
    `continuation` decoded for all of them together: each row equals `expected[i]`, the
    reference logits of prompts[i] + continuation at every position."""
    tables = [tuple(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    out = backend.forward(
        [PackedItem(i, p, 0, tables[i], prompt_logits=True) for i, p in enumerate(prompts)]
    )
    for i, prompt in enumerate(prompts):
        assert out.prompt[i] is not None
        torch.testing.assert_close(out.prompt[i], expected[i][: len(prompt)], atol=1e-4, rtol=0)
        torch.testing.assert_close(out.last[i], expected[i][len(prompt) - 1], atol=1e-4, rtol=0)
    for step, token in enumerate(continuation):
        out = backend.forward(
            [PackedItem(i, (token,), len(p) + step, tables[i]) for i, p in enumerate(prompts)]
        )
        for i, prompt in enumerate(prompts):
            torch.testing.assert_close(
                out.last[i], expected[i][len(prompt) + step], atol=1e-4, rtol=0
            )


def hf_logits(model: PreTrainedModel, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def test_models_the_llama_forwards_refuse(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    assert unsupported_reason(tiny_lm("llama").config.to_dict()) is None
    assert "model_type 'gpt2'" in (unsupported_reason(tiny_lm("gpt2").config.to_dict()) or "")
    dynamic = tiny_lm("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "rope type 'dynamic'" in (unsupported_reason(dynamic.config.to_dict()) or "")
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        paged(dynamic)
    # The fallback engine serves it through transformers' forward, still exactly.
    backend = make_backend(dynamic)
    assert backend.path.name == "hf"
    out = backend.prefill([PrefillItem(0, PROMPTS[2])])
    assert int(out.last[0].argmax()) == greedy_reference(dynamic, PROMPTS[2], 1)[0]


def test_the_refusal_reads_every_spelling_of_a_configs_rope() -> None:
    """config.json names the rope as transformers 4 wrote it (`rope_scaling`, with `type` in
    older files) or as transformers 5 does (`rope_parameters`); no rope section is the
    default one."""
    llama = {"model_type": "mistral"}
    assert unsupported_reason(llama) is None
    assert unsupported_reason({**llama, "rope_scaling": None}) is None
    assert unsupported_reason({**llama, "rope_scaling": {"type": "linear", "factor": 2}}) is None
    for rope in ({"type": "dynamic"}, {"rope_type": "dynamic"}):
        assert "depends on the sequence length" in (
            unsupported_reason({**llama, "rope_scaling": rope}) or ""
        )
    # LongRoPE is Phi-3's: its forward takes it, another family's refuses it.
    longrope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    assert unsupported_reason({"model_type": "phi3", "rope_scaling": longrope}) is None
    assert unsupported_reason({**llama, "rope_scaling": longrope}) == (
        "rope type 'longrope' is not one mistral uses"
    )
    v5 = {**llama, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}
    assert "rope type 'dynamic'" in (unsupported_reason(v5) or "")
    assert unsupported_reason({"model_type": "gpt2"}) == (
        "model_type 'gpt2' is not one of the families it runs (llama, mistral, qwen2, "
        "qwen2_vl_text, qwen2_5_vl_text, qwen3, gemma, gemma2, gemma3_text, phi3, granite, "
        "olmo2, mixtral, qwen2_moe, qwen3_moe)"
    )


def test_fused_weights_are_shared_with_the_hf_modules() -> None:
    model = build("qwen2-untied-biases")
    before = sum(p.numel() for p in model.parameters())
    backend = paged(model)
    attn = model.model.layers[1].self_attn
    layer = backend.path.layers[1]
    q_rows = attn.q_proj.weight.shape[0]
    assert attn.q_proj.weight.data_ptr() == layer.qkv_w.data_ptr()
    assert attn.k_proj.weight.data_ptr() == layer.qkv_w[q_rows:].data_ptr()
    assert attn.v_proj.bias.data_ptr() == layer.qkv_b[-attn.v_proj.bias.numel() :].data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    # The HF modules still compute what they did: generate agrees with the paged forward.
    assert greedy(backend, [PROMPTS[0]], 5)[0] == greedy_reference(model, PROMPTS[0], 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gate_up_and_both_weight_layouts(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's layout choices on this CPU — gate and up fused into one matmul — in float32
    (weights transposed to [in, out]) and bfloat16 (HF's [out, in]): the paged forward's
    prompt and decode logits equal HF's float32 forward."""
    monkeypatch.setitem(decoder.FUSE_GATE_UP, "cpu", True)
    model = build("qwen2-untied-biases")
    reference = [hf_logits(model, p + CONTINUATION) for p in PROMPTS]
    backend = paged(model.to(dtype))
    assert backend.path.fuse_gate_up and len(backend.path.layers[0].mlp.gate_up_w) == 1
    assert backend.path.transposed == (dtype == torch.float32)
    atol = 1e-4 if dtype == torch.float32 else 0.02  # bf16 logits differ by ~4e-3 (std 0.16)
    tables = [tuple(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
    out = backend.forward(
        [PackedItem(i, p, 0, tables[i], prompt_logits=True) for i, p in enumerate(PROMPTS)]
    )
    for i, prompt in enumerate(PROMPTS):
        assert out.prompt[i] is not None
        torch.testing.assert_close(
            out.prompt[i].float(), reference[i][: len(prompt)], atol=atol, rtol=0
        )
    out = backend.forward(
        [PackedItem(i, (CONTINUATION[0],), len(p), tables[i]) for i, p in enumerate(PROMPTS)]
    )
    for i, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(
            out.last[i].float(), reference[i][len(prompt)], atol=atol, rtol=0
        )


@pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN packed linear")
@pytest.mark.parametrize("case", ["llama-tied", "llama-untied", "qwen2-untied-biases"])
def test_packed_weights_give_hf_logits_and_leave_one_copy(case: str) -> None:
    """Projections over oneDNN-packed weights (common/gemm.py): prompt and decode logits equal
    HF's; the HF modules' packed weights move to the meta device (one copy in memory) while
    biases and embeddings stay theirs; a tied lm_head is packed as a copy beside the
    embeddings, an untied one moves like the projections."""
    model = build(case)
    expected = [hf_logits(model, p + CONTINUATION) for p in PROMPTS]
    backend = paged(model, packed_weights=True)
    path = backend.path
    assert path.packed and not path.transposed
    check_packed_logits(backend, PROMPTS, CONTINUATION, expected)
    layer, attn = path.layers[1], model.model.layers[1].self_attn
    mlp = model.model.layers[1].mlp
    assert layer.qkv_w.is_mkldnn and layer.o_w.is_mkldnn and path.lm_head.is_mkldnn
    assert all(w.is_mkldnn for w in (*layer.mlp.gate_up_w, layer.mlp.down_w))
    for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.down_proj):
        assert linear.weight.is_meta
    if attn.q_proj.bias is not None:
        assert layer.qkv_b is not None and attn.q_proj.bias.data_ptr() == layer.qkv_b.data_ptr()
    embed = model.model.embed_tokens.weight
    assert not embed.is_meta and path.embed is embed
    tied = model.lm_head.weight is embed
    assert tied == model.config.tie_word_embeddings
    assert model.lm_head.weight.is_meta != tied


def test_packed_weights_are_for_the_eager_cpu_forward() -> None:
    with pytest.raises(ValueError, match="packed weights are for the eager forward on a CPU"):
        PagedTorchBackend(
            build("llama-tied"),
            max_sequences=2,
            max_sequence_tokens=32,
            max_prefill_tokens=32,
            kv_tokens=64,
            compile=True,
            packed_weights=True,
        )
