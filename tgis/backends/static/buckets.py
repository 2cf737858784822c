"""Shape buckets of the static-shape backends (tpu, neuron, gaudi) and their warmup plan.

A compiled device graph (an XLA program, a Neuron NEFF, an HPU graph) has fixed shapes, so
every step is padded up to a bucket: the number of rows a step runs and, for prefill, the
padded prompt length. Each distinct bucket is a graph compiled once (at warmup) and reused.
Device-agnostic: no torch, no device.

    policy = static_policy(batch_size=4, max_length=1024, max_input_tokens=1023)
    policy.length_bucket(100)        # 128: the prompt is padded to 128 positions
    policy.decode_rows(3)            # 4: decode always runs the whole static batch
    plan = policy.warmup_plan()      # every (phase, rows, length) the server will run

tpu / neuron (seeds 000, 002): one static batch of `batch_size` rows. Decode always runs every
row. Prefill runs either every row ("rebuild": the whole KV cache is recomputed from each
slot's tokens at each prefill, as the seeds describe) or only the new sequences' rows
("insert"), padded to a power of two. Prompt lengths are padded to powers of two from 16
(optimum-tpu's prefill buckets), capped at the longest sequence the mode can prefill.

gaudi (seed 003): decode rows padded to a multiple of BATCH_BUCKET_SIZE, prefill rows to a
multiple of PREFILL_BATCH_BUCKET_SIZE, prompts to a multiple of PAD_SEQUENCE_TO_MULTIPLE_OF.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal

from tgis.backends.common.warmup import powers_of_two
from tgis.config import PREFILL_MODES, GaudiSettings
from tgis.engine.backend import Shape

PrefillMode = Literal["rebuild", "insert"]
# optimum-tpu's smallest prefill bucket: shorter prompts are padded to 16 positions.
MIN_LENGTH_BUCKET = 16


@dataclass(frozen=True)
class ShapePolicy:
    """The buckets of one backend. All tuples are sorted ascending and end at the maximum."""

    batch_size: int  # rows of the KV cache (static slots)
    max_length: int  # positions per row
    prefill_mode: PrefillMode
    prefill_lengths: tuple[int, ...]  # padded prompt lengths
    prefill_rows: tuple[int, ...]  # padded prefill batch sizes
    decode_batches: tuple[int, ...]  # padded decode batch sizes

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_length < 2:
            raise ValueError(
                f"a static shape needs batch_size >= 1 and max_length >= 2, got "
                f"{self.batch_size} x {self.max_length}"
            )
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(
                f"prefill mode {self.prefill_mode!r} is not one of {', '.join(PREFILL_MODES)}"
            )
        for name, values, limit in (
            ("prefill_lengths", self.prefill_lengths, self.max_length),
            ("prefill_rows", self.prefill_rows, self.batch_size),
            ("decode_batches", self.decode_batches, self.batch_size),
        ):
            if not values or list(values) != sorted(set(values)) or values[0] < 1:
                raise ValueError(f"{name} must be increasing positive sizes, got {values}")
            if values[-1] > limit:
                raise ValueError(f"{name} {values} go past {limit}")

    @staticmethod
    def _bucket(buckets: tuple[int, ...], value: int, what: str) -> int:
        index = bisect.bisect_left(buckets, value)
        if value < 1 or index == len(buckets):
            raise ValueError(f"{what} {value} is outside the buckets {buckets}")
        return buckets[index]

    def length_bucket(self, tokens: int) -> int:
        """The padded length of a prefill whose longest sequence has `tokens` tokens."""
        return self._bucket(self.prefill_lengths, tokens, "prefill length")

    def prefill_batch(self, sequences: int) -> int:
        """Rows of a prefill of `sequences` new sequences (every row in rebuild mode)."""
        return self._bucket(self.prefill_rows, sequences, "prefill batch")

    def decode_rows(self, rows_in_use: int) -> int:
        """Rows a decode step runs when rows [0, rows_in_use) hold the running sequences."""
        return self._bucket(self.decode_batches, rows_in_use, "decode batch")

    def warmup_plan(self, max_prompt_tokens: int | None = None) -> list[Shape]:
        """Every shape serving can meet: prefill per (rows, length) bucket, then decode per
        rows bucket. `max_prompt_tokens` drops length buckets no prompt can reach."""
        lengths = self.prefill_lengths
        if max_prompt_tokens is not None and self.prefill_mode == "insert":
            lengths = lengths[: bisect.bisect_left(lengths, max_prompt_tokens) + 1]
        plan = [Shape("prefill", rows, n) for rows in self.prefill_rows for n in lengths]
        return plan + [Shape("decode", rows, 1) for rows in self.decode_batches]


def static_policy(
    batch_size: int, max_length: int, max_input_tokens: int, prefill_mode: PrefillMode = "insert"
) -> ShapePolicy:
    """The tpu / neuron policy (see the module doc).

    Rebuild prefills re-run every slot's whole sequence, so their lengths reach max_length - 1;
    insert prefills only new prompts, at most `max_input_tokens` long.
    """
    if not 0 < max_input_tokens < max_length:
        raise ValueError(
            f"max_input_tokens {max_input_tokens} must be within 1..{max_length - 1} "
            f"(below max_length {max_length})"
        )
    longest = max_length - 1 if prefill_mode == "rebuild" else max_input_tokens
    rows = (batch_size,) if prefill_mode == "rebuild" else powers_of_two(1, batch_size)
    return ShapePolicy(
        batch_size,
        max_length,
        prefill_mode,
        powers_of_two(MIN_LENGTH_BUCKET, longest),
        rows,
        (batch_size,),
    )


def gaudi_policy(settings: GaudiSettings, max_length: int) -> ShapePolicy:
    """Seed 003's buckets, exactly those GaudiSettings derives (and `serve --check` explains):
    decode rows, prefill rows and prompt lengths."""
    return ShapePolicy(
        settings.decode_batch_size,
        max_length,
        "insert",
        settings.length_buckets,
        settings.prefill_rows,
        settings.decode_buckets,
    )
