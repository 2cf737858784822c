"""Speculative decoding with a draft model (tgis.engine.draft): greedy output identical to
decoding without speculation, with the target itself as draft (every draft accepted) and with
an unrelated small model of the same vocabulary (few accepted); the draft cache catches up
from the first disagreement and gives its blocks back; a draft that fails costs only the
speculation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_engine import PROMPTS, request, tokenizer
from tests.engine.test_poison_batch import make_engine, paged_backend
from tests.engine.test_speculation import EDIT, Counts, outputs
from tests.factories import tiny_config
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine.draft import DraftModelProposer
from tgis.engine.engine import Engine
from tgis.engine.types import GenerationRequest
from tgis.server.http.metrics import Metrics

__all__ = ["tokenizer"]


def other_model(vocab: int) -> PagedTorchBackend:
    """A small random llama of the demo model's vocabulary: a poor but valid draft."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config("llama", vocab_size=vocab, max_position_embeddings=512))
    return PagedTorchBackend(
        model.eval(), max_sequences=16, max_sequence_tokens=300, max_prefill_tokens=512,
        kv_tokens=4096,
    )  # fmt: skip


def requests(tokenizer: Any) -> list[GenerationRequest]:
    prompts = [EDIT, *PROMPTS[:4]]
    reqs = [
        request(tokenizer, p, f"d{i}", max_new_tokens=20 + 3 * i, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    reqs.append(request(tokenizer, PROMPTS[5], "pen", max_new_tokens=25, repetition_penalty=1.4))
    return reqs


@pytest.fixture(scope="module")
def plain(demo_model_dir: Path, tokenizer: Any) -> Iterator[Engine]:
    engine = make_engine(paged_backend(demo_model_dir), demo_model_dir, tokenizer)
    yield engine
    engine.stop()


def speculating(
    demo_model_dir: Path, tokenizer: Any, draft: PagedTorchBackend
) -> tuple[Engine, DraftModelProposer, Counts]:
    metrics = Metrics()
    proposer = DraftModelProposer(draft)
    engine = make_engine(
        paged_backend(demo_model_dir), demo_model_dir, tokenizer, speculate=4,
        proposer=proposer, observer=metrics,
    )  # fmt: skip
    return engine, proposer, Counts(metrics)


def test_the_target_as_its_own_draft(plain: Engine, demo_model_dir: Path, tokenizer: Any) -> None:
    reqs = requests(tokenizer)
    expected = [outputs(plain, [r])[0] for r in reqs]
    engine, proposer, counts = speculating(demo_model_dir, tokenizer, paged_backend(demo_model_dir))
    try:
        assert [outputs(engine, [r])[0] for r in reqs] == expected
        assert outputs(engine, reqs) == expected
    finally:
        engine.stop()
    # A greedy draft of the same model is the target's own choice, except where the target
    # applies a processor the draft does not (the repetition penalty of one request).
    assert counts.drafted > 100 and counts.accepted >= 0.8 * counts.drafted
    assert proposer.blocks.free_blocks == proposer.blocks.num_blocks  # all given back


def test_an_unrelated_draft_changes_nothing_but_speed(
    plain: Engine, demo_model_dir: Path, tokenizer: Any
) -> None:
    reqs = requests(tokenizer)
    expected = [outputs(plain, [r])[0] for r in reqs]
    engine, proposer, counts = speculating(demo_model_dir, tokenizer, other_model(len(tokenizer)))
    try:
        assert outputs(engine, reqs) == expected
    finally:
        engine.stop()
    assert counts.drafted > 100 and counts.accepted < 0.5 * counts.drafted
    assert proposer.blocks.free_blocks == proposer.blocks.num_blocks


def test_the_draft_cache_catches_up_from_the_first_disagreement(demo_model_dir: Path) -> None:
    backend = paged_backend(demo_model_dir)
    proposer = DraftModelProposer(backend)
    seen: list[tuple[tuple[int, ...], int]] = []
    forward = backend.forward

    def spy(items: Any) -> Any:
        seen.extend((item.token_ids, item.start) for item in items)
        return forward(items)

    backend.forward = spy  # type: ignore[method-assign]
    tokens = [5, 6, 7, 8, 9]
    (first,) = proposer.draft([(1, tokens, 3)])
    assert len(first) == 3
    assert seen == [(tuple(tokens), 0), ((first[0],), 5), ((first[1],), 6)]
    seen.clear()
    # The sequence took the first draft token, then another: the cache keeps position 5.
    tokens = [*tokens, first[0], 1234]
    proposer.draft([(1, tokens, 2)])
    assert seen[0] == ((1234,), 6)
    proposer.release(1)
    assert proposer.blocks.free_blocks == proposer.blocks.num_blocks


def test_a_failing_draft_model_costs_only_the_speculation(
    plain: Engine, demo_model_dir: Path, tokenizer: Any
) -> None:
    draft = paged_backend(demo_model_dir)

    def broken(items: Any) -> Any:
        raise RuntimeError("the draft model failed")

    draft.forward = broken  # type: ignore[method-assign]
    reqs = requests(tokenizer)[:3]
    expected = outputs(plain, reqs)
    engine, _, counts = speculating(demo_model_dir, tokenizer, draft)
    try:
        assert outputs(engine, reqs) == expected
        assert engine.healthy()
    finally:
        engine.stop()
    assert counts.drafted == 0


def test_a_long_catch_up_runs_in_bounded_forwards(demo_model_dir: Path) -> None:
    wanted = [(1, list(range(5, 40)), 3), (2, list(range(50, 61)), 2), (3, [7, 8], 4)]
    whole = DraftModelProposer(paged_backend(demo_model_dir)).draft(wanted)
    backend = paged_backend(demo_model_dir)
    chunked = DraftModelProposer(backend, max_step_tokens=8)
    sizes: list[int] = []
    forward = backend.forward

    def spy(items: Any) -> Any:
        sizes.append(sum(len(item.token_ids) for item in items))
        return forward(items)

    backend.forward = spy  # type: ignore[method-assign]
    assert chunked.draft(wanted) == whole
    assert [len(d) for d in whole] == [3, 2, 4]
    assert max(sizes) <= 8 and sum(sizes) == 35 + 11 + 2 + 2 + 1 + 3


def test_drafts_stay_inside_the_model_vocabulary(demo_model_dir: Path) -> None:
    backend = paged_backend(demo_model_dir)
    forward = backend.forward

    def padded(items: Any) -> Any:
        out = forward(items)
        # A draft whose embedding has more rows than the model's vocabulary, the extra row
        # scoring highest everywhere.
        extra = torch.full((out.last.shape[0], 1), 1e9)
        return type(out)(torch.cat([out.last, extra], dim=1), out.prompt)

    backend.forward = padded  # type: ignore[method-assign]
    vocab = int(forward([]).last.shape[1])
    (drafted,) = DraftModelProposer(backend, vocab_size=vocab).draft([(1, [5, 6, 7], 3)])
    assert len(drafted) == 3 and max(drafted) < vocab
    (unbounded,) = DraftModelProposer(backend).draft([(1, [5, 6, 7], 1)])
    assert unbounded == (vocab,)
