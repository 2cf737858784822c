"""TorchDynamicBackend: exact greedy tokens, continuous batching, slot compaction, capacity."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.conftest import (
    ALL_VARIANTS,
    PROMPTS,
    VARIANTS,
    greedy_reference,
    make_backend,
)
from tests.backends.scenarios import alone_run, random_prompts, staggered_greedy
from tests.factories import make_model_dir, tiny_model
from tgis.backends.common import device as torch_device
from tgis.backends.common.device import cpu_has_native_bf16, resolve_dtype
from tgis.backends.fallback import backend as torch_dynamic
from tgis.backends.fallback.backend import TorchDynamicBackend
from tgis.backends.fallback.hf_forward import HFForward, pad_groups
from tgis.engine.backend import PrefillItem, Shape
from tgis.errors import ConfigError

NEW_TOKENS = 8
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run_greedy(
    backend: TorchDynamicBackend, prompts: tuple[tuple[int, ...], ...], new_tokens: int
) -> list[list[int]]:
    """The engine's simplest driver: prefill every prompt at once, then argmax decode."""
    out = backend.prefill([PrefillItem(i, p) for i, p in enumerate(prompts)])
    tokens = [[int(row.argmax())] for row in out.last]
    ids = list(range(len(prompts)))
    for _ in range(new_tokens - 1):
        logits = backend.decode(ids, [t[-1] for t in tokens])
        for row, seq in zip(logits, tokens, strict=True):
            seq.append(int(row.argmax()))
    for seq_id in ids:
        backend.release(seq_id)
    return tokens


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_greedy_tokens_equal_generate(
    tiny_lm: Callable[..., PreTrainedModel], variant: str
) -> None:
    model = tiny_lm(variant)
    backend = make_backend(model)
    assert backend.path.name == "hf"
    expected = [greedy_reference(model, p, NEW_TOKENS) for p in PROMPTS]
    assert run_greedy(backend, PROMPTS, NEW_TOKENS) == expected
    assert backend.running == 0


@pytest.mark.parametrize("variant", ALL_VARIANTS)
@pytest.mark.parametrize("pad_slack", [0.0, 10.0], ids=["unpadded", "padded"])
def test_prompt_logits_equal_full_forward(
    tiny_lm: Callable[..., PreTrainedModel], variant: str, pad_slack: float
) -> None:
    """Prompt logits of several prompts prefilled together (on the generic path: one by one,
    or right-padded into one batch) equal HF's full-sequence forward of each prompt."""
    model = tiny_lm(variant)
    backend = make_backend(model)
    assert isinstance(backend.path, HFForward)
    backend.path.pad_slack = pad_slack
    items = [PrefillItem(i, p, prompt_logprobs=i != 1) for i, p in enumerate(PROMPTS)]
    out = backend.prefill(items)
    assert out.last.shape == (len(PROMPTS), backend.vocab_size)
    assert out.last.dtype == torch.float32
    assert out.prompt[1] is None
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            full = model(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(out.last[i], full[-1], atol=1e-4, rtol=0)
        if i != 1:
            assert out.prompt[i] is not None
            assert out.prompt[i].shape == (len(prompt), backend.vocab_size)
            torch.testing.assert_close(out.prompt[i], full, atol=1e-4, rtol=0)


def test_prompt_logits_without_the_lm_head_hook() -> None:
    """A model that computes logits without calling its output-embedding module gets its rows
    selected after the forward instead, with the same result."""
    # A model of its own: its hooks are cleared below, the session's shared one stays intact.
    arch, fields = VARIANTS["gpt_neox"]
    model = tiny_model(arch, seed=0, **fields)  # type: ignore[arg-type]
    backend = make_backend(model)
    backend.path.pad_slack = 10.0  # type: ignore[attr-defined]
    model.get_output_embeddings()._forward_pre_hooks.clear()
    out = backend.prefill([PrefillItem(i, p, prompt_logprobs=True) for i, p in enumerate(PROMPTS)])
    for prompt, logits in zip(PROMPTS, out.prompt, strict=True):
        with torch.no_grad():
            full = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)


