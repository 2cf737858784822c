"""tgis.backends.models.moe: the paged forward's mixture-of-experts MLP computes what the HF
sparse-MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE) compute, on the grouped-matmul path and on the
per-expert one, while sharing the HF modules' weights; dense layers are told apart from MoE
ones, and blocks it cannot compute are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from tgis.backends.models.moe import MoeMlp, moe_block

HIDDEN = 64
SHAPE = {
    "vocab_size": 256,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    # Weights large enough that outputs are O(0.1..1): an absolute tolerance then means something.
    "initializer_range": 0.1,
}
QWEN_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def mixtral(**overrides: object) -> PretrainedConfig:
    return MixtralConfig(**{**SHAPE, "num_local_experts": 8, "num_experts_per_tok": 2, **overrides})


def qwen3(**overrides: object) -> PretrainedConfig:
    return Qwen3MoeConfig(**{**SHAPE, **QWEN_MOE, "norm_topk_prob": True, **overrides})


def qwen2(**overrides: object) -> PretrainedConfig:
    fields = {"shared_expert_intermediate_size": 64, "mlp_only_layers": [1]}
    return Qwen2MoeConfig(**{**SHAPE, **QWEN_MOE, **fields, **overrides})


FAMILIES = {
    "mixtral": mixtral,
    "qwen3-renormalized": qwen3,
    "qwen3-not-renormalized": lambda: qwen3(norm_topk_prob=False),
    "qwen2-shared-expert": qwen2,
}


def build(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A fresh tiny model (each test its own: MoeMlp.of re-points its modules' weights)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def blocks(model: PreTrainedModel) -> list[nn.Module]:
    found = [moe_block(layer) for layer in model.model.layers]
    return [block for block in found if block is not None]


def hf(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The HF block's output for packed x [N, hidden] (it takes [batch, seq, hidden])."""
    out, _router_logits = block(x[None])
    return out[0]


def inputs(n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, HIDDEN, generator=generator).to(dtype)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_equals_the_hf_block(family: str, dtype: torch.dtype, grouped: bool) -> None:
    """Every MoE layer's MoeMlp gives the HF block's output for 1, 5 and 37 tokens (1 token
    leaves 6 of 8 experts empty); the HF block still gives it after its weights were stacked."""
    model = build(FAMILIES[family](), dtype)
    found = blocks(model)
    assert found
    for block in found:
        xs = [inputs(n, dtype, seed=n) for n in (1, 5, 37)]
        before = [hf(block, x) for x in xs]
        mlp = replace(MoeMlp.of(block), grouped=grouped)
        # On CPU the grouped matmul takes float32 and bfloat16 at these widths.
        assert mlp.runs_grouped is grouped
        act = block.experts[0].act_fn
        for x, reference in zip(xs, before, strict=True):
            out = mlp(x, act)
            assert out.shape == x.shape and out.dtype == dtype
            assert reference.abs().max() > 0.05  # the tolerances below are not vacuous
            if dtype == torch.float32:
                torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
            else:
                torch.testing.assert_close(out, reference, atol=2e-2, rtol=2e-2)
            assert torch.equal(hf(block, x), reference)


@torch.no_grad()
def test_the_paths_agree_and_route_as_hf() -> None:
    """Grouped and per-expert give the same float32 output over many tokens, where every
    expert has rows; Qwen3 without renormalization differs from the renormalized MLP."""
    block = blocks(build(qwen3()))[0]
    mlp = MoeMlp.of(block)
    act = block.experts[0].act_fn
    x = inputs(200, torch.float32)
    grouped, per_expert = mlp(x, act), replace(mlp, grouped=False)(x, act)
    torch.testing.assert_close(grouped, per_expert, atol=1e-6, rtol=0)
    unnormalized = replace(mlp, renormalize=False)(x, act)
    assert (unnormalized - grouped).abs().max() > 1e-3
    torch.testing.assert_close(unnormalized, hf_unnormalized(block, x), atol=1e-5, rtol=0)


