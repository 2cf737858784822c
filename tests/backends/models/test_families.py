"""tgis.backends.models.families on the paged engine: a tiny random model of every family, with
the family's special settings switched on, gives transformers' logits and generate()'s greedy
tokens alone, batched with different lengths, across chunked prefill, preemption and
prefix-cache hits; LoRA adapters on each family's projection names give the merged model's
logits."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.backends.conftest import PROMPTS, greedy_reference
from tests.backends.models.test_decoder import check_packed_logits
from tests.backends.paged.test_backend import check_chunked_and_preempted, check_prefix_cache_hits
from tests.backends.paged_driver import greedy, paged
from tests.factories import make_lora_adapter
from tgis.adapter_store import AdapterStore, LoraShapes
from tgis.backends.common.gemm import packing_available
from tgis.backends.models.families import FAMILIES, family_of, paged_unsupported_reason
from tgis.backends.models.moe import MoeMlp
from tgis.engine.backend import PackedItem
from tgis.errors import InputValidationError

NEW = 8
# Every family's tiny shape: several layers, grouped-query attention, widths that are
# multiples of 8 (the grouped expert matmul's alignment).
_BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}
_GEMMA2_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
# family -> (model_type, its special settings)
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            # Caps low enough to bend the tiny model's scores and logits.
            "attn_logit_softcapping": 0.05,
            "final_logit_softcapping": 0.5,
            "sliding_window": 6,
            "layer_types": _GEMMA2_LAYERS,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 6,
            "layer_types": _GEMMA2_LAYERS,
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "final_logit_softcapping": 0.5,
        },
    ),
    "phi3": (
        "phi3",
        {
            "partial_rotary_factor": 0.5,
            # Long factors from position 64 on (the tests' sequences stay below; generate()
            # recomputes a sequence that crosses it: test_phi3_long_rope_...).
            "original_max_position_embeddings": 64,
            "max_position_embeddings": 256,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [1.5, 2.0, 3.0, 4.0],
            },
        },
    ),
    "granite": (
        "granite",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.1,
            "logits_scaling": 8.0,
        },
    ),
    "olmo2": ("olmo2", {}),
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [2],
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        },
    ),
}
# The llama family has its own tests (test_decoder.py); Qwen2-VL's language model exists only
# behind its vision tower (tests/server/test_vision_routes.py, tests/backends/models/
# test_mrope.py); every other family is tested here.
NEW_FAMILIES = [f.name for f in FAMILIES if f.name not in ("llama", "mistral", "qwen2", "qwen2_vl")]


def family_model(name: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A float32 random model of family `name` with its special settings (fresh each call:
    the backend re-points its weights)."""
    from transformers import AutoConfig

    model_type, settings = SETTINGS[name]
    config = AutoConfig.for_model(model_type, **{**_BASE, **settings, **overrides})
    torch.manual_seed(seed)
    # Eager attention: transformers' SDPA path drops Gemma 2's soft-capping.
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    # Random norms (transformers starts them at 1, or 0 for Gemma's 1 + w) so that a norm
    # applied in the wrong place, or with the wrong offset, changes the logits.
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for module_name, param in model.named_parameters():
            if "norm" in module_name:
                param.copy_(param + 0.3 * torch.randn(param.shape, generator=generator))
    return model


