"""The paged engine's request features on every model family of models/families.py, through
the engine as the server drives it: speculation (drafts verified several tokens a row), a tuned
prompt prefix, a grammar and top-n logprobs each give what transformers gives for the same
family (its generate() over the same tokens or embeddings, its log-softmax), alone and batched
together."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.models.test_families import NEW_FAMILIES, family_model
from tests.backends.paged_driver import paged
from tests.engine.test_engine import collect, run, tokenizer
from tests.engine.test_prompt_prefix import generate_over_embeds
from tests.engine.test_speculation import Counts
from tgis.engine.engine import Engine
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.types import GenerationRequest, PromptPrefix, TokenEvent
from tgis.params import GenerateParameters, GrammarSpec
from tgis.server.http.metrics import Metrics

NEW = 10
# Prompts of different lengths, none the start of another.
PROMPTS = [(20, 21, 22, 23, 24, 25), (5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7), (40, 41, 42)]
TOP_N = 3
# Logprobs of the float32 engine against transformers' (they differ by ~1e-6).
TOLERANCE = 1e-4

__all__ = ["tokenizer"]  # the fixture shared with test_engine


def greedy_params(**extra: Any) -> GenerateParameters:
    return GenerateParameters(max_new_tokens=NEW, ignore_eos=True, **extra)


def reference(model: PreTrainedModel, ids: tuple[int, ...], prefix: torch.Tensor | None = None):
    """generate()'s greedy tokens after `ids` (behind `prefix`'s embedding rows), and the
    log-softmax of each step's logits."""
    return generate_over_embeds(model, ids, prefix, NEW)


class ReferenceProposer:
    """Drafts generate()'s own next tokens with the last of each draft made wrong: every
    verify step then accepts some drafted tokens and rejects one, whatever the random model
    repeats (prompt lookup drafts only where it does)."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.expected = expected
        self.vocab = vocab

    def draft(self, wanted: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        drafts = []
        for _, tokens, k in wanted:
            prompt = next(p for p in self.expected if tuple(tokens[: len(p)]) == p)
            done = len(tokens) - len(prompt)
            draft = list(self.expected[prompt][done : done + k])
            if len(draft) > 1:
                draft[-1] = (draft[-1] + 1) % self.vocab
            drafts.append(tuple(draft))
        return drafts

    def release(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""


class Family:
    """One family's tiny model (its references taken before the engine owns it) and engines
    over it: plain, and speculating with n-gram drafts."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        # The demo model's tokenizer (one the grammar engine reads): the model spans its vocab.
        self.model = family_model(name, seed=11, vocab_size=len(tokenizer))
        embed = self.model.get_input_embeddings().weight
        generator = torch.Generator().manual_seed(12)
        rows = torch.randn(6, embed.shape[1], generator=generator) * 3 * embed.std().item()
        self.prefix = PromptPrefix("tuned", rows, b"tuned")
        self.expected = [reference(self.model, p) for p in PROMPTS]
        self.prefixed = reference(self.model, PROMPTS[0], rows)
        self.metrics = Metrics()
        self.plain = self._engine(tokenizer, speculate=0)
        drafts = {p: tokens for p, (tokens, _) in zip(PROMPTS, self.expected, strict=True)}
        proposer = ReferenceProposer(drafts, len(tokenizer))
        self.speculating = self._engine(tokenizer, speculate=3, proposer=proposer)

    def _engine(
        self, tokenizer: Any, speculate: int, proposer: ReferenceProposer | None = None
    ) -> Engine:
        backend = paged(self.model, blocks=64, max_sequences=8)
        capacity = backend.capacity
        limits = SchedulerLimits(
            max_batch_prefill_tokens=64,
            max_batch_total_tokens=capacity.kv_tokens,
            max_sequences=8,
            prefill_step_tokens=capacity.prefill_step_tokens,
        )
        engine = Engine(
            backend, tokenizer, limits, 8, (2,),
            self.metrics if speculate else None, prefix_caching=True, speculate=speculate,
            proposer=proposer,
        )  # fmt: skip
        engine.start()
        return engine

    def stop(self) -> None:
        self.plain.stop()
        self.speculating.stop()


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def family(request: Any, tokenizer: Any) -> Iterator[Family]:
    built = Family(request.param, tokenizer)
    yield built
    built.stop()


