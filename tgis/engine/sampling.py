"""Batched logits processing and token choice: one call per step for the whole batch.

Per-request options become one per-row parameter table uploaded at each step, so the engine
adds and drops rows freely between steps. A row's result never depends on the other rows of
the batch.

Order (TGI's `HeterogeneousNextTokenChooser`, HF semantics for each processor), after
OpenAI's `logit_bias` (added to the raw logits before anything else, as OpenAI and vLLM do):
min_new_tokens EOS mask (none with ignore_eos) -> repetition_penalty -> frequency/presence
penalties -> length penalty (TGIS; HF's ExponentialDecayLengthPenalty over generated tokens) ->
temperature -> top_k -> top_p -> typical_p -> choice. Logprobs, ranks and top-n alternatives
are taken from `log_softmax` of the processed scores, as TGI reports them.

On an accelerator a step is queued without waiting for the device: the step's host values
(parameters, random states, EOS ids) go up in two non-blocking copies from pinned memory, the
token history of penalised rows stays on the device (a seen-token mask and generated-token
counts per row, updated there with each chosen token), processors run over the whole batch with
neutral values for rows that do not use them, top_p / typical_p sort the whole vocabulary
instead of trying a few candidates first, and the chosen ids, logprobs and ranks come back in
one copy. Only top-n alternatives, when a row asks for them, wait for the device mid-step.
On a CPU the work follows the rows that need it instead: penalties read and write only each
penalised row's seen ids (kept beside its mask), and only sampled rows draw and count ranks.

Choice: argmax for greedy rows; for sampled rows, inverse-CDF sampling with one uniform draw
per row from a counter-based generator: draw n of a row is SplitMix64 of (seed + (n + 1) *
golden gamma), computed on the device for the whole batch at once, so seeded runs replay
exactly whatever the batch, with no per-row generator (TGI keeps a `torch.Generator` per row
and draws a vocabulary-sized exponential vector from each).

Frequency and presence penalties follow OpenAI: `logit -= frequency * count + presence *
(count > 0)`, counting the *generated* tokens only. (TGI instead subtracts `frequency * count /
len(prompt + generated)` over the prompt too; OpenAI's definition is what clients expect.)
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgis.engine.grammar import unpack
from tgis.engine.transfer import HostCopy, host_to_device, to_device, to_host
from tgis.params import MAX_SEED, GenerateParameters

if TYPE_CHECKING:
    from tgis.engine.grammar import Constraint, KnownMask
    from tgis.engine.thinking import ThinkingLimit

_NEG_INF = float("-inf")
# Rows of prompt logits handled at once by prompt_logprobs ([rows, vocab] float32 temporaries).
_PROMPT_CHUNK = 256
# Candidates top_p / typical_p look at first on a CPU (then x16, then the whole vocabulary):
# sorting a 50k vocabulary costs ~5 ms a row on a CPU core, a top-64 a tenth of a millisecond.
# Accelerators sort the whole vocabulary at once (checking for a shortfall would wait for them).
_CANDIDATES = 64

# SplitMix64 (Steele, Lea, Flood 2014): the golden gamma and the two mixing multipliers.
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# Columns of the per-row parameter table (neutral values make a processor a no-op on a row).
(
    _TEMPERATURE,
    _TOP_P,
    _TYPICAL_P,
    _REPETITION,
    _FREQUENCY,
    _PRESENCE,
    _TOP_K,
    _NO_EOS,
    _EOS_BOOST,
) = range(9)


def _active(value: float | None, neutral: float) -> float | None:
    return None if value is None or value == neutral else value


def _splitmix64(z: int) -> int:
    z &= MAX_SEED
    z = ((z ^ (z >> 30)) * _MIX1) & MAX_SEED
    z = ((z ^ (z >> 27)) * _MIX2) & MAX_SEED
    return z ^ (z >> 31)


def derive_seed(seed: int, index: int) -> int:
    """The seed of candidate `index` of a best_of request whose seed is `seed` (0 keeps it)."""
    return seed if index == 0 else _splitmix64(seed + index * _GAMMA)


def _int64(value: int) -> int:
    """A 64-bit unsigned value as the int64 that has its bits."""
    value &= MAX_SEED
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts signed values arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def draw_state(seed: int, draw: int) -> int:
    """The int64 state behind draw `draw` (0-based) of the stream of `seed`."""
    return _int64(seed + (draw + 1) * _GAMMA)


def uniforms(states: torch.Tensor) -> torch.Tensor:
    """Uniform float32 values in [0, 1), 24 random bits each, from int64 `draw_state`s, on the
    states' device: the top 24 bits of SplitMix64's output (int64 products wrap as uint64's)."""
    z = states
    z = (z ^ _shift_right(z, 30)) * _int64(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _int64(_MIX2)
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 40).to(torch.float32) * 2.0**-24


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
        self.do_sample = bool(params.do_sample or params.sampling_warpers)
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
        # The grammar the row's tokens must follow, or its reasoning budget around it (set by
        # the engine when one is asked; a row scored ahead has the mask of its position).
        self.constraint: Constraint | ThinkingLimit | KnownMask | None = None
        self.prompt_len = len(prompt_ids)
        self.generated = 0
        self.penalized = bool(
            self.repetition_penalty or self.frequency_penalty or self.presence_penalty
        )
        # Penalised rows: prompt + generated ids on the host until the device state is made,
        # then a seen-token mask [V] bool and generated-token counts [V] float32 there.
        self._ids: list[int] | None = list(prompt_ids) if self.penalized else None
        self._seen: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        # On a CPU: the seen ids themselves, in the order first seen (`seen_ids`).
        self._seen_ids: torch.Tensor | None = None

    def params_row(self, vocab: int) -> list[float]:
        """This row's line of the parameter table (neutral values for unused processors)."""
        return [
            self.temperature or 1.0,
            self.top_p or 1.0,
            self.typical_p or 1.0,
            self.repetition_penalty or 1.0,
            self.frequency_penalty,
            self.presence_penalty,
            float(min(self.top_k, vocab)),
            float(self.eos_masked),
            self.eos_boost(),
        ]

    @property
    def eos_masked(self) -> bool:
        """Whether EOS is banned this step: before min_new_tokens, unless the request ignores
        EOS (vLLM's `ignore_eos`): then EOS ends nothing, so it stays an ordinary token."""
        return self.generated < self.params.min_new_tokens and not self.params.ignore_eos

    def eos_boost(self) -> float:
        """The length penalty's factor this step: EOS logits grow by |logit| times it."""
        if self.params.length_penalty is None:
            return 0.0
        start_index, decay_factor = self.params.length_penalty
        past = self.generated - start_index
        return decay_factor**past - 1.0 if past > 0 else 0.0

    def draw_state(self) -> int:
        """The random state of this row's next draw (greedy rows: 0, never used)."""
        return draw_state(self.seed, self.generated) if self.seed is not None else 0

    def penalty_state(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen [V] bool: prompt and generated ids, counts [V] float32: generated ids) on
        `device`, built from the host ids on first use (penalised rows only)."""
        if self._seen is None or self._counts is None:
            if self._ids is None:
                raise RuntimeError("token history is only kept for rows with penalties")
            ids = to_device(self._ids, torch.long, device)
            generated = ids[self.prompt_len :]
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._seen[ids] = True
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._counts.index_add_(0, generated, torch.ones_like(generated, dtype=torch.float32))
            self._ids = None
        return self._seen, self._counts

    def seen_ids(self, vocab: int) -> torch.Tensor:
        """The distinct ids of prompt and generated tokens, int64 on the CPU (penalised rows
        whose state is on the CPU): what the sparse penalties read, kept as tokens come."""
        seen, _ = self.penalty_state(vocab, torch.device("cpu"))
        if self._seen_ids is None:
            self._seen_ids = seen.nonzero().squeeze(1)
        return self._seen_ids

    def record(self, token: torch.Tensor) -> None:
        """Record the chosen token, a [1] int64 tensor on the logits' device."""
        if self.penalized:
            if self._seen is None or self._counts is None:
                assert self._ids is not None
                self._ids.append(int(token.item()))
            else:
                if self._seen_ids is not None and not bool(self._seen[token]):
                    self._seen_ids = torch.cat([self._seen_ids, token])
                self._seen.index_fill_(0, token, True)
                self._counts.index_put_((token,), torch.ones_like(token, dtype=torch.float32), True)
        self.generated += 1

    def ahead(self, tokens: Sequence[int], mask: KnownMask | None = None) -> SamplingRow:
        """This row as it will be once `tokens` are generated (for scoring speculative
        positions): its count, penalty history and random draw moved on, and its grammar's
        mask at that point (`mask`, from `Constraint.masks_ahead`; None: unconstrained); the
        row itself is not changed."""
        row = copy.copy(self)
        row.constraint = mask
        row.generated = self.generated + len(tokens)
        if self.penalized and tokens:
            if self._seen is None or self._counts is None:
                row._ids = [*(self._ids or ()), *tokens]
            else:
                ids = torch.tensor(list(tokens), device=self._seen.device)
                row._seen = self._seen.clone().index_fill_(0, ids, True)
                row._seen_ids = None
                row._counts = self._counts.clone().index_add_(
                    0, ids, torch.ones_like(ids, dtype=torch.float32)
                )
        return row

    def append(self, token_id: int) -> None:
        """Record a generated token given on the host (SamplingBatch.choose records its own)."""
        device = self._seen.device if self._seen is not None else torch.device("cpu")
        self.record(torch.tensor([token_id], device=device))


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

    def take(self, rows: Sequence[int]) -> SampleOutput:
        """These rows of the choice, in this order."""
        return SampleOutput(
            [self.token_ids[i] for i in rows],
            [self.logprobs[i] for i in rows],
            [self.ranks[i] for i in rows],
            [self.top_ids[i] for i in rows],
            [self.top_logprobs[i] for i in rows],
        )

    @classmethod
    def concat(cls, outputs: Sequence[SampleOutput]) -> SampleOutput:
        """The rows of `outputs`, one after the other (choices made apart, emitted as one)."""
        return cls(
            [t for o in outputs for t in o.token_ids],
            [lp for o in outputs for lp in o.logprobs],
            [r for o in outputs for r in o.ranks],
            [ids for o in outputs for ids in o.top_ids],
            [lps for o in outputs for lps in o.top_logprobs],
        )


class SamplingBatch:
    """The sampling work of one step over `rows`, in the order of the logits' rows."""

    def __init__(
        self,
        rows: Sequence[SamplingRow],
        eos_token_ids: Sequence[int] = (),
        *,
        queued: bool | None = None,
    ) -> None:
        self.rows = list(rows)
        self.eos_token_ids = list(eos_token_ids)
        # Queued: processors over the whole batch and whole-vocabulary sorts, nothing that
        # waits for the device (None: on accelerators). The same results either way.
        self.queued = queued

    def _queued(self, device: torch.device) -> bool:
        return self.queued if self.queued is not None else device.type != "cpu"

    def _select(self, keep: Callable[[SamplingRow], object]) -> list[int]:
        return [i for i, r in enumerate(self.rows) if keep(r)]

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed scores [B, V] float32 from raw logits [B, V] (never modified in place;
        returned as is when no row needs processing)."""
        scores = logits.float()
        vocab, device = scores.shape[-1], scores.device
        rows = self.rows
        table = to_device([r.params_row(vocab) for r in rows], torch.float32, device)
        if any(r.params.logit_bias for r in rows):
            scores = _logit_bias(scores, [r.params.logit_bias for r in rows])

        def column(index: int) -> torch.Tensor:
            return table[:, index : index + 1]  # [B, 1]

        # A constraint that allows every token this step (a reasoning budget not yet spent,
        # without a grammar) gives no mask.
        constrained = [
            (i, mask)
            for i, r in enumerate(rows)
            if r.constraint is not None and (mask := r.constraint.packed(vocab)) is not None
        ]
        if constrained:  # first: the processors below see only what the grammar allows
            # Bitmasks go up (1/8 of a bool mask's bytes) and are unpacked on the device; an
            # unconstrained row's words have every bit set.
            packed = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
            for i, mask in constrained:
                packed[i] = mask
            scores = scores.masked_fill(~unpack(host_to_device(packed, device), vocab), _NEG_INF)
        eos = [e for e in self.eos_token_ids if 0 <= e < vocab]
        if eos and any(r.eos_masked for r in rows):
            eos_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            eos_mask[to_device(eos, torch.long, device)] = True
            scores = scores.masked_fill((column(_NO_EOS) > 0) & eos_mask, _NEG_INF)
        penalized = [r.penalized for r in rows]
        queued = self._queued(device)
        if any(penalized) and not queued:
            scores = _penalize_rows(scores, rows, vocab)
        elif any(penalized):
            blank = torch.zeros(vocab, dtype=torch.float32, device=device)
            unseen = torch.zeros(vocab, dtype=torch.bool, device=device)
            states = [
                r.penalty_state(vocab, device) if p else (unseen, blank)
                for r, p in zip(rows, penalized, strict=True)
            ]
            if any(r.repetition_penalty for r in rows):
                seen = torch.stack([state[0] for state in states])
                scores = _repetition(scores, seen, column(_REPETITION))
            if any(r.frequency_penalty or r.presence_penalty for r in rows):
                counts = torch.stack([state[1] for state in states])
                scores = _frequency_presence(scores, counts, column(_FREQUENCY), column(_PRESENCE))
        if eos and any(r.eos_boost() for r in rows):
            scores = _length_penalty(scores, to_device(eos, torch.long, device), column(_EOS_BOOST))
        if any(r.temperature for r in rows):
            scores = scores / column(_TEMPERATURE)
        if any(r.top_k for r in rows):
            largest = max(min(r.top_k, vocab) for r in rows)
            scores = _top_k(scores, column(_TOP_K).squeeze(1).long(), largest)
        candidates = vocab if queued else _CANDIDATES
        for index, warper, kind in (
            (_TOP_P, _top_p, "top_p"),
            (_TYPICAL_P, _typical_p, "typical_p"),
        ):
            using = [i for i, r in enumerate(rows) if getattr(r, kind)]
            if using:
                scores = _on_rows(scores, using, column(index), warper, candidates, queued)
        return scores

    def choose(self, logits: torch.Tensor) -> SampleOutput:
        """Pick one token per row from raw logits [B, V] and record it in the row."""
        return self.launch(logits).result()

    def launch(self, logits: torch.Tensor) -> PendingSample:
        """Queue the step's choice; `result()` waits for it. On an accelerator the host is free
        in between (for the scheduler's bookkeeping of the step)."""
        scores = self.process(logits)
        device, vocab = scores.device, scores.shape[-1]
        logprobs = torch.log_softmax(scores, dim=-1)  # [B, V]
        sampled = [r.do_sample for r in self.rows]
        some = [i for i, s in enumerate(sampled) if s]
        # On a CPU only the sampled rows draw (and count their rank); queued, every row does,
        # so that no row list goes up to the device.
        subset = 0 < len(some) < len(sampled) and not self._queued(device)
        if subset:
            at = torch.tensor(some)
            next_ids = scores.argmax(dim=-1)
            states = torch.tensor([self.rows[i].draw_state() for i in some], dtype=torch.long)
            drawn = _draw(logprobs[at], states, vocab)
            next_ids[at] = drawn
            chosen = logprobs.gather(1, next_ids.unsqueeze(1))  # [B, 1]
            ranks = torch.ones_like(next_ids)
            ranks[at] = torch.count_nonzero(logprobs[at] > chosen[at], dim=-1) + 1
        elif some:
            states = to_device([r.draw_state() for r in self.rows], torch.long, device)
            next_ids = _draw(logprobs, states, vocab)
            if not all(sampled):
                greedy = to_device([not s for s in sampled], torch.bool, device)
                next_ids = torch.where(greedy, scores.argmax(dim=-1), next_ids)
            chosen = logprobs.gather(1, next_ids.unsqueeze(1))  # [B, 1]
            # A greedy row's count is 0: argmax is the first of any ties.
            ranks = torch.count_nonzero(logprobs > chosen, dim=-1) + 1
        else:
            next_ids = scores.argmax(dim=-1)  # greedy rows have rank 1 by construction
            chosen = logprobs.gather(1, next_ids.unsqueeze(1))  # [B, 1]
            ranks = torch.ones_like(next_ids)
        for i, row in enumerate(self.rows):
            row.record(next_ids[i : i + 1])
        # One device-to-host copy for the three (float64 holds every token id and rank exactly).
        packed = torch.stack([next_ids.double(), chosen.squeeze(1).double(), ranks.double()])
        return PendingSample(self, to_host(packed), logprobs, next_ids)

    def _top_tokens(self, logprobs: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """TGI's batch_top_tokens: the n best per row, plus any tie with the n-th; never -inf."""
        ids: list[list[int]] = [[] for _ in self.rows]
        lps: list[list[float]] = [[] for _ in self.rows]
        idx = self._select(lambda r: r.top_n > 0)
        if not idx:
            return ids, lps
        vocab, device = logprobs.shape[-1], logprobs.device
        sub = (
            logprobs if len(idx) == len(self.rows) else logprobs[to_device(idx, torch.long, device)]
        )
        wanted = [min(self.rows[i].top_n, vocab) for i in idx]
        best = torch.topk(sub, k=max(wanted), dim=-1).values  # [N, max_n], sorted
        n = to_device(wanted, torch.long, device)
        nth = best.gather(1, (n - 1).unsqueeze(1))  # [N, 1]
        nth = nth.clamp(min=torch.finfo(sub.dtype).min)  # -inf n-th: keep finite ones only
        counts = (sub >= nth).sum(dim=-1).tolist()  # [N]
        top = torch.topk(sub, k=max(counts), dim=-1)
        values, indices = top.values.tolist(), top.indices.tolist()
        for j, (i, c) in enumerate(zip(idx, counts, strict=True)):
            ids[i], lps[i] = indices[j][:c], values[j][:c]
        return ids, lps


class PendingSample:
    """A step's choice queued on the device (`SamplingBatch.launch`)."""

    def __init__(
        self, batch: SamplingBatch, host: HostCopy, logprobs: torch.Tensor, token_ids: torch.Tensor
    ) -> None:
        self._batch = batch
        self._host = host  # [3, B] float64: ids, logprobs, ranks (being copied)
        self._logprobs = logprobs
        # [B] int64 on the device: what the next step reads before the host has the ids.
        self.token_ids = token_ids

    def result(self) -> SampleOutput:
        """Wait for the device and return the choice as Python values."""
        top_ids, top_lps = self._batch._top_tokens(self._logprobs)
        values = self._host.wait().tolist()
        token_ids = [int(t) for t in values[0]]
        return SampleOutput(token_ids, values[1], [int(r) for r in values[2]], top_ids, top_lps)


def _draw(logprobs: torch.Tensor, states: torch.Tensor, vocab: int) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform draw per row (from its random `states`), one cumsum
    over the rows' probabilities; right=True skips zero-probability tokens (flat stretches
    of the CDF)."""
    cdf = logprobs.exp().cumsum(dim=-1)  # [B, V]
    u = uniforms(states).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=vocab - 1)


def _penalize_rows(scores: torch.Tensor, rows: Sequence[SamplingRow], vocab: int) -> torch.Tensor:
    """Repetition, frequency and presence penalties on a CPU: only the penalised rows' seen
    tokens are read and written (a few hundred of a row's vocabulary), not [B, V] masks.
    The same values as the dense processors."""
    out = scores.clone()
    for i, row in enumerate(rows):
        if not row.penalized:
            continue
        ids = row.seen_ids(vocab)
        _, counts = row.penalty_state(vocab, scores.device)
        values = out[i, ids]
        if row.repetition_penalty:
            p = row.repetition_penalty
            values = torch.where(values < 0, values * p, values / p)
        if row.frequency_penalty or row.presence_penalty:
            c = counts[ids]
            values = values - (c * row.frequency_penalty + (c > 0) * row.presence_penalty)
        out[i, ids] = values
    return out


def _on_rows(
    scores: torch.Tensor,
    rows: list[int],
    mass: torch.Tensor,
    warper: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    candidates: int,
    queued: bool,
) -> torch.Tensor:
    """A top_p / typical_p `warper` applied to `rows` with their `mass` [B, 1] (1.0: unused).
    Only those rows are computed, unless `queued`: then every row is, and the result is kept
    where the mass is below 1, so no row list goes up to the device."""
    if len(rows) == scores.shape[0]:
        return warper(scores, mass, candidates)
    if not queued:
        at = torch.tensor(rows)
        out = scores.clone()
        out[at] = warper(scores[at], mass[at], candidates)
        return out
    return torch.where(mass < 1.0, warper(scores, mass, candidates), scores)


def _length_penalty(scores: torch.Tensor, eos: torch.Tensor, boost: torch.Tensor) -> torch.Tensor:
    """TGIS's length penalty: EOS logits [B, E] += |logit| * boost [B, 1] (0: unchanged);
    a masked (-inf) EOS stays masked."""
    logits = scores[:, eos]
    grown = logits + logits.abs() * boost
    out = scores.clone()
    out[:, eos] = torch.where(torch.isfinite(logits) & (boost > 0), grown, logits)
    return out


def _logit_bias(
    scores: torch.Tensor, biases: Sequence[tuple[tuple[int, float], ...]]
) -> torch.Tensor:
    """scores [B, V] with each row's (token, bias) pairs added (a new tensor; token ids past
    the model's vocabulary, which the tokenizer's may be short of, are never biased)."""
    vocab = scores.shape[-1]
    pairs = [(i, t, b) for i, row in enumerate(biases) for t, b in row if t < vocab]
    if not pairs:
        return scores
    rows, tokens, values = zip(*pairs, strict=True)
    index = to_device([list(rows), list(tokens)], torch.long, scores.device)
    bias = to_device(list(values), torch.float32, scores.device)
    return scores.index_put((index[0], index[1]), bias, accumulate=True)


def _repetition(scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF RepetitionPenaltyLogitsProcessor over `seen` [B, V] (prompt and generated tokens):
    seen tokens' logits /p if > 0 else *p (p = 1 on rows without the penalty: unchanged)."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def _frequency_presence(
    scores: torch.Tensor, counts: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor
) -> torch.Tensor:
    """OpenAI penalties from generated-token `counts` [B, V] (0 and 0 leave a row unchanged)."""
    return scores - (counts * freq + (counts > 0) * pres)


def _top_k(scores: torch.Tensor, k: torch.Tensor, largest: int) -> torch.Tensor:
    """HF TopKLogitsWarper with per-row k [B] (<= vocab; 0: no top_k on that row): keep logits
    >= the k-th largest. `largest` is max(k), known on the host."""
    best = torch.topk(scores, largest, dim=-1).values  # [B, largest], sorted
    kth = best.gather(1, (k.clamp(min=1) - 1).unsqueeze(1))  # [B, 1]
    kth = torch.where(k.unsqueeze(1) > 0, kth, _NEG_INF)
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


@dataclass(frozen=True)
class PromptDetails:
    """Per prompt token after the first, from the raw prompt logits (unprocessed, as TGI's
    decoder_input_details and TGIS's input_tokens report them)."""

    logprobs: list[float]
    # 1-based rank of the prompt token among the model's predictions at its position.
    ranks: list[int]
    # The top_n most likely tokens at each position (empty lists when top_n is 0).
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def extend(self, more: PromptDetails) -> None:
        """Append the details of the positions that follow (the next prefill chunk's)."""
        self.logprobs.extend(more.logprobs)
        self.ranks.extend(more.ranks)
        self.top_ids.extend(more.top_ids)
        self.top_logprobs.extend(more.top_logprobs)


def prompt_details(
    logits: torch.Tensor, prompt_ids: Sequence[int], top_n: int = 0
) -> PromptDetails:
    """Details of each prompt token after the first from the prompt logits [L, V] (row j
    predicts token j + 1): len(prompt_ids) - 1 entries; the first prompt token has none."""
    n = len(prompt_ids) - 1
    details = PromptDetails([], [], [], [])
    if n <= 0:
        return details
    targets = torch.as_tensor(list(prompt_ids[1:]), dtype=torch.long, device=logits.device)
    # Chunked: a full [L, V] float32 log_softmax would cost gigabytes on long prompts.
    for start in range(0, n, _PROMPT_CHUNK):
        rows = logits[start : min(start + _PROMPT_CHUNK, n)].to(torch.float32)
        logprobs = rows - torch.logsumexp(rows, dim=-1, keepdim=True)
        picked = logprobs.gather(1, targets[start : start + rows.shape[0]].unsqueeze(1))
        ranks = (logprobs > picked).sum(dim=-1) + 1
        details.logprobs.extend(picked.squeeze(1).tolist())
        details.ranks.extend(ranks.tolist())
        if top_n > 0:
            top = torch.topk(logprobs, k=min(top_n, logprobs.shape[-1]), dim=-1)
            details.top_ids.extend(top.indices.tolist())
            details.top_logprobs.extend(top.values.tolist())
        else:
            details.top_ids.extend([] for _ in range(rows.shape[0]))
            details.top_logprobs.extend([] for _ in range(rows.shape[0]))
    return details
