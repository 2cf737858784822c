"""Batched sampling: each processor against HF's, token choice, logprobs, seeds, top-n."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tgis.engine.sampling import (
    SamplingBatch,
    SamplingRow,
    derive_seed,
    draw_state,
    prompt_details,
    uniforms,
)
from tgis.params import GenerateParameters as P

VOCAB = 64
EOS = 2


def logits_for(step: int, rows: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    """Deterministic random logits [rows, vocab] for a step."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1000 + step)) * 3


def test_greedy_picks_argmax_with_raw_logprobs_and_rank_one() -> None:
    logits = logits_for(0, rows=4)
    out = SamplingBatch([SamplingRow(P(), [1]) for _ in range(4)]).choose(logits)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert out.ranks == [1, 1, 1, 1]
    assert out.top_ids == [[], [], [], []]


def test_top_k_one_is_greedy_with_logprob_zero() -> None:
    logits = logits_for(1, rows=5)
    rows = [SamplingRow(P(top_k=1, seed=i), [1]) for i in range(5)]
    for row in rows:
        assert row.do_sample and row.seed is not None  # top_k makes TGI sample
    out = SamplingBatch(rows).choose(logits)
    assert out.token_ids == logits.argmax(-1).tolist()
    # The processed distribution has one token left: TGI reports its logprob as 0.
    assert out.logprobs == [0.0] * 5


def test_top_p_masks_exactly_the_tail() -> None:
    probs = torch.tensor([[0.45, 0.3, 0.15, 0.1]])
    scores = SamplingBatch([SamplingRow(P(top_p=0.7), [1])]).process(probs.log())
    # ascending cumulative mass: 0.1, 0.25, 0.55, 1.0 -> the two with mass <= 0.3 go.
    assert torch.isinf(scores[0, 2:]).all() and torch.isfinite(scores[0, :2]).all()
    assert scores[0, :2].tolist() == pytest.approx(probs[0, :2].log().tolist())


def test_temperature_scales_the_reported_logprobs() -> None:
    logits = logits_for(2, rows=3)
    out = SamplingBatch([SamplingRow(P(temperature=0.5, seed=s), [1]) for s in range(3)]).choose(
        logits
    )
    scaled = torch.log_softmax(logits / 0.5, -1)
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(scaled[i, token].item(), abs=1e-5)
        assert out.ranks[i] == int((scaled[i] > scaled[i, token]).sum()) + 1


# queued=True is the accelerator's way (whole batch, whole-vocabulary sorts), run on the CPU.
QUEUED = pytest.mark.parametrize("queued", [False, True], ids=["rows", "queued"])


@QUEUED
def test_processors_match_huggingface_in_a_mixed_batch(queued: bool) -> None:
    logits = logits_for(3, rows=6)
    histories = [[5, 9, 9, 40], [1], [7, 3], [2, 60, 61], [8], [4, 4]]
    params = [
        P(repetition_penalty=1.7),
        P(top_k=7),
        P(top_p=0.6),
        P(typical_p=0.4),
        P(),
        P(repetition_penalty=0.6),
    ]
    scores = SamplingBatch(
        [SamplingRow(p, h) for p, h in zip(params, histories, strict=True)], queued=queued
    ).process(logits)
    expected = [
        RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([histories[0]]), logits[0:1].clone()),
        TopKLogitsWarper(7)(None, logits[1:2].clone()),
        TopPLogitsWarper(0.6)(None, logits[2:3].clone()),
        TypicalLogitsWarper(0.4)(None, logits[3:4].clone()),
        logits[4:5],
        RepetitionPenaltyLogitsProcessor(0.6)(torch.tensor([histories[5]]), logits[5:6].clone()),
    ]
    for i, exp in enumerate(expected):
        assert torch.equal(scores[i : i + 1], exp), f"row {i}"
    # Each warper really removed something, so the comparison is not vacuous.
    for i in (1, 2, 3):
        assert torch.isinf(scores[i]).sum() > 0


