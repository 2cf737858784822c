"""Device graphs over the fixed-shape forward: capture a step once per bucket, replay it after.

A step of a given shape is recorded once with its input tensors, and later steps of that shape
copy their inputs into those tensors and replay the recording, skipping the per-op launch cost.
The fixed-shape forward (static/kv.py's StaticLlamaForward) makes every step of a bucket the
same recording. `GraphedStaticModel` wraps it as a StaticModel; a `GraphApi` says how a device
captures and replays: HPU graphs on gaudi, which serves through it (the paged engine records
its CUDA graphs of decode through the same interface, paged/graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tgis.backends.common.graphs import GraphApi
from tgis.backends.static.batch import EagerOps
from tgis.backends.static.kv import StaticLlamaForward

logger = logging.getLogger(__name__)


@dataclass
class _Captured:
    """One recorded graph: the tensors it reads its inputs from and the one it writes."""

    graph: Any
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor


class GraphedStaticModel:
    """A StaticModel running a StaticLlamaForward through device graphs: decode per rows
    bucket, prefill per (rows, length) bucket when `graph_prefill`. Prefills that return every
    position's logits (prompt logprobs) run without a graph (warmup never records them)."""

    def __init__(
        self,
        forward: StaticLlamaForward,
        api: GraphApi,
        enabled: bool = True,
        graph_prefill: bool = False,
        on_decode: Callable[[], None] | None = None,
    ) -> None:
        self.forward = forward
        self.api = api
        self.enabled = enabled
        self.graph_prefill = graph_prefill
        self.on_decode = on_decode
        self.vocab_size: int = forward.vocab_size
        self.kv_bytes_per_token: int = forward.kv_bytes_per_token
        self.captures = 0
        self.replays = 0
        self._graphs: dict[tuple[Any, ...], _Captured] = {}

    @property
    def graph_keys(self) -> list[tuple[Any, ...]]:
        """The buckets recorded so far: ("decode", rows) and ("prefill", rows, length)."""
        return list(self._graphs)

    @property
    def prefill_uses_graphs(self) -> bool:
        return self.enabled and self.graph_prefill

    def _run(
        self,
        key: tuple[Any, ...],
        step: Callable[..., torch.Tensor],
        inputs: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Record `step` for `key` the first time, replay it afterwards; returns a copy of the
        graph's output (the next replay writes into the same tensor)."""
        captured = self._graphs.get(key)
        if captured is None:
            static = tuple(t.clone() for t in inputs)
            graph, output = self.api.capture(lambda: step(*static))
            captured = self._graphs[key] = _Captured(graph, static, output)
            self.captures += 1
            logger.debug("recorded a device graph for %s", key)
        else:
            for target, value in zip(captured.inputs, inputs, strict=True):
                target.copy_(value)
            self.api.replay(captured.graph)
            self.replays += 1
        return captured.output.clone()

    @torch.no_grad()
    def prefill_static(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        rows: torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """StaticLlamaForward.prefill_static, through a graph per (rows, length) bucket when
        prefill graphs are on."""
        if not self.prefill_uses_graphs or all_logits:
            return self.forward.prefill_static(input_ids, lengths, rows, all_logits)
        b, length = input_ids.shape
        return self._run(
            ("prefill", b, length),
            lambda ids, lens, where: self.forward.prefill_static(ids, lens, where, False),
            (input_ids, lengths, rows),
        )

    @torch.no_grad()
    def decode_static(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """StaticLlamaForward.decode_static, through a graph per rows bucket."""
        if self.on_decode is not None:
            self.on_decode()
        if not self.enabled:
            return self.forward.decode_static(input_ids, positions, rows)
        return self._run(
            ("decode", rows),
            lambda ids, pos: self.forward.decode_static(ids, pos, rows),
            (input_ids, positions),
        )


class GraphOps(EagerOps):
    """DeviceOps of an eager device whose steps replay graphs: the graphs recorded count as
    its compilations (what warmup reports and what a late recording is noticed by)."""

    def __init__(self, device: str | torch.device, graphs: GraphedStaticModel) -> None:
        super().__init__(device)
        self.graphs = graphs

    def compilations(self) -> int:
        return self.graphs.captures