def test_padding_groups_bound_the_waste() -> None:
    lengths = [232, 114, 210, 243, 123, 26, 82, 146]
    assert pad_groups(lengths, 0.25) == [[3, 0, 2, 7], [4, 1, 6], [5]]
    assert pad_groups([5, 5, 5], 0.0) == [[0, 1, 2]]
    assert pad_groups([7, 2, 13], 0.0) == [[2], [0], [1]]
    assert pad_groups([7, 2, 13], 10.0) == [[2, 0, 1]]


@pytest.mark.parametrize("variant", ["llama", "gpt2", "bloom"])
def test_continuous_batching_is_invisible_to_each_sequence(
    tiny_lm: Callable[..., PreTrainedModel], variant: str
) -> None:
    """16 sequences of different lengths join at different steps, leave when done, and are
    decoded in shuffled order (sometimes only a subset): each gets the tokens and logits it
    gets alone."""
    model = tiny_lm(variant)
    prompts, budgets = random_prompts(16, seed=7, vocab=256)
    solo = make_backend(model, max_sequences=1)
    alone = [alone_run(solo, p, n) for p, n in zip(prompts, budgets, strict=True)]

    backend = make_backend(model, max_sequences=16)
    joins = {0: range(0, 5), 2: range(5, 9), 3: range(9, 10), 6: range(10, 16)}
    tokens, logits = staggered_greedy(backend, prompts, budgets, joins)
    assert backend.running == 0
    for seq_id in range(16):
        assert tokens[seq_id] == alone[seq_id][0], f"sequence {seq_id}"
        torch.testing.assert_close(
            torch.stack(logits[seq_id]), torch.stack(alone[seq_id][1]), atol=1e-4, rtol=0
        )