def test_repetition_penalty_uses_generated_tokens_too() -> None:
    row = SamplingRow(P(repetition_penalty=2.0), [1])
    batch = SamplingBatch([row])
    logits = torch.zeros(1, 8)
    logits[0, 5] = 4.0
    assert batch.choose(logits).token_ids == [5]  # penalised next step
    scores = SamplingBatch([row]).process(logits)
    assert scores[0, 5].item() == 2.0
    seen, counts = row.penalty_state(8, torch.device("cpu"))
    assert seen.nonzero().flatten().tolist() == [1, 5] and counts.tolist()[5] == 1.0


def test_frequency_and_presence_penalties_count_generated_tokens_only() -> None:
    row = SamplingRow(P(frequency_penalty=0.5, presence_penalty=0.25), [3, 6])
    for token in (3, 3, 5):
        row.append(token)
    base = logits_for(4)
    scores = SamplingBatch([row]).process(base)
    delta = (base - scores)[0]
    expected = torch.zeros(VOCAB)
    expected[3] = 0.5 * 2 + 0.25
    expected[5] = 0.5 * 1 + 0.25
    assert delta.tolist() == pytest.approx(expected.tolist(), abs=1e-5)  # prompt's 6 untouched


def test_min_new_tokens_suppresses_eos() -> None:
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    row = SamplingRow(P(min_new_tokens=2), [1])
    chosen = [SamplingBatch([row], [EOS]).choose(logits).token_ids[0] for _ in range(3)]
    assert EOS not in chosen[:2]
    assert chosen[2] == EOS


def test_ignore_eos_leaves_eos_an_ordinary_token_under_min_new_tokens() -> None:
    """vLLM's ignore_eos: EOS ends nothing, so min_new_tokens has no reason to ban it."""
    logits = torch.zeros(1, 8)
    logits[0, EOS] = 10.0
    row = SamplingRow(P(min_new_tokens=2, ignore_eos=True), [1])
    chosen = [SamplingBatch([row], [EOS]).choose(logits).token_ids[0] for _ in range(3)]
    assert chosen == [EOS, EOS, EOS]


def sample_run(
    row: SamplingRow,
    steps: int,
    batch_with: list[SamplingRow] | None = None,
    queued: bool | None = None,
) -> list[int]:
    """Tokens of `row` over `steps`, alone or as row 5 of a batch with `batch_with`."""
    tokens = []
    for step in range(steps):
        own = logits_for(step)
        if batch_with is None:
            tokens.append(SamplingBatch([row], [EOS], queued=queued).choose(own).token_ids[0])
            continue
        others = logits_for(step + 500, rows=len(batch_with))
        rows = [*batch_with[:5], row, *batch_with[5:]]
        logits = torch.cat([others[:5], own, others[5:]])
        tokens.append(SamplingBatch(rows, [EOS], queued=queued).choose(logits).token_ids[5])
    return tokens


def mixed_rows() -> list[SamplingRow]:
    params = [
        P(),
        P(do_sample=True),
        P(temperature=0.3, seed=9),
        P(top_k=3),
        P(top_p=0.5, seed=1),
        P(typical_p=0.7),
        P(repetition_penalty=1.5),
        P(frequency_penalty=1.0, presence_penalty=-0.5, do_sample=True),
        P(min_new_tokens=3, top_n_tokens=4),
        P(do_sample=True, seed=42),
        P(temperature=2.0, top_k=50, top_p=0.95),
        P(top_n_tokens=2, do_sample=True),
        P(),
        P(typical_p=0.2, temperature=0.8),
        P(repetition_penalty=0.8, top_k=10),
    ]
    return [SamplingRow(p, [1, 2, 3, i]) for i, p in enumerate(params)]


@pytest.mark.parametrize(
    "params",
    [
        P(do_sample=True, seed=1234),
        P(temperature=1.5, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=7, top_n_tokens=3),
    ],
)
@QUEUED
def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_16(params: P, queued: bool) -> None:
    alone = sample_run(SamplingRow(params, [1, 2]), steps=12)
    batched = sample_run(
        SamplingRow(params, [1, 2]), steps=12, batch_with=mixed_rows(), queued=queued
    )
    assert alone == batched
    assert len(set(alone)) > 3  # really sampling, not stuck on one token


