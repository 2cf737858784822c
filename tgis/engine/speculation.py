"""Speculative decoding: tokens proposed cheaply, verified by one forward of the model.

A sequence's draft (`NgramProposer`: prompt lookup, no extra model) rides on its decode step:
the step computes the last token and the k draft tokens together (the paged scheduler reserves
their slots), so the model's logits at each of the k + 1 positions come out of one forward.
`verify` then chooses what a step-by-step decode would have:

- Each position is scored as that decode would score it: the row's processors see the draft
  tokens before it as generated (penalties, min_new_tokens, the length penalty, the random draw
  of that position), through `SamplingRow.ahead`.
- Greedy rows: the argmax at each position; drafts are accepted while they equal it, and the
  first mismatch is replaced by the argmax. The tokens are exactly those of decoding one at a
  time.
- Sampled rows (rejection sampling, Leviathan et al. 2023, with a proposal that puts all its
  mass on the draft token): draft token d at a position whose processed distribution is p is
  accepted when the position's uniform draw u < p(d); otherwise the token is drawn from p
  without d, renormalised, with (u - p(d)) / (1 - p(d)), which is uniform given the rejection.
  Each emitted token is therefore distributed exactly as p, as without speculation (the tokens
  themselves differ from a non-speculative run with the same seed: the draw is used another way).
- After the last accepted draft token, one more token comes from the following position (a
  bonus when every draft token was accepted, the correction otherwise): every verify step
  gives at least one token.

Rows under a grammar speculate too: a copy of the row's matcher walks the draft and gives
the mask of each position (`Constraint.masks_ahead`); a draft token the grammar does not allow
scores -inf, so it is rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tgis.engine.grammar import Constraint, KnownMask
from tgis.engine.sampling import SampleOutput, SamplingBatch, SamplingRow, uniforms
from tgis.engine.thinking import ThinkingLimit
from tgis.engine.transfer import to_device

# Longest and shortest n-gram looked up (vLLM's prompt_lookup_max / prompt_lookup_min).
NGRAM_MAX = 3
NGRAM_MIN = 1


class Proposer(Protocol):
    """Where drafts come from: prompt lookup (`NgramProposer`) or a draft model
    (tgis.engine.draft.DraftModelProposer)."""

    def draft(self, wanted: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """Drafts for (seq_id, tokens, k) requests, in order: at most k tokens each."""
        ...

    def release(self, seq_id: int) -> None:
        """The sequence left: what is kept for it goes."""
        ...


class NgramProposer:
    """Prompt lookup: the last n tokens (n = NGRAM_MAX down to NGRAM_MIN) are searched for
    earlier in the sequence (prompt and generated), latest occurrence first; the tokens that
    followed it are the draft. Where text is copied from the prompt (editing code, quoting,
    extracting) the drafts are long and mostly right; elsewhere they are empty or rejected."""

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def draft(self, wanted: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """Drafts for (seq_id, tokens, k) requests, in order."""
        return [self.propose(tokens, k) for _, tokens, k in wanted]

    def release(self, seq_id: int) -> None:
        """Nothing is kept per sequence."""

    def propose(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` tokens to follow `token_ids` (none when no n-gram recurs)."""
        length = len(token_ids)
        if k <= 0:
            return ()
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            pattern = list(token_ids[length - n :])
            last = pattern[-1]
            # Latest earlier occurrence whose continuation is known: ends before the suffix.
            for end in range(length - 2, n - 2, -1):
                if token_ids[end] == last and list(token_ids[end - n + 1 : end + 1]) == pattern:
                    return tuple(token_ids[end + 1 : end + 1 + k])
        return ()


@dataclass(frozen=True)
class Verified:
    """One sequence's tokens from a verify step: the accepted draft tokens, then the one
    chosen after them, as rows of `choice`; `accepted` of its `drafted` tokens were right."""

    choice: SampleOutput
    accepted: int
    drafted: int


