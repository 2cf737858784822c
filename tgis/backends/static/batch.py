"""The static batch shared by the tpu, neuron and gaudi backends (seeds 000, 002, 003).

One internal batch of `batch_size` slots x `max_length` positions lives on the device. A new
request takes the lowest free slot at prefill; decode steps run a fixed number of rows (every
slot on tpu/neuron, a bucket on gaudi); a finished request frees its slot. From the client's
view this is ordinary continuous batching with token streaming: the engine and its sampling
(greedy, multinomial with the usual warpers) are the same as on every backend.

Two prefill modes (ShapePolicy.prefill_mode):
- "rebuild": each prefill recomputes the KV cache of every slot from its tokens (prompt plus
  tokens fed so far), as seeds 000 and 002 describe. Simple for a device model that can only
  prefill a whole batch; each prefill costs a forward over all running sequences.
- "insert": each prefill runs only the new prompts into their slots; the running sequences'
  KV stays. Needs a device model that writes given cache rows (ours and Neuron's continuous
  batching do). Both modes give the same greedy tokens (tests/backends/static/test_batch.py).

The device-specific parts are two small interfaces: a `StaticModel` (runs a padded prefill into
given rows, a decode over rows [0, n)) and `DeviceOps` (where inputs go, how a step ends).
Shapes come from the `ShapePolicy` (static/buckets.py); so does the warmup plan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from tgis.backends.common.warmup import CompileWatch, run_plan
from tgis.backends.static.buckets import ShapePolicy
from tgis.engine.backend import (
    BackendCapacity,
    PrefillItem,
    PrefillOutput,
    Shape,
    ShapeTiming,
    check_prefill_items,
)

logger = logging.getLogger(__name__)


def pad_token_id(model_config: Any, tokenizer: Any = None) -> int:
    """What padding positions carry: the tokenizer's pad id, else the config's, else EOS
    (tokenizer, then config; the first of a list), else 0."""
    candidates = (
        getattr(tokenizer, "pad_token_id", None),
        getattr(model_config, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        getattr(model_config, "eos_token_id", None),
    )
    for value in candidates:
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int) and value >= 0:
            return value
    return 0


class StaticModel(Protocol):
    """A model with a static KV cache of `batch_size` (+ scratch) rows on a device."""

    vocab_size: int
    kv_bytes_per_token: int

    def prefill_static(
        self,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        rows: torch.Tensor,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """input_ids [b, L] right-padded from position 0, lengths [b], rows [b] (the scratch
        row for padding) -> logits [b, vocab] at each last token ([b, L, vocab] with
        all_logits)."""
        ...

    def decode_static(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """One token per cache row [0, rows) at `positions` -> logits [rows, vocab]."""
        ...


class DeviceOps(Protocol):
    """How step inputs reach the device and how a step ends there."""

    name: str
    device: torch.device

    def sync(self) -> None:
        """End the step: execute what was traced (XLA's mark_step, HPU's mark_step)."""
        ...

    def compilations(self) -> int:
        """Graphs compiled so far in this process (0 where the device does not compile)."""
        ...


class EagerOps:
    """Plain torch on a CPU (or any eager device): nothing to sync, nothing compiled."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.name = self.device.type

    def sync(self) -> None:
        """Eager ops have already run."""

    def compilations(self) -> int:
        return 0


