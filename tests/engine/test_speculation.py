"""Speculative decoding: the n-gram proposer; verification scoring each position as a
one-at-a-time decode would (greedy: the same tokens, with penalties and length rules too;
sampled: each emitted token distributed as the target, a statistical test); and the paged
engine with --speculate: greedy output identical alone and in mixed batches, under grammars
too, drafts accepted (counted for /metrics), blocks all given back, seeds replayed."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_engine import PROMPTS, collect, request, run, tokenizer
from tests.engine.test_poison_batch import make_engine, paged_backend, slot_backend
from tgis.engine.engine import Engine
from tgis.engine.sampling import SamplingBatch, SamplingRow
from tgis.engine.speculation import NgramProposer, verify
from tgis.engine.types import GenerationRequest
from tgis.params import GenerateParameters, GrammarSpec
from tgis.server.http.metrics import Metrics

__all__ = ["tokenizer"]


def test_the_proposer_continues_the_latest_longest_match() -> None:
    propose = NgramProposer().propose
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # "6 7" last occurred at 6..7 (followed by 2, 6, 7) before 1..2 (followed by 8, 9, ...).
    assert propose(tokens, 3) == (2, 6, 7)
    # The 3-gram "9 6 7"... does not recur, "6 7" does: the longest match that recurs wins.
    assert propose([1, 2, 3, 4, 1, 2, 3], 2) == (4, 1)
    assert propose([1, 2, 3, 4, 9, 2, 3], 2) == (4, 9)  # "2 3" (the 3-gram "9 2 3" is new)
    assert propose([1, 2, 3], 4) == ()  # nothing recurs
    assert propose([1, 2, 3, 1], 0) == ()
    assert propose([4, 4], 3) == (4,)  # what is known after the match, no more
    assert propose([7], 3) == ()
    with pytest.raises(ValueError):
        NgramProposer(ngram_max=1, ngram_min=2)


def params(**kw: Any) -> GenerateParameters:
    return GenerateParameters(**{"max_new_tokens": 50, **kw})


EOS = [11]


def sequential(row: SamplingRow, logits: torch.Tensor, until: int) -> list[int]:
    """Greedy one token at a time over logits rows 0..until (each after the tokens before)."""
    tokens = []
    for j in range(until + 1):
        tokens.extend(SamplingBatch([row], EOS).choose(logits[j : j + 1]).token_ids)
    return tokens


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5, "presence_penalty": 0.7},
        {"min_new_tokens": 3},
        {"length_penalty": (1, 3.0)},
    ],
)
def test_greedy_verification_picks_what_one_at_a_time_decoding_would(kw: dict[str, Any]) -> None:
    rng = random.Random(7)
    vocab = 12
    for trial in range(30):
        torch.manual_seed(trial)
        k = rng.randint(1, 5)
        logits = torch.randn(k + 1, vocab) * 3
        prompt = [rng.randrange(vocab) for _ in range(6)]
        p = params(**kw)
        # The draft: what sequential greedy would choose, with a wrong token somewhere.
        truth = sequential(SamplingRow(p, prompt), logits, k)
        wrong_at = rng.randint(0, k)
        draft = [*truth[:wrong_at], (truth[wrong_at] + 1) % vocab, *truth[wrong_at + 1 :]][:k]
        row = SamplingRow(p, prompt)
        (result,) = verify([row], [logits], [draft], EOS)
        accepted = min(wrong_at, k)
        assert result.accepted == accepted and result.drafted == k
        # The emitted tokens are the sequential ones: processors saw each draft token.
        expected = sequential(SamplingRow(p, prompt), logits, accepted)
        assert result.choice.token_ids == expected
        assert row.generated == len(expected)
        assert all(rank == 1 for rank in result.choice.ranks)


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Each emitted token is distributed as the processed distribution at its position, for a
    likely and an unlikely draft token: the first token's frequencies over 6000 seeds, and the
    second token's after an accepted first (chi-square, far from the 0.1% critical value)."""
    probs0 = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    probs1 = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    logits = torch.log(torch.stack([probs0, probs1]).clamp(min=1e-30))
    p = params(do_sample=True)
    n = 6000
    for draft_token in (0, 3):
        first: Counter[int] = Counter()
        second: Counter[int] = Counter()
        for seed in range(n):
            row = SamplingRow(p, [1, 2], seed=seed * 7919 + draft_token)
            (result,) = verify([row], [logits], [[draft_token]])
            tokens = result.choice.token_ids
            first[tokens[0]] += 1
            if result.accepted:
                assert tokens[0] == draft_token and len(tokens) == 2
                second[tokens[1]] += 1
            else:
                assert tokens[0] != draft_token and len(tokens) == 1
        assert chi_square(first, probs0, n) < 18.5  # 4 degrees of freedom, p = 0.001
        accepted = sum(second.values())
        assert abs(accepted / n - float(probs0[draft_token])) < 0.03
        assert chi_square(second, probs1[:4] / probs1[:4].sum(), accepted) < 16.3  # 3 dof
        assert second[4] == 0


def chi_square(counts: Counter[int], probs: torch.Tensor, n: int) -> float:
    return sum(
        (counts[i] - n * float(q)) ** 2 / (n * float(q)) for i, q in enumerate(probs) if q > 0
    )


# --- the engine ----------------------------------------------------------------------------

CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result += item.price\n"
    "    return result\n"
)
# Copying from the prompt: prompt lookup finds long drafts.
EDIT = f"Rename result to total:\n{CODE}\nRenamed:\n{CODE[:40]}"


class Counts:
    """The speculation counters of the server's metrics (what /metrics shows)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def _total(self, name: str) -> float:
        line = f"tgis_speculative_{name}_tokens_total "
        text = self.metrics.render().decode()
        return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])

    @property
    def drafted(self) -> float:
        return self._total("draft")

    @property
    def accepted(self) -> float:
        return self._total("accepted")

    @property
    def emitted(self) -> float:
        return self._total("emitted")


@pytest.fixture(scope="module")
def engines(demo_model_dir: Path, tokenizer: Any) -> Iterator[tuple[Engine, Engine, Counts]]:
    metrics = Metrics()
    plain = make_engine(paged_backend(demo_model_dir), demo_model_dir, tokenizer)
    speculating = make_engine(
        paged_backend(demo_model_dir), demo_model_dir, tokenizer, speculate=4,
        observer=metrics, prefix_caching=True,
    )  # fmt: skip
    yield plain, speculating, Counts(metrics)
    plain.stop()
    speculating.stop()


def outputs(engine: Engine, reqs: list[GenerationRequest]) -> list[list[int]]:
    async def together() -> list[list[int]]:
        results = await asyncio.gather(*(collect(engine.generate(r)) for r in reqs))
        return [[e.token.id for e in events] for events in results]

    return run(together())


def mixed(tokenizer: Any) -> list[GenerationRequest]:
    prompts = [EDIT, *PROMPTS[:5], EDIT.replace("total", "amount")]
    reqs = [
        request(tokenizer, prompt, f"g{i}", max_new_tokens=24 + i, ignore_eos=True)
        for i, prompt in enumerate(prompts)
    ]
    reqs.append(request(tokenizer, EDIT, "pen", max_new_tokens=30, repetition_penalty=1.3))
    reqs.append(request(tokenizer, EDIT, "stop", max_new_tokens=40, stop=("return",)))
    reqs.append(request(tokenizer, PROMPTS[6], "eos", max_new_tokens=40))
    return reqs


def test_greedy_output_is_identical_alone_and_in_batches(
    engines: tuple[Engine, Engine, Counts], tokenizer: Any
) -> None:
    plain, speculating, counts = engines
    reqs = mixed(tokenizer)
    before = counts.accepted
    expected = [outputs(plain, [r])[0] for r in reqs]
    assert [outputs(speculating, [r])[0] for r in reqs] == expected  # alone
    assert outputs(speculating, reqs) == expected  # all together
    # Again, over prefix-cache blocks whose K/V include accepted draft tokens'.
    assert outputs(speculating, reqs) == expected
    assert counts.accepted - before > 20  # the copies were drafted and accepted
    assert counts.drafted >= counts.accepted and counts.emitted > counts.accepted
    # Every block is back (or cached, unused) once everything has finished.
    blocks = speculating.scheduler.blocks  # type: ignore[union-attr]
    assert blocks.free_blocks == blocks.num_blocks
    assert blocks.stats.hit_tokens > 0


def test_sampled_runs_replay(engines: tuple[Engine, Engine, Counts], tokenizer: Any) -> None:
    _, speculating, counts = engines
    sampled = [
        request(tokenizer, EDIT, f"s{i}", max_new_tokens=20, do_sample=True, seed=11 + i,
                temperature=0.8, ignore_eos=True)
        for i in range(3)
    ]  # fmt: skip
    before = counts.drafted
    first = outputs(speculating, sampled)
    assert outputs(speculating, sampled) == first  # seeds replay with speculation too
    assert all(len(ids) == 20 for ids in first)
    assert counts.drafted > before


def test_grammar_rows_speculate_within_their_grammar(
    engines: tuple[Engine, Engine, Counts], tokenizer: Any
) -> None:
    plain, speculating, counts = engines
    text = GrammarSpec.regex(r"[^`]{10,300}")  # the model's repetitions fit it
    narrow = GrammarSpec.regex(r"[0-9]{3}-[a-z]{2,5}")  # the drafts do not
    reqs = [
        request(tokenizer, PROMPTS[1], "text", max_new_tokens=60, grammar=text),
        request(tokenizer, EDIT, "narrow", max_new_tokens=20, grammar=narrow),
        request(tokenizer, EDIT, "free", max_new_tokens=20, ignore_eos=True),
    ]
    expected = [outputs(plain, [r])[0] for r in reqs]
    before = (counts.drafted, counts.accepted)
    assert outputs(speculating, [reqs[0]]) == expected[:1]
    assert counts.drafted > before[0] and counts.accepted > before[1]
    assert outputs(speculating, reqs) == expected  # mixed with others, the same tokens
    code = tokenizer.decode(expected[1], skip_special_tokens=True)
    assert code[:3].isdigit() and code[3] == "-"


def test_speculation_needs_the_paged_engine(demo_model_dir: Path, tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="needs a paged backend"):
        make_engine(slot_backend(demo_model_dir), demo_model_dir, tokenizer, speculate=2)
    with pytest.raises(ValueError, match="speculate must be in"):
        make_engine(paged_backend(demo_model_dir), demo_model_dir, tokenizer, speculate=99)
