"""tgis.backends.paged.compile: decode steps through the graphs compiled at warmup give
generate's greedy tokens (alone and batched, across block boundaries, with a sliding window and
with biases), serving compiles nothing and runs no decode step eagerly, and the engine's rules
around compiled decode hold. Every test builds its own model (the backend takes its weights)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tests.backends.conftest import PROMPTS, greedy_reference
from tests.backends.models.test_quantized import llama
from tests.backends.paged.test_backend import NEW, EagerDecodeApi, fresh
from tests.backends.paged_driver import greedy, scheduler_for
from tgis.backends.common.quant import Quantization
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.backends.paged.compile import compile_options
from tgis.engine.backend import PackedItem, Shape
from tgis.errors import ConfigError


def compiled(
    model: torch.nn.Module,
    max_sequences: int = 4,
    blocks: int = 48,
    compile: bool = True,
    quantization: Quantization | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> PagedTorchBackend:
    return PagedTorchBackend(
        model,  # type: ignore[arg-type]
        max_sequences=max_sequences,
        max_sequence_tokens=64,
        max_prefill_tokens=64,
        kv_tokens=blocks * 4,
        block_size=4,
        compile=compile,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
    )


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Each test compiles its own backend's graphs from the same code (`CompiledDecode._step`):
    dynamo's per-code cache of compiled graphs is emptied first, so that earlier tests' graphs
    do not count against its recompile limit (a serving process compiles one backend)."""
    torch._dynamo.reset()


def unique_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize(
    ("variant", "overrides"),
    [("llama", {}), ("mistral", {"sliding_window": 6}), ("qwen2", {})],
)
def test_compiled_decode_gives_generates_tokens(variant: str, overrides: dict[str, int]) -> None:
    """Warmup compiles the batch-1 graph and the batch-2-and-up one; decoding prompts alone
    and together (3 rows, then fewer as they end) afterwards compiles nothing, runs every
    decode step through a graph, and gives generate's tokens."""
    model = fresh(variant, seed=3, **overrides)
    reference = [greedy_reference(model, p, NEW) for p in PROMPTS]
    backend = compiled(model)
    decode = backend.compiled
    assert decode is not None and backend.runtime()["compiled_decode"] == []
    timings = backend.warmup(4, 16)
    assert [(t.shape, t.compiled) for t in timings[:2]] == [
        (Shape("decode", 1, 1), 1),
        (Shape("decode", 2, 1), 1),
    ]
    assert backend.runtime()["compiled_decode"] == ["1", "2-4"]
    graphs = unique_graphs()
    assert [greedy(backend, [p], NEW)[0] for p in PROMPTS] == reference
    assert greedy(backend, PROMPTS, NEW) == reference
    # The sliding window over blocks and chunked prompts (mixed steps run eagerly).
    assert greedy(backend, PROMPTS, NEW, scheduler_for(backend, prefill_tokens=5)) == reference
    assert unique_graphs() == graphs
    assert decode.eager_steps == 0


