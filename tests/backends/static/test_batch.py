"""The static batch (tpu / neuron / gaudi semantics) run eagerly on the CPU: the fixed-shape
llama forward equals the HF model, both prefill modes give every sequence the tokens it gets
alone, and bad calls leave the slots untouched."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, greedy_reference
from tests.backends.scenarios import alone_run, random_prompts, staggered_greedy
from tgis.backends.static.batch import EagerOps, StaticBatchBackend
from tgis.backends.static.buckets import Shape, gaudi_policy, static_policy
from tgis.backends.static.kv import StaticLlamaForward
from tgis.config import GaudiSettings
from tgis.engine.backend import PrefillItem

MAX_LENGTH = 64


def make_static(
    model: PreTrainedModel,
    batch_size: int = 4,
    mode: str = "insert",
    max_input: int = 40,
    max_length: int = MAX_LENGTH,
) -> StaticBatchBackend:
    forward = StaticLlamaForward(model, batch_size, max_length)
    policy = static_policy(batch_size, max_length, max_input, mode)  # type: ignore[arg-type]
    return StaticBatchBackend(forward, policy, EagerOps(), "cpu-static", pad_token_id=3)


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2"])
def test_prefill_and_decode_logits_equal_the_hf_model(
    tiny_lm: Callable[..., PreTrainedModel], variant: str
) -> None:
    """Padded prompts of different lengths in one prefill, then decode steps: every row's
    logits are the HF model's over the same tokens."""
    model = tiny_lm(variant)
    forward = StaticLlamaForward(model, batch_size=3, max_length=MAX_LENGTH)
    length = 16
    padded = [list(p) + [3] * (length - len(p)) for p in PROMPTS]
    logits = forward.prefill_static(
        torch.tensor(padded),
        torch.tensor([len(p) for p in PROMPTS]),
        torch.tensor([2, 0, 1]),
        all_logits=True,
    )
    extra = (11, 250, 4)
    decoded = []
    positions = [0, 0, 0]
    for row, prompt in zip((2, 0, 1), PROMPTS, strict=True):
        positions[row] = len(prompt)
    for step, token in enumerate(extra):
        # rows hold PROMPTS[1], PROMPTS[2], PROMPTS[0]
        out = forward.decode_static(
            torch.tensor([token] * 3), torch.tensor([p + step for p in positions]), 3
        )
        decoded.append(out)
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            full = model(torch.tensor([list(prompt) + list(extra)])).logits[0].float()
            torch.testing.assert_close(
                logits[i, : len(prompt)], full[: len(prompt)], atol=1e-4, rtol=0
            )
            row = (2, 0, 1)[i]
            for step in range(len(extra)):
                torch.testing.assert_close(
                    decoded[step][row], full[len(prompt) + step], atol=1e-4, rtol=0
                )


@pytest.mark.parametrize("mode", ["insert", "rebuild"])
def test_greedy_tokens_equal_generate(tiny_lm: Callable[..., PreTrainedModel], mode: str) -> None:
    model = tiny_lm("llama")
    backend = make_static(model, mode=mode)
    for prompt in PROMPTS:
        tokens, _ = alone_run(backend, prompt, 8)
        assert tokens == greedy_reference(model, prompt, 8)


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_both_prefill_modes_give_every_sequence_its_alone_tokens(
    tiny_lm: Callable[..., PreTrainedModel], variant: str
) -> None:
    """Ten sequences share four static slots, joining as slots free up and leaving when done:
    rebuild and insert prefills give the same greedy tokens, each equal to the sequence run
    alone (and the logits agree)."""
    model = tiny_lm(variant)
    prompts, budgets = random_prompts(10, seed=3, vocab=256, max_len=30)
    solo = make_static(model, batch_size=1)
    alone = [alone_run(solo, p, n) for p, n in zip(prompts, budgets, strict=True)]
    # Joins never exceed the free slots: 3 at once, then as earlier ones finish.
    joins = {0: range(0, 3), 1: range(3, 4), 13: range(4, 6), 26: range(6, 8), 39: range(8, 10)}
    results = {}
    for mode in ("insert", "rebuild"):
        backend = make_static(model, batch_size=4, mode=mode)
        results[mode] = staggered_greedy(backend, prompts, budgets, joins, subsets=False)
        assert backend.running == 0
    for seq_id in range(10):
        assert results["insert"][0][seq_id] == alone[seq_id][0], f"insert, sequence {seq_id}"
        assert results["rebuild"][0][seq_id] == alone[seq_id][0], f"rebuild, sequence {seq_id}"
        for mode in ("insert", "rebuild"):
            torch.testing.assert_close(
                torch.stack(results[mode][1][seq_id]),
                torch.stack(alone[seq_id][1]),
                atol=1e-4,
                rtol=0,
            )


