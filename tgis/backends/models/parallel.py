"""The collectives of tensor parallelism, as the decoder forward calls them.

A small module of its own so that the forward (models/decoder.py) and the paged backend can name
`TensorParallel` without importing the machinery that starts and drives the ranks
(paged/tensor_parallel.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group and the collectives the forward calls."""

    rank: int
    world: int
    vocab_size: int  # the model's whole vocabulary

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows per rank (the last rank's are padded with zeros)."""
        return math.ceil(self.vocab_size / self.world)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: this rank's rows, zeros elsewhere, summed over ranks."""
        local = ids - self.rank * self.vocab_rows
        inside = (local >= 0) & (local < self.vocab_rows)
        out = F.embedding(local.clamp(0, self.vocab_rows - 1), weight) * inside[:, None]
        return self.all_reduce(out)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[rows, vocab_rows] of each rank -> [rows, vocab]."""
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

    def agree_min(self, value: int) -> int:
        """The smallest `value` of all ranks (pool sizes every rank can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())