def test_compiled_logits_close_to_eager_and_uncompiled_steps_run_eagerly() -> None:
    """Compiled decode logits equal the eager forward's to float32 rounding; before warmup
    compiled anything, a decode step runs the same function eagerly (and is counted); a step
    with a prompt-prefix embedding runs the eager forward."""
    model = fresh("llama", seed=8)
    backend = compiled(model)
    decode = backend.compiled
    assert decode is not None
    tables = [tuple(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
    prompts = [PackedItem(i, p, 0, tables[i]) for i, p in enumerate(PROMPTS)]
    step = [PackedItem(i, (11,), len(p), tables[i]) for i, p in enumerate(PROMPTS)]

    def eager_forward() -> torch.Tensor:
        backend.compiled = None
        try:
            backend.forward(prompts)
            return backend.forward(step).last
        finally:
            backend.compiled = decode

    expected = eager_forward()
    backend.forward(prompts)
    torch.testing.assert_close(backend.forward(step).last, expected, atol=1e-5, rtol=0)
    assert decode.eager_steps == 1  # nothing compiled yet
    backend.warmup(4, 16)  # its dummy steps write blocks of the pool: prefill again
    expected = eager_forward()
    backend.forward(prompts)
    torch.testing.assert_close(backend.forward(step).last, expected, atol=1e-4, rtol=0)
    assert decode.eager_steps == 1
    embeds = model.model.embed_tokens.weight[:1].detach().clone()
    backend.forward([PackedItem(0, (11,), len(PROMPTS[0]), tables[0], embeds=((0, embeds),))])
    assert decode.eager_steps == 1


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"),
    [
        pytest.param(Quantization("int8"), None, id="int8"),
        pytest.param(Quantization("int4", 32), torch.float8_e4m3fn, id="int4-float8-pool"),
    ],
)
def test_compiled_decode_over_quantized_weights_gives_the_eager_kernels_tokens(
    quantization: Quantization, kv_cache_dtype: torch.dtype | None
) -> None:
    """Quantized kernels' tensors fold into the graphs as constants (inductor lowers the
    weight-only GEMMs into its own): decoding after warmup runs every step through a graph and
    gives the tokens of the eager forward over the same quantized weights (which
    tests/backends/models/test_quantized.py holds to the dequantized reference), and the
    compiled step's logits agree with the eager step's to the kernels' bfloat16 rounding. A
    float8 pool (--kv-cache-dtype) compiles the same way."""
    eager = compiled(
        llama(seed=5), compile=False, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    expected = greedy(eager, PROMPTS, NEW)
    backend = compiled(llama(seed=5), quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    decode = backend.compiled
    assert decode is not None
    assert backend.runtime()["quantization"] == quantization.method
    backend.warmup(4, 16)
    assert backend.runtime()["compiled_decode"] == ["1", "2-4"]
    assert greedy(backend, PROMPTS, NEW) == expected
    assert decode.eager_steps == 0
    tables = [tuple(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
    prompts = [PackedItem(i, p, 0, tables[i]) for i, p in enumerate(PROMPTS)]
    step = [PackedItem(i, (11,), len(p), tables[i]) for i, p in enumerate(PROMPTS)]
    for runner in (eager, backend):
        runner.forward(prompts)
    torch.testing.assert_close(
        backend.forward(step).last, eager.forward(step).last, atol=2e-2, rtol=0
    )
    assert decode.eager_steps == 0


def test_compile_is_refused_where_graphs_record_decode() -> None:
    """--compile compiles the plain-torch attention path's decode; where decode graphs are
    recorded (flash attention on CUDA) it is a ConfigError naming the fix."""
    with pytest.raises(ConfigError, match="--compile compiles the decode step") as info:
        PagedTorchBackend(
            fresh(), max_sequences=2, max_sequence_tokens=32, max_prefill_tokens=32,
            kv_tokens=64, block_size=4, graph_api=EagerDecodeApi(), compile=True,
        )  # fmt: skip
    assert "drop --compile (TGIS_COMPILE)" in str(info.value)


def test_a_pool_sized_from_memory_leaves_room_for_the_compiled_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each compiled graph holds a packed copy of the weights: the pool takes what is left."""
    from tgis.backends.paged import backend as paged_torch

    monkeypatch.setattr(paged_torch, "available_memory", lambda device: 1 << 26)

    def budget(compile: bool) -> int | None:
        model = fresh()
        backend = PagedTorchBackend(
            model, max_sequences=4, max_sequence_tokens=32, max_prefill_tokens=32,
            memory_fraction=0.5, compile=compile,
        )  # fmt: skip
        weights = sum(p.nbytes for p in model.parameters())  # tied: counted once
        expected = int(((1 << 26) - (2 * weights if compile else 0)) * 0.5)
        assert backend.capacity.kv_budget_tokens == expected // backend.capacity.kv_bytes_per_token
        return backend.capacity.kv_budget_tokens

    assert budget(True) < budget(False)  # type: ignore[operator]


def test_compile_options_pack_weights_for_cpu_gemms() -> None:
    assert compile_options(torch.device("cpu")) == {
        "freezing": True,
        "max_autotune": True,
        "max_autotune_gemm_backends": "CPP,ATEN",
    }
    assert compile_options(torch.device("cuda")) == {"freezing": True}