def test_unseeded_rows_report_a_seed_that_replays() -> None:
    first = SamplingRow(P(do_sample=True), [1])
    second = SamplingRow(P(do_sample=True), [1])
    assert first.seed is not None and second.seed is not None and first.seed != second.seed
    tokens = sample_run(first, steps=10)
    replay = sample_run(SamplingRow(P(do_sample=True, seed=first.seed), [1]), steps=10)
    assert tokens == replay
    assert SamplingRow(P(seed=5), [1]).seed is None  # greedy: no seed reported (TGI)


def test_best_of_candidates_get_distinct_derived_seeds() -> None:
    seeds = [derive_seed(77, i) for i in range(4)]
    assert seeds[0] == 77 and len(set(seeds)) == 4
    assert all(0 <= s < 2**64 for s in seeds)
    assert seeds == [derive_seed(77, i) for i in range(4)]
    params = P(do_sample=True)
    runs = [sample_run(SamplingRow(params, [1], seed=s), steps=8) for s in seeds]
    assert len({tuple(r) for r in runs}) > 1
    assert runs[2] == sample_run(SamplingRow(params, [1], seed=seeds[2]), steps=8)


def test_top_n_tokens_are_the_best_of_the_processed_distribution() -> None:
    logits = logits_for(5, rows=2)
    rows = [
        SamplingRow(P(top_n_tokens=3), [1]),
        SamplingRow(P(top_n_tokens=4, temperature=0.5), [1]),
    ]
    out = SamplingBatch(rows).choose(logits)
    for i, temp in enumerate((1.0, 0.5)):
        lp = torch.log_softmax(logits[i] / temp, -1)
        best = torch.topk(lp, k=3 + i)
        assert out.top_ids[i] == best.indices.tolist()
        assert out.top_logprobs[i] == pytest.approx(best.values.tolist(), abs=1e-5)


