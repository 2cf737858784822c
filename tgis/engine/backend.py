"""The Backend protocol: what the engine needs from a device. Backends implement it.

The engine decides *which* sequences run in a step; the backend owns *where* their KV cache
lives. A sequence is known to the backend by its integer `seq_id` from its prefill until
`release(seq_id)`. Logits come back as float32 CPU-or-device tensors, one row per item, in
the order the items were given.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from tgis.engine.types import ImageInput, LoraAdapter


def prompt_logprobs_refusal(backend: str, encoder_decoder: bool, available: bool) -> str | None:
    """Why a request cannot have prompt logprobs (`decoder_input_details`) here, or None."""
    if encoder_decoder:
        return (
            "input token details (`decoder_input_details`, TGIS's input_tokens with "
            "logprobs, ranks or top tokens) are not available for encoder-decoder "
            "models: the input is encoded, not predicted. Ask without them"
        )
    if not available:
        return (
            f"`decoder_input_details` (prompt logprobs) is not available on the "
            f"{backend} backend: its compiled model returns the last "
            "position's logits only. Ask without it (OpenAI: no `echo` with `logprobs`)"
        )
    return None


@dataclass(frozen=True)
class BackendCapacity:
    """What the loaded backend can hold at once, measured or configured at load time."""

    max_sequences: int  # sequences whose KV cache can be held at once (slots)
    max_sequence_tokens: int  # prompt + generated tokens per sequence
    kv_tokens: int  # total tokens of KV cache (max_batch_total_tokens)
    kv_bytes_per_token: int
    # Tokens one prefill step should hold (a soft cap, see SchedulerLimits): where prefill is
    # compute-bound, larger steps add no throughput and only delay first tokens. None: no cap.
    prefill_step_tokens: int | None = None
    # The KV tokens memory holds (measured from free memory, or given), which exceeds kv_tokens
    # when the slots are capped by max_sequences. None: fixed by the shape (kv_tokens).
    kv_budget_tokens: int | None = None
    # Whether prefill can return every prompt position's logits (decoder_input_details).
    prompt_logprobs: bool = True
    # The most prompt positions one step returns logits for (a paged backend on an
    # accelerator: float32 rows of the vocabulary are what the step's peak memory is sized
    # for). None: no cap.
    prompt_logit_tokens: int | None = None
    # Whether prompts may start with embeddings instead of tokens (tuned prompt prefixes).
    prompt_prefixes: bool = True
    # Whether requests may name a LoRA adapter (PackedItem.adapter): the paged engine.
    lora: bool = False
    # An encoder-decoder model: the prompt is the encoder's input, the output starts anew.
    encoder_decoder: bool = False
    # Whether prompts may hold images (GenerationRequest.images): a paged backend over a
    # vision-language model, whose `encode_images` gives their features.
    images: bool = False
    # Whether an image's rows attend to each other both ways (Gemma 3): a prefill chunk never
    # ends inside an image, so its rows are computed together (PackedItem.spans).
    whole_images: bool = False
    # A paged backend (`PagedBackend`): tokens per KV block; kv_tokens is then the pool's size
    # (num_blocks * block_size) and max_sequences the most sequences one step may hold.
    block_size: int | None = None
    # A paged backend whose every layer attends to at most the last `sliding_window` positions
    # (its own included): blocks wholly before that window can go back to the pool. None: some
    # layer attends to the whole sequence.
    sliding_window: int | None = None
    # A paged backend whose `forward` takes `fed`: a step's last tokens read on the device
    # from the sampled ids of the step before (async scheduling launches a step before the
    # one in flight's ids are on the host).
    fed_tokens: bool = False

    @property
    def num_blocks(self) -> int:
        """Blocks in a paged backend's pool (0 for a slot backend)."""
        return self.kv_tokens // self.block_size if self.block_size else 0


@dataclass(frozen=True)
class PrefillItem:
    """A new sequence: its whole prompt. `prompt_logprobs` asks for logits at every position."""

    seq_id: int
    input_ids: tuple[int, ...]
    prompt_logprobs: bool = False
    # Embeddings [k, hidden] of the first k positions, used instead of their tokens' (a
    # prompt prefix's virtual tokens); None: every position is its token's embedding. An
    # encoder-decoder backend takes them before the decoder's start token instead, and
    # `encoder_embeds` before the encoder's input.
    embeds: torch.Tensor | None = None
    encoder_embeds: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillOutput:
    """Logits after each prompt: `last` is [n_items, vocab]; `prompt[i]` is [len_i, vocab] or
    None (only for items that asked: row j predicts token j + 1)."""

    last: torch.Tensor
    prompt: tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class PackedItem:
    """One sequence's part of a packed step (paged backends): `token_ids` at positions
    `start`.. computed, their K/V written through `block_table` (the sequence's blocks in
    order; every position up to the last must have one). `sample`: return the last token's
    logits; `prompt_logits`: return logits at every position of the chunk."""

    seq_id: int
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    sample: bool = True
    prompt_logits: bool = False
    # (offset, [k, hidden]) pairs: the chunk's rows offset.. offset + k - 1 take these
    # embeddings instead of their tokens' (a prompt prefix's virtual tokens, an image's
    # features); none: every row is its token's embedding.
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()
    # The LoRA adapter the item's tokens go through (backends with `lora`); None: the base.
    adapter: LoraAdapter | None = None
    # (first position, t, h, w) of each of the sequence's images whose rows fill a grid
    # (ImageInput.grid): a model with multimodal rope rotates every row of the sequence by
    # them (tgis.backends.models.mrope); none: rows rotate at their own positions.
    grids: tuple[tuple[int, int, int, int], ...] = ()
    # (start, length) positions of each of the sequence's images: a model whose image rows
    # attend to each other both ways (BackendCapacity.whole_images) lets them; others ignore
    # them.
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class FedTokens:
    """The tokens of a step that the step before it samples (async scheduling): launched before
    those ids are on the host, the step reads them on the device. `items[k]`'s last token
    (PLACEHOLDER_ID in its `token_ids`) is row `rows[k]` of `source()`, the earlier step's
    sampled ids ([B] int64 on the backend's device). `source` is called where the forward
    runs, which comes after the earlier step's sampling in the device's order."""

    items: tuple[int, ...]
    rows: tuple[int, ...]
    source: Callable[[], torch.Tensor]

    def flat(self, lengths: Sequence[int]) -> list[int]:
        """Where the fed tokens are among the step's packed ids, given each item's token
        count."""
        ends, end = [], 0
        for n in lengths:
            end += n
            ends.append(end - 1)
        return [ends[i] for i in self.items]

    def write(self, ids: torch.Tensor, where: torch.Tensor) -> None:
        """Write the fed tokens into a step's packed `ids` on the device; `where` holds their
        places (`flat`) then their rows of `source()`, as the step's inputs took them up."""
        count = len(self.items)
        ids.index_copy_(0, where[:count], self.source().index_select(0, where[count:]))