class StaticBatchBackend:
    """Implements `Backend` over a `StaticModel`; see the module doc."""

    def __init__(
        self,
        model: StaticModel,
        policy: ShapePolicy,
        ops: DeviceOps,
        name: str,
        pad_token_id: int = 0,
        dtype: torch.dtype | None = None,
        prompt_logprobs: bool = True,
    ) -> None:
        self.model, self.policy, self.ops = model, policy, ops
        self.name = name
        self.dtype = dtype  # the weights' dtype, for /info (None: the device model's own)
        self.device = str(ops.device)
        self.vocab_size = model.vocab_size
        self.pad_token_id = pad_token_id
        size = policy.batch_size
        self._capacity = BackendCapacity(
            max_sequences=size,
            max_sequence_tokens=policy.max_length,
            kv_tokens=size * policy.max_length,
            kv_bytes_per_token=model.kv_bytes_per_token,
            prompt_logprobs=prompt_logprobs,
            # A static graph takes token ids only: no embeddings in place of tokens.
            prompt_prefixes=False,
        )
        self._row_of: dict[int, int] = {}
        # Per slot: the tokens its KV cache holds (prompt + tokens fed by decode), or None.
        self._tokens: list[list[int] | None] = [None] * size
        self._watch = CompileWatch(ops.compilations)
        # Materialize what loading left pending (cache zeros, rope tables): otherwise the first
        # step's graph would include it and differ from the same bucket's later steps.
        ops.sync()

    def runtime(self) -> dict[str, Any]:
        """What the start-up log and /info say of this backend beside its capacity: a static
        batch of fixed shapes (the buckets compiled at warmup)."""
        return {"engine": "static"}

    @property
    def capacity(self) -> BackendCapacity:
        """batch_size slots of max_length tokens: fixed by the static shape."""
        return self._capacity

    @property
    def running(self) -> int:
        """Sequences holding a slot."""
        return len(self._row_of)

    def slot_of(self, seq_id: int) -> int:
        """The slot (cache row) `seq_id` occupies."""
        return self._row_of[seq_id]

    def _free_rows(self) -> list[int]:
        return [row for row, tokens in enumerate(self._tokens) if tokens is None]

    def _tensor(self, values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.ops.device)

    def _check_prefill(self, items: Sequence[PrefillItem]) -> None:
        longest, size = self.policy.prefill_lengths[-1], self.policy.batch_size
        check_prefill_items(
            items,
            free=len(self._free_rows()),
            slots=f"{size} static slots",
            running=self._row_of,
            max_prompt=longest,
            max_prompt_label=f"the longest prefill bucket of {size} x {self.policy.max_length}",
            vocab_size=self.vocab_size,
        )
        if not self._capacity.prompt_logprobs and any(item.prompt_logprobs for item in items):
            raise ValueError(
                f"prompt logprobs (decoder_input_details) are not available on the {self.name} "
                "backend"
            )

    def _run_prefill(
        self,
        sequences: Sequence[Sequence[int]],
        rows: Sequence[int],
        all_logits: bool,
        batch: int | None = None,
    ) -> torch.Tensor:
        """Pad `sequences` (for `rows`) to the step's bucket (`batch` rows if given), run it,
        return host logits."""
        length = self.policy.length_bucket(max(len(s) for s in sequences))
        batch = batch or self.policy.prefill_batch(len(sequences))
        scratch = self.policy.batch_size
        padded = [list(s) + [self.pad_token_id] * (length - len(s)) for s in sequences]
        padded += [[self.pad_token_id] * length] * (batch - len(sequences))
        lengths = [len(s) for s in sequences] + [1] * (batch - len(sequences))
        all_rows = list(rows) + [scratch] * (batch - len(sequences))
        logits = self.model.prefill_static(
            self._tensor(padded), self._tensor(lengths), self._tensor(all_rows), all_logits
        )
        self._end_step(f"prefill {batch}x{length}" + (" (all logits)" if all_logits else ""))
        # To the host first: slicing on the device would be one more (tiny) graph to compile.
        return logits.cpu()[: len(sequences)]

    @torch.no_grad()
    def prefill(self, items: Sequence[PrefillItem]) -> PrefillOutput:
        """Put new sequences into the lowest free slots and return their logits.

        ValueError (state untouched) for more items than free slots, a running or repeated
        seq_id, or a prompt outside 1..the longest prefill bucket.
        """
        if not items:
            return PrefillOutput(torch.empty((0, self.vocab_size)), ())
        self._check_prefill(items)
        rows = self._free_rows()[: len(items)]
        if self.policy.prefill_mode == "insert":
            logits = self._run_prefill([item.input_ids for item in items], rows, False)
        else:
            # Rebuild: every slot from its tokens; free slots get one pad token.
            tokens: list[Sequence[int]] = [t or [self.pad_token_id] for t in self._tokens]
            for item, row in zip(items, rows, strict=True):
                tokens[row] = item.input_ids
            full = self._run_prefill(tokens, range(self.policy.batch_size), False)
            logits = full[torch.tensor(rows)]
        prompt: list[torch.Tensor | None] = [None] * len(items)
        wanting = [i for i, item in enumerate(items) if item.prompt_logprobs]
        if wanting:
            # Every position's logits only for the prompts that ask (run again into the scratch
            # row): never [all slots x positions x vocab] of a whole rebuild.
            scratch = [self.policy.batch_size] * len(wanting)
            every = self._run_prefill(
                [items[i].input_ids for i in wanting],
                scratch,
                True,
                1 << (len(wanting) - 1).bit_length(),
            )
            for j, i in enumerate(wanting):
                prompt[i] = every[j, : len(items[i].input_ids)]
        # Only now do the sequences exist: a failed forward leaves no half-registered state.
        for item, row in zip(items, rows, strict=True):
            self._row_of[item.seq_id] = row
            self._tokens[row] = list(item.input_ids)
        return PrefillOutput(logits, tuple(prompt))

    @torch.no_grad()
    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Feed `token_ids[i]` to `seq_ids[i]`; logits [n, vocab] in the order given.

        The step runs `policy.decode_rows(highest used slot + 1)` rows; rows not in the call
        compute at their own next position (overwritten when they are next fed) or, when
        free, at position 0 of their free slot."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"{len(seq_ids)} seq_ids but {len(token_ids)} token_ids")
        if not seq_ids:
            return torch.empty((0, self.vocab_size))
        try:
            rows = [self._row_of[s] for s in seq_ids]
        except KeyError as missing:
            raise ValueError(f"decode of unknown sequence {missing.args[0]}") from None
        if len(set(rows)) != len(rows):
            raise ValueError(f"decode seq_ids repeat: {list(seq_ids)}")
        limit = self.policy.max_length
        for seq_id, row in zip(seq_ids, rows, strict=True):
            if len(self._tokens[row] or ()) >= limit:
                raise ValueError(f"sequence {seq_id} is full ({limit} tokens): release it")
        if any(t < 0 or t >= self.vocab_size for t in token_ids):
            raise ValueError(f"token ids outside [0, {self.vocab_size})")
        used = max(row for row, t in enumerate(self._tokens) if t is not None) + 1
        size = self.policy.decode_rows(used)
        ids = [self.pad_token_id] * size
        # Rows not fed compute at their next position (a full row: its last one), overwritten
        # before anything reads it; free rows at position 0.
        last = self.policy.max_length - 1
        positions = [min(len(t), last) if t is not None else 0 for t in self._tokens[:size]]
        for row, token in zip(rows, token_ids, strict=True):
            ids[row] = token
        logits = self.model.decode_static(self._tensor(ids), self._tensor(positions), size)
        self._end_step(f"decode {size}")
        for row, token in zip(rows, token_ids, strict=True):
            self._tokens[row].append(token)  # type: ignore[union-attr]
        return logits.cpu()[torch.tensor(rows)]

    def _end_step(self, label: str) -> None:
        """Sync the device; after warmup, a step that compiled is counted and logged."""
        self.ops.sync()
        self._watch.check(label)

    @property
    def late_compilations(self) -> int:
        """Graphs serving steps compiled after warmup (each one a request paid for)."""
        return self._watch.late

    def release(self, seq_id: int) -> None:
        """Free `seq_id`'s slot (unknown or already released ids do nothing)."""
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._tokens[row] = None

    def warmup_plan(self, max_batch_size: int, max_input_tokens: int) -> list[Shape]:
        """Every bucket of the policy (ShapePolicy.warmup_plan): the static shape fixes the
        batch, so `max_batch_size` changes nothing."""
        del max_batch_size
        return self.policy.warmup_plan(max_input_tokens)

    @torch.no_grad()
    def run_shape(self, shape: Shape) -> ShapeTiming:
        """Run one step of `shape` on dummy tokens without touching any live slot (prefill
        writes the scratch row, decode runs free rows); returns its time and compilations."""
        if self._row_of:
            raise RuntimeError("warmup needs an idle backend: sequences are running")
        before, start = self.ops.compilations(), time.perf_counter()
        if shape.phase == "prefill":
            ids = self._tensor([[1 % self.vocab_size] * shape.length] * shape.rows)
            lengths = self._tensor([shape.length] * shape.rows)
            rows = self._tensor([self.policy.batch_size] * shape.rows)
            logits = self.model.prefill_static(ids, lengths, rows, False)
        else:
            # Two tensors, as in serving: one tensor passed twice would trace another graph.
            ids, positions = self._tensor([0] * shape.rows), self._tensor([0] * shape.rows)
            logits = self.model.decode_static(ids, positions, shape.rows)
        self.ops.sync()
        logits.cpu()
        return ShapeTiming(shape, time.perf_counter() - start, self.ops.compilations() - before)

    def warmup(
        self,
        max_batch_size: int,
        max_input_tokens: int,
        on_shape: Callable[[ShapeTiming], None] | None = None,
    ) -> list[ShapeTiming]:
        """Run every shape of the plan once (compiling each graph), in plan order."""
        plan = self.warmup_plan(max_batch_size, max_input_tokens)
        timings = run_plan(plan, self.run_shape, on_shape)
        self._watch.arm()
        return timings
