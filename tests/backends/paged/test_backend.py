"""tgis.backends.paged.backend: packed steps over a paged pool equal HF's forward and generate,
alone, in batches, chunked, preempted and with prefix-cache hits. Every test builds its own
model: the backend takes the model's weights (fused views), so none is shared."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from tests.backends.conftest import PROMPTS, VARIANTS, greedy_reference
from tests.backends.models.test_decoder import (
    CASES,
    CONTINUATION,
    build,
    check_packed_logits,
    hf_logits,
)
from tests.backends.paged_driver import greedy, paged, scheduler_for
from tests.factories import make_model_dir, tiny_model
from tgis.backends.common.kv import to_cache
from tgis.backends.paged.attention import flash_paged_available, step_metadata
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.backends.paged.graphs import CudaGraphApi, DecodeStep
from tgis.engine import transfer
from tgis.engine.backend import FedTokens, PackedItem, Shape
from tgis.engine.sequence import PLACEHOLDER_ID
from tgis.engine.transfer import StaleCopies
from tgis.errors import ConfigError

NEW = 6
CPU = torch.device("cpu")


def fresh(variant: str = "llama", seed: int = 0, **overrides: object) -> PreTrainedModel:
    arch, fields = VARIANTS[variant]
    return tiny_model(arch, seed=seed, **{**fields, **overrides})  # type: ignore[arg-type]


@pytest.mark.parametrize("case", CASES)
def test_prompt_and_decode_logits_equal_hf(case: str) -> None:
    """Prompts of three lengths prefilled in one packed step (every position's logits), then
    decoded together: each row equals HF's full forward over the same tokens."""
    model = build(case)
    expected = [hf_logits(model, p + CONTINUATION) for p in PROMPTS]
    check_packed_logits(paged(model), PROMPTS, CONTINUATION[:-1], expected)


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2"])
def test_greedy_tokens_equal_generate_alone_and_batched(variant: str) -> None:
    model = fresh(variant)
    reference = [greedy_reference(model, p, NEW) for p in PROMPTS]
    backend = paged(model)
    assert [greedy(backend, [p], NEW)[0] for p in PROMPTS] == reference
    assert greedy(backend, PROMPTS, NEW) == reference


def test_sliding_window_over_blocks_and_chunks() -> None:
    """mistral with a 6-token window, block size 4, prompts chunked by 5 tokens."""
    model = fresh("mistral", seed=2, sliding_window=6)
    reference = [greedy_reference(model, p, NEW) for p in PROMPTS]
    backend = paged(model)
    assert greedy(backend, PROMPTS, NEW, scheduler_for(backend, prefill_tokens=5)) == reference


def check_chunked_and_preempted(model: PreTrainedModel, new_tokens: int = NEW) -> None:
    """A pool of 7 blocks of 4 for four sequences of up to 21 tokens: prompts are chunked
    by 3 tokens, sequences are preempted and recomputed, the tokens stay those of generate."""
    prompts = [*PROMPTS, (7, 7, 9, 200, 31)]
    reference = [greedy_reference(model, p, new_tokens) for p in prompts]
    backend = paged(model, blocks=7, max_sequence_tokens=24)
    sched = scheduler_for(backend, prefill_tokens=3)
    assert greedy(backend, prompts, new_tokens, sched) == reference
    assert sched.preemptions > 0
    assert sched.blocks.free_blocks == 7


def test_chunked_prefill_and_preemption_change_no_token() -> None:
    check_chunked_and_preempted(fresh("llama", seed=4))


def check_prefix_cache_hits(model: PreTrainedModel, new_tokens: int = NEW) -> None:
    """Three prompts sharing 12 tokens (3 blocks of 4): the later two find them cached and
    their greedy tokens stay generate()'s."""
    shared = tuple(range(40, 52))
    prompts = [(*shared, 9, 10), (*shared, 99), (*shared, 5, 6, 7, 8)]
    reference = [greedy_reference(model, p, new_tokens) for p in prompts]
    backend = paged(model)
    sched = scheduler_for(backend, prefix_caching=True)
    assert greedy(backend, prompts[:1], new_tokens, sched) == reference[:1]
    assert greedy(backend, prompts[1:], new_tokens, sched) == reference[1:]
    assert sched.blocks.stats.hit_tokens == 24  # 12 prompt tokens found, twice


def test_prefix_cache_hits_change_no_token() -> None:
    check_prefix_cache_hits(fresh("qwen2", seed=5))


def test_bf16_logits_close_to_float32() -> None:
    model = build("llama-tied")
    expected = hf_logits(model, PROMPTS[0])
    backend = paged(model.to(torch.bfloat16))
    out = backend.forward([PackedItem(0, PROMPTS[0], 0, tuple(range(4)), prompt_logits=True)])
    assert out.prompt[0] is not None and out.prompt[0].dtype == torch.float32
    torch.testing.assert_close(out.prompt[0], expected, atol=0.05, rtol=0)


def test_bad_items_are_refused_before_any_write() -> None:
    backend = paged(fresh(), blocks=4, max_sequence_tokens=16)
    before = [k.clone() for k in backend.path.pool.keys]
    cases = [
        (PackedItem(0, (1, 2), 15, (0, 1, 2, 3)), "positions 15..16 outside 0..15"),
        (PackedItem(0, (1,) * 9, 0, (0, 1)), "2 blocks of 4 cannot hold 9 positions"),
        (PackedItem(0, (1, 2), 0, (7,)), r"block ids outside \[0, 4\)"),
        (PackedItem(0, (1, 999), 0, (0,)), r"token ids outside \[0, 256\)"),
    ]
    for item, message in cases:
        with pytest.raises(ValueError, match=message):
            backend.forward([PackedItem(1, (5,), 0, (3,)), item])
    for a, b in zip(before, backend.path.pool.keys, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_pool_size_from_the_budget_and_from_memory() -> None:
    backend = paged(fresh(), blocks=7, block_size=4, max_sequence_tokens=28)
    cap = backend.capacity
    assert (cap.block_size, cap.num_blocks, cap.kv_tokens) == (4, 7, 28)
    # From memory on CPU: never more than max_sequences x max_sequence_tokens, whole blocks.
    sized = PagedTorchBackend(
        fresh(), max_sequences=3, max_sequence_tokens=30, max_prefill_tokens=30, block_size=8
    )
    assert sized.capacity.kv_tokens == 96
    with pytest.raises(ConfigError, match="cannot hold one sequence of 64 tokens"):
        paged(fresh(), blocks=3, block_size=4)


def test_a_pool_sized_from_memory_leaves_a_shared_cache_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tgis.backends.paged import backend as paged_torch

    monkeypatch.setattr(paged_torch, "available_memory", lambda device: 1 << 26)

    def sized(shared: int) -> PagedTorchBackend:
        return PagedTorchBackend(
            fresh(), max_sequences=4, max_sequence_tokens=32, max_prefill_tokens=32,
            memory_fraction=0.5, shared_kv_bytes_per_token=shared,
        )  # fmt: skip

    alone = sized(0).capacity
    # A draft cache of as many bytes per token as this one: half the tokens fit.
    shared = sized(alone.kv_bytes_per_token).capacity
    assert alone.kv_budget_tokens == (1 << 25) // alone.kv_bytes_per_token
    assert shared.kv_budget_tokens == (1 << 25) // (2 * alone.kv_bytes_per_token)
    assert shared.kv_bytes_per_token == alone.kv_bytes_per_token


def test_warmup_plan_follows_the_budgets() -> None:
    backend = paged(fresh(), blocks=32, block_size=4, max_sequences=16, prefill=20)
    plan = backend.warmup_plan(max_batch_size=16, max_input_tokens=50)
    # the largest chunk the scheduler sends (prefill budget 20), then decode buckets up to
    # what the pool holds at 3 blocks per warmup sequence (10)
    assert plan == [
        Shape("prefill", 1, 20),
        *(Shape("decode", n, 1) for n in (1, 2, 4, 8, 10)),
    ]
    timings = backend.warmup(16, 50)
    assert [t.shape for t in timings] == plan


def eager_decode(step: DecodeStep) -> torch.Tensor:
    """The logits of `step`'s decode through the path a CPU serves with: plain-torch
    attention over the head-major pool, its metadata built from what the buffers the step
    reads hold now (KV lengths, block tables), the blocks it enters zeroed, the new K/V
    written at the buffers' slots."""
    path, meta = step.path, step.meta
    pool = path.pool
    assert not pool.flash  # head-major, as `pool_shape` lays it out off CUDA
    kv_lens = meta.seqused_k.tolist()
    eager = step_metadata(
        [1] * len(kv_lens), kv_lens, meta.block_table.tolist(), pool.block_size, path.device,
        path.windows, pool.num_blocks, pool.kv_heads,
    )  # fmt: skip
    eager = replace(eager, slot_mapping=meta.slot_mapping)
    if eager.fresh_blocks is not None:  # as the backend's eager step does
        pool.clear(eager.fresh_blocks)
    return path.forward(step.input_ids, step.positions, eager, step.rows)


class EagerDecodeApi:
    """A GraphApi for the CPU, where nothing can be recorded. It never runs the step it is
    given (a `DecodeStep`: flash attention over a pages pool, CUDA only): at capture, and
    each time a replay is asked of it, it computes that step's decode with `eager_decode`
    from the tensors the step reads, into the one output tensor it handed back at capture.
    `replays_asked`: the bucket of each replay asked for."""

    def __init__(self) -> None:
        self.replays_asked: list[int] = []

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        assert isinstance(step, DecodeStep)
        output = eager_decode(step)
        return (step, output), output

    def replay(self, graph: Any) -> None:
        step, output = graph
        output.copy_(eager_decode(step))
        self.replays_asked.append(step.input_ids.shape[0])


def assert_decodes_equal(
    eager: PagedTorchBackend,
    graphed: PagedTorchBackend,
    prompts: Sequence[Sequence[int]],
    tables: Sequence[tuple[int, ...]],
    atol: float,
) -> None:
    """Prefill `prompts` (sequence i in blocks `tables[i]`) on both backends, then NEW decode
    steps of them all, each fed the eager logits' argmax: the graphed backend's logits equal
    the eager one's at every step (new inputs each step, over the K/V earlier steps wrote)."""
    prefill = [PackedItem(i, tuple(p), 0, tables[i]) for i, p in enumerate(prompts)]
    tokens = eager.forward(prefill).last.argmax(-1).tolist()
    graphed.forward(prefill)
    for step in range(NEW):
        items = [
            PackedItem(i, (tokens[i],), len(p) + step, tables[i]) for i, p in enumerate(prompts)
        ]
        expected = eager.forward(items).last
        torch.testing.assert_close(graphed.forward(items).last, expected, atol=atol, rtol=0)
        tokens = expected.argmax(-1).tolist()


def test_decode_graph_buckets_buffers_and_padding_on_cpu() -> None:
    """What `DecodeGraphs` does around its graphs, on a CPU: warmup records one graph per
    bucket, largest first, over a pool with one block more than the scheduler knows (the
    scratch block); a decode step asks for the replay of the smallest bucket holding its
    rows, after filling in place the buffers the recorded step reads (token ids, positions,
    slots, KV lengths, block tables padded with the scratch block), with padding rows that
    write the scratch block only; it reads the logits back from the bucket's first rows. The
    logits equal a twin eager backend's, batch after batch in buckets filled and padded.

    Not checked here: that a recorded CUDA graph replays its kernels and gives the eager
    forward's logits, nor the flash metadata only those kernels read (query offsets, the
    longest KV length). `EagerDecodeApi` computes each step with the CPU's attention path;
    recording and replay are `test_real_cuda_graphs_equal_eager_on_cuda`'s, on a GPU."""
    kw = {"max_sequences": 4, "max_sequence_tokens": 64, "max_prefill_tokens": 64}
    api = EagerDecodeApi()
    eager = PagedTorchBackend(fresh("llama", seed=6), kv_tokens=32 * 4, block_size=4, **kw)
    graphed = PagedTorchBackend(
        fresh("llama", seed=6), kv_tokens=32 * 4, block_size=4, graph_api=api, **kw
    )
    graphs, pool = graphed.graphs, graphed.path.pool
    assert eager.graphs is None and graphs is not None and graphed.capacity.num_blocks == 32
    assert graphs.scratch_block == 32 and pool.num_blocks == 33
    timings = graphed.warmup(4, 20)
    assert graphs.captured == (1, 2, 4)
    assert [t.shape for t in timings if t.compiled] == [Shape("decode", b, 1) for b in (4, 2, 1)]
    prompts = [*PROMPTS, (7, 7, 9, 200, 31)]
    # 5 blocks of 4 per sequence (19 tokens at most), out of order and interleaved
    tables = [tuple(range(31 - i, 11, -4)) for i in range(4)]
    # Block-table rows sent: only those whose blocks changed (a row's first sequence, the
    # padding row that replaced the fourth), not every row of every step.
    for batch, bucket, rows_sent in ((1, 1, 1), (2, 2, 1), (4, 4, 2), (3, 4, 1)):
        api.replays_asked.clear()
        sent = graphs.table_rows_sent
        assert_decodes_equal(eager, graphed, prompts[:batch], tables, atol=1e-5)
        assert api.replays_asked == [bucket] * NEW  # prefill stays eager
        assert graphs.table_rows_sent - sent == rows_sent
    # The last step's buffers: 3 sequences in the bucket of 4, at their last positions.
    scratch, size = graphs.scratch_block, pool.block_size
    width = graphs.block_table.shape[1]
    for row, prompt in enumerate(prompts[:3]):
        position = len(prompt) + NEW - 1
        assert graphs.positions[row].item() == position
        assert graphs.seqused_k[row].item() == position + 1
        assert graphs.block_table[row].tolist() == [*tables[row], *[scratch] * (width - 5)]
        slot = tables[row][position // size] * size + position % size
        assert graphs.slot_mapping[row].item() == slot
    # the padding row: one key, in the scratch block, which it writes
    assert graphs.block_table[3].tolist() == [scratch] * width
    assert graphs.slot_mapping[3].item() == scratch * size and graphs.seqused_k[3].item() == 1


def test_cuda_graphs_refused_where_attention_over_pages_cannot_run() -> None:
    with pytest.raises(ConfigError, match="--cuda-graphs needs attention over KV pages"):
        PagedTorchBackend(
            fresh(), max_sequences=2, max_sequence_tokens=16, max_prefill_tokens=16,
            kv_tokens=64, cuda_graphs=True,
        )  # fmt: skip
    assert paged(fresh()).graphs is None  # the default on a CPU: eager


class CountingCudaGraphApi(CudaGraphApi):
    """The CUDA graphs serving records, counting the replays."""

    def __init__(self) -> None:
        super().__init__()
        self.replays = 0

    def replay(self, graph: Any) -> None:
        super().replay(graph)
        self.replays += 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_equal_eager_on_cuda() -> None:
    """Real CUDA graphs of the paged decode, recorded at warmup: each decode step of a
    bfloat16 model replays its bucket's graph, and the logits it reads back equal those of a
    twin eager backend (flash attention too) given the same steps, for batches that fill a
    bucket (1, 4) and batches padded in one (3 in 4, 5 in 8)."""
    if not flash_paged_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("this torch's varlen_attn has no block_table")
    prompts = [*PROMPTS, (9, 9, 9), (1, 2, 3, 4, 5)]
    kw = {"max_sequences": 8, "max_sequence_tokens": 512, "max_prefill_tokens": 512}
    models = [fresh("llama", seed=7).to("cuda", torch.bfloat16) for _ in range(2)]
    api = CountingCudaGraphApi()
    eager = PagedTorchBackend(models[0], kv_tokens=4096, cuda_graphs=False, **kw)
    graphed = PagedTorchBackend(models[1], kv_tokens=4096, cuda_graphs=True, graph_api=api, **kw)
    graphed.warmup(8, 64)
    graphs = graphed.graphs
    assert eager.graphs is None and graphs is not None and graphs.captured == (1, 2, 4, 8)
    assert graphed.path.pool.flash and graphed.capacity.num_blocks == 16
    tables = [(15 - i,) for i in range(len(prompts))]  # one block of 256 tokens each
    for batch, bucket in ((1, 1), (4, 4), (3, 4), (5, 8)):
        assert graphs.graph_for(batch) == bucket
        before = api.replays
        # bfloat16: a padded bucket's GEMMs may round differently from the eager batch's; a
        # stale input or a misplaced row would be off by far more than this tolerance
        assert_decodes_equal(eager, graphed, prompts[:batch], tables, atol=2e-2)
        assert api.replays == before + NEW  # every decode step, prefill eager


class FailingApi(EagerDecodeApi):
    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_graph_that_cannot_be_recorded_leaves_decode_eager_unless_required() -> None:
    kw = {"max_sequences": 2, "max_sequence_tokens": 32, "max_prefill_tokens": 32}
    model = fresh()
    reference = [greedy_reference(model, p, 2) for p in PROMPTS[:2]]
    backend = PagedTorchBackend(model, kv_tokens=64, block_size=4, graph_api=FailingApi(), **kw)
    timings = backend.warmup(2, 8)
    assert backend.graphs is None and not any(t.compiled for t in timings)
    assert greedy(backend, PROMPTS[:2], 2) == reference  # serves eagerly
    required = PagedTorchBackend(
        fresh(), kv_tokens=64, block_size=4, graph_api=FailingApi(), cuda_graphs=True, **kw
    )
    with pytest.raises(ConfigError, match="recording the decode graph of batch 2 failed"):
        required.warmup(2, 8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_tokens_same_alone_and_batched() -> None:
    """On the GPU (float32 so rounding cannot flip a token, hence plain-torch attention):
    greedy tokens equal generate's, alone and in a batch, chunked and from cached blocks."""
    model = fresh("llama", seed=8)
    reference = [greedy_reference(model, p, NEW) for p in PROMPTS]
    backend = PagedTorchBackend(
        copy.deepcopy(model).to("cuda"), max_sequences=8, max_sequence_tokens=512,
        max_prefill_tokens=512, kv_tokens=4096, cuda_graphs=False, attention_backend="torch",
    )  # fmt: skip
    # The plain-torch path, asked for (float32: flash attention does not compute in it).
    assert not backend.path.pool.flash
    assert [greedy(backend, [p], NEW)[0] for p in PROMPTS] == reference
    assert greedy(backend, PROMPTS, NEW) == reference
    sched = scheduler_for(backend, prefill_tokens=5, prefix_caching=True)
    assert greedy(backend, PROMPTS, NEW, sched) == reference


@pytest.mark.parametrize("measured", [True, False], ids=["packed", "plain"])
def test_load_measures_the_weight_layout_and_says_it(
    measured: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded backend owns its model: the probe chooses the layout (common/gemm.py), the
    runtime facts say which and why; a model handed in keeps HF's layout unless asked."""
    from tgis.backends.paged import backend as paged_backend

    asked: list[tuple[torch.dtype, int, int]] = []

    def probe(dtype: torch.dtype, hidden: int, intermediate: int) -> tuple[bool, str]:
        asked.append((dtype, hidden, intermediate))
        return measured, "measured here"

    monkeypatch.setattr(paged_backend, "choose_packing", probe)
    model_dir = make_model_dir(tmp_path / "llama")
    loaded = PagedTorchBackend.load(
        model_dir, "cpu", "float32", max_sequences=2, max_sequence_tokens=32,
        max_prefill_tokens=32, kv_tokens=64,
    )  # fmt: skip
    config = loaded.model.config
    assert asked == [(torch.float32, config.hidden_size, config.intermediate_size)]
    assert loaded.path.packed == measured
    layout = "oneDNN packed" if measured else "plain [out, in]"
    assert loaded.runtime()["weights"] == f"{layout} (measured here)"
    handed = paged(tiny_model("llama"))
    assert not handed.path.packed and handed.runtime()["weights"] == "plain [out, in]"
    assert len(asked) == 1


def test_ranks_pack_only_where_every_rank_measured_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under tensor parallelism the ranks agree on one layout (the smallest of their choices)."""
    from tgis.backends.paged import backend as paged_backend

    class Ranks:
        def __init__(self, others: int) -> None:
            self.others = others
            self.asked: list[int] = []

        def agree_min(self, value: int) -> int:
            self.asked.append(value)
            return min(value, self.others)

    monkeypatch.setattr(paged_backend, "choose_packing", lambda *shape: (True, "measured here"))
    model = tiny_model("llama")
    backend = paged(model)
    for others, packed in ((1, True), (0, False)):
        ranks = Ranks(others)
        backend.parallel = ranks  # type: ignore[assignment]
        assert backend._packing(None, False, model) == packed and ranks.asked == [1]
        if not packed:
            assert backend.weights == (
                "plain [out, in] (measured here; another rank measured plain weights faster)"
            )


class _RoundingCache(DynamicCache):
    """HF's cache holding what a float8 pool holds: each new key and value rounded through
    `dtype` (saturating, as `kv.to_cache` stores them) before anything attends to it."""

    def __init__(self, dtype: torch.dtype, config: Any) -> None:
        super().__init__(config=config)
        self.kv_dtype = dtype

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def rounded(x: torch.Tensor) -> torch.Tensor:
            return to_cache(x, self.kv_dtype).to(x.dtype)

        return super().update(rounded(key_states), rounded(value_states), layer_idx, *args)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_a_float8_pool_gives_generates_tokens_over_rounded_keys_and_values(
    dtype: torch.dtype,
) -> None:
    """--kv-cache-dtype: the pool holds a byte per value (a quarter of float32's bytes per
    token), attention goes through plain torch saying why, and the greedy tokens, alone,
    batched and in chunked prompts, are generate()'s over a cache that rounds every key and
    value as the pool does; the logits of a decode step agree with HF's forward over the same
    rounding to float32 accumulation."""
    model = fresh("llama", seed=4)
    plain = paged(copy.deepcopy(model)).capacity.kv_bytes_per_token
    backend = PagedTorchBackend(
        model, max_sequences=4, max_sequence_tokens=64, max_prefill_tokens=64,
        kv_tokens=128, block_size=4, kv_cache_dtype=dtype,
    )  # fmt: skip
    assert backend.path.pool.keys[0].dtype == dtype
    assert backend.capacity.kv_bytes_per_token * 4 == plain
    name = str(dtype).removeprefix("torch.")
    assert backend.runtime()["kv_cache_dtype"] == name
    assert f"the KV cache is {name}, which flash attention's varlen_attn" in backend.attention

    def reference(prompt: tuple[int, ...]) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=3,
                past_key_values=_RoundingCache(dtype, model.config),
            )  # fmt: skip
        return out[0, len(prompt) :].tolist()

    expected = [reference(p) for p in PROMPTS]
    assert [greedy(backend, [p], NEW)[0] for p in PROMPTS] == expected
    assert greedy(backend, PROMPTS, NEW) == expected
    assert greedy(backend, PROMPTS, NEW, scheduler_for(backend, prefill_tokens=5)) == expected
    prompt = PROMPTS[0]
    table = tuple(range(8))
    backend.forward([PackedItem(0, prompt, 0, table)])
    last = backend.forward([PackedItem(0, (11,), len(prompt), table)]).last[0]
    with torch.no_grad():
        hf = model(
            torch.tensor([(*prompt, 11)]), past_key_values=_RoundingCache(dtype, model.config)
        ).logits[0, -1]
    torch.testing.assert_close(last, hf.float(), atol=1e-4, rtol=0)
    unrounded = hf_logits(model, (*prompt, 11))[-1]
    assert (last - unrounded).abs().max() > 1e-3  # the rounding shows


def test_a_decode_graph_rotates_rows_after_an_image_at_their_grid_positions() -> None:
    """A decode row of a sequence with an image grid (multimodal rope): the graph's position
    buffer holds the row's rotary position (its index less the grid's rope delta) while its
    KV length stays its index + 1, and the logits are the eager step's."""
    kw = {"max_sequences": 4, "max_sequence_tokens": 64, "max_prefill_tokens": 64}
    api = EagerDecodeApi()
    eager = PagedTorchBackend(fresh("llama", seed=6), kv_tokens=32 * 4, block_size=4, **kw)
    graphed = PagedTorchBackend(
        fresh("llama", seed=6), kv_tokens=32 * 4, block_size=4, graph_api=api, **kw
    )
    graphed.warmup(4, 20)
    prompt, table = PROMPTS[0], tuple(range(31, 11, -4))
    grids = ((1, 1, 2, 3),)  # rows 1..6 a 2x3 grid: later rows sit 6 - 3 = 3 positions back
    for backend in (eager, graphed):  # (a llama model: the prompt's rows rotate as text)
        backend.forward([PackedItem(0, tuple(prompt), 0, table)])
    step = [PackedItem(0, (5,), len(prompt), table, grids=grids)]
    expected = eager.forward(step).last
    api.replays_asked.clear()
    torch.testing.assert_close(graphed.forward(step).last, expected, atol=1e-5, rtol=0)
    assert api.replays_asked == [1]
    assert graphed.graphs is not None
    assert graphed.graphs.positions[0].item() == len(prompt) - 3
    assert graphed.graphs.seqused_k[0].item() == len(prompt) + 1


def fed_step(
    items: Sequence[PackedItem], fed: Sequence[int], device: torch.device
) -> tuple[list[PackedItem], FedTokens]:
    """`items` with the `fed` ones' last token left to the device: the step before's ids
    (on `device`) hold them at rows of their own, among others."""
    sampled = torch.tensor([5, *(items[i].token_ids[-1] for i in reversed(fed)), 9], device=device)
    rows = tuple(len(fed) - k for k in range(len(fed)))
    left = [
        replace(item, token_ids=(*item.token_ids[:-1], PLACEHOLDER_ID)) if i in fed else item
        for i, item in enumerate(items)
    ]
    return left, FedTokens(tuple(fed), rows, lambda: sampled)


def assert_fed_decodes_equal(
    given: PagedTorchBackend,
    fed: Sequence[PagedTorchBackend],
    prompts: Sequence[Sequence[int]],
    tables: Sequence[tuple[int, ...]],
    atol: float,
) -> list[int]:
    """Prefill `prompts` on every backend, then NEW decode steps: `given` is given each
    step's ids, each of `fed` has rows 0 and 2 (where there are) read on the device; their
    logits equal `given`'s. The last step's tokens."""
    prefill = [PackedItem(i, tuple(p), 0, tables[i]) for i, p in enumerate(prompts)]
    tokens = given.forward(prefill).last.argmax(-1).tolist()
    for backend in fed:
        backend.forward(prefill)
    for step in range(NEW):
        items = [
            PackedItem(i, (tokens[i],), len(p) + step, tables[i]) for i, p in enumerate(prompts)
        ]
        expected = given.forward(items).last
        for backend in fed:
            rows = [i for i in (0, 2) if i < len(items)]
            got = backend.forward(*fed_step(items, rows, backend.device_obj)).last
            torch.testing.assert_close(got, expected, atol=atol, rtol=0)
        tokens = expected.argmax(-1).tolist()
    return tokens


def test_tokens_fed_on_the_device_equal_the_tokens_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling launches a step before the host has the ids the step before sampled:
    an item's last token is read on the device from those ids (`FedTokens`). Under an
    accelerator's copies (one staging buffer, its padding scribbled), eagerly and through the
    decode graphs, a step fed so gives the logits of the same step given its ids, over the
    K/V the earlier steps wrote; fed rows mix with given ones and with a prompt chunk whose
    last token is fed. The tokens a fed item does give are still checked."""
    monkeypatch.setitem(transfer.COPIES, "cpu", StaleCopies())
    kw = {"max_sequences": 4, "max_sequence_tokens": 64, "max_prefill_tokens": 64}
    api = EagerDecodeApi()
    given, eager, graphed = (
        PagedTorchBackend(fresh("llama", seed=6), kv_tokens=32 * 4, block_size=4, **kw, **extra)
        for extra in ({}, {}, {"graph_api": api})
    )
    graphed.warmup(4, 20)
    prompts = PROMPTS[:3]
    tables = [tuple(range(31 - i, 11, -4)) for i in range(4)]
    tokens = assert_fed_decodes_equal(given, [eager, graphed], prompts, tables, atol=1e-5)
    assert api.replays_asked == [4] * NEW  # fed through the graph's own buffers
    # A prompt chunk whose last token is fed (a recomputation), beside fed decodes.
    at = len(prompts[0]) + NEW
    items = [
        PackedItem(3, (7, 7, 9, 200, 31), 0, tables[3]),
        PackedItem(0, (tokens[0],), at, tables[0]),
        PackedItem(1, (tokens[1],), len(prompts[1]) + NEW, tables[1]),
    ]
    expected = given.forward(items).last
    torch.testing.assert_close(
        eager.forward(*fed_step(items, [0, 1], CPU)).last, expected, atol=1e-5, rtol=0
    )
    left, fed = fed_step([PackedItem(0, (999, 5), at + 1, tables[0])], [0], CPU)
    with pytest.raises(ValueError, match=r"token ids outside \[0, 256\)"):
        eager.forward(left, fed)
    with pytest.raises(ValueError, match=r"token ids outside \[0, 256\)"):
        eager.forward(left)  # a placeholder no step before fills


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tokens_fed_on_cuda_equal_the_tokens_given() -> None:
    """On the GPU: decode steps whose tokens are read from the step before's ids on the
    device, eagerly and replayed from real CUDA graphs (bfloat16, flash attention), give the
    logits of a twin eager backend given the ids."""
    if not flash_paged_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("this torch's varlen_attn has no block_table")
    kw = {"max_sequences": 8, "max_sequence_tokens": 512, "max_prefill_tokens": 512}
    given, eager, graphed = (
        PagedTorchBackend(
            fresh("llama", seed=7).to("cuda", torch.bfloat16), kv_tokens=4096, **kw, **extra
        )
        for extra in (
            {"cuda_graphs": False}, {"cuda_graphs": False},
            {"cuda_graphs": True, "graph_api": CountingCudaGraphApi()},
        )
    )  # fmt: skip
    graphed.warmup(8, 64)
    assert graphed.graphs is not None
    api = graphed.graphs.api
    assert isinstance(api, CountingCudaGraphApi)
    prompts = [*PROMPTS, (9, 9, 9)]
    tables = [(15 - i,) for i in range(len(prompts))]
    assert_fed_decodes_equal(given, [eager, graphed], prompts, tables, atol=2e-2)
    assert api.replays == NEW