def verify(
    rows: Sequence[SamplingRow],
    logits: Sequence[torch.Tensor],
    drafts: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int] = (),
) -> list[Verified]:
    """The tokens of each row: `logits[i]` [len(drafts[i]) + 1, vocab] are the model's logits
    at the last known token and after each draft token. The rows record what they emit."""
    scored: list[SamplingRow] = []
    owner: list[tuple[int, int]] = []  # (row, position) of each scored position
    stacked = torch.cat([block.float() for block in logits])  # [positions, vocab]
    for i, (row, draft) in enumerate(zip(rows, drafts, strict=True)):
        constraint = row.constraint
        masks: list[KnownMask | None] = [None] * len(draft)
        if isinstance(constraint, (Constraint, ThinkingLimit)):
            masks = constraint.masks_ahead(draft, stacked.shape[-1])
        for j in range(len(draft) + 1):
            scored.append(row if j == 0 else row.ahead(draft[:j], masks[j - 1]))
            owner.append((i, j))
    batch = SamplingBatch(scored, eos_token_ids)
    scores = batch.process(stacked)
    device, vocab = scores.device, scores.shape[-1]
    logprobs = torch.log_softmax(scores, dim=-1)
    probs = logprobs.exp()
    # The draft token each position is asked about (-1: the last position, none).
    asked = [drafts[i][j] if j < len(drafts[i]) else -1 for i, j in owner]
    asked_t = to_device(asked, torch.long, device)
    has_draft = asked_t >= 0
    draft_p = torch.where(
        has_draft, probs.gather(1, asked_t.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0
    )
    states = to_device([r.draw_state() for r in scored], torch.long, device)
    u = uniforms(states)
    # A rejected draft token is drawn again from p without it; the last position from p.
    rest = probs.scatter(1, asked_t.clamp(min=0).unsqueeze(1), 0.0)
    rest = torch.where(has_draft.unsqueeze(1), rest, probs)
    cdf = rest.cumsum(dim=-1)
    redraw = ((u - draft_p) / (1.0 - draft_p).clamp(min=1e-12)).clamp(0.0, 1.0 - 2.0**-24)
    sampled_ids = torch.searchsorted(cdf, (redraw * cdf[:, -1]).unsqueeze(1), right=True)
    sampled_ids = sampled_ids.squeeze(1).clamp(max=vocab - 1)
    greedy_ids = scores.argmax(dim=-1)
    do_sample = to_device([r.do_sample for r in scored], torch.bool, device)
    accept = torch.where(do_sample, u < draft_p, greedy_ids == asked_t) & has_draft
    replace_ids = torch.where(do_sample, sampled_ids, greedy_ids)
    host = torch.stack([accept.long(), replace_ids]).tolist()
    accepted_flags, replacements = host[0], host[1]
    # Per row: accepted drafts, then the replacement (or bonus) token.
    counts: list[int] = []
    picks: list[tuple[int, int]] = []  # (position, token) of every emitted token, in order
    position = 0
    for draft in drafts:
        taken = 0
        while taken < len(draft) and accepted_flags[position + taken]:
            taken += 1
        tokens = [*draft[:taken], replacements[position + taken]]
        picks.extend((position + j, t) for j, t in enumerate(tokens))
        counts.append(taken)
        position += len(draft) + 1
    at = to_device([p for p, _ in picks], torch.long, device)
    ids = to_device([t for _, t in picks], torch.long, device)
    picked = logprobs[at]
    chosen = picked.gather(1, ids.unsqueeze(1))  # [picked, 1]
    ranks = ((picked > chosen).sum(dim=-1) + 1).tolist()
    top_ids, top_lps = SamplingBatch([scored[p] for p, _ in picks])._top_tokens(picked)
    chosen_l = chosen.squeeze(1).tolist()
    out: list[Verified] = []
    start = 0
    for row, taken, draft in zip(rows, counts, drafts, strict=True):
        span = slice(start, start + taken + 1)
        tokens = [t for _, t in picks[span]]
        for token in tokens:
            row.append(token)
        choice = SampleOutput(tokens, chosen_l[span], ranks[span], top_ids[span], top_lps[span])
        out.append(Verified(choice, taken, len(draft)))
        start += taken + 1
    return out