def test_top_n_includes_ties_and_skips_masked_tokens() -> None:
    logits = torch.tensor([[2.0, 2.0, 2.0, 1.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    rows = [SamplingRow(P(top_n_tokens=2), [1]), SamplingRow(P(top_n_tokens=4, top_k=2), [1])]
    out = SamplingBatch(rows).choose(logits)
    assert sorted(out.top_ids[0]) == [0, 1, 2]  # the tie at the 2nd place is kept (TGI)
    assert out.top_ids[1] == [0, 1]  # top_k left two tokens; -inf ones are not reported
    assert all(math.isfinite(x) for x in out.top_logprobs[1])


def test_sampled_ranks_count_better_tokens() -> None:
    row = SamplingRow(P(do_sample=True, seed=3, temperature=3.0), [1])
    ranks = []
    for step in range(20):
        logits = logits_for(step)
        out = SamplingBatch([row]).choose(logits)
        lp = torch.log_softmax(logits[0] / 3.0, -1)
        token = out.token_ids[0]
        assert out.ranks[0] == int((lp > lp[token]).sum()) + 1
        ranks.append(out.ranks[0])
    assert max(ranks) > 1


def test_prompt_details_are_raw_next_token_logprobs_ranks_and_alternatives() -> None:
    logits = logits_for(6, rows=5)
    ids = [4, 10, 11, 12, 13]
    got = prompt_details(logits, ids, top_n=3)
    lp = torch.log_softmax(logits, -1)
    assert got.logprobs == pytest.approx([lp[j, ids[j + 1]].item() for j in range(4)], abs=1e-5)
    assert got.ranks == [int((lp[j] > lp[j, ids[j + 1]]).sum()) + 1 for j in range(4)]
    assert max(got.ranks) > 1
    assert got.top_ids == [torch.topk(lp[j], 3).indices.tolist() for j in range(4)]
    assert got.top_logprobs[0] == pytest.approx(torch.topk(lp[0], 3).values.tolist(), abs=1e-5)
    assert prompt_details(logits, ids).top_ids == [[], [], [], []]
    assert prompt_details(logits[:1], [4]).logprobs == []


def test_penalty_state_holds_tokens_recorded_before_and_after_it_is_built() -> None:
    row = SamplingRow(P(frequency_penalty=0.5), [1, 2])
    for token in (3, 3):
        row.append(token)  # host ids, before the device state exists
    seen, counts = row.penalty_state(16, torch.device("cpu"))
    for token in (3, 9):
        row.append(token)
    assert seen.nonzero().flatten().tolist() == [1, 2, 3, 9]
    assert counts.nonzero().flatten().tolist() == [3, 9]
    assert counts[3].item() == 3.0 and counts[1].item() == 0.0  # prompt ids are not counted
    assert row.generated == 4


def test_uniform_draws_are_splitmix64_on_the_device() -> None:
    """The vectorised draws equal SplitMix64 in Python integers: int64 products wrap as
    uint64's and right shifts are logical, for seeds across the whole 64-bit range."""
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, *(derive_seed(12345, i) for i in range(1, 60))]
    draws = [0, 1, 7, 2**20]
    states = torch.tensor([draw_state(s, d) for s in seeds for d in draws])
    expected = [(derive_seed(s, d + 1) >> 40) / 2**24 for s in seeds for d in draws]
    got = uniforms(states)
    assert got.dtype == torch.float32
    assert got.tolist() == expected
    assert min(expected) >= 0.0 and max(expected) < 1.0


def test_sampling_follows_the_distribution() -> None:
    """4,000 rows with distinct seeds sample a 4-token distribution within a chi-square bound
    (p = 0.001 at 3 degrees of freedom is 16.27)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = [SamplingRow(P(do_sample=True, seed=s), [1]) for s in range(4000)]
    out = SamplingBatch(rows).choose(probs.log().expand(4000, 4))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).float()
    expected = probs * 4000
    assert float(((counts - expected) ** 2 / expected).sum()) < 16.27


# Kept sets of ~1-20 tokens (64 candidates suffice), ~100-2500 (1024 or all), ~4000 (all).
@QUEUED
@pytest.mark.parametrize("scale", [4.0, 2.0, 0.3])
def test_top_p_and_typical_p_match_huggingface_on_a_large_vocabulary(
    scale: float, queued: bool
) -> None:
    vocab = 5000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(7)) * scale
    params = [P(top_p=0.9), P(top_p=0.5), P(typical_p=0.9), P(typical_p=0.3)]
    scores = SamplingBatch([SamplingRow(p, [1]) for p in params], queued=queued).process(logits)
    expected = torch.cat(
        [
            TopPLogitsWarper(0.9)(None, logits[0:1].clone()),
            TopPLogitsWarper(0.5)(None, logits[1:2].clone()),
            TypicalLogitsWarper(0.9)(None, logits[2:3].clone()),
            TypicalLogitsWarper(0.3)(None, logits[3:4].clone()),
        ]
    )
    assert torch.equal(torch.isinf(scores), torch.isinf(expected))
    assert torch.equal(scores, expected)
    kept = torch.isfinite(scores).sum(-1)
    assert kept.max() > 1 and (kept < vocab).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_choice_equals_the_cpu_choice() -> None:
    """The queued CUDA step picks the CPU's tokens for a mixed batch over several steps, and the
    device's SplitMix64 draws equal Python's."""
    states = torch.tensor([draw_state(s, d) for s in (0, 2**64 - 1, 77) for d in (0, 5)])
    assert uniforms(states.cuda()).cpu().tolist() == uniforms(states).tolist()
    on_cpu = mixed_rows()
    on_cuda = [SamplingRow(r.params, [1, 2, 3, i], seed=r.seed) for i, r in enumerate(on_cpu)]
    for step in range(6):
        logits = logits_for(step, rows=len(on_cpu), vocab=512)
        want = SamplingBatch(on_cpu, [EOS]).choose(logits)
        got = SamplingBatch(on_cuda, [EOS]).choose(logits.cuda())
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert got.ranks == want.ranks and got.top_ids == want.top_ids


def test_length_penalty_grows_the_eos_logits_as_huggingface_does() -> None:
    """After start_index generated tokens, EOS logits grow by |logit| * (decay^(n - start) - 1),
    HF's ExponentialDecayLengthPenalty with its start counted in generated tokens."""
    from transformers import ExponentialDecayLengthPenalty

    logits = logits_for(9, rows=2)
    logits[0, EOS], logits[1, EOS] = -1.5, 2.0
    rows = [SamplingRow(P(length_penalty=(2, 1.5)), [1, 2, 3]) for _ in range(2)]
    for token in (5, 6, 7, 8):  # four generated: penalty index 2
        for row in rows:
            row.append(token)
    scores = SamplingBatch(rows, [EOS]).process(logits)
    hf = ExponentialDecayLengthPenalty((2, 1.5), EOS, input_ids_seq_length=3)
    expected = hf(torch.zeros(2, 7, dtype=torch.long), logits.clone())
    assert torch.allclose(scores, expected)
    assert scores[0, EOS] > logits[0, EOS] and scores[1, EOS] > logits[1, EOS]
    untouched = SamplingBatch([SamplingRow(P(length_penalty=(5, 2.0)), [1])], [EOS])
    assert torch.equal(untouched.process(logits[:1]), logits[:1])  # before start_index


def test_logit_bias_is_added_to_the_raw_logits_before_every_other_processor() -> None:
    """OpenAI's logit_bias: the bias joins the raw logit first (so temperature divides the
    biased logit, and the repetition penalty sees it), per row; +100 forces a token and -100
    bans the argmax for greedy rows; a row without it is untouched; ids past the logits'
    vocabulary are ignored."""
    logits = logits_for(9, rows=3)
    best = logits.argmax(-1)
    rows = [
        SamplingRow(P(logit_bias=((5, 100.0), (VOCAB + 3, 50.0))), [1]),
        SamplingRow(P(logit_bias=((int(best[1]), -100.0),)), [1]),
        SamplingRow(P(), [1]),
    ]
    out = SamplingBatch(rows).choose(logits)
    assert out.token_ids[0] == 5
    assert out.token_ids[1] != int(best[1])
    assert out.token_ids[2] == int(best[2])
    biased = logits[0].clone()
    biased[5] += 100.0
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(biased, -1)[5].item(), abs=1e-5)
    scaled = SamplingBatch([SamplingRow(P(temperature=2.0, logit_bias=((7, 3.0),)), [1])])
    expected = logits[:1].clone()
    expected[0, 7] += 3.0
    torch.testing.assert_close(scaled.process(logits[:1]), expected / 2.0)
    penalised = SamplingBatch(
        [SamplingRow(P(repetition_penalty=2.0, logit_bias=((7, -4.0),)), [7])]
    )
    value = float(logits[0, 7]) - 4.0  # biased first, then penalised by its sign
    assert penalised.process(logits[:1])[0, 7].item() == pytest.approx(
        value * 2.0 if value < 0 else value / 2.0
    )
    assert torch.equal(logits, logits_for(9, rows=3))  # never modified in place


def test_a_cpu_batch_chooses_as_the_queued_one_step_after_step() -> None:
    """The CPU's ways (penalties over each row's seen ids alone, draws and ranks for the
    sampled rows alone) choose what the queued way (dense over the whole batch) does, step
    after step as the penalised rows' histories grow."""
    on_cpu, queued = mixed_rows(), mixed_rows()
    for row, twin in zip(on_cpu, queued, strict=True):
        twin.seed = row.seed  # unseeded rows drew a random seed each
    assert any(r.penalized for r in on_cpu) and 0 < sum(r.do_sample for r in on_cpu) < len(on_cpu)
    for step in range(8):
        logits = logits_for(step, rows=len(on_cpu))
        a = SamplingBatch(on_cpu, [0], queued=False).choose(logits)
        b = SamplingBatch(queued, [0], queued=True).choose(logits)
        assert (a.token_ids, a.ranks) == (b.token_ids, b.ranks), step
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.top_ids == b.top_ids