def events(engine: Engine, reqs: list[GenerationRequest]) -> list[list[TokenEvent]]:
    async def together() -> list[list[TokenEvent]]:
        return list(await asyncio.gather(*(collect(engine.generate(r)) for r in reqs)))

    return run(together())


def ids(streams: list[list[TokenEvent]]) -> list[list[int]]:
    return [[e.token.id for e in stream] for stream in streams]


def test_speculation_keeps_generates_tokens(family: Family) -> None:
    reqs = [GenerationRequest(f"s{i}", p, greedy_params()) for i, p in enumerate(PROMPTS)]
    expected = [tokens for tokens, _ in family.expected]
    counts = Counts(family.metrics)
    drafted, accepted = counts.drafted, counts.accepted
    assert [ids(events(family.speculating, [r]))[0] for r in reqs] == expected
    assert ids(events(family.speculating, reqs)) == expected
    # Two of each three drafted tokens were right, and accepted.
    assert counts.accepted > accepted and counts.drafted - drafted > counts.accepted - accepted


def test_a_prompt_prefix_is_generates_inputs_embeds(family: Family) -> None:
    params = greedy_params(top_n_tokens=TOP_N, details=True)
    prefixed = GenerationRequest("p", PROMPTS[0], params, prefix=family.prefix)
    plain = GenerationRequest("n", PROMPTS[0], params)
    check_logprobs(events(family.plain, [prefixed])[0], family.prefixed)
    # Batched with the same input without it, over the prefix cache: each its own tokens.
    with_prefix, without = events(family.plain, [prefixed, plain])
    check_logprobs(with_prefix, family.prefixed)
    check_logprobs(without, family.expected[0])
    # The prefix changes what follows by far more than the tolerance (a random model may still
    # pick the same tokens).
    first_with, first_without = family.prefixed[1][0], family.expected[0][1][0]
    assert (first_with - first_without).abs().max() > 10 * TOLERANCE


def check_logprobs(
    stream: list[TokenEvent], expected: tuple[list[int], list[torch.Tensor]]
) -> None:
    """The stream's tokens are generate()'s, each with its log-softmax and its top-n."""
    tokens, logprobs = expected
    assert [e.token.id for e in stream] == tokens
    for event, reference_logprobs in zip(stream, logprobs, strict=True):
        assert event.token.logprob is not None
        assert math.isclose(
            event.token.logprob, reference_logprobs[event.token.id].item(), abs_tol=TOLERANCE
        )
        # The top n (with any tokens tied with the n-th: a random model's logits are close),
        # each at its own log-softmax, the n-th that of transformers' n-th.
        top = event.top_tokens
        values = [t.logprob for t in top]
        assert len(top) >= TOP_N and values == sorted(values, reverse=True)  # type: ignore[type-var]
        for info in top:
            assert info.logprob is not None
            assert math.isclose(info.logprob, reference_logprobs[info.id].item(), abs_tol=TOLERANCE)
        nth = torch.topk(reference_logprobs, TOP_N).values[-1].item()
        assert math.isclose(top[TOP_N - 1].logprob, nth, abs_tol=TOLERANCE)  # type: ignore[arg-type]


def test_top_n_logprobs_are_transformers_log_softmax(family: Family) -> None:
    reqs = [
        GenerationRequest(f"t{i}", p, greedy_params(top_n_tokens=TOP_N, details=True))
        for i, p in enumerate(PROMPTS)
    ]
    for stream, expected in zip(events(family.plain, reqs), family.expected, strict=True):
        check_logprobs(stream, expected)


def test_a_grammar_holds_the_output_beside_free_rows(family: Family) -> None:
    pattern = r"[a-z]{2,6}( [a-z]{2,6}){1,3}"
    constrained = GenerationRequest(
        "g", PROMPTS[0], GenerateParameters(max_new_tokens=40, grammar=GrammarSpec.regex(pattern))
    )
    free = GenerationRequest("f", PROMPTS[2], greedy_params())
    for engine in (family.plain, family.speculating):
        grammar_run, free_run = events(engine, [constrained, free])
        completion = grammar_run[-1].completion
        assert completion is not None
        assert re.fullmatch(pattern, completion.generated_text.strip()), completion
        assert [e.token.id for e in free_run] == family.expected[2][0]