def test_decode_of_a_subset_leaves_the_others_intact(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    """A running sequence left out of some decode steps (its row computes a throwaway token
    at its next position) still continues exactly."""
    model = tiny_lm("llama")
    prompts, budgets = random_prompts(6, seed=11, vocab=256)
    budgets = [12] * 6
    solo = make_static(model, batch_size=1)
    alone = [alone_run(solo, p, n) for p, n in zip(prompts, budgets, strict=True)]
    backend = make_static(model, batch_size=8)
    tokens, _ = staggered_greedy(backend, prompts, budgets, {0: range(0, 3), 2: range(3, 6)})
    for seq_id in range(6):
        assert tokens[seq_id] == alone[seq_id][0]


def test_prompt_logprobs_cover_every_position(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    model = tiny_lm("llama")
    for mode in ("insert", "rebuild"):
        backend = make_static(model, mode=mode)
        out = backend.prefill(
            [PrefillItem(1, PROMPTS[0], prompt_logprobs=True), PrefillItem(2, PROMPTS[1])]
        )
        with torch.no_grad():
            full = model(torch.tensor([PROMPTS[0]])).logits[0].float()
        assert out.prompt[1] is None
        assert out.prompt[0] is not None
        torch.testing.assert_close(out.prompt[0], full, atol=1e-4, rtol=0)
        torch.testing.assert_close(out.last[0], full[-1], atol=1e-4, rtol=0)


def test_slots_are_the_lowest_free_and_reused(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    backend = make_static(tiny_lm("llama"), batch_size=4)
    backend.prefill([PrefillItem(i, (5, 6, 7)) for i in range(3)])
    assert [backend.slot_of(i) for i in range(3)] == [0, 1, 2]
    backend.release(1)
    backend.release(1)  # twice: nothing happens
    backend.prefill([PrefillItem(9, (8,)), PrefillItem(10, (9,))])
    assert backend.slot_of(9) == 1 and backend.slot_of(10) == 3
    assert backend.running == 4
    assert backend.capacity.max_sequences == 4
    assert backend.capacity.kv_tokens == 4 * MAX_LENGTH


def test_bad_calls_raise_and_change_nothing(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    model = tiny_lm("llama")
    backend = make_static(model, batch_size=2, max_input=20)
    backend.prefill([PrefillItem(1, (5, 6))])
    with pytest.raises(ValueError, match="only 1 of 2 static slots are free"):
        backend.prefill([PrefillItem(2, (5,)), PrefillItem(3, (6,))])
    with pytest.raises(ValueError, match="already running"):
        backend.prefill([PrefillItem(1, (5,))])
    with pytest.raises(ValueError, match=r"prompt of 21 tokens, must be 1\.\.20"):
        backend.prefill([PrefillItem(2, tuple(range(4, 25)))])
    with pytest.raises(ValueError, match="token ids outside"):
        backend.prefill([PrefillItem(2, (5, 999))])
    with pytest.raises(ValueError, match="unknown sequence 7"):
        backend.decode([7], [5])
    with pytest.raises(ValueError, match="repeat"):
        backend.decode([1, 1], [5, 5])
    assert backend.running == 1 and backend.slot_of(1) == 0
    # Sequence 1's cache is what its prefill left: decoding continues it exactly.
    out = backend.decode([1], [9])
    with torch.no_grad():
        expected = model(torch.tensor([[5, 6, 9]])).logits[0, -1].float()
    assert out.shape == (1, backend.vocab_size)
    torch.testing.assert_close(out[0], expected, atol=1e-4, rtol=0)


def test_full_sequence_cannot_decode(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    backend = make_static(tiny_lm("llama"), batch_size=1, max_input=15, max_length=16)
    backend.prefill([PrefillItem(1, tuple(range(4, 19)))])
    backend.decode([1], [5])  # the 16th token
    with pytest.raises(ValueError, match="is full"):
        backend.decode([1], [5])


def test_warmup_runs_every_shape_without_touching_slots(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    model = tiny_lm("llama")
    backend = make_static(model, batch_size=4, max_input=40)
    seen: list[Shape] = []
    timings = backend.warmup(4, 40, on_shape=lambda t: seen.append(t.shape))
    # Insert mode: prefill rows 1, 2, 4 x lengths 16, 32, 40, then decode of the 4 slots.
    assert seen == [
        *(Shape("prefill", rows, length) for rows in (1, 2, 4) for length in (16, 32, 40)),
        Shape("decode", 4, 1),
    ]
    assert [t.shape for t in timings] == seen
    assert all(t.seconds > 0 and t.compiled == 0 for t in timings)
    # Warmup left no sequence behind, and generation afterwards is exact.
    assert backend.running == 0
    tokens, _ = alone_run(backend, PROMPTS[2], 6)
    assert tokens == greedy_reference(model, PROMPTS[2], 6)
    backend.prefill([PrefillItem(1, (5, 6))])
    with pytest.raises(RuntimeError, match="idle backend"):
        backend.warmup(4, 40)


def test_gaudi_buckets_decode_only_the_rows_in_use(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    """Decode runs the smallest bucket that covers the highest used slot (gaudi's padding)."""
    model = tiny_lm("llama")
    forward = StaticLlamaForward(model, batch_size=8, max_length=MAX_LENGTH)
    settings = GaudiSettings(
        batch_bucket_size=4,
        prefill_batch_bucket_size=2,
        pad_sequence_to_multiple_of=16,
        decode_batch_size=8,
        prefill_batch_size=4,
        max_input_tokens=32,
    )
    policy = gaudi_policy(settings, MAX_LENGTH)
    backend = StaticBatchBackend(forward, policy, EagerOps(), "cpu-buckets", pad_token_id=3)
    calls: list[int] = []
    original = forward.decode_static

    def spy(input_ids: torch.Tensor, positions: torch.Tensor, rows: int) -> torch.Tensor:
        calls.append(rows)
        assert input_ids.shape == positions.shape == (rows,)
        return original(input_ids, positions, rows)

    forward.decode_static = spy  # type: ignore[method-assign]
    backend.prefill([PrefillItem(i, PROMPTS[i % 3]) for i in range(3)])
    backend.decode([0, 1, 2], [5, 6, 7])
    backend.prefill([PrefillItem(i, PROMPTS[0]) for i in range(3, 6)])
    backend.decode(list(range(6)), [5] * 6)
    backend.release(5)
    backend.release(4)
    backend.decode(list(range(4)), [5] * 4)
    assert calls == [4, 8, 4]
    tokens, _ = alone_run(make_static(model, batch_size=1), PROMPTS[1], 5)
    backend2 = StaticBatchBackend(
        StaticLlamaForward(model, 8, MAX_LENGTH), policy, EagerOps(), "b", pad_token_id=3
    )
    assert alone_run(backend2, PROMPTS[1], 5)[0] == tokens


def test_prompt_logprobs_cost_only_the_prompts_that_ask(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    """In rebuild mode every slot is recomputed, but every-position logits are computed only
    for the new prompt that asks: one extra pass of that prompt, never slots x positions x vocab."""
    model = tiny_lm("llama")
    backend = make_static(model, batch_size=4, mode="rebuild")
    backend.prefill([PrefillItem(i, PROMPTS[i]) for i in range(3)])
    calls: list[tuple[tuple[int, ...], bool]] = []
    original = backend.model.prefill_static

    def spy(ids: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, all_logits: bool = False):  # type: ignore[no-untyped-def]
        calls.append((tuple(ids.shape), all_logits))
        return original(ids, lengths, rows, all_logits)

    backend.model.prefill_static = spy  # type: ignore[method-assign]
    out = backend.prefill([PrefillItem(9, (5, 6, 7), prompt_logprobs=True)])
    assert calls == [((4, 16), False), ((1, 16), True)]
    with torch.no_grad():
        full = model(torch.tensor([[5, 6, 7]])).logits[0].float()
    assert out.prompt[0] is not None
    torch.testing.assert_close(out.prompt[0], full, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.last[0], full[-1], atol=1e-4, rtol=0)


def test_a_full_row_does_not_break_the_others(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    """A sequence fed up to max_length stays in the batch (the engine would have released it):
    decoding the others computes its row at its last position instead of past the cache."""
    model = tiny_lm("llama")
    backend = make_static(model, batch_size=2, max_input=15, max_length=16)
    backend.prefill([PrefillItem(1, tuple(range(4, 19))), PrefillItem(2, (5, 6))])
    backend.decode([1], [5])  # sequence 1 now holds all 16 positions
    tokens = [int(backend.decode([2], [7])[0].argmax())]
    with torch.no_grad():
        expected = model(torch.tensor([[5, 6, 7]])).logits[0, -1].argmax()
    assert tokens == [int(expected)]


@pytest.mark.parametrize("variant", ["llama", "mistral"])
def test_sdpa_prefill_equals_the_matmul_prefill(
    tiny_lm: Callable[..., PreTrainedModel], variant: str
) -> None:
    """The SDPA prefill (used on CUDA) gives the matmul prefill's logits, padding and sliding
    windows included."""
    model = tiny_lm(variant, sliding_window=4) if variant == "mistral" else tiny_lm(variant)
    results = []
    for sdpa in (False, True):
        forward = StaticLlamaForward(model, batch_size=3, max_length=MAX_LENGTH)
        forward.sdpa_prefill = sdpa
        padded = [list(p) + [3] * (16 - len(p)) for p in PROMPTS]
        results.append(
            forward.prefill_static(
                torch.tensor(padded),
                torch.tensor([len(p) for p in PROMPTS]),
                torch.tensor([0, 1, 2]),
                all_logits=True,
            )
        )
    for i, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(
            results[1][i, : len(prompt)], results[0][i, : len(prompt)], atol=1e-4, rtol=0
        )