def hf_unnormalized(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    block.norm_topk_prob = False
    try:
        return hf(block, x)
    finally:
        block.norm_topk_prob = True


@torch.no_grad()
def test_no_tokens() -> None:
    block = blocks(build(mixtral()))[0]
    mlp = MoeMlp.of(block)
    for path in (mlp, replace(mlp, grouped=False)):
        out = path(torch.empty(0, HIDDEN), block.experts[0].act_fn)
        assert out.shape == (0, HIDDEN)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_keeps_one_copy_of_the_weights(family: str) -> None:
    """After `of`, every expert Linear's weight is a frozen view of the stacked tensors: same
    storage, same parameter count, no second copy; writes to the stack reach the modules."""
    model = build(FAMILIES[family]())
    count = sum(p.numel() for p in model.parameters())
    for block in blocks(model):
        mlp = MoeMlp.of(block)
        names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        inter = mlp.gate_up.shape[1] // 2
        experts = list(block.experts)
        assert mlp.gate_up.shape == (len(experts), 2 * inter, HIDDEN)
        assert mlp.down.shape == (len(experts), HIDDEN, inter)
        for index, expert in enumerate(experts):
            gate, up, down = (getattr(expert, name).weight for name in names)
            assert isinstance(gate, nn.Parameter) and not gate.requires_grad
            assert gate.data_ptr() == mlp.gate_up[index, :inter].data_ptr()
            assert up.data_ptr() == mlp.gate_up[index, inter:].data_ptr()
            assert down.data_ptr() == mlp.down[index].data_ptr()
            for weight, stacked in ((gate, mlp.gate_up), (up, mlp.gate_up), (down, mlp.down)):
                assert weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
        # The stacks are exactly the experts' weights, not larger buffers.
        assert mlp.gate_up.untyped_storage().nbytes() == mlp.gate_up.numel() * 4
        assert mlp.router is block.gate.weight
        with torch.no_grad():
            mlp.gate_up[3].fill_(0.5)
        assert torch.all(getattr(experts[3], names[0]).weight == 0.5)
        if family.startswith("qwen2"):
            shared = block.shared_expert
            assert mlp.shared_gate_up is not None and mlp.shared_gate is not None
            assert shared.gate_proj.weight.data_ptr() == mlp.shared_gate_up.data_ptr()
            assert shared.up_proj.weight.data_ptr() == mlp.shared_gate_up[64:].data_ptr()
            assert mlp.shared_down is shared.down_proj.weight
            assert mlp.shared_gate is block.shared_expert_gate.weight
        else:
            assert mlp.shared_gate_up is mlp.shared_down is mlp.shared_gate is None
    assert sum(p.numel() for p in model.parameters()) == count


@torch.no_grad()
def test_widths_the_grouped_matmul_refuses_take_the_per_expert_path() -> None:
    """An expert width of 6 float32s (24 bytes) is no multiple of 16 bytes, and float64 has no
    grouped kernel: both run one matmul per expert, still as HF."""
    for config, dtype in (
        (qwen3(moe_intermediate_size=6), torch.float32),
        (qwen3(), torch.float64),
    ):
        block = blocks(build(config, dtype))[0]
        x = inputs(37, dtype)
        reference = hf(block, x)
        mlp = MoeMlp.of(block)
        assert not mlp.runs_grouped
        torch.testing.assert_close(mlp(x, block.experts[0].act_fn), reference, atol=1e-5, rtol=0)


@torch.no_grad()
def test_router_jitter_is_ignored_in_inference() -> None:
    """Mixtral's router jitter is applied by HF in training only; eval outputs are unchanged."""
    block = blocks(build(mixtral(router_jitter_noise=0.1)))[0]
    x = inputs(37, torch.float32)
    reference = hf(block, x)
    out = MoeMlp.of(block)(x, block.experts[0].act_fn)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


def test_moe_block_tells_dense_layers_apart() -> None:
    """Mixtral: every layer sparse. Qwen2-MoE: layer 1 dense (mlp_only_layers). Qwen3-MoE with
    decoder_sparse_step 2: only layer 1 sparse. Llama: none."""
    kinds = {
        "mixtral": (mixtral(), ["MixtralSparseMoeBlock"] * 2),
        "qwen2": (qwen2(), ["Qwen2MoeSparseMoeBlock", None]),
        "qwen3-step-2": (qwen3(decoder_sparse_step=2), [None, "Qwen3MoeSparseMoeBlock"]),
        "llama": (LlamaConfig(**SHAPE), [None, None]),
    }
    for name, (config, expected) in kinds.items():
        layers = build(config).model.layers
        found = [moe_block(layer) for layer in layers]
        assert [type(b).__name__ if b is not None else None for b in found] == expected, name
        for block, layer in zip(found, layers, strict=True):
            if block is not None:
                assert block is getattr(layer, "block_sparse_moe", None) or block is layer.mlp


def test_unsupported_blocks_are_refused() -> None:
    """Another MoE family's block (OLMoE: found by moe_block, not computed), a dense MLP, and
    biases on an expert or the router are refused with ValueErrors that say what."""
    olmoe = build(OlmoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=2))
    block = moe_block(olmoe.model.layers[0])
    assert type(block).__name__ == "OlmoeSparseMoeBlock"
    with pytest.raises(ValueError, match="OlmoeSparseMoeBlock is not a sparse-MoE block"):
        MoeMlp.of(block)
    dense = build(qwen2()).model.layers[1].mlp
    with pytest.raises(ValueError, match="Qwen2MoeMLP is not a sparse-MoE block"):
        MoeMlp.of(dense)

    block = blocks(build(mixtral()))[0]
    block.experts[2].w3 = nn.Linear(HIDDEN, 64, bias=True)
    with pytest.raises(ValueError, match=r"MixtralSparseMoeBlock\.experts\.2\.w3 has a bias"):
        MoeMlp.of(block)
    # Refused before any weight was re-pointed.
    assert block.experts[0].w1.weight.untyped_storage().nbytes() == 64 * HIDDEN * 4

    block = blocks(build(qwen3()))[0]
    block.gate = nn.Linear(HIDDEN, 8, bias=True)
    with pytest.raises(ValueError, match=r"\.gate has a bias"):
        MoeMlp.of(block)

    block = blocks(build(qwen3()))[0]
    block.experts[5].up_proj = nn.Linear(HIDDEN, 16, bias=False)
    with pytest.raises(ValueError, match="gate and up projections differ in width"):
        MoeMlp.of(block)
    block.experts[5].gate_proj = nn.Linear(HIDDEN, 16, bias=False)
    with pytest.raises(ValueError, match="experts' weights differ in shape"):
        MoeMlp.of(block)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_grouped_path_on_cuda_is_graph_capturable() -> None:
    """bfloat16 on a GPU with grouped-GEMM kernels: the grouped path runs, matches HF, and a
    CUDA graph of it (no host syncs) replays the same output for new tokens."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("no grouped-GEMM kernel for this GPU")
    model = build(qwen2(), torch.bfloat16).to("cuda")
    block = blocks(model)[0]
    mlp = MoeMlp.of(block)
    assert mlp.runs_grouped
    act = block.experts[0].act_fn
    x = inputs(37, torch.bfloat16).cuda()
    torch.testing.assert_close(mlp(x, act), hf(block, x), atol=2e-2, rtol=2e-2)

    static = torch.zeros_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mlp(static, act)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mlp(static, act)
    for seed in (2, 3):
        fresh = inputs(37, torch.bfloat16, seed=seed).cuda()
        static.copy_(fresh)
        graph.replay()
        # index_add_ is atomic on CUDA (no fixed order): equal up to bfloat16 rounding.
        torch.testing.assert_close(captured, mlp(fresh, act), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(captured, hf(block, fresh), atol=2e-2, rtol=2e-2)
