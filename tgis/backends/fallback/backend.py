"""The cpu / cuda backend: dynamic shapes, continuous batching over a slot-compacted KV cache.

Sequences join (prefill) and leave (release) between decode steps. The running sequences
always occupy slots 0..n-1 of the `SlotKVCache`; a release moves the last slot into the hole,
so a decode step reads the cache through views with no gather and no per-step cache copy.

The forward is transformers' own (`HFForward`) over that cache: this is the engine for the
architectures the paged engine does not run (backends/choose.py decides which engine runs a
model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from tgis.backends.common.device import KV_MEMORY_FRACTION, available_memory, load_causal_lm
from tgis.backends.common.kv import kv_bytes_per_token
from tgis.backends.common.warmup import CompileWatch, powers_of_two, run_plan
from tgis.backends.fallback.forward import DecodeBatch, PrefillSegment
from tgis.backends.fallback.hf_forward import HFForward, probe_kv_shape
from tgis.backends.fallback.slot_cache import SlotKVCache
from tgis.config import use_inductor_cache
from tgis.engine.backend import (
    BackendCapacity,
    PrefillItem,
    PrefillOutput,
    Shape,
    ShapeTiming,
    check_prefill_items,
)
from tgis.engine.transfer import to_device
from tgis.errors import ConfigError

logger = logging.getLogger(__name__)

# Most prompt tokens one forward call processes; longer prompts are prefilled in chunks so the
# activations (and prompt logits) of one call stay bounded.
DEFAULT_PREFILL_CHUNK_TOKENS = 2048


CPU_PREFILL_STEP_TOKENS = 512
# Prompt length of the short sequences warmup fills the batch with.
WARMUP_SHORT_PROMPT = 8


class TorchDynamicBackend:
    """A transformers causal LM on a torch CPU or CUDA device (implements `Backend`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_sequences: int,
        max_sequence_tokens: int,
        kv_tokens: int | None = None,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        kv_memory_fraction: float | None = None,
        compile: bool = False,
    ) -> None:
        """Wrap an already loaded `model` (eval mode, on its device, in its dtype).

        compile: run decode steps through torch.compile (dynamic shapes: the batch size and
        the KV length vary per step without recompiling); warmup pays the compilation.

        kv_tokens: the KV budget in tokens; None
        sizes it from free memory (`kv_memory_fraction` of it). max_sequences is clamped to
        what the budget holds at max_sequence_tokens each.
        """
        if max_sequences < 1 or max_sequence_tokens < 1 or prefill_chunk_tokens < 1:
            raise ValueError(
                "max_sequences, max_sequence_tokens and prefill_chunk_tokens must be >= 1"
            )
        self.model = model.eval()
        self.device_obj = next(model.parameters()).device
        self.device = str(self.device_obj)
        self.name = self.device_obj.type
        self.dtype = next(model.parameters()).dtype
        head = model.get_output_embeddings()
        self.vocab_size = int(head.weight.shape[0]) if head is not None else model.config.vocab_size
        self.prefill_chunk_tokens = prefill_chunk_tokens

        with torch.inference_mode():
            shape = probe_kv_shape(model)
        per_token = kv_bytes_per_token(
            shape.num_layers, shape.num_heads, shape.head_dim, self.dtype, shape.value_head_dim
        )
        max_sequences = self._fit_sequences(
            max_sequences, max_sequence_tokens, kv_tokens, per_token, kv_memory_fraction
        )
        with torch.inference_mode():
            cache = SlotKVCache(
                shape.num_layers,
                max_sequences,
                shape.num_heads,
                max_sequence_tokens,
                shape.head_dim,
                self.dtype,
                self.device_obj,
                shape.value_head_dim,
            )
        self.path = HFForward(model, cache)
        self.cache = cache
        self.compiled = compile
        self._watch = CompileWatch(self.compilations)
        if compile:
            self.path.decode = torch.compile(self.path.decode, dynamic=True)  # type: ignore[method-assign]
        self._capacity = BackendCapacity(
            max_sequences=max_sequences,
            max_sequence_tokens=max_sequence_tokens,
            kv_tokens=max_sequences * max_sequence_tokens,
            kv_budget_tokens=self._kv_budget,
            kv_bytes_per_token=per_token,
            # A CPU prefill is compute-bound from a few hundred tokens on: bigger steps only
            # delay the first tokens of everyone in them.
            prefill_step_tokens=CPU_PREFILL_STEP_TOKENS if self.device_obj.type == "cpu" else None,
        )
        # Sequence bookkeeping: seq_id -> slot; per slot (0..n-1) its seq_id and cached tokens.
        self._slot_of: dict[int, int] = {}
        self._seq_at: list[int] = []
        self._length: list[int] = []
        logger.info(
            "torch backend on %s (%s, %s path): %d sequences x %d tokens, %d bytes/token",
            self.device,
            self.dtype,
            self.path.name,
            max_sequences,
            max_sequence_tokens,
            per_token,
        )

    @classmethod
    def load(
        cls,
        model_dir: Path,
        device: str = "cpu",
        dtype: str | None = None,
        *,
        max_sequences: int,
        max_sequence_tokens: int,
        kv_tokens: int | None = None,
        kv_memory_fraction: float | None = None,
        num_threads: int | None = None,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        compile: bool = False,
        compile_cache: Path | None = None,
    ) -> TorchDynamicBackend:
        """Load the causal LM in `model_dir` onto `device` ("cpu", "cuda", "cuda:1").

        dtype: "float32" | "float16" | "bfloat16" | None, resolved by `resolve_dtype` (float32
        on CPUs without native bf16). On CPU, torch's intra-op threads are set process-wide to
        `num_threads`, by default the cores this process may use (affinity and cgroup quota):
        one thread per core is fastest for the matmul-bound forward, and more threads than
        cores only add contention. With `compile`, `compile_cache` keeps inductor's caches
        (a second start compiles faster).
        """
        dev = torch.device(device)
        if compile and compile_cache is not None:
            use_inductor_cache(compile_cache)
        model = load_causal_lm(model_dir, dev, dtype, num_threads)
        return cls(
            model,
            max_sequences=max_sequences,
            max_sequence_tokens=max_sequence_tokens,
            kv_tokens=kv_tokens,
            kv_memory_fraction=kv_memory_fraction,
            prefill_chunk_tokens=prefill_chunk_tokens,
            compile=compile,
        )

    def _fit_sequences(
        self,
        max_sequences: int,
        max_sequence_tokens: int,
        kv_tokens: int | None,
        per_token: int,
        fraction: float | None,
    ) -> int:
        """max_sequences clamped to the KV budget (given, or measured from free memory)."""
        if kv_tokens is None:
            fraction = KV_MEMORY_FRACTION.get(self.name, 0.5) if fraction is None else fraction
            free = available_memory(self.device_obj)
            kv_tokens = int(free * fraction) // per_token
            source = f"{fraction:.0%} of {free / 2**30:.1f} GiB free"
        else:
            source = f"kv_tokens={kv_tokens}"
        fits = kv_tokens // max_sequence_tokens
        if fits < 1:
            raise ConfigError(
                f"the KV cache budget ({source}: {kv_tokens} tokens at {per_token} bytes each) "
                f"cannot hold one sequence of {max_sequence_tokens} tokens",
                "lower --max-total-tokens or free memory",
            )
        if fits < max_sequences:
            logger.warning(
                "KV budget (%s) holds %d sequences of %d tokens, not %d: clamping",
                source,
                fits,
                max_sequence_tokens,
                max_sequences,
            )
        self._kv_budget = kv_tokens
        return min(max_sequences, fits)

    @property
    def capacity(self) -> BackendCapacity:
        """Slots, tokens per slot and KV bytes, fixed at load time."""
        return self._capacity

    @property
    def running(self) -> int:
        """Sequences holding a slot."""
        return len(self._seq_at)

    def sequence_length(self, seq_id: int) -> int:
        """Tokens cached for `seq_id` (prompt + tokens decoded so far)."""
        return self._length[self._slot_of[seq_id]]

    def slot_of(self, seq_id: int) -> int:
        """The slot `seq_id` occupies (moves when a sequence after it is released)."""
        return self._slot_of[seq_id]

    @torch.inference_mode()
    def prefill(self, items: Sequence[PrefillItem]) -> PrefillOutput:
        """Run the prompts of new sequences into free slots; return their logits.

        Raises ValueError (before touching the cache) for more items than free slots, a seq_id
        already running or repeated, or a prompt that is empty or longer than
        max_sequence_tokens.
        """
        if not items:
            return PrefillOutput(torch.empty((0, self.vocab_size), device=self.device_obj), ())
        self._check_prefill(items)
        first = len(self._seq_at)
        slots = list(range(first, first + len(items)))
        last: list[torch.Tensor | None] = [None] * len(items)
        prompt: list[list[torch.Tensor]] = [[] for _ in items]
        done = [0] * len(items)  # prompt tokens already run, per item
        while any(d < len(item.input_ids) for d, item in zip(done, items, strict=True)):
            budget, members, segments = self.prefill_chunk_tokens, [], []
            for i, item in enumerate(items):
                if budget == 0:
                    break
                take = min(len(item.input_ids) - done[i], budget)
                if take == 0:
                    continue
                tokens = item.input_ids[done[i] : done[i] + take]
                embeds = None
                if item.embeds is not None and done[i] < item.embeds.shape[0]:
                    embeds = item.embeds[done[i] : done[i] + take]
                segments.append(
                    PrefillSegment(slots[i], done[i], tokens, item.prompt_logprobs, embeds)
                )
                members.append(i)
                budget -= take
                done[i] += take
            for i, logits in zip(members, self.path.prefill(segments), strict=True):
                last[i] = logits[-1]
                if items[i].prompt_logprobs:
                    prompt[i].append(logits)
        # Only now do the sequences exist: a failed forward leaves no half-registered state.
        for item, slot in zip(items, slots, strict=True):
            self._slot_of[item.seq_id] = slot
            self._seq_at.append(item.seq_id)
            self._length.append(len(item.input_ids))
        return PrefillOutput(
            torch.stack([t for t in last if t is not None]),
            tuple(
                torch.cat(p) if item.prompt_logprobs else None
                for p, item in zip(prompt, items, strict=True)
            ),
        )

    def _check_prefill(self, items: Sequence[PrefillItem]) -> None:
        check_prefill_items(
            items,
            free=self._capacity.max_sequences - len(self._seq_at),
            slots=f"{self._capacity.max_sequences} KV slots",
            running=self._slot_of,
            max_prompt=self._capacity.max_sequence_tokens,
            max_prompt_label="max_sequence_tokens",
            vocab_size=self.vocab_size,
        )

    @torch.inference_mode()
    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Append `token_ids[i]` to `seq_ids[i]`; return next-token logits [n, vocab] (float32,
        rows in the order given). The fast case is every running sequence (any order); a subset
        that is not the slot prefix 0..m-1 is served through a gather copy of its cache rows."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"{len(seq_ids)} seq_ids but {len(token_ids)} token_ids")
        if not seq_ids:
            return torch.empty((0, self.vocab_size), device=self.device_obj)
        try:
            slots = [self._slot_of[s] for s in seq_ids]
        except KeyError as missing:
            raise ValueError(f"decode of unknown sequence {missing.args[0]}") from None
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode seq_ids repeat: {list(seq_ids)}")
        limit = self._capacity.max_sequence_tokens
        for seq_id, slot in zip(seq_ids, slots, strict=True):
            if self._length[slot] >= limit:
                raise ValueError(f"sequence {seq_id} is full ({limit} tokens): release it")
        if any(t < 0 or t >= self.vocab_size for t in token_ids):
            raise ValueError(f"token ids outside [0, {self.vocab_size})")
        n = len(slots)
        prefix = max(slots) == n - 1  # exactly the slots 0..n-1, in some order
        if prefix:
            # Feed rows in slot order so the cache is read through views; undo the order after.
            order = slots
            rows_ids = [0] * n
            for slot, token in zip(slots, token_ids, strict=True):
                rows_ids[slot] = token
            row_slots = list(range(n))
        else:
            order, rows_ids, row_slots = list(range(n)), list(token_ids), slots
        positions = [self._length[s] for s in row_slots]
        device = self.device_obj
        batch = DecodeBatch(
            input_ids=to_device(rows_ids, torch.long, device),
            positions=to_device(positions, torch.long, device),
            kv_len=max(positions) + 1,
            # Compiled: always the masked variant, so equal and unequal lengths share a graph.
            ragged=self.compiled or min(positions) != max(positions),
            slots=None if prefix else torch.tensor(row_slots, dtype=torch.long).to(device),
        )
        logits = self.path.decode(batch)
        # A decode variant warmup did not compile (e.g. a subset of the running sequences).
        self._watch.check(f"a decode step of {n} sequences")
        for slot in slots:
            self._length[slot] += 1
        if order != list(range(n)):
            logits = logits[torch.tensor(order, device=device)]
        return logits

    def release(self, seq_id: int) -> None:
        """Free `seq_id`'s slot: the last slot's sequence moves into it (one sequence's KV is
        copied). Releasing an unknown or already released seq_id does nothing."""
        slot = self._slot_of.pop(seq_id, None)
        if slot is None:
            return
        last = len(self._seq_at) - 1
        if slot != last:
            moved = self._seq_at[last]
            with torch.inference_mode():
                self.cache.move(last, slot, self._length[last])
            self._seq_at[slot], self._length[slot] = moved, self._length[last]
            self._slot_of[moved] = slot
        self._seq_at.pop()
        self._length.pop()

    def warmup_plan(self, max_batch_size: int, max_input_tokens: int) -> list[Shape]:
        """Representative shapes for eager kernels: the longest prompt alone, short prompts
        filling the batch, and a decode step per power-of-two batch size up to the largest
        batch (with torch.compile: the batch sizes it specializes on). Sizes stop at the slots
        free now."""
        rows = max(1, min(max_batch_size, self._capacity.max_sequences - len(self._seq_at)))
        longest = max(1, min(max_input_tokens, self._capacity.max_sequence_tokens - 1))
        short = min(WARMUP_SHORT_PROMPT, longest)
        plan = [Shape("prefill", 1, longest)]
        if rows > 1:
            plan.append(Shape("prefill", rows, short))
        return plan + [Shape("decode", n, 1) for n in powers_of_two(1, rows)]

    @property
    def late_compilations(self) -> int:
        """Graphs compiled by decode steps after warmup (each one a request paid for)."""
        return self._watch.late

    def compilations(self) -> int:
        """Graphs torch.compile built in this process (0 when nothing is compiled)."""
        if not self.compiled:
            return 0
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def run_shape(self, shape: Shape) -> ShapeTiming:
        """Run one step of `shape` on sequences of its own (released afterwards); a decode
        shape first prefills its rows untimed. Needs `shape.rows` free slots."""
        free = self._capacity.max_sequences - len(self._seq_at)
        if shape.rows > free:
            raise RuntimeError(
                f"warmup of {shape.label()} needs {shape.rows} free slots, {free} are"
            )
        base = min([0, *self._slot_of]) - 1
        ids = [base - i for i in range(shape.rows)]
        short = min(WARMUP_SHORT_PROMPT, self._capacity.max_sequence_tokens - 1)
        length = shape.length if shape.phase == "prefill" else max(1, short)
        items = [PrefillItem(i, tuple(j % self.vocab_size for j in range(length))) for i in ids]
        before = self.compilations()
        try:
            if shape.phase == "prefill":
                start = time.perf_counter()
                self.prefill(items)
            else:
                self.prefill(items)
                start = time.perf_counter()
                self.decode(ids, [1 % self.vocab_size] * shape.rows)
            seconds = time.perf_counter() - start
        finally:
            for seq_id in ids:
                self.release(seq_id)
        return ShapeTiming(shape, seconds, self.compilations() - before)

    def warmup(
        self,
        max_batch_size: int,
        max_input_tokens: int,
        on_shape: Callable[[ShapeTiming], None] | None = None,
    ) -> list[ShapeTiming]:
        """Run the plan once: pays the one-off costs (allocator growth, kernel selection,
        thread pools, torch.compile) before serving. Leaves no sequence behind."""
        plan = self.warmup_plan(max_batch_size, max_input_tokens)
        timings = run_plan(plan, self.run_shape, on_shape)
        if self.compiled:
            self._watch.arm()
        return timings
