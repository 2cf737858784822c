"""The engine's vocabulary: what goes in (a request) and what comes out (token events).

Shared by the engine, the server and the benchmark. Pure data: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from tgis.params import GenerateParameters

if TYPE_CHECKING:
    import torch


class FinishReason(str, Enum):
    """Why a sequence stopped. Values are TGI's (plus the time limit of TGIS)."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    TIME_LIMIT = "time_limit"
    # The client went away or the server is shutting down; never sent to a client.
    CANCELLED = "cancelled"

    def openai(self) -> str:
        """OpenAI's finish_reason for this reason."""
        return "length" if self in (FinishReason.LENGTH, FinishReason.TIME_LIMIT) else "stop"


@dataclass(frozen=True)
class GenerationRequest:
    """One validated, tokenized request as the engine receives it.

    `input_ids` are already truncated (params.truncate) and within the server's limits.
    `best_of` > 1 is expanded by the engine into several sequences with derived seeds.
    """

    request_id: str
    input_ids: tuple[int, ...]
    params: GenerateParameters
    # time.monotonic() when the HTTP request arrived (for queue/validation timings).
    arrival: float = 0.0
    # A tuned prompt prefix whose embeddings go before the input's (TGIS's prompt tuning).
    prefix: PromptPrefix | None = None
    # A LoRA adapter applied to the model for this request; None: the base model.
    adapter: LoraAdapter | None = None
    # The images whose features take the rows of their placeholder tokens in `input_ids`.
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, processed for its model and not yet encoded: `pixels` are what
    the model's image processor made of it alone (host tensors, by the processor's names),
    `runs` the (start, length) runs of `input_ids` positions its features fill, in order
    (the features' rows 0.. go to the first run's positions, then the next run's). `digest`
    identifies its pixels: blocks of prompts with the same image at the same place share the
    prefix cache. `grid`: the (t, h, w) grid its rows fill, row-major, for a model whose
    rotary positions follow it (Qwen2-VL's multimodal rope); None: its rows rotate at their own
    positions, as text does."""

    digest: bytes
    runs: tuple[tuple[int, int], ...]
    pixels: Mapping[str, torch.Tensor]
    grid: tuple[int, int, int] | None = None

    @property
    def tokens(self) -> int:
        """Prompt positions its features fill."""
        return sum(length for _, length in self.runs)


@dataclass(frozen=True, eq=False)
class PromptPrefix:
    """Virtual-token embeddings [length, hidden], in the serving dtype on the model's device,
    prepended to a request's input embeddings — for an encoder-decoder model, `embeddings`
    go before the decoder's start token (possibly none) and `encoder` before the encoder's
    input. `key` keeps the prefix-cache blocks of prompts that follow it apart from any other
    prefix's."""

    prefix_id: str
    embeddings: torch.Tensor
    key: bytes
    encoder: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Virtual tokens before the (decoder's) tokens."""
        return int(self.embeddings.shape[0])

    @property
    def tokens(self) -> int:
        """Every virtual token, encoder's and decoder's: what counts toward the limits."""
        return self.length + (int(self.encoder.shape[0]) if self.encoder is not None else 0)


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A PEFT LoRA adapter on the serving device, in the serving dtype: per layer, for each
    adapted projection (as the model's family names it: `LoraShapes.modules`), `a` [in,
    rank] and `b` [rank, out] with the adapter's scale folded into `b`, so that the projection of x becomes x W^T + (x a) b. `key` keeps the
    prefix-cache blocks of its requests apart from the base model's and other adapters'."""

    name: str
    layers: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]
    key: bytes
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for ab in layer.values()
            for t in ab
        )


@dataclass(frozen=True)
class TokenInfo:
    """One token as TGI reports it: id, decoded text, log-probability, special flag."""

    id: int
    text: str
    logprob: float | None
    special: bool = False
    # 1-based rank of the token in the (processed) distribution; TGIS reports it.
    rank: int | None = None


@dataclass(frozen=True)
class Timings:
    """Seconds spent in each phase of one request."""

    validation: float = 0.0
    queue: float = 0.0
    inference: float = 0.0
    first_token: float = 0.0  # from arrival to the first token


@dataclass(frozen=True)
class Completion:
    """The final state of one sequence, sent with its last token event."""

    finish_reason: FinishReason
    generated_text: str
    generated_tokens: int
    input_length: int
    seed: int | None
    # Prompt tokens with their logprobs and ranks when decoder_input_details was asked (first:
    # None), and the top_n_tokens alternatives at each prompt position (first: none).
    prefill: tuple[TokenInfo, ...] = ()
    prefill_top: tuple[tuple[TokenInfo, ...], ...] = ()
    # Every generated token (for `details`), and its top-n alternatives per step.
    tokens: tuple[TokenInfo, ...] = ()
    top_tokens: tuple[tuple[TokenInfo, ...], ...] = ()
    timings: Timings = field(default_factory=Timings)
    # The stop sequence that matched, if any.
    stop_sequence: str | None = None


@dataclass(frozen=True)
class TokenEvent:
    """One step of one sequence, as streamed to the client.

    `text` is the new text this token makes visible: possibly "" while an incomplete UTF-8
    character or a possible stop-sequence prefix is held back, possibly several tokens' worth
    when held text is released. `completion` is set on the last event only.
    """

    token: TokenInfo
    text: str
    top_tokens: tuple[TokenInfo, ...] = ()
    completion: Completion | None = None
    # Which of the request's best_of sequences this is (0 for ordinary requests).
    index: int = 0
    # On a sequence's first event, when decoder_input_details was asked: its prompt details
    # (as in Completion), so a stream can send them before the generated tokens.
    prefill: tuple[TokenInfo, ...] = ()
    prefill_top: tuple[tuple[TokenInfo, ...], ...] = ()


class EngineObserver(Protocol):
    """Receives the engine's step-level figures (the server turns them into tgi_* metrics).

    Called from the engine thread; implementations must be cheap and thread-safe.
    """

    def on_step(
        self, method: str, batch_size: int, tokens: int, duration: float, forward: float
    ) -> None:
        """A forward pass finished. method: "prefill" or "next_token"; tokens: input tokens
        of the step including padding; duration: the whole step; forward: the model call."""

    def on_step_failure(self, method: str, reason: str) -> None:
        """A forward pass failed (reason: "oom" or "error")."""

    def on_concatenation(self) -> None:
        """New sequences joined the running batch."""

    def on_batch_state(
        self, waiting: int, running: int, input_tokens: int, max_remaining: int
    ) -> None:
        """The queue and batch after a step: waiting requests, running sequences, tokens held
        by the running batch, most tokens any running sequence may still generate."""

    def on_kv_state(
        self,
        used_blocks: int,
        num_blocks: int,
        queried_tokens: int,
        hit_tokens: int,
        evicted_blocks: int,
        preemptions: int,
    ) -> None:
        """A paged KV pool after a step: blocks in use of all; since start, prompt tokens
        looked up in the prefix cache and found there, cached blocks evicted, sequences
        preempted (running totals)."""

    def on_speculation(self, draft_tokens: int, accepted_tokens: int, emitted_tokens: int) -> None:
        """A step verified `draft_tokens` speculative tokens (speculative decoding), of which
        `accepted_tokens` were right; its verifying rows emitted `emitted_tokens` in all."""

    def on_images(self, encoded: int, cached: int) -> None:
        """A step encoded `encoded` images (the vision tower's runs), and found `cached` of
        the images of the prompts it began wholly in the prefix cache (never encoded)."""


class EngineClient(Protocol):
    """What the HTTP layer needs of the engine."""

    def generate(
        self, request: GenerationRequest, reserved: bool = False
    ) -> AsyncIterator[TokenEvent]:
        """Stream the request's token events; the last one carries its Completion.

        Raises OverloadedError (HTTP 429) at once when max_concurrent_requests are in flight,
        GenerationError (HTTP 424) if the backend fails. Closing the iterator early (client
        gone) cancels the request and frees its KV cache at the next step. `reserved`: its
        place among max_concurrent_requests was taken by `reserve`.
        """
        ...

    def reserve(self, count: int) -> None:
        """Take `count` places among max_concurrent_requests at once, or raise
        OverloadedError: a batched request is admitted whole or refused whole."""
        ...

    def release(self, count: int) -> None:
        """Give back reserved places that no `generate` used."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests admitted and not finished."""
        ...

    def healthy(self) -> bool:
        """False once the engine thread has died or is shutting down."""
        ...
