"""tgis.backends.simulated: a forward that is a timer's, over the model's vocabulary, whose
tokens are reproducible: the engine over it on a simulated device's stream gives the tokens
the table's rows choose, the same as over an inline stream."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.factories import tiny_tokenizer
from tgis.backends.simulated import HEAD, SimulatedBackend
from tgis.engine.backend import FedTokens, PackedItem
from tgis.engine.engine import Engine
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.sequence import PLACEHOLDER_ID
from tgis.engine.stream import DeviceStream, SimulatedStream
from tgis.engine.types import GenerationRequest
from tgis.params import GenerateParameters


def expected_greedy(backend: SimulatedBackend, prompt: list[int], new: int) -> list[int]:
    """The oracle: each next token is the argmax of the table row of the last token and its
    position."""
    tokens = list(prompt)
    for _ in range(new):
        row = backend.row(tokens[-1], len(tokens) - 1)
        tokens.append(int(backend._table[row].argmax()))
    return tokens[len(prompt) :]


def test_logits_follow_each_rows_last_token_and_position() -> None:
    backend = SimulatedBackend(vocab_size=500, max_sequences=2, max_sequence_tokens=64)
    out = backend.forward([
        PackedItem(0, (5, 6, 7), 0, (0,)),
        PackedItem(1, (9,), 3, (4,), prompt_logits=True),
    ])  # fmt: skip
    assert out.last.shape == (2, 500)
    assert torch.equal(out.last[0], backend._table[backend.row(7, 2)])
    assert torch.equal(out.last[1], backend._table[backend.row(9, 3)])
    assert out.prompt[0] is None and out.prompt[1] is not None
    assert backend.capacity.max_sequences == 2 and backend.capacity.block_size == 16
    with pytest.raises(ValueError, match="takes no images"):
        backend.encode_images([])


def test_fed_tokens_are_read_from_the_step_befores_ids() -> None:
    """An item whose last token the step before samples (async scheduling) takes it from that
    step's ids, at its row there: the logits of the same step given the token."""
    backend = SimulatedBackend(vocab_size=500, max_sequences=2, max_sequence_tokens=64)
    given = backend.forward([PackedItem(0, (5, 6, 7), 0, (0,)), PackedItem(1, (9, 44), 3, (4,))])
    sampled = torch.tensor([3, 44, 1, 7])
    fed = backend.forward(
        [
            PackedItem(0, (5, 6, PLACEHOLDER_ID), 0, (0,)),
            PackedItem(1, (9, PLACEHOLDER_ID), 3, (4,)),
        ],
        FedTokens((1, 0), (1, 3), lambda: sampled),
    )
    assert torch.equal(fed.last, given.last)
    assert backend.capacity.fed_tokens


@pytest.mark.parametrize("vocab", [4096, 128_256])
def test_each_rows_logits_are_peaked_as_a_language_models(vocab: int) -> None:
    """The likeliest token holds a good part of the mass and top-p 0.9 is reached within the
    row's HEAD likely tokens, as on a model's logits (flat logits would send top-p through
    the whole vocabulary)."""
    backend = SimulatedBackend(vocab_size=vocab, max_sequences=1, max_sequence_tokens=8)
    probs = backend._table.softmax(dim=-1).sort(dim=-1, descending=True).values
    assert bool(((probs[:, 0] > 0.2) & (probs[:, 0] < 0.95)).all())
    assert bool((probs[:, :HEAD].sum(dim=-1) > 0.9).all())


@pytest.mark.parametrize("simulated", [False, True], ids=["inline", "simulated-device"])
def test_the_engine_over_a_simulated_device_gives_the_tables_tokens(simulated: bool) -> None:
    tokenizer = tiny_tokenizer()
    vocab = len(tokenizer)
    backend = SimulatedBackend(vocab_size=vocab, max_sequences=4, max_sequence_tokens=64)
    stream = SimulatedStream(step_s=0.001) if simulated else DeviceStream()
    limits = SchedulerLimits(
        max_batch_prefill_tokens=256,
        max_batch_total_tokens=backend.capacity.kv_tokens,
        max_sequences=4,
    )
    engine = Engine(backend, tokenizer, limits, 8, (), stream=stream)
    engine.start()
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]

    async def all_of() -> list[list[int]]:
        async def one(i: int, prompt: list[int]) -> list[int]:
            params = GenerateParameters(max_new_tokens=6, ignore_eos=True)
            request = GenerationRequest(f"r{i}", tuple(prompt), params)
            return [event.token.id async for event in engine.generate(request)]

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    try:
        got = asyncio.run(asyncio.wait_for(all_of(), timeout=60))
    finally:
        engine.stop()
        stream.close()
    assert got == [expected_greedy(backend, p, 6) for p in prompts]
    if simulated:
        assert stream.busy_s >= 6 * 0.001  # at least one step per token
