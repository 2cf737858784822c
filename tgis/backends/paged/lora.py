"""LoRA adapters in the packed forward of the paged engine (every family models/families.py
names, on the projections its checkpoints name: attention's and the dense MLP's).

A step's adapters (those of its items; rows of the base model have none) are stacked, per
layer and fused projection, into one pair of factors: A [in, R] holds each adapter's `a`
columns side by side and B [R, out] their `b` rows, each adapter's block padded to its rank.
Every adapted projection then adds `((x A) * M) B` to its output, where the mask M [rows, R]
keeps for each row only its own adapter's columns (none for the base model's rows): two
matmuls per projection and layer, whatever the mix of adapters in the step, and no adapter is
ever merged into the weights. q/k/v and gate/up are stacked as the forward fuses them, so their
update lands on the fused output in one piece. Stacked factors are cached per combination of
adapters (a few combinations recur while the same requests run).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tgis.backends.models.families import Family, family_of
from tgis.engine.types import LoraAdapter

# Combinations of adapters whose stacked factors stay cached.
STACKS_CACHED = 8

Factors = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LoraShapes:
    """What an adapter must fit: the model's layers, each projection an adapter may adapt
    with its (in, out) sizes, as the family's checkpoints name them, and the family."""

    num_layers: int
    modules: Mapping[str, tuple[int, int]]
    family: Family

    @classmethod
    def of(cls, config: Any) -> LoraShapes:
        """From a transformers config of a family the paged forward runs."""
        family = family_of(config.to_dict())
        if family is None:
            raise ValueError(
                f"LoRA adapters are served for the paged engine's families, not {config.model_type!r}"
            )
        return cls(config.num_hidden_layers, family.lora_modules(config), family)


@dataclass(frozen=True)
class Stack:
    """The stacked factors of some adapters: per layer, per projection name (`qkv`, `o_proj`,
    `gate_up` or `gate_proj` / `up_proj`, `down_proj`), (A, B) or absent where none of them
    adapts it; `owner[name]` [R] the index of the adapter each column belongs to."""

    layers: tuple[dict[str, Factors], ...]
    owner: dict[str, torch.Tensor]
    dtype: torch.dtype


def stack(adapters: Sequence[LoraAdapter], shapes: LoraShapes, fuse_gate_up: bool) -> Stack:
    """Stack `adapters` (in order) for a model of `shapes`."""
    some = next(
        (ab[0] for adapter in adapters for layer in adapter.layers for ab in layer.values()), None
    )
    assert some is not None, "an adapter adapts some projection"
    device, dtype = some.device, some.dtype
    owner: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Factors]] = [{} for _ in range(shapes.num_layers)]
    for name, modules in shapes.family.lora_groups(fuse_gate_up).items():
        # Each adapter's block: its rank's columns for each module, side by side.
        widths = [adapter.rank * len(modules) for adapter in adapters]
        starts = [sum(widths[:g]) for g in range(len(adapters))]
        owner[name] = torch.repeat_interleave(
            torch.arange(len(adapters), device=device), torch.tensor(widths, device=device)
        )
        outs = [shapes.modules[m][1] for m in modules]
        fan_in = shapes.modules[modules[0]][0]
        for index, stacked in enumerate(layers):
            present = [
                (g, j, adapter.layers[index][m])
                for g, adapter in enumerate(adapters)
                for j, m in enumerate(modules)
                if m in adapter.layers[index]
            ]
            if not present:
                continue
            a_all = torch.zeros(fan_in, sum(widths), device=device, dtype=dtype)
            b_all = torch.zeros(sum(widths), sum(outs), device=device, dtype=dtype)
            for g, j, (a, b) in present:
                col, out = starts[g] + j * adapters[g].rank, sum(outs[:j])
                a_all[:, col : col + a.shape[1]] = a
                b_all[col : col + b.shape[0], out : out + outs[j]] = b
            stacked[name] = (a_all, b_all)
    return Stack(tuple(layers), owner, dtype)


class LoraStacks:
    """A backend's adapter stacks: built for each new combination of adapters in a step, the
    last STACKS_CACHED kept."""

    def __init__(self, shapes: LoraShapes, fuse_gate_up: bool) -> None:
        self.shapes = shapes
        self.fuse_gate_up = fuse_gate_up
        self._cache: OrderedDict[tuple[bytes, ...], Stack] = OrderedDict()

    def step(
        self, adapters: Sequence[LoraAdapter | None], lengths: Sequence[int]
    ) -> LoraStep | None:
        """The step of items with `adapters` (None: the base model) and `lengths` token rows
        each, packed in order; None when no item has an adapter."""
        chosen = {a.key: a for a in adapters if a is not None}
        if not chosen:
            return None
        keys = tuple(sorted(chosen))
        stacked = self._cache.get(keys)
        if stacked is None:
            stacked = stack([chosen[k] for k in keys], self.shapes, self.fuse_gate_up)
            self._cache[keys] = stacked
            while len(self._cache) > STACKS_CACHED:
                self._cache.popitem(last=False)
        self._cache.move_to_end(keys)
        if len(keys) == 1 and all(a is not None for a in adapters):
            return LoraStep(stacked, None)
        index = {k: g for g, k in enumerate(keys)}
        owners = []
        for adapter, n in zip(adapters, lengths, strict=True):
            owners.extend([index[adapter.key] if adapter is not None else len(keys)] * n)
        device = stacked.owner["o_proj"].device
        # One row past the adapters' for the base model's rows: all zero.
        onehot = torch.eye(len(keys) + 1, len(keys), device=device, dtype=stacked.dtype)
        return LoraStep(stacked, onehot[torch.tensor(owners, device=device)])


class LoraStep:
    """The adapters of one packed step: their stack and each row's adapter."""

    def __init__(self, stacked: Stack, rows: torch.Tensor | None) -> None:
        """rows: one-hot [N, adapters] of each row's adapter (all zero for the base model's
        rows); None when every row has the one adapter."""
        self.stack = stacked
        self.rows = rows
        self._masks: dict[str, torch.Tensor] = {}

    def mask(self, name: str) -> torch.Tensor | None:
        """[N, R] of projection `name`: 1 where the column is the row's adapter's."""
        if self.rows is None:
            return None
        mask = self._masks.get(name)
        if mask is None:
            mask = self.rows.index_select(1, self.stack.owner[name])
            self._masks[name] = mask
        return mask

    def layer(self, index: int) -> LayerLora:
        """The step's updates in layer `index`."""
        return LayerLora(self, index)


@dataclass(frozen=True)
class LayerLora:
    """One layer of a LoraStep: `add` applies its updates to one projection's output."""

    step: LoraStep
    index: int

    def add(self, out: torch.Tensor, x: torch.Tensor, name: str) -> None:
        """out [N, out] += the step's update of projection `name` (`qkv`, `o_proj`, `gate_up`,
        `gate_proj`, `up_proj`, `down_proj`) from its input x [N, in]."""
        factors = self.step.stack.layers[self.index].get(name)
        if factors is None:
            return
        a, b = factors
        low = torch.mm(x, a)
        mask = self.step.mask(name)
        if mask is not None:
            low.mul_(mask)
        out.addmm_(low, b)