def hf_logits(model: PreTrainedModel, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def hf_incremental_logits(
    model: PreTrainedModel, prompt: tuple[int, ...], continuation: tuple[int, ...]
) -> torch.Tensor:
    """transformers' logits as generate() computes them: the prompt in one forward, then one
    token at a time over its KV cache -> [len(prompt) + len(continuation), vocab]."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        rows, cache = [out.logits[0]], out.past_key_values
        for position, token in enumerate(continuation, start=len(prompt)):
            out = model(
                torch.tensor([[token]]),
                past_key_values=cache,
                position_ids=torch.tensor([[position]]),
                cache_position=torch.tensor([position]),
                use_cache=True,
            )
            rows.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(rows).float()


def test_every_new_family_has_a_tested_model() -> None:
    assert sorted(SETTINGS) == sorted(NEW_FAMILIES)
    for name, (model_type, _) in SETTINGS.items():
        family = family_of({"model_type": model_type})
        assert family is not None and family.name == name


# The layouts of the weights the forward reads: HF's [out, in], and oneDNN's packed one.
WEIGHTS = [
    pytest.param(False, id="plain"),
    pytest.param(
        True,
        id="onednn",
        marks=pytest.mark.skipif(not packing_available(), reason="no oneDNN packed linear"),
    ),
]


@pytest.mark.parametrize("packed_weights", WEIGHTS)
@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_packed_prefill_and_decode_logits_equal_transformers(
    name: str, packed_weights: bool
) -> None:
    """Three prompts prefilled in one packed step (every position's logits), then decoded
    together for NEW steps: each row equals transformers' over the same tokens."""
    # Phi-3 crosses from its short rope factors to the long ones at position 16 here.
    model = family_model(
        name, **({"original_max_position_embeddings": 16} if name == "phi3" else {})
    )
    continuation = (11, 250, 4, 4, 97, 31, 8, 200)
    expected = [hf_incremental_logits(model, p, continuation) for p in PROMPTS]
    backend = paged(model, packed_weights=packed_weights)
    check_packed_logits(backend, PROMPTS, continuation, expected)


@pytest.mark.parametrize("packed_weights", WEIGHTS)
@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_greedy_tokens_equal_generate_alone_and_batched(name: str, packed_weights: bool) -> None:
    model = family_model(name, seed=1)
    reference = [greedy_reference(model, p, NEW) for p in PROMPTS]
    backend = paged(model, packed_weights=packed_weights)
    assert [greedy(backend, [p], NEW)[0] for p in PROMPTS] == reference
    assert greedy(backend, PROMPTS, NEW) == reference


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_chunked_prefill_and_preemption_change_no_token(name: str) -> None:
    check_chunked_and_preempted(family_model(name, seed=2), NEW)


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_prefix_cache_hits_change_no_token(name: str) -> None:
    check_prefix_cache_hits(family_model(name, seed=3), NEW)


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
def test_bfloat16_logits_close_to_float32(name: str) -> None:
    model = family_model(name, seed=4)
    expected = hf_logits(model, PROMPTS[2])
    backend = paged(copy.deepcopy(model).to(torch.bfloat16))
    out = backend.forward([PackedItem(0, PROMPTS[2], 0, tuple(range(4)), prompt_logits=True)])
    assert out.prompt[0] is not None
    torch.testing.assert_close(out.prompt[0], expected, atol=0.03, rtol=0)


def test_phi3_long_rope_switches_factors_by_position() -> None:
    """Positions below original_max_position_embeddings (16) rotate with the short factors,
    later ones with the long, whichever step computes them: the logits of a sequence decoded
    past position 16 are transformers' forward over its KV cache step by step (its
    generate() instead recomputes the whole sequence with the long factors once it crosses,
    which no cached prefix could reuse)."""
    model = family_model("phi3", seed=5, original_max_position_embeddings=16)
    backend = paged(model)
    table_cos = backend.path.cos
    assert table_cos.shape[-1] == 8  # partial rotary: half of head_dim 16
    short = model.model.rotary_emb.original_inv_freq
    assert torch.allclose(table_cos[3, :4].float(), (3 * short).cos() * _scaling(model), atol=1e-6)
    assert not torch.allclose(table_cos[20, :4].float(), (20 * short).cos() * _scaling(model))
    prompt, continuation = PROMPTS[2], (11, 250, 4, 4, 97, 31, 8, 200)
    expected = hf_incremental_logits(model, prompt, continuation)
    tables = tuple(range(8))
    out = backend.forward([PackedItem(0, prompt, 0, tables)])
    torch.testing.assert_close(out.last[0], expected[len(prompt) - 1], atol=1e-4, rtol=0)
    for step, token in enumerate(continuation):
        out = backend.forward([PackedItem(0, (token,), len(prompt) + step, tables)])
        torch.testing.assert_close(out.last[0], expected[len(prompt) + step], atol=1e-4, rtol=0)


def _scaling(model: PreTrainedModel) -> float:
    return float(model.model.rotary_emb.attention_scaling)


def test_gemma2_attends_through_plain_torch_for_its_soft_cap() -> None:
    model = family_model("gemma2")
    # The caps matter to the tiny model: without them its logits are others.
    uncapped = family_model("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
    difference = hf_logits(model, PROMPTS[2]) - hf_logits(uncapped, PROMPTS[2])
    assert difference.abs().max() > 1e-2
    backend = paged(model)
    assert "soft-caps its attention scores at 0.05" in backend.runtime()["attention"]
    assert backend.path.attn_softcap == 0.05 and backend.path.final_softcap == 0.5
    # Alternating windows: both the sliding and the global layers are there.
    assert backend.path.windows == [None, 6]
    assert backend.capacity.sliding_window is None


def test_granite_multipliers_are_read_from_its_config() -> None:
    path = paged(family_model("granite")).path
    assert (path.embed_scale, path.residual_scale, path.logits_divisor) == (12.0, 0.22, 8.0)
    assert path.scaling == pytest.approx(0.1)


def test_unsupported_settings_name_the_reason() -> None:
    assert paged_unsupported_reason({"model_type": "qwen3"}) is None
    assert paged_unsupported_reason({"model_type": "gemma3"}) == (
        "model_type 'gemma3' is not one of the families it runs (llama, mistral, qwen2, "
        "qwen2_vl_text, qwen2_5_vl_text, qwen3, gemma, gemma2, gemma3_text, phi3, granite, "
        "olmo2, mixtral, qwen2_moe, qwen3_moe)"
    )
    dynamic = {"model_type": "qwen3", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    assert paged_unsupported_reason(dynamic) == (
        "rope type 'dynamic' depends on the sequence length"
    )


# --- LoRA on each family's projection names ---------------------------------------------


def _store(model: PreTrainedModel, named: dict[str, Path]) -> AdapterStore:
    return AdapterStore(
        LoraShapes.of(model.config), named=named, dtype=torch.float32,
        device=torch.device("cpu"), max_loras=2, max_rank=8,
    )  # fmt: skip


@pytest.mark.parametrize("packed_weights", WEIGHTS)
@pytest.mark.parametrize(
    ("name", "targets"),
    [
        ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        ("gemma2", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ],
)
def test_lora_on_the_familys_projections_equals_the_merged_model(
    name: str, targets: list[str], packed_weights: bool, tmp_path: Path
) -> None:
    """Adapters stay plain [out, in] tensors beside the base weights in either layout."""
    base = family_model(name, seed=6)
    merged = make_lora_adapter(base, tmp_path / "a", seed=7, target_modules=targets)
    adapter = _store(base, {"a": tmp_path / "a"}).get("a")
    backend = paged(copy.deepcopy(base), packed_weights=packed_weights)
    prompt = PROMPTS[0]
    items = [
        PackedItem(0, prompt, 0, (0, 1), prompt_logits=True, adapter=adapter),
        PackedItem(1, prompt, 0, (2, 3), prompt_logits=True),
    ]
    out = backend.forward(items).prompt
    assert out[0] is not None and out[1] is not None
    torch.testing.assert_close(out[0], hf_logits(merged, prompt), atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(base, prompt), atol=1e-4, rtol=0)


def test_lora_on_experts_is_refused_naming_the_projections(tmp_path: Path) -> None:
    base = family_model("mixtral", seed=8)
    make_lora_adapter(base, tmp_path / "experts", seed=9, target_modules=["w1", "q_proj"])
    store = _store(base, {"experts": tmp_path / "experts"})
    with pytest.raises(
        InputValidationError, match="q_proj, k_proj, v_proj, o_proj is served for mixtral"
    ):
        store.get("experts")


def test_an_expert_layer_freezes_for_compiled_decode() -> None:
    """--compile folds the weights as constants (DecoderWeights.as_constants): an expert
    layer's tensors become parameters and its derived kernel choice is derived again."""
    path = paged(family_model("mixtral")).path
    frozen = path.as_constants()
    for layer, plain in zip(frozen.layers, path.layers, strict=True):
        assert isinstance(layer.mlp, MoeMlp) and isinstance(plain.mlp, MoeMlp)
        assert isinstance(layer.mlp.gate_up, nn.Parameter)
        assert layer.mlp.gate_up.data_ptr() == plain.mlp.gate_up.data_ptr()
        assert layer.mlp.runs_grouped == plain.mlp.runs_grouped
