"""A reasoning block held to a budget of tokens (`params.ThinkingBudget`).

`ThinkingLimit` takes a sequence's constraint slot, around its grammar if it has one. It
follows the generated ids: the block opens at the start marker's ids (or at the first token
when the prompt opened it), each token inside it is spent, and it closes at the end marker's
ids. Once the budget is spent, the only token allowed is the next one of the end marker, so the
block closes within the marker's length and the answer follows. The grammar, which allows the
marker anywhere in the block, moves on with every token as before.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from tgis.engine.grammar import Constraint, KnownMask, masks_along
from tgis.params import ThinkingBudget


def _ends_with(ids: Sequence[int], marker: Sequence[int]) -> bool:
    return bool(marker) and len(ids) >= len(marker) and list(ids[-len(marker) :]) == list(marker)


class ThinkingLimit:
    """One sequence's reasoning budget, over its grammar's constraint (`inner`, or None)."""

    def __init__(self, budget: ThinkingBudget, inner: Constraint | None = None) -> None:
        self.budget = budget
        self.inner = inner
        self.inside = budget.opened
        self.closed = False  # the first block has ended: nothing more is watched
        self.spent = 0
        self._tail: list[int] = []
        self._keep = max(len(budget.start_ids), len(budget.end_ids))

    def copy(self) -> ThinkingLimit:
        """An independent limit in the same state (another best_of candidate)."""
        twin = copy.copy(self)
        twin.inner = self.inner.copy() if self.inner is not None else None
        twin._tail = list(self._tail)
        return twin

    def forced(self) -> int | None:
        """The token the budget forces next, or None."""
        if not self.inside or self.spent < self.budget.tokens:
            return None
        end = self.budget.end_ids
        # The end marker's tokens already written (the model may have begun it itself).
        written = max(
            (k for k in range(len(end)) if k == 0 or _ends_with(self._tail, end[:k])), default=0
        )
        return end[written]

    def packed(self, width: int) -> torch.Tensor | None:
        """The tokens allowed next as a bitmask of `width` ids (see Constraint.packed), or
        None when every token is (no grammar, and nothing forced): the step masks nothing."""
        allowed = self.inner.packed(width) if self.inner is not None else None
        token = self.forced()
        if token is None or token >= width:
            return allowed
        word, bit = divmod(token, 32)
        if allowed is not None and not (int(allowed[word]) >> bit) & 1:
            return allowed  # where the grammar refuses the marker, the grammar rules
        only = torch.zeros((width + 31) // 32, dtype=torch.int32)
        only[word] = (1 << bit) - (1 << 32 if bit == 31 else 0)
        return only

    def allowed(self, width: int) -> torch.Tensor:
        return KnownMask(self.packed(width)).allowed(width)

    def advance(self, token_id: int) -> None:
        """Consume the chosen token (the grammar first: ValueError if it refuses it)."""
        if self.inner is not None:
            self.inner.advance(token_id)
        if self.closed:
            return
        self._tail = [*self._tail, token_id][-self._keep :]
        if self.inside:
            if _ends_with(self._tail, self.budget.end_ids):
                self.inside, self.closed = False, True
            else:
                self.spent += 1
        elif _ends_with(self._tail, self.budget.start_ids):
            self.inside = True

    def masks_ahead(self, draft: Sequence[int], width: int) -> list[KnownMask | None]:
        """The masks after each prefix of `draft` (Constraint.masks_ahead), each token checked
        against the mask before it, the budget's forced tokens included; this limit does not
        move."""
        return masks_along(self.copy(), draft, width, checked=True)

    @property
    def complete(self) -> bool:
        return self.inner.complete if self.inner is not None else False
