"""CUDA graphs of the paged forward's decode steps: one graph per batch-size bucket.

A decode step (every sequence computes one token) of n sequences runs the graph of the
smallest bucket >= n (1, 2, 4, 8, then every 8 up to 256 and every 16 beyond, up to the
largest batch: `decode_buckets`), recorded once at warmup, largest first, into one memory
pool. The graphs read persistent input buffers (token ids, positions, slot mapping, block
tables, KV lengths) that each step fills from one copy up (engine/transfer.py's
`to_device_all`); of the block tables only the rows that changed go up (a sequence entered a
new block, or another sequence took its row); the attention over KV pages
(tgis's Triton kernels, or flash attention) reads only each sequence's real KV length
(`seqused_k`), so one graph serves any mix of lengths. Rows beyond n are padding: their one
token is written to a scratch block of the pool that no sequence owns, and their logits are
dropped.

Prefill and mixed steps (and decode batches beyond the largest bucket) run eagerly. Graphs
need attention over KV pages: the plain-torch path's gather shapes depend on the KV lengths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tgis.backends.common.graphs import GraphApi
from tgis.backends.paged.attention import StepMetadata
from tgis.backends.paged.forward import PagedForward
from tgis.engine.backend import FedTokens
from tgis.engine.transfer import host_to_device_all

logger = logging.getLogger(__name__)

# Decode buckets after 1, 2, 4 and 8: every 8 rows up to 256, every 16 beyond. A batch pads up
# to its bucket, so finer buckets waste fewer rows (a 9-row batch runs 16, not 16 of 32).
_STEP, _WIDER_STEP, _WIDER_FROM = 8, 16, 256


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes decode graphs are recorded for, up to `max_batch` (the last bucket)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    size = 8
    while size < max_batch:
        buckets.append(size)
        size += _STEP if size < _WIDER_FROM else _WIDER_STEP
    return (*buckets, max_batch)


@dataclass
class _Graph:
    graph: Any
    logits: torch.Tensor  # [bucket, vocab], written by each replay


@dataclass(frozen=True)
class DecodeStep:
    """The decode step of one bucket that a graph records: `path`'s forward over views of
    `DecodeGraphs`' persistent buffers, taken once at capture. A recorded graph reads the
    same memory at every replay, so `DecodeGraphs.run` refills the buffers in place and never
    rebinds them; `meta` (flash attention's slot mapping, KV lengths and block tables) views
    the same buffers."""

    path: PagedForward
    input_ids: torch.Tensor  # [bucket] long
    positions: torch.Tensor  # [bucket] long
    meta: StepMetadata
    rows: torch.Tensor  # [bucket]: every row's logits

    def __call__(self) -> torch.Tensor:
        return self.path.forward(self.input_ids, self.positions, self.meta, self.rows)


class DecodeGraphs:
    """Recorded decode steps of `path` for batch buckets up to `max_batch`."""

    def __init__(
        self,
        path: PagedForward,
        api: GraphApi,
        max_batch: int,
        max_blocks: int,
        max_kv_len: int,
        scratch_block: int,
    ) -> None:
        """max_blocks: the longest block table (max_sequence_tokens / block_size, rounded
        up); max_kv_len: the longest KV length a sequence reaches; scratch_block: a block of
        the pool no sequence owns (padding rows write there)."""
        self.path = path
        self.api = api
        self.buckets = decode_buckets(max_batch)
        self.max_kv_len = max_kv_len
        block_size = path.pool.block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        device = path.device
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), self.scratch_slot, dtype=torch.long, device=device)
        self.seqused_k = torch.ones(size, dtype=torch.int32, device=device)
        self.block_table = torch.full(
            (size, max_blocks), scratch_block, dtype=torch.int32, device=device
        )
        self.cu_seq_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(size, device=device)
        # What each row of `block_table` holds (its blocks before the scratch padding; ():
        # all scratch), so that a step sends only the rows that changed.
        self._tables: list[tuple[int, ...]] = [()] * size
        self.table_rows_sent = 0
        self._graphs: dict[int, _Graph] = {}

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding `batch` rows (None: larger than every bucket)."""
        return next((b for b in self.buckets if b >= batch), None)

    def graph_for(self, batch: int) -> int | None:
        """The recorded bucket a decode step of `batch` rows replays (None: it runs eagerly)."""
        bucket = self.bucket_for(batch)
        return bucket if bucket in self._graphs else None

    @torch.inference_mode()
    def capture(self, bucket: int) -> None:
        """Record the decode step of `bucket` rows (all padding while recording)."""
        meta = StepMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            cu_seq_q=self.cu_seq_q[: bucket + 1],
            seqused_k=self.seqused_k[:bucket],
            block_table=self.block_table[:bucket],
            max_q=1,
            max_k=self.max_kv_len,
            flash=True,
            triton=self.path.pool.triton,
        )
        step = DecodeStep(
            self.path, self.input_ids[:bucket], self.positions[:bucket], meta, self.rows[:bucket]
        )
        graph, logits = self.api.capture(step)
        self._graphs[bucket] = _Graph(graph, logits)

    @torch.inference_mode()
    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        rope: Sequence[int] | None = None,
        fed: FedTokens | None = None,
    ) -> torch.Tensor:
        """One decode step of n = len(token_ids) sequences at `positions` through the bucket's
        graph: logits [n, vocab] (float32). `rope`: the positions the rows rotate at, where
        they differ from their own (multimodal rope). `fed`: the rows whose token is read on
        the device from the step before's sampled ids. The caller checked that n fits a
        captured bucket."""
        n = len(token_ids)
        bucket = self.graph_for(n)
        if bucket is None:
            raise ValueError(f"no CUDA graph holds a decode batch of {n}")
        width = self.block_table.shape[1]
        pad = bucket - n
        scratch = [self.scratch_block] * width
        # Only the block-table rows that differ from what the buffer holds go up.
        changed: list[int] = []
        wanted: list[tuple[int, ...]] = []
        for row in range(bucket):
            blocks = tuple(block_tables[row]) if row < n else ()
            if self._tables[row] != blocks:
                changed.append(row)
                wanted.append(blocks)
        host = torch.tensor(
            [
                [*token_ids, *([0] * pad)],
                [*(positions if rope is None else rope), *([0] * pad)],
                [*slots, *([self.scratch_slot] * pad)],
                [*(p + 1 for p in positions), *([1] * pad)],
            ],
            dtype=torch.long,
        )
        table = torch.tensor(
            [[*blocks, *scratch[len(blocks) :]] for blocks in wanted], dtype=torch.int32
        ).view(len(wanted), width)
        # One copy up, then into the graph's own buffers on the device.
        feeding = torch.tensor([*fed.items, *fed.rows] if fed is not None else [], dtype=torch.long)
        host, table, at, feeding = host_to_device_all(
            (host, table, torch.tensor(changed, dtype=torch.long), feeding),
            self.input_ids.device,
        )
        self.input_ids[:bucket].copy_(host[0])
        if fed is not None:  # one token per row: a row's token is its item's
            fed.write(self.input_ids, feeding)
        self.positions[:bucket].copy_(host[1])
        self.slot_mapping[:bucket].copy_(host[2])
        self.seqused_k[:bucket].copy_(host[3])
        if changed:
            self.block_table.index_copy_(0, at, table)
            for row, blocks in zip(changed, wanted, strict=True):
                self._tables[row] = blocks
        self.table_rows_sent += len(changed)
        captured = self._graphs[bucket]
        self.api.replay(captured.graph)
        return captured.logits[:n]


class CudaGraphApi:
    """GraphApi for CUDA graphs (torch.cuda.CUDAGraph). Recording only records, so the step
    runs once eagerly on a side stream first (as PyTorch requires before capture: lazy
    initializations must not be recorded) and the graph is replayed once after recording to
    produce the output. All graphs share one memory pool."""

    def __init__(self) -> None:
        self.pool: Any = None

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # idempotent: padding rows write the scratch block
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()
        self.pool = graph.pool()
        graph.replay()
        return graph, output

    def replay(self, graph: Any) -> None:
        graph.replay()
