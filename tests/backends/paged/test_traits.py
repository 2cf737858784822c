"""tgis.backends.paged.traits: the CUDA configuration of the paged backend run on the CPU —
the pool sized by a profiling forward through a fake of torch.cuda's memory calls, blocks of
256, no prefill chunk cap, copies that are stale until waited for — gives the tokens each
request gets alone and transformers' generate()."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from tests.backends.conftest import greedy_reference
from tests.factories import tiny_model
from tgis.backends.common.device import load_causal_lm
from tgis.backends.paged.backend import PagedTorchBackend, paged_kv_bytes_per_token
from tgis.backends.paged.traits import CUDA_BLOCK_SIZE, cuda_traits, device_traits
from tgis.engine import transfer
from tgis.engine.backend import PackedItem
from tgis.engine.engine import Engine
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.types import GenerationRequest
from tgis.errors import ConfigError
from tgis.params import GenerateParameters

CPU = torch.device("cpu")


class FakeCuda:
    """torch.cuda's memory calls for a device of `total` bytes whose allocator peaks at
    `peak` bytes; `calls` lists them in order."""

    def __init__(self, total: int, peak: int) -> None:
        self.total, self.peak = total, peak
        self.calls: list[str] = []

    def synchronize(self, device: Any = None) -> None:
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self.calls.append("reset_peak_memory_stats")

    def max_memory_allocated(self, device: Any = None) -> int:
        self.calls.append("max_memory_allocated")
        return self.peak

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self.total // 3, self.total

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")


def llama(seed: int = 0) -> PreTrainedModel:
    return tiny_model("llama", seed=seed, hidden_size=64, intermediate_size=128, vocab_size=256)


def cuda_shaped(
    model: PreTrainedModel, fake: FakeCuda, max_sequences: int = 4, **kw: Any
) -> PagedTorchBackend:
    return PagedTorchBackend(
        model,
        max_sequences=max_sequences,
        # Plain-torch attention: CUDA's Triton kernels run under Triton's interpreter here,
        # which test_attention_backends.py drives on models its speed allows.
        **{
            "max_sequence_tokens": 512,
            "max_prefill_tokens": 1200,
            "attention_backend": "torch",
            "traits": cuda_traits(CPU, fake),
            **kw,
        },
    )


def logit_capped(model: PreTrainedModel, fake: FakeCuda, rows: int) -> PagedTorchBackend:
    """cuda_shaped with prompt logits at `rows` positions a step at most."""
    vocab = model.get_output_embeddings().weight.shape[0]
    traits = dataclasses.replace(cuda_traits(CPU, fake), prompt_logit_bytes=4 * vocab * rows)
    return cuda_shaped(model, fake, traits=traits)


def test_each_device_has_its_traits() -> None:
    cpu = device_traits(CPU)
    assert (cpu.block_size, cpu.prefill_step_tokens, cpu.memory, cpu.fuse_gate_up) == (
        16, 512, None, False,
    )  # fmt: skip
    cuda = device_traits(torch.device("cuda", 0))
    assert (cuda.block_size, cuda.prefill_step_tokens, cuda.fuse_gate_up) == (
        CUDA_BLOCK_SIZE, None, True,
    )  # fmt: skip
    assert cuda.memory is not None and cuda.kv_memory_fraction == 0.85


def test_the_pool_is_sized_after_a_profiling_forward_of_the_whole_serving_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The profiling forward runs once every part of a serving step exists (LoRA stacks, no
    compiled or graphed decode yet), over the largest step the scheduler sends: 1200 prompt
    tokens as sequences the rope tables hold (512, 512, 176), in blocks of 256 of its own,
    logits at every position. Then the pool: 85% of the device less the peak, capped at what
    4 sequences of 512 tokens fill."""
    seen: list[list[PackedItem]] = []
    forward = PagedTorchBackend._forward_packed

    def spy(self: PagedTorchBackend, items: Sequence[PackedItem]) -> Any:
        seen.append(list(items))
        assert self.lora is not None and self.compiled is None and self.graphs is None
        return forward(self, items)

    monkeypatch.setattr(PagedTorchBackend, "_forward_packed", spy)
    model = llama()
    per_token = paged_kv_bytes_per_token(model)
    fake = FakeCuda(total=10_000 * per_token, peak=3_000 * per_token)
    backend = cuda_shaped(model, fake, max_sequences=64)
    (items,) = seen
    assert [len(i.token_ids) for i in items] == [512, 512, 176]
    assert [i.block_table for i in items] == [(0, 1), (2, 3), (4,)]
    assert all(i.prompt_logits and i.start == 0 for i in items)
    assert fake.calls == [
        "synchronize", "reset_peak_memory_stats", "synchronize", "max_memory_allocated",
        "empty_cache",
    ]  # fmt: skip
    cap = backend.capacity
    assert cap.block_size == 256 and cap.prefill_step_tokens is None
    assert backend.path.fuse_gate_up
    # (0.85 * 10000 - 3000) tokens = 5500 -> 21 blocks of 256
    assert cap.kv_budget_tokens == 5_500 and cap.num_blocks == 21
    # A device with room for more than 4 sequences of 512 ever fill: 8 blocks.
    roomy = cuda_shaped(llama(), FakeCuda(total=10**6 * per_token, peak=0))
    assert roomy.capacity.num_blocks == 8