def test_release_moves_last_slot_into_the_hole(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    model = tiny_lm("llama")
    prompts = (*PROMPTS, (77, 78, 79))
    expected = [greedy_reference(model, p, 6) for p in prompts]
    backend = make_backend(model, max_sequences=4)
    out = backend.prefill([PrefillItem(10 + i, p) for i, p in enumerate(prompts)])
    tokens = {10 + i: [int(row.argmax())] for i, row in enumerate(out.last)}
    for _ in range(2):
        logits = backend.decode(list(tokens), [t[-1] for t in tokens.values()])
        for seq, row in zip(tokens.values(), logits, strict=True):
            seq.append(int(row.argmax()))
    assert [backend.slot_of(s) for s in tokens] == [0, 1, 2, 3]

    backend.release(11)  # slot 1: sequence 13 moves from slot 3 into it
    assert backend.running == 3
    assert backend.slot_of(13) == 1
    assert backend.sequence_length(13) == len(prompts[3]) + 2
    backend.release(11)  # releasing twice, or an unknown id, changes nothing
    backend.release(999)
    assert backend.running == 3
    del tokens[11]
    after: dict[int, list[torch.Tensor]] = {s: [] for s in tokens}
    for _ in range(3):
        logits = backend.decode(list(tokens), [t[-1] for t in tokens.values()])
        for seq_id, row in zip(tokens, logits, strict=True):
            after[seq_id].append(row)
            tokens[seq_id].append(int(row.argmax()))
    assert tokens == {10: expected[0], 12: expected[2], 13: expected[3]}
    # Logits too (greedy tokens of a tiny random model barely depend on the context): the
    # moved sequence attends to its own KV, not to what the released one left in the slot.
    for seq_id, rows in after.items():
        prompt = prompts[seq_id - 10]
        with torch.no_grad():
            full = model(torch.tensor([prompt + tuple(tokens[seq_id][:-1])])).logits[0]
        torch.testing.assert_close(torch.stack(rows), full[-3:], atol=1e-4, rtol=0)
    # The freed slot is reused by the next prefill.
    backend.prefill([PrefillItem(20, prompts[1])])
    assert backend.slot_of(20) == 3


def test_chunked_prefill_equals_one_pass(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    model = tiny_lm("qwen2")
    items = [PrefillItem(i, p, prompt_logprobs=True) for i, p in enumerate(PROMPTS)]
    whole = make_backend(model).prefill(items)
    chunked_backend = make_backend(model, prefill_chunk_tokens=5)
    chunked = chunked_backend.prefill(items)
    torch.testing.assert_close(chunked.last, whole.last, atol=1e-5, rtol=0)
    for a, b in zip(chunked.prompt, whole.prompt, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert [chunked_backend.sequence_length(i) for i in range(3)] == [len(p) for p in PROMPTS]


def test_kv_budget_smaller_than_requested_clamps_sequences(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    model = tiny_lm("llama")  # 2 layers x 2 KV heads x head_dim 16, float32
    backend = TorchDynamicBackend(model, max_sequences=16, max_sequence_tokens=64, kv_tokens=200)
    capacity = backend.capacity
    assert capacity.max_sequences == 3  # 200 // 64
    assert capacity.max_sequence_tokens == 64
    assert capacity.kv_tokens == 3 * 64
    assert capacity.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert backend.cache.keys[0].shape == (3, 2, 64, 16)


def test_kv_budget_from_free_memory(
    tiny_lm: Callable[..., PreTrainedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_lm("gpt2")  # generic path: 2 layers x 4 heads x 16, float32 -> 1024 B/token
    monkeypatch.setattr(torch_dynamic, "available_memory", lambda device: 1024 * 1000)
    backend = TorchDynamicBackend(
        model, max_sequences=8, max_sequence_tokens=100, kv_memory_fraction=0.5
    )
    assert backend.capacity.kv_bytes_per_token == 1024
    assert backend.capacity.max_sequences == 5  # 500 tokens fit
    with pytest.raises(ConfigError, match="cannot hold one sequence of 600 tokens"):
        TorchDynamicBackend(model, max_sequences=8, max_sequence_tokens=600, kv_memory_fraction=0.5)
    monkeypatch.undo()
    measured = TorchDynamicBackend(model, max_sequences=4, max_sequence_tokens=64)
    assert measured.capacity.max_sequences == 4  # a tiny cache fits in any machine's memory


def test_prefill_beyond_slots_raises_and_changes_nothing(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    model = tiny_lm("llama")
    backend = make_backend(model, max_sequences=2, max_sequence_tokens=16)
    backend.prefill([PrefillItem(0, PROMPTS[0])])
    with pytest.raises(
        ValueError, match="prefill of 2 sequences but only 1 of 2 KV slots are free"
    ):
        backend.prefill([PrefillItem(1, PROMPTS[1]), PrefillItem(2, PROMPTS[1])])
    with pytest.raises(ValueError, match="already running"):
        backend.prefill([PrefillItem(0, PROMPTS[1])])
    with pytest.raises(ValueError, match=r"must be 1\.\.16"):
        backend.prefill([PrefillItem(3, tuple(range(4, 21)))])
    with pytest.raises(ValueError, match="unknown sequence 5"):
        backend.decode([5], [4])
    assert backend.running == 1
    # The sequence already there is intact.
    first = [greedy_reference(model, PROMPTS[0], 3)]
    backend.release(0)
    assert run_greedy(backend, (PROMPTS[0],), 3) == first


def test_full_sequence_cannot_decode(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    backend = make_backend(tiny_lm("llama"), max_sequences=1, max_sequence_tokens=8)
    backend.prefill([PrefillItem(0, (4, 5, 6, 7, 8, 9, 10))])
    backend.decode([0], [11])
    with pytest.raises(ValueError, match="sequence 0 is full"):
        backend.decode([0], [12])


def test_warmup_releases_its_own_sequences(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    backend = make_backend(tiny_lm("gpt2"), max_sequences=4, max_sequence_tokens=32)
    backend.prefill([PrefillItem(0, PROMPTS[0])])
    seen: list[Shape] = []
    timings = backend.warmup(
        max_batch_size=8, max_input_tokens=40, on_shape=lambda t: seen.append(t.shape)
    )
    # The longest prompt the slots hold, the free slots filled, decode per power of two.
    assert (
        [t.shape for t in timings]
        == seen
        == [
            Shape("prefill", 1, 31),
            Shape("prefill", 3, 8),
            Shape("decode", 1, 1),
            Shape("decode", 2, 1),
            Shape("decode", 3, 1),
        ]
    )
    assert all(t.seconds > 0 and t.compiled == 0 for t in timings)
    assert backend.running == 1
    assert backend.slot_of(0) == 0


def test_load_from_a_model_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_model_dir(tmp_path / "llama", arch="llama", with_tokenizer=False)
    threads = torch.get_num_threads()
    # The default is what the CPU's measurement picks (common/device.choose_cpu_dtype), which
    # a loaded machine may flip: held here to the measurement's answer.
    import tgis.backends.common.device as device

    measured = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    monkeypatch.setattr(device, "choose_cpu_dtype", lambda *_: (measured, "measured"))
    backend = TorchDynamicBackend.load(
        model_dir, max_sequences=4, max_sequence_tokens=32, kv_tokens=1000, num_threads=threads
    )
    assert (backend.name, backend.device, backend.path.name) == ("cpu", "cpu", "hf")
    assert backend.vocab_size == 128
    assert backend.dtype == measured
    generic = TorchDynamicBackend.load(
        model_dir,
        "cpu",
        "bfloat16",
        max_sequences=2,
        max_sequence_tokens=32,
        kv_tokens=64,
        num_threads=threads,
    )
    assert generic.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert generic.capacity.max_sequences == 2


def test_dtype_rules() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native_bf16 = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype(cpu, None, torch.float32, (64, 128)) in (native_bf16, torch.float32)
    assert resolve_dtype(cpu, "bfloat16", None) == native_bf16
    assert resolve_dtype(cpu, "float32", torch.bfloat16) == torch.float32
    assert resolve_dtype(cpu, "float16", None) == torch.float32
    assert resolve_dtype(cuda, "float32", torch.bfloat16) == torch.float32
    assert resolve_dtype(cuda, None, "bfloat16") == torch.bfloat16
    assert resolve_dtype(cuda, None, torch.float16) == torch.float16
    with pytest.raises(ValueError, match="not one of"):
        resolve_dtype(cpu, "int8", None)


@pytest.mark.parametrize(
    ("bf16_ms", "f32_ms", "chosen"),
    [(2.0, 3.0, torch.bfloat16), (3.3, 2.7, torch.float32)],
    ids=["bf16-faster", "bf16-slower"],
)
def test_auto_dtype_on_a_native_bf16_cpu_is_the_faster_measured(
    monkeypatch: pytest.MonkeyPatch, bf16_ms: float, f32_ms: float, chosen: torch.dtype
) -> None:
    monkeypatch.setattr(torch_device, "cpu_has_native_bf16", lambda: True)
    timed: list[tuple[torch.dtype, int, int]] = []

    def probe(dtype: torch.dtype, hidden: int, intermediate: int) -> float:
        timed.append((dtype, hidden, intermediate))
        return (bf16_ms if dtype == torch.bfloat16 else f32_ms) / 1000

    monkeypatch.setattr(torch_device, "decode_matmul_seconds", probe)
    dtype, why = torch_device.choose_cpu_dtype(576, 1536)
    assert dtype == chosen
    assert f"bfloat16 {bf16_ms:.2f} ms, float32 {f32_ms:.2f} ms" in why
    assert sorted(str(t) for t in timed) == sorted(
        str((d, 576, 1536)) for d in (torch.float32, torch.bfloat16)
    )
    assert resolve_dtype(torch.device("cpu"), None, None, (576, 1536)) == chosen
    # Asked for, bf16 is what runs; float32 asked for is float32 whatever is faster.
    assert resolve_dtype(torch.device("cpu"), "bfloat16", None) == torch.bfloat16
    assert resolve_dtype(torch.device("cpu"), "float32", None) == torch.float32


def test_auto_dtype_without_native_bf16_is_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_device, "cpu_has_native_bf16", lambda: False)
    dtype, why = torch_device.choose_cpu_dtype(64, 128)
    assert dtype == torch.float32 and "no native bfloat16" in why


def test_the_dtype_probe_times_real_matmuls() -> None:
    assert 0 < torch_device.decode_matmul_seconds(torch.float32, 64, 128) < math.inf


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("variant", ["llama", "gpt2", "falcon"])
def test_cuda_greedy_tokens_equal_generate(
    tiny_lm: Callable[..., PreTrainedModel], variant: str
) -> None:
    arch, fields = VARIANTS[variant]
    model = tiny_model(arch, seed=0, **fields).to("cuda")  # type: ignore[arg-type]
    backend = make_backend(model)
    assert backend.name == "cuda"
    expected = [greedy_reference(tiny_lm(variant), p, NEW_TOKENS) for p in PROMPTS]
    assert run_greedy(backend, PROMPTS, NEW_TOKENS) == expected
    out = backend.prefill([PrefillItem(i, p, prompt_logprobs=True) for i, p in enumerate(PROMPTS)])
    for prompt, logits in zip(PROMPTS, out.prompt, strict=True):
        assert logits is not None and logits.device.type == "cuda"
        with torch.no_grad():
            full = tiny_lm(variant)(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits.cpu(), full, atol=1e-3, rtol=0)


def test_compiled_decode_equals_eager_and_compiles_only_at_warmup(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    """--compile: warmup compiles the decode step (batch 1 and a dynamic-batch graph); serving
    other batch sizes and lengths afterwards compiles nothing and gives the eager tokens.
    (The engine decodes every running sequence, so the subset path is not exercised.)"""
    model = tiny_lm("llama")
    prompts, budgets = random_prompts(5, seed=5, vocab=256)
    eager = make_backend(model, max_sequences=8)
    joins = {0: range(0, 2), 3: range(2, 5)}
    expected, _ = staggered_greedy(eager, prompts, budgets, joins, subsets=False)
    compiled = make_backend(model, max_sequences=8, compile=True)
    before = compiled.compilations()  # the process's count: other tests compile too
    timings = compiled.warmup(8, 40)
    assert compiled.compilations() > before
    assert sum(t.compiled for t in timings) == compiled.compilations() - before
    after_warmup = compiled.compilations()
    tokens, _ = staggered_greedy(compiled, prompts, budgets, joins, subsets=False)
    assert tokens == expected
    assert compiled.compilations() == after_warmup
    assert compiled.late_compilations == 0
    # A subset of the running sequences (never sent by the engine) is another variant: it
    # compiles, and that is counted and logged.
    compiled.prefill([PrefillItem(i, (5, 6, 7)) for i in range(3)])
    compiled.decode([0, 2], [8, 9])
    assert compiled.late_compilations >= 1


def test_warmup_fits_tiny_sequence_limits(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    """max_total_tokens below the warmup's short prompt still warms up (serve must start)."""
    for tokens in (2, 4, 8):
        backend = make_backend(tiny_lm("llama"), max_sequences=2, max_sequence_tokens=tokens)
        timings = backend.warmup(2, tokens - 1)
        assert timings and backend.running == 0


def test_a_sliding_window_shorter_than_the_sequences_is_refused() -> None:
    """transformers' sliding-window mask shares one cache position across rows, so the slot
    engine refuses a window shorter than its sequences (the paged engine masks per row)."""
    arch, fields = VARIANTS["mistral"]
    model = tiny_model(arch, seed=2, **{**fields, "sliding_window": 6})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"sliding window of 6 tokens.*--max-total-tokens to 6"):
        make_backend(model, max_sequence_tokens=32)
    assert make_backend(model, max_sequence_tokens=6).path.name == "hf"
