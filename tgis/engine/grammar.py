"""Output constrained to a JSON schema or a regular expression, with llguidance.

A request's `GrammarSpec` (tgis.params) is checked when it is validated (schema and regex
errors, without the tokenizer), compiled into a `Constraint` per sequence when the engine admits
it, and applied at every step: the constraint gives the bitmask of the tokens its grammar allows
next, the sampler sets every other token's score to -inf before any processor, and the chosen
token advances it. The next mask is computed in a worker thread as soon as the token is known
(llguidance releases the GIL), so it is ready by the time the next forward has run.

Once the grammar is complete it allows only EOS, so a constrained sequence ends with
`eos_token`; one that cannot complete within max_new_tokens ends with `length`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tgis.params import GrammarSpec

# Token t is bit t % 32 of word t // 32 of llguidance's mask, least significant first.
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tgis-grammar")


class GrammarCompiler:
    """Builds constraints over one tokenizer (its llguidance form is made once: at start-up
    by `prepare`, else on first use)."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer,
                    n_vocab=len(self.tokenizer),
                    eos_token=self.eos_token_ids or None,
                )
            return self._ll_tokenizer

    def prepare(self) -> None:
        """Make the tokenizer's llguidance form now (a vocabulary walk: up to seconds for a
        large vocabulary), so that the first grammar request does not wait for it."""
        self._tokenizer()

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """A new sequence's constraint (its first mask starts computing at once). Raises
        ValueError when the grammar is unusable."""
        import llguidance as llg

        tokenizer = self._tokenizer()
        limits = llg.LLParserLimits(verbose_errors=False)
        matcher = llg.LLMatcher(tokenizer, spec.grammar(), log_level=0, limits=limits)
        if matcher.is_error():
            raise ValueError(f"the grammar cannot be used: {matcher.get_error()}")
        return Constraint(matcher, tokenizer.vocab_size)


class Constraint:
    """One sequence's grammar state. The engine thread advances it; its masks are computed in
    a worker thread (one owner at a time: `advance` and `allowed` wait for that work)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._pending: Future[torch.Tensor] | None = _WORKER.submit(self._mask)

    def copy(self) -> Constraint:
        """An independent constraint in the same state (another best_of candidate)."""
        if self._pending is not None:
            self._pending.result()  # the matcher has one owner at a time; the mask is kept
        return Constraint(self._matcher.deep_copy(), self.vocab_size)

    def _settle(self) -> torch.Tensor | None:
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _mask(self) -> torch.Tensor:
        bitmask = torch.empty(self._words, dtype=torch.int32)
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), self._words * 4)
        return bitmask

    def packed(self, width: int) -> torch.Tensor:
        """The tokens the grammar allows next as a bitmask of `width` ids: int32
        [ceil(width / 32)], bit j of word w for id 32 w + j (ids past the tokenizer's
        vocabulary, a model's padding, are never allowed). What a step uploads: 1/8 of a bool
        mask's bytes."""
        bitmask = self._settle()
        if bitmask is None:
            bitmask = self._mask()
        return pack_to_width(bitmask, self.vocab_size, width)

    def allowed(self, width: int) -> torch.Tensor:
        """The tokens the grammar allows next, as a bool [width]."""
        return unpack(self.packed(width), width)

    def advance(self, token_id: int) -> None:
        """Consume the chosen token and start computing the next mask. Raises ValueError if
        the grammar does not allow it."""
        self._settle()
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"the grammar does not allow token {token_id}")
        if not self._matcher.is_stopped():
            self._pending = _WORKER.submit(self._mask)

    def masks_ahead(self, draft: Sequence[int], width: int) -> list[KnownMask | None]:
        """The masks after each prefix of `draft` (speculative decoding: position j + 1 is
        scored after draft[:j + 1]), from a copy: this constraint does not move. None from the
        first draft token the grammar does not allow: that token is rejected (its score is
        -inf), so nothing after it is scored for use."""
        walker = self.copy()
        masks = masks_along(walker, draft, width)
        walker._settle()
        return masks

    @property
    def complete(self) -> bool:
        """The output matches the whole grammar and nothing may follow but EOS."""
        return bool(self._matcher.is_stopped())


def masks_along(
    walker: Any, draft: Sequence[int], width: int, checked: bool = False
) -> list[KnownMask | None]:
    """The masks of `walker` (a constraint's copy, moved here) after each token of `draft`;
    None from the first token it does not take: its `advance` raises ValueError, or with
    `checked`, the mask before the token does not allow it."""
    masks: list[KnownMask | None] = []
    before = walker.packed(width) if checked else None  # None: every token allowed
    for token in draft:
        refused = bool(masks) and masks[-1] is None
        if not refused and before is not None:
            refused = not (int(before[token // 32]) >> (token % 32)) & 1
        if not refused:
            try:
                walker.advance(token)
            except ValueError:
                refused = True
        if refused:
            masks.append(None)
            continue
        mask = walker.packed(width)
        before = mask if checked else None
        masks.append(KnownMask(mask))
    return masks


class KnownMask:
    """A mask computed ahead (`Constraint.masks_ahead`), in the place of a constraint for
    scoring one speculative position: a bitmask as `Constraint.packed` gives it (None: every
    token allowed, as a reasoning budget not yet spent gives it)."""

    def __init__(self, packed: torch.Tensor | None) -> None:
        self._packed = packed

    def packed(self, width: int) -> torch.Tensor | None:
        if self._packed is None:
            return None
        words = (width + 31) // 32
        if words == self._packed.shape[0]:
            return self._packed
        return pack_to_width(self._packed, self._packed.shape[0] * 32, width)

    def allowed(self, width: int) -> torch.Tensor:
        packed = self.packed(width)
        return torch.ones(width, dtype=torch.bool) if packed is None else unpack(packed, width)


def pack_to_width(bitmask: torch.Tensor, valid: int, width: int) -> torch.Tensor:
    """`bitmask` (int32 words, ids below `valid` meaningful) as the bitmask of `width` ids:
    bits of ids at or past `valid` cleared, words added or dropped to ceil(width / 32)."""
    out = torch.zeros((width + 31) // 32, dtype=torch.int32)
    full, rest = divmod(min(valid, width), 32)
    out[:full] = bitmask[:full]
    if rest:
        out[full] = bitmask[full] & ((1 << rest) - 1)
    return out


def unpack(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [..., width] of int32 bitmasks [..., ceil(width / 32)] (on their device)."""
    shifts = _BIT_SHIFTS.to(packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :width].bool()