def test_the_profiled_step_holds_the_prompt_logits_a_step_may_return(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompt logits at 700 positions at most (CUDA caps them by bytes: 512 MiB of float32
    rows, 1,046 positions of a 128k vocabulary): the profiled step is the same 1200 tokens,
    700 of them in sequences that return logits at every position and the rest sampling
    their last, instead of a logit row at every position (67 GB for a 128k-token step of a
    128k vocabulary: the 8B shape was refused for it)."""
    seen: list[list[PackedItem]] = []
    forward = PagedTorchBackend._forward_packed

    def spy(self: PagedTorchBackend, items: Sequence[PackedItem]) -> Any:
        seen.append(list(items))
        return forward(self, items)

    monkeypatch.setattr(PagedTorchBackend, "_forward_packed", spy)
    model = llama()
    fake = FakeCuda(total=10**6 * paged_kv_bytes_per_token(model), peak=0)
    backend = logit_capped(model, fake, 700)
    (items,) = seen
    assert [(len(i.token_ids), i.prompt_logits, i.sample) for i in items] == [
        (512, True, True), (188, True, True), (500, False, True),
    ]  # fmt: skip
    assert [i.block_table for i in items] == [(0, 1), (2,), (3, 4)]
    assert backend.capacity.prompt_logit_tokens == 700
    assert cuda_traits(CPU, fake).prompt_logit_tokens(128_256, 131_072) == 1_046
    assert device_traits(CPU).prompt_logit_tokens(128_256, 512) is None


def test_prompt_logprobs_in_chunks_of_the_logit_budget_equal_the_models(
    demo_model_dir: Path, stale_copies: transfer.StaleCopies
) -> None:
    """With 7 prompt-logit rows a step, a 40-token prompt's logprobs come over 6 steps while
    another request decodes beside it: each equals log_softmax of the model's own logits."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = load_causal_lm(demo_model_dir, CPU, "float32")
    reference = copy.deepcopy(model)
    fake = FakeCuda(total=100_000 * paged_kv_bytes_per_token(model), peak=0)
    backend = logit_capped(model, fake, 7)
    rows: list[int] = []
    forward = backend.forward

    def counting(items: Sequence[PackedItem]) -> Any:
        rows.append(sum(len(i.token_ids) for i in items if i.prompt_logits))
        return forward(items)

    backend.forward = counting  # type: ignore[method-assign]
    prompt = (tokenizer("def main():\n    return 1\n")["input_ids"] * 20)[:40]
    other = tokenizer("import os")["input_ids"]
    engine = engine_over(backend, tokenizer, prefix_caching=True)

    async def both() -> Any:
        detailed = GenerateParameters(
            max_new_tokens=2, details=True, decoder_input_details=True, ignore_eos=True
        )
        plain = GenerateParameters(max_new_tokens=8, ignore_eos=True)

        async def last(request: GenerationRequest) -> Any:
            events = [event async for event in engine.generate(request)]
            return events[-1]

        return await asyncio.gather(
            last(GenerationRequest("d", tuple(prompt), detailed)),
            last(GenerationRequest("p", tuple(other), plain)),
        )

    try:
        done, _ = asyncio.run(asyncio.wait_for(both(), timeout=120))
    finally:
        engine.stop()
    assert max(rows) == 7 and sum(rows) == 40
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(39), torch.tensor(prompt[1:])]
    prefill = done.completion.prefill
    assert [t.id for t in prefill] == prompt and prefill[0].logprob is None
    got = torch.tensor([t.logprob for t in prefill[1:]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_a_device_without_room_for_one_sequence_is_refused() -> None:
    per_token = paged_kv_bytes_per_token(llama())
    with pytest.raises(ConfigError, match="cannot hold one sequence of 512 tokens"):
        cuda_shaped(llama(), FakeCuda(total=1_000 * per_token, peak=500 * per_token))


def test_no_pool_tensor_outgrows_32_bit_indexing() -> None:
    """A budget of 10^12 tokens gives no more blocks than an int32 indexes in one layer's
    key tensor (less the graphs' scratch block)."""
    backend = cuda_shaped(llama(), FakeCuda(total=10**9, peak=0))
    shape = backend.kv_shape
    per_block = backend.block_size * shape.num_heads * shape.head_dim
    blocks = backend._size_pool(10**12, 1, 10**12, None, spare_blocks=1)
    assert (blocks + 1) * per_block <= 2**31 - 1 < (blocks + 2) * per_block


# --- the CUDA configuration serving on the CPU --------------------------------------------


@pytest.fixture
def stale_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[transfer.StaleCopies]:
    """The CPU's copies made an accelerator's: a copy to the host is stale until waited for."""
    copies = transfer.StaleCopies()
    monkeypatch.setitem(transfer.COPIES, "cpu", copies)
    yield copies


def engine_over(backend: PagedTorchBackend, tokenizer: Any, prefix_caching: bool) -> Engine:
    cap = backend.capacity
    limits = SchedulerLimits(
        max_batch_prefill_tokens=1200,
        max_batch_total_tokens=cap.kv_tokens,
        max_sequences=cap.max_sequences,
        prefill_step_tokens=cap.prefill_step_tokens,
        prompt_logit_tokens=cap.prompt_logit_tokens,
    )
    engine = Engine(backend, tokenizer, limits, 64, (), prefix_caching=prefix_caching)
    engine.start()
    return engine


def generate(
    engine: Engine, prompts: Sequence[Sequence[int]], new: int, stagger: int
) -> list[list[int]]:
    """Greedy tokens of each prompt; prompt i joins once prompt i - 1 has `stagger` tokens
    (0: all at once)."""

    async def one(i: int, started: list[asyncio.Event]) -> list[int]:
        if i and stagger:
            await started[i - 1].wait()
        params = GenerateParameters(max_new_tokens=new, ignore_eos=True)
        ids: list[int] = []
        async for event in engine.generate(GenerationRequest(f"r{i}", tuple(prompts[i]), params)):
            ids.append(event.token.id)
            if len(ids) == stagger:
                started[i].set()
        started[i].set()
        return ids

    async def together() -> list[list[int]]:
        started = [asyncio.Event() for _ in prompts]
        return list(await asyncio.gather(*(one(i, started) for i in range(len(prompts)))))

    return asyncio.run(asyncio.wait_for(together(), timeout=300))


def test_the_cuda_configuration_on_the_cpu_gives_generates_tokens(
    demo_model_dir: Path, stale_copies: transfer.StaleCopies
) -> None:
    """The demo model in float32 with CUDA's traits (blocks of 256, the whole prefill budget
    in one step, the profiled pool), pools filled with NaN (this folder's conftest) and the
    sampled ids' copy stale until waited for: each request alone, all at once and staggered
    (each joining the batch mid-decode) give transformers' greedy tokens."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = load_causal_lm(demo_model_dir, CPU, "float32")
    reference_model = copy.deepcopy(model)
    prompts = [
        tokenizer(text)["input_ids"]
        for text in ("def main():\n    ", "import os\nimport sys\n", "class Parser:", "#")
    ]
    # A prompt longer than a block: its decode reads two blocks, the others' padding.
    prompts[1] = (prompts[1] * 40)[:300]
    new = 12
    reference = [greedy_reference(reference_model, tuple(p), new) for p in prompts]
    per_token = paged_kv_bytes_per_token(model)
    fake = FakeCuda(total=100_000 * per_token, peak=0)
    backend = cuda_shaped(model, fake)
    engine = engine_over(backend, tokenizer, prefix_caching=True)
    try:
        assert [generate(engine, [p], new, 0)[0] for p in prompts] == reference
        assert generate(engine, prompts, new, 0) == reference
        assert generate(engine, prompts, new, stagger=3) == reference
    finally:
        engine.stop()
    assert stale_copies.fetched > 0


def test_bfloat16_batched_and_staggered_equal_each_request_alone(
    demo_model_dir: Path, stale_copies: transfer.StaleCopies
) -> None:
    """The same in bfloat16 (CUDA's serving dtype): batching changes no token."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = load_causal_lm(demo_model_dir, CPU, "bfloat16")
    prompts = [tokenizer(t)["input_ids"] for t in ("def f(x):", "for i in range(", "x = [")]
    prompts[0] = (prompts[0] * 80)[:280]
    per_token = paged_kv_bytes_per_token(model)
    backend = cuda_shaped(model, FakeCuda(total=100_000 * per_token, peak=0))
    engine = engine_over(backend, tokenizer, prefix_caching=False)
    try:
        alone = [generate(engine, [p], 10, 0)[0] for p in prompts]
        assert generate(engine, prompts, 10, 0) == alone
        assert generate(engine, prompts, 10, stagger=2) == alone
    finally:
        engine.stop()
