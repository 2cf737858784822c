"""LoRA adapters in the packed forward of the llama family (the paged engine).

A step's token rows are grouped by the adapter of the item they belong to; in every layer each
adapted projection adds, to each group's rows, the group's low-rank update: for rows R of an
adapter with factors a [in, r] and b [r, out] (scale folded in), out[R] += (x[R] a) b. That is
one pair of small matmuls per adapter, projection and layer, however the adapters and the base
model's rows are mixed in the step; rows of the base model are left as they are, and no
adapter is ever merged into the weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgis.engine.types import LoraAdapter


@dataclass(frozen=True)
class LoraGroup:
    """The rows [n] (long, on the device) of a step that go through `adapter`; `whole`: they
    are all the step's rows, in order."""

    rows: torch.Tensor
    adapter: LoraAdapter
    whole: bool


class LoraStep:
    """The adapters of one packed step, grouped by rows."""

    def __init__(self, groups: Sequence[LoraGroup]) -> None:
        self.groups = tuple(groups)

    @classmethod
    def of(
        cls,
        adapters: Sequence[LoraAdapter | None],
        lengths: Sequence[int],
        device: torch.device,
    ) -> LoraStep | None:
        """The step of items with `adapters` (None: the base model) and `lengths` token rows
        each, packed in order; None when no item has an adapter."""
        rows: dict[int, list[int]] = {}
        chosen: dict[int, LoraAdapter] = {}
        offset = 0
        for adapter, n in zip(adapters, lengths, strict=True):
            if adapter is not None:
                rows.setdefault(id(adapter), []).extend(range(offset, offset + n))
                chosen[id(adapter)] = adapter
            offset += n
        if not rows:
            return None
        groups = [
            LoraGroup(torch.tensor(r, dtype=torch.long).to(device), chosen[k], len(r) == offset)
            for k, r in rows.items()
        ]
        return cls(groups)

    def layer(self, index: int) -> LayerLora:
        """The step's updates in layer `index`."""
        return LayerLora(self, index)


@dataclass(frozen=True)
class LayerLora:
    """One layer of a LoraStep: `add` applies its updates to one projection."""

    step: LoraStep
    index: int

    def add(self, out: torch.Tensor, x: torch.Tensor, module: str) -> None:
        """out [N, out] (a view may do) += each group's update of `module` from x [N, in]."""
        for group in self.step.groups:
            factors = group.adapter.layers[self.index].get(module)
            if factors is None:
                continue
            a, b = factors
            if group.whole:
                out.add_(torch.mm(torch.mm(x, a), b))
            else:
                update = torch.mm(torch.mm(x.index_select(0, group.rows), a), b)
                out.index_add_(0, group.rows, update)
