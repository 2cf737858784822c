"""A paged backend whose forward is a timer (`tgis benchmark --engine --simulated-device-ms`):
the engine's host work measured against an accelerator of a given step time, on a CPU.

Its forward costs next to nothing and returns logits over the model's whole vocabulary from a
cheap deterministic function of each row's last token and position (rows of a fixed random
table, each peaked as a language model's: `peaked_table`), so the tokens are reproducible and
sampling, penalties and stop rules run over the real vocabulary. The device time is the stream's (`tgis.engine.stream.SimulatedStream`): each step's
forward takes its `step_s` on the simulated device's own timeline, whatever its rows.

    backend = SimulatedBackend(vocab_size=128_256, max_sequences=64, max_sequence_tokens=4096)
    engine = Engine(backend, tokenizer, limits, 64, eos, stream=SimulatedStream(step_s=0.002))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from tgis.engine.backend import (
    BackendCapacity,
    FedTokens,
    PackedItem,
    PackedOutput,
    Shape,
    ShapeTiming,
)
from tgis.engine.types import ImageInput

# Distinct rows of logits the function draws from: enough that neighbouring tokens differ.
TABLE_ROWS = 64
BLOCK_SIZE = 16
# Each row is shaped as a language model's next-token logits: HEAD likely tokens, each
# HEAD_STEP below the one before, over a flat tail; the first holds about half the mass (so
# top-p and typical-p find their tokens among the first candidates, as on a real model).
HEAD = 32
HEAD_STEP = 0.5


def peaked_table(rows: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, vocab_size] float32 logits: a standard normal tail, and HEAD random tokens of
    each row raised to log(vocab) + 2.5, then down by HEAD_STEP each."""
    table = torch.randn(rows, vocab_size, generator=generator)
    head = min(HEAD, vocab_size)
    top = math.log(vocab_size) + 2.5
    boost = top - HEAD_STEP * torch.arange(head, dtype=torch.float32)
    for row in range(rows):
        tokens = torch.randperm(vocab_size, generator=generator)[:head]
        table[row, tokens] = boost
    return table


class SimulatedBackend:
    """A PagedBackend over a timer; see the module doc."""

    name = "simulated"
    device = "cpu"

    def __init__(
        self,
        vocab_size: int,
        max_sequences: int,
        max_sequence_tokens: int,
        seed: int = 0,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        if vocab_size < 2 or max_sequences < 1 or max_sequence_tokens < 2:
            raise ValueError("a simulated device needs a vocabulary, sequences and tokens")
        self.vocab_size = vocab_size
        generator = torch.Generator().manual_seed(seed)
        self._table = peaked_table(TABLE_ROWS, vocab_size, generator)
        blocks = max_sequences * -(-max_sequence_tokens // block_size)
        self._capacity = BackendCapacity(
            max_sequences=max_sequences,
            max_sequence_tokens=max_sequence_tokens,
            kv_tokens=blocks * block_size,
            kv_bytes_per_token=0,
            block_size=block_size,
            fed_tokens=True,
        )

    @property
    def capacity(self) -> BackendCapacity:
        return self._capacity

    def row(self, token_id: int, position: int) -> int:
        """The table row of the logits after `token_id` at `position`."""
        return (token_id * 7919 + position * 104_729) % TABLE_ROWS

    def forward(self, items: Sequence[PackedItem], fed: FedTokens | None = None) -> PackedOutput:
        """Logits for each item's sampled row and, where asked, each of its positions; `fed`
        items' last tokens are read from the earlier step's ids on this (simulated) device."""
        known: dict[int, int] = {}
        if fed is not None and fed.items:
            ids = fed.source().index_select(0, torch.tensor(fed.rows, dtype=torch.long))
            known = dict(zip(fed.items, ids.tolist(), strict=True))
        last: list[int] = []
        prompt: list[torch.Tensor | None] = []
        for i, item in enumerate(items):
            tokens = item.token_ids if i not in known else (*item.token_ids[:-1], known[i])
            rows = [self.row(t, item.start + j) for j, t in enumerate(tokens)]
            if item.sample:
                last.append(rows[-1])
            prompt.append(self._table[rows] if item.prompt_logits else None)
        logits = self._table[last] if last else self._table[:0]
        return PackedOutput(logits, tuple(prompt))

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        raise ValueError("a simulated device takes no images")

    def warmup_plan(self, max_batch_size: int, max_input_tokens: int) -> list[Shape]:
        return []

    def warmup(
        self,
        max_batch_size: int,
        max_input_tokens: int,
        on_shape: Callable[[ShapeTiming], None] | None = None,
    ) -> list[ShapeTiming]:
        return []