@dataclass(frozen=True)
class PackedOutput:
    """`last` [items that sample, vocab] in item order; `prompt[i]` [len(token_ids), vocab] for
    items that asked (row j predicts the token after position start + j), else None."""

    last: torch.Tensor
    prompt: tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class Shape:
    """One step shape warmup runs: `rows` sequences of `length` positions (decode: length 1).
    On a compiling device each distinct shape is one graph."""

    phase: Literal["prefill", "decode"]
    rows: int
    length: int

    def label(self) -> str:
        """`prefill 4x128` / `decode 8`."""
        if self.phase == "decode":
            return f"decode {self.rows}"
        return f"prefill {self.rows}x{self.length}"


@dataclass(frozen=True)
class ShapeTiming:
    """One warmup shape: wall seconds and the graphs it compiled."""

    shape: Shape
    seconds: float
    compiled: int


class Backend(Protocol):
    """A model on a device, with its KV cache."""

    name: str
    device: str
    vocab_size: int

    @property
    def capacity(self) -> BackendCapacity: ...

    def prefill(self, items: Sequence[PrefillItem]) -> PrefillOutput:
        """Run the prompts of new sequences, keep their KV cache, return their logits."""
        ...

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Append one token to each sequence, return next-token logits [n, vocab]."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget a sequence and free its KV cache (finished, cancelled or failed)."""
        ...

    def warmup_plan(self, max_batch_size: int, max_input_tokens: int) -> list[Shape]:
        """The step shapes `warmup` runs, in order: every bucket serving can meet on a
        compiling device, representative ones on an eager device."""
        ...

    def warmup(
        self,
        max_batch_size: int,
        max_input_tokens: int,
        on_shape: Callable[[ShapeTiming], None] | None = None,
    ) -> list[ShapeTiming]:
        """Run each shape of the plan once on dummy tokens (compiling or capturing it), leaving
        no sequence behind; `on_shape` hears of each as it finishes. Needs an idle backend."""
        ...


class PagedBackend(Protocol):
    """A model on a device over a paged KV pool. It keeps no per-sequence state: the engine's
    scheduler owns the block tables, and every step says where each token's K/V goes."""

    name: str
    device: str
    vocab_size: int

    @property
    def capacity(self) -> BackendCapacity: ...

    def forward(self, items: Sequence[PackedItem], fed: FedTokens | None = None) -> PackedOutput:
        """Run one packed step (prefill chunks and decodes together). `fed`: tokens read on
        the device (only where capacity says `fed_tokens`)."""
        ...

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's features [image.tokens, hidden] on the device, in the serving dtype:
        the model's vision tower and projector over the images together (backends whose
        capacity says `images`)."""
        ...

    def warmup_plan(self, max_batch_size: int, max_input_tokens: int) -> list[Shape]: ...

    def warmup(
        self,
        max_batch_size: int,
        max_input_tokens: int,
        on_shape: Callable[[ShapeTiming], None] | None = None,
    ) -> list[ShapeTiming]: ...


def check_prefill_items(
    items: Sequence[PrefillItem],
    *,
    free: int,
    slots: str,
    running: Container[int],
    max_prompt: int,
    max_prompt_label: str,
    vocab_size: int,
) -> None:
    """The checks every backend makes before a prefill touches its cache: no more items than
    `free` slots (`slots` names them, e.g. "4 KV slots"), seq_ids new and distinct, prompts of
    1..max_prompt tokens (`max_prompt_label` says where the limit comes from), ids in the
    vocabulary. Raises ValueError naming the offending sequence."""
    if len(items) > free:
        raise ValueError(f"prefill of {len(items)} sequences but only {free} of {slots} are free")
    ids = [item.seq_id for item in items]
    if len(set(ids)) != len(ids) or any(i in running for i in ids):
        raise ValueError(f"prefill seq_ids {ids} repeat or are already running")
    for item in items:
        if not 0 < len(item.input_ids) <= max_prompt:
            raise ValueError(
                f"sequence {item.seq_id}: prompt of {len(item.input_ids)} tokens, "
                f"must be 1..{max_prompt} ({max_prompt_label})"
            )
        if min(item.input_ids) < 0 or max(item.input_ids) >= vocab_size:
            raise ValueError(f"sequence {item.seq_id}: token ids outside [0, {vocab_size})")
