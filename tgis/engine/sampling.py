"""Batched logits processing and token choice: one call per step for the whole batch.

Per-request options become per-row tensors built at each step from the rows' cached state,
so the engine adds and drops rows freely between steps. Each processor runs only on the rows
that use it, and a row's result never depends on the other rows of the batch.

Order (TGI's `HeterogeneousNextTokenChooser`, HF semantics for each processor):
min_new_tokens EOS mask -> repetition_penalty -> frequency/presence penalties -> temperature
-> top_k -> top_p -> typical_p -> choice. Logprobs, ranks and top-n alternatives are taken from
`log_softmax` of the processed scores, as TGI reports them.

Choice: argmax for greedy rows; for sampled rows, inverse-CDF sampling with one uniform draw
from the row's own `torch.Generator` (TGI draws a vocabulary-sized exponential vector per row
instead; one scalar is far cheaper, and seeded runs replay exactly whatever the batch).

Frequency and presence penalties follow OpenAI: `logit -= frequency * count + presence *
(count > 0)`, counting the *generated* tokens only. (TGI instead subtracts `frequency * count /
len(prompt + generated)` over the prompt too; OpenAI's definition is what clients expect.)
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tgis.params import MAX_SEED, GenerateParameters

_NEG_INF = float("-inf")
# Rows of prompt logits handled at once by prompt_logprobs ([rows, vocab] float32 temporaries).
_PROMPT_CHUNK = 256
# Candidates top_p / typical_p look at first (then x16, then the whole vocabulary): sorting a
# 50k vocabulary costs ~5 ms a row on a CPU core, a top-64 a tenth of a millisecond.
_CANDIDATES = 64


def _active(value: float | None, neutral: float) -> float | None:
    return None if value is None or value == neutral else value


def derive_seed(seed: int, index: int) -> int:
    """The seed of candidate `index` of a best_of request whose seed is `seed` (0 keeps it)."""
    if index == 0:
        return seed
    # splitmix64: well-mixed, distinct seeds for neighbouring indices.
    z = (seed + index * 0x9E3779B97F4A7C15) & MAX_SEED
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MAX_SEED
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MAX_SEED
    return z ^ (z >> 31)


class SamplingRow:
    """One sequence's sampling state, kept by the engine from prefill to finish.

    `seed` is the seed actually used (a random one when sampling without a seed, so it can be
    reported and replayed), or None for greedy rows, as TGI reports it. `seed` given here
    overrides `params.seed` (best_of candidates get `derive_seed` seeds).
    """

    def __init__(
        self, params: GenerateParameters, prompt_ids: Sequence[int], seed: int | None = None
    ) -> None:
        self.params = params
        self.do_sample = params.do_sample or params.sampling_warpers
        if seed is None:
            seed = params.seed
        if self.do_sample and seed is None:
            seed = secrets.randbits(64)
        self.seed = seed if self.do_sample else None
        # The active processors, neutral values (1.0, 0) resolved once here rather than per step.
        self.repetition_penalty = _active(params.repetition_penalty, 1.0)
        self.frequency_penalty = params.frequency_penalty or 0.0
        self.presence_penalty = params.presence_penalty or 0.0
        self.temperature = _active(params.temperature, 1.0)
        self.top_k = params.top_k or 0
        self.top_p = _active(params.top_p, 1.0)
        self.typical_p = _active(params.typical_p, 1.0)
        self.top_n = params.top_n_tokens or 0
        self.prompt_len = len(prompt_ids)
        self.generated = 0
        self._generator: torch.Generator | None = None
        # Prompt + generated ids, only for rows with penalties: [capacity] int64, grown by doubling.
        self._history: torch.Tensor | None = None
        if self.repetition_penalty or self.frequency_penalty or self.presence_penalty:
            capacity = self.prompt_len + (params.max_new_tokens or 16)
            self._history = torch.empty(max(capacity, 1), dtype=torch.long)
            self._history[: self.prompt_len] = torch.as_tensor(list(prompt_ids), dtype=torch.long)

    def generator(self, device: torch.device) -> torch.Generator:
        """This row's random generator, seeded once on first use (on the logits' device)."""
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed if self.seed is not None else 0)
        return self._generator

    def append(self, token_id: int) -> None:
        """Record a generated token (SamplingBatch.choose does it for the chosen tokens)."""
        if self._history is not None:
            n = self.prompt_len + self.generated
            if n == self._history.numel():
                self._history = torch.cat([self._history, torch.empty_like(self._history)])
            self._history[n] = token_id
        self.generated += 1

    def history(self) -> torch.Tensor:
        """Prompt + generated ids [prompt_len + generated] (rows with penalties only)."""
        if self._history is None:
            raise RuntimeError("token history is only kept for rows with penalties")
        return self._history[: self.prompt_len + self.generated]

    def generated_ids(self) -> torch.Tensor:
        """Generated ids [generated] (rows with penalties only)."""
        return self.history()[self.prompt_len :]


@dataclass(frozen=True)
class SampleOutput:
    """One step's choice, per row, as Python values."""

    token_ids: list[int]
    logprobs: list[float]
    # 1-based rank of the chosen token in the processed distribution (TGIS).
    ranks: list[int]
    # Per row: the top_n_tokens alternatives, most likely first (ties at the n-th included,
    # as TGI does); empty lists for rows that did not ask.
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def _padded(seqs: list[torch.Tensor], repeat_first: bool = True) -> torch.Tensor:
    """Stack 1-D tensors into [rows, max_len], padding with each row's first value (re-penalising
    a token already in the row is idempotent for gather/scatter) or with zeros."""
    out = torch.zeros(len(seqs), max(1, max(s.numel() for s in seqs)), dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        out[i, : s.numel()] = s
        if repeat_first and s.numel():
            out[i, s.numel() :] = s[0]
    return out


class _Scores:
    """Scores [B, V] float32 under processing; the caller's logits are copied only before the
    first in-place update of some of the rows."""

    def __init__(self, logits: torch.Tensor, rows: int) -> None:
        self.scores = logits.float()
        self._owned = self.scores is not logits
        self._rows = rows

    def column(self, values: Sequence[float | None]) -> torch.Tensor:
        """Per-row values as a [n, 1] float32 tensor on the scores' device (None -> 0)."""
        data = [v or 0.0 for v in values]
        return torch.tensor(data, dtype=torch.float32, device=self.scores.device).unsqueeze(1)

    def apply(self, idx: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace rows `idx` by fn(those rows); fn returns a new tensor."""
        if len(idx) == self._rows:
            self.scores, self._owned = fn(self.scores), True
            return
        if not self._owned:
            self.scores, self._owned = self.scores.clone(), True
        at = torch.tensor(idx, device=self.scores.device)
        self.scores[at] = fn(self.scores[at])


class SamplingBatch:
    """The sampling work of one step over `rows`, in the order of the logits' rows."""

    def __init__(self, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int] = ()) -> None:
        self.rows = list(rows)
        self.eos_token_ids = list(eos_token_ids)

    def _select(self, keep: Callable[[SamplingRow], object]) -> list[int]:
        return [i for i, r in enumerate(self.rows) if keep(r)]

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed scores [B, V] float32 from raw logits [B, V] (never modified in place;
        returned as is when no row needs processing)."""
        work = _Scores(logits, len(self.rows))
        self._penalize(work)
        self._warp(work)
        return work.scores

    def _penalize(self, work: _Scores) -> None:
        rows, dev, vocab = self.rows, work.scores.device, work.scores.shape[-1]
        eos = [e for e in self.eos_token_ids if 0 <= e < vocab]
        idx = self._select(lambda r: r.generated < r.params.min_new_tokens)
        if eos and idx:
            eos_t = torch.tensor(eos, device=dev)
            work.apply(idx, lambda s: s.index_fill(1, eos_t, _NEG_INF))
        idx = self._select(lambda r: r.repetition_penalty and r.prompt_len + r.generated)
        if idx:
            ids = _padded([rows[i].history() for i in idx]).to(dev)
            pen = work.column([rows[i].repetition_penalty for i in idx])
            work.apply(idx, lambda s: _repetition(s, ids, pen))
        idx = self._select(lambda r: r.generated and (r.frequency_penalty or r.presence_penalty))
        if idx:
            ids = _padded([rows[i].generated_ids() for i in idx]).to(dev)
            valid = _padded([torch.ones(rows[i].generated) for i in idx], False).to(dev)
            freq = work.column([rows[i].frequency_penalty for i in idx])
            pres = work.column([rows[i].presence_penalty for i in idx])
            work.apply(idx, lambda s: _frequency_presence(s, ids, valid, freq, pres))

    def _warp(self, work: _Scores) -> None:
        rows = self.rows
        idx = self._select(lambda r: r.temperature)
        if idx:
            temp = work.column([rows[i].temperature for i in idx])
            work.apply(idx, lambda s: s / temp)
        idx = self._select(lambda r: r.top_k)
        if idx:
            k = torch.tensor([rows[i].top_k for i in idx], device=work.scores.device)
            work.apply(idx, lambda s: _top_k(s, k))
        idx = self._select(lambda r: r.top_p)
        if idx:
            top_p = work.column([rows[i].top_p for i in idx])
            work.apply(idx, lambda s: _top_p(s, top_p))
        idx = self._select(lambda r: r.typical_p)
        if idx:
            mass = work.column([rows[i].typical_p for i in idx])
            work.apply(idx, lambda s: _typical_p(s, mass))

    def choose(self, logits: torch.Tensor) -> SampleOutput:
        """Pick one token per row from raw logits [B, V] and record it in the row."""
        scores = self.process(logits)
        dev = scores.device
        logprobs = torch.log_softmax(scores, dim=-1)  # [B, V]
        sampled = self._select(lambda r: r.do_sample)
        every = len(sampled) == len(self.rows)

        def of_sampled(t: torch.Tensor) -> torch.Tensor:  # [S, ...]; no copy when S == B
            return t if every else t[sampled]

        if every:
            next_ids = torch.empty(len(self.rows), dtype=torch.long, device=dev)
        else:
            next_ids = scores.argmax(dim=-1)  # greedy rows (sampled ones overwritten below)
        if sampled:
            # Inverse-CDF sampling with one uniform draw per row from the row's own generator:
            # a row's token never depends on the other rows, and a step costs one cumsum.
            cdf = of_sampled(logprobs).exp().cumsum(dim=-1)  # [S, V]
            u = torch.stack(
                [torch.rand((), generator=self.rows[i].generator(dev), device=dev) for i in sampled]
            )
            # right=True skips zero-probability tokens (flat stretches of the CDF).
            picked = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True)
            next_ids[sampled] = picked.squeeze(1).clamp(max=scores.shape[-1] - 1)
        chosen = logprobs.gather(1, next_ids.unsqueeze(1))  # [B, 1]
        # Greedy rows have rank 1 by construction; count better tokens for sampled rows only.
        ranks = torch.ones_like(next_ids)
        if sampled:
            better = torch.count_nonzero(of_sampled(logprobs) > of_sampled(chosen), dim=-1)
            ranks[sampled] += better
        top_ids, top_lps = self._top_tokens(logprobs)
        # One device-to-host copy for the three (float64 holds every token id and rank exactly).
        host = torch.stack([next_ids.double(), chosen.squeeze(1).double(), ranks.double()]).tolist()
        token_ids = [int(t) for t in host[0]]
        for row, token in zip(self.rows, token_ids, strict=True):
            row.append(token)
        return SampleOutput(token_ids, host[1], [int(r) for r in host[2]], top_ids, top_lps)

    def _top_tokens(self, logprobs: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """TGI's batch_top_tokens: the n best per row, plus any tie with the n-th; never -inf."""
        ids: list[list[int]] = [[] for _ in self.rows]
        lps: list[list[float]] = [[] for _ in self.rows]
        idx = self._select(lambda r: r.top_n > 0)
        if not idx:
            return ids, lps
        vocab = logprobs.shape[-1]
        sub = logprobs[idx]  # [N, V]
        n = torch.tensor([min(self.rows[i].top_n, vocab) for i in idx], device=sub.device)
        best = torch.topk(sub, k=int(n.max()), dim=-1).values  # [N, max_n], sorted
        nth = best.gather(1, (n - 1).unsqueeze(1))  # [N, 1]
        nth = nth.clamp(min=torch.finfo(sub.dtype).min)  # -inf n-th: keep finite ones only
        counts = (sub >= nth).sum(dim=-1).tolist()  # [N]
        top = torch.topk(sub, k=max(counts), dim=-1)
        values, indices = top.values.tolist(), top.indices.tolist()
        for j, (i, c) in enumerate(zip(idx, counts, strict=True)):
            ids[i], lps[i] = indices[j][:c], values[j][:c]
        return ids, lps


def _repetition(scores: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF RepetitionPenaltyLogitsProcessor: seen tokens' logits /p if > 0 else *p."""
    seen = scores.gather(1, ids)  # [R, L]
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return scores.scatter(1, ids, seen)


def _frequency_presence(
    scores: torch.Tensor,
    ids: torch.Tensor,
    valid: torch.Tensor,
    freq: torch.Tensor,
    pres: torch.Tensor,
) -> torch.Tensor:
    """OpenAI penalties over generated `ids` [F, G] (`valid` [F, G] is 0 on padding)."""
    counts = torch.zeros_like(scores).scatter_add_(1, ids, valid)  # [F, V]
    # Spread over the occurrences: each adds freq, and presence / count (so presence once).
    per_occurrence = (freq + pres / counts.gather(1, ids).clamp(min=1)) * valid
    return scores.scatter_add(1, ids, -per_occurrence)


def _top_k(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """HF TopKLogitsWarper with per-row k [K]: keep logits >= the k-th largest."""
    k = k.clamp(max=scores.shape[-1])
    best = torch.topk(scores, int(k.max()), dim=-1).values  # [K, max_k], sorted
    kth = best.gather(1, (k - 1).unsqueeze(1))  # [K, 1]
    return scores.masked_fill(scores < kth, _NEG_INF)


def _top_p(scores: torch.Tensor, top_p: torch.Tensor, k: int = _CANDIDATES) -> torch.Tensor:
    """HF TopPLogitsWarper: keep the most likely tokens until their mass reaches top_p (the
    first always). Sorting the vocabulary is slow, so the k most likely tokens are tried first;
    rows whose k best do not reach top_p are redone with more candidates."""
    k = min(k, scores.shape[-1])
    top = scores.softmax(dim=-1).topk(k, dim=-1)  # [P, k], most likely first
    mass_before = top.values.cumsum(dim=-1) - top.values  # exclusive prefix sums
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top.indices, mass_before < top_p)
    out = scores.masked_fill(~keep, _NEG_INF)
    short = (top.values.sum(dim=-1, keepdim=True) < top_p).squeeze(1)  # [P]
    if k < scores.shape[-1] and bool(short.any()):
        out[short] = _top_p(scores[short], top_p[short], k * 16)
    return out


def _typical_p(scores: torch.Tensor, mass: torch.Tensor, k: int = _CANDIDATES) -> torch.Tensor:
    """HF TypicalLogitsWarper: keep the tokens whose surprise is closest to the entropy, until
    their mass reaches `mass`. As in _top_p, k candidates first, more if they fall short."""
    k = min(k, scores.shape[-1])
    normalized = torch.log_softmax(scores, dim=-1)
    probs = normalized.exp()
    ent = -(normalized * probs).nansum(-1, keepdim=True)  # [P, 1]
    shifted = torch.abs(-normalized - ent)  # [P, V]
    near = torch.topk(shifted, k, dim=-1, largest=False)  # [P, k], closest first
    cumulative = probs.gather(1, near.indices).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1, keepdim=True)  # [P, 1]
    threshold = near.values.gather(1, last.clamp(max=k - 1))
    out = scores.masked_fill(shifted > threshold, _NEG_INF)
    short = (last == k).squeeze(1)
    if k < scores.shape[-1] and bool(short.any()):
        out[short] = _typical_p(scores[short], mass[short], k * 16)
    return out


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int]) -> list[float]:
    """Logprob of each prompt token after the first, from the raw prompt logits [L, V]
    (row j predicts token j + 1), as TGI's decoder_input_details reports them (unprocessed).
    Returns len(prompt_ids) - 1 values; the first prompt token has none.
    """
    n = len(prompt_ids) - 1
    if n <= 0:
        return []
    targets = torch.as_tensor(list(prompt_ids[1:]), dtype=torch.long, device=logits.device)
    out: list[float] = []
    # Chunked: a full [L, V] float32 log_softmax would cost gigabytes on long prompts.
    for start in range(0, n, _PROMPT_CHUNK):
        rows = logits[start : min(start + _PROMPT_CHUNK, n)].to(torch.float32)
        picked = rows.gather(1, targets[start : start + rows.shape[0]].unsqueeze(1)).squeeze(1)
        out.extend((picked - torch.logsumexp(rows, dim=-1)).tolist())
    return out
