"""The request path shared by the TGI and OpenAI routes: tokenize, truncate, validate, generate.

Tokenizing runs in a worker thread and the engine in its own thread, so nothing here blocks the
event loop. An EventStream owns one engine iterator and closes it exactly once, shielded from
cancellation, so a client that goes away frees its sequence at the engine's next step.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from tgis.engine.detokenize import tokenizer_facts
from tgis.engine.types import (
    Completion,
    EngineClient,
    GenerationRequest,
    ImageInput,
    LoraAdapter,
    PromptPrefix,
    TokenEvent,
    TokenInfo,
)
from tgis.errors import InputValidationError
from tgis.params import GenerateParameters, RequestLimits, truncate_ids, validate
from tgis.prefix_store import PrefixStore

if TYPE_CHECKING:
    from tgis.adapter_store import AdapterStore
from tgis.server.http.errors import ApiError, invalid
from tgis.server.http.images import ImageLimits, ImageRef, UrlPolicy, load_images, markdown_images
from tgis.server.http.metrics import Metrics
from tgis.vision.processor import ImageProcessor, ProcessedPrompt, ProcessorMismatch


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the engine."""

    request: GenerationRequest
    prompt: str
    validation_s: float

    @property
    def params(self) -> GenerateParameters:
        return self.request.params

    @property
    def input_length(self) -> int:
        return len(self.request.input_ids)


@dataclass
class SequenceResult:
    """One finished sequence of a request (one per `best_of` / `n` index)."""

    index: int
    completion: Completion
    tokens: list[TokenInfo] = field(default_factory=list)
    top_tokens: list[tuple[TokenInfo, ...]] = field(default_factory=list)

    @property
    def details_tokens(self) -> Sequence[TokenInfo]:
        """Generated tokens for `details`: the engine's list, else the streamed tokens."""
        return self.completion.tokens or self.tokens

    @property
    def details_top_tokens(self) -> Sequence[tuple[TokenInfo, ...]]:
        return self.completion.top_tokens or self.top_tokens

    def mean_logprob(self) -> float:
        """TGI's best_of score: the mean log-probability of the generated tokens."""
        logprobs = [t.logprob for t in self.details_tokens if t.logprob is not None]
        return sum(logprobs) / len(logprobs) if logprobs else float("-inf")


def pick_best(results: Sequence[SequenceResult]) -> tuple[SequenceResult, list[SequenceResult]]:
    """TGI's best_of choice: the highest mean logprob wins (first on ties); the others follow."""
    best = max(results, key=lambda r: (r.mean_logprob(), -r.index))
    return best, [r for r in results if r is not best]


class EventStream:
    """The token events of one request, starting with an event already received."""

    def __init__(self, iterator: AsyncIterator[TokenEvent], first: TokenEvent) -> None:
        self._iterator = iterator
        self._pending: TokenEvent | None = first
        self._closed = False

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._pending is not None:
            event, self._pending = self._pending, None
            return event
        if self._closed:
            raise StopAsyncIteration
        return await self._iterator.__anext__()

    async def aclose(self) -> None:
        """Close the engine's iterator (cancelling the request if it is still running)."""
        if self._closed:
            return
        self._closed = True
        await close_iterator(self._iterator)


async def close_iterator(iterator: Any) -> None:
    """`aclose()` an engine iterator even while the calling task is being cancelled."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


def shift_images(images: tuple[ImageInput, ...], cut: int) -> tuple[ImageInput, ...]:
    """The images of a prompt whose first `cut` tokens were truncated away; a 422 when that
    would cut into an image."""
    if not cut or not images:
        return images
    first = min(start for image in images for start, _ in image.runs)
    if first < cut:
        raise InputValidationError(
            f"`truncate` keeps the prompt's last tokens, which would cut {cut} tokens into "
            f"its images (the first image token is token {first}): raise `truncate`, or drop "
            "it"
        )
    return tuple(
        ImageInput(image.digest, tuple((start - cut, n) for start, n in image.runs), image.pixels)
        for image in images
    )


class Pipeline:
    """Turns request inputs into engine requests and engine events into results."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        limits: RequestLimits,
        metrics: Metrics,
        prefixes: PrefixStore | None = None,
        adapters: AdapterStore | None = None,
        vision: ImageProcessor | None = None,
        image_limits: ImageLimits | None = None,
        url_policy: UrlPolicy | None = None,
    ) -> None:
        """`vision`: a vision-language model's processor (prompts may hold images, within
        `image_limits`; remote ones fetched under `url_policy`, none without one)."""
        self.engine = engine
        self.tokenizer = tokenizer
        size = tokenizer_facts(tokenizer).vocab_size
        if size is None:
            raise TypeError(f"the tokenizer ({type(tokenizer).__name__}) has no size")
        # Read once: `len(tokenizer)` walks the vocabulary, too slow for every request.
        self.vocab_size = size
        self.limits = limits
        self.metrics = metrics
        self.prefixes = prefixes
        self.adapters = adapters
        self.vision = vision
        self.image_limits = image_limits or ImageLimits()
        self.url_policy = url_policy

    def markdown(self, text: str) -> tuple[str, list[ImageRef]]:
        """TGI's `inputs` with each markdown image (`![](url)`) replaced by the model's image
        placeholder, and the images they name; the text as it is for a model that takes no
        images (its markdown is text)."""
        if self.vision is None:
            return text, []
        found = markdown_images(text)
        if not found:
            return text, []
        parts, refs, at = [], [], 0
        for i, (start, end, url) in enumerate(found):
            parts += [text[at:start], self.vision.placeholder]
            refs.append(ImageRef(url, f"inputs (image {i + 1})"))
            at = end
        parts.append(text[at:])
        return "".join(parts), refs

    def check_images(self, refs: Sequence[ImageRef]) -> None:
        """Refuse images sent to a model that takes none (before its template sees them)."""
        if refs and self.vision is None:
            raise InputValidationError(
                f"`{refs[0].field}` is an image, and this model takes none: it is a text "
                "model. Send text only, or serve a vision-language model (docs/models.md)"
            )

    async def process_images(
        self, text: str, refs: Sequence[ImageRef], add_special_tokens: bool
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The token ids of `text`, whose image placeholders stand for `refs`, and the images
        ready for the engine: read, decoded and processed (worker threads)."""
        self.check_images(refs)
        vision = self.vision
        assert vision is not None
        decoded = await load_images(list(refs), self.image_limits, self.url_policy)

        def run() -> ProcessedPrompt:
            return vision.process(
                text,
                [d.image for d in decoded],
                [bytes.fromhex(d.digest) for d in decoded],
                add_special_tokens,
            )

        try:
            processed = await anyio.to_thread.run_sync(run)
        except ProcessorMismatch as exc:
            raise InputValidationError(
                f"the prompt's image tokens are not its images': {exc}. The text may not "
                f"hold the image placeholder {vision.placeholder!r} itself"
            ) from None
        return processed.input_ids, processed.images

    async def prefix(self, prefix_id: str | None) -> PromptPrefix | None:
        """The tuned prompt prefix `prefix_id` (read in a worker thread the first time), or
        None without one. Raises InputValidationError with TGIS's message."""
        if prefix_id is None:
            return None
        if self.prefixes is None:
            raise InputValidationError(
                f"can't retrieve prompt prefix with id '{prefix_id}': this server has no "
                "prompt prefix store (start it with --prefix-store-path)"
            )
        return await anyio.to_thread.run_sync(self.prefixes.get, prefix_id)

    async def adapter(self, adapter_id: str | None) -> LoraAdapter | None:
        """The LoRA adapter `adapter_id` (read in a worker thread the first time), or None
        for the base model (no id, or an empty one). Raises InputValidationError."""
        if not adapter_id:
            return None
        if self.adapters is None:
            raise InputValidationError(
                f"adapter_id '{adapter_id}': this server has no LoRA adapters (start it with "
                "--lora-adapters or --lora-adapter-dir)"
            )
        return await anyio.to_thread.run_sync(self.adapters.get, adapter_id)

    def check_length(self, text: str) -> None:
        """Refuse, before tokenizing, a text longer in characters than any prompt the server
        takes could be: 32 characters per token of max_total_tokens."""
        limit = self.limits.max_prompt_chars
        if len(text) > limit:
            raise InputValidationError(
                f"`inputs` has {len(text)} characters; prompts of up to "
                f"{self.limits.max_total_tokens} tokens are at most {limit} characters long "
                "here. Shorten the text (truncate it yourself when you use `truncate`)"
            )

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, computed in a worker thread (long prompts take milliseconds)."""

        def run() -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

        return await anyio.to_thread.run_sync(run)

    async def prepare(
        self,
        prompt: str | Sequence[int],
        params: GenerateParameters,
        *,
        arrival: float,
        stream: bool,
        add_special_tokens: bool = True,
        prefix_id: str | None = None,
        adapter_id: str | None = None,
        images: Sequence[ImageRef] = (),
    ) -> Prepared:
        """Tokenize (unless given ids), truncate to `params.truncate`, validate; with
        `prefix_id`, the prompt prefix goes first and counts toward the limits; with
        `adapter_id`, the request goes through that LoRA adapter; with `images`, the text
        holds their placeholders (`markdown`, a chat template's image parts), and their
        tokens count toward every limit.

        Raises InputValidationError (HTTP 422) with tgis.params's message.
        """
        prefix = await self.prefix(prefix_id)
        adapter = await self.adapter(adapter_id)
        pictures: tuple[ImageInput, ...] = ()
        if isinstance(prompt, str):
            self.check_length(prompt)
            if images:
                ids, pictures = await self.process_images(prompt, images, add_special_tokens)
            else:
                ids = await self.encode(prompt, add_special_tokens)
            text = prompt
        else:
            ids = list(prompt)
            outside = [i for i in ids if i >= self.vocab_size]
            if outside:
                raise InputValidationError(
                    f"token id {outside[0]} is outside the vocabulary (size {self.vocab_size})"
                )
            text = await anyio.to_thread.run_sync(self.tokenizer.decode, ids)
        biased = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if biased:
            raise InputValidationError(
                f"`logit_bias` token id {biased[0]} is outside the vocabulary (size "
                f"{self.vocab_size})"
            )
        self.metrics.raw_input(len(ids))
        # validate takes the length before truncation (it checks `truncate` itself) and
        # returns the parameters normalized, with max_new_tokens filled in.
        prefix_length = prefix.tokens if prefix is not None else 0
        check = partial(
            validate, params, len(ids), self.limits, stream=stream, prefix_length=prefix_length
        )
        # A grammar is compiled to be checked (milliseconds): not on the event loop.
        params = await anyio.to_thread.run_sync(check) if params.grammar else check()
        cut = len(ids)
        ids = truncate_ids(ids, params.truncate)
        pictures = shift_images(pictures, cut - len(ids))
        request = GenerationRequest(
            request_id=uuid.uuid4().hex,
            input_ids=tuple(ids),
            params=params,
            arrival=arrival,
            prefix=prefix,
            adapter=adapter,
            images=pictures,
        )
        validation_s = time.monotonic() - arrival
        self.metrics.validated(len(ids), params.max_new_tokens, validation_s)
        return Prepared(request=request, prompt=text, validation_s=validation_s)

    async def start(self, prepared: Prepared) -> EventStream:
        """Submit to the engine and wait for the first event.

        Waiting for it before answering lets overload (429) and backend failures (424) keep
        their status codes on streaming routes too.
        """
        iterator = self.engine.generate(prepared.request)
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            raise ApiError(500, "Incomplete generation", "incomplete_generation") from None
        except BaseException:
            await close_iterator(iterator)
            raise
        return EventStream(iterator, first)

    async def collect(self, stream: EventStream, sequences: int) -> list[SequenceResult]:
        """Gather `sequences` finished sequences from a stream, then close it."""
        tokens: dict[int, list[TokenInfo]] = {}
        tops: dict[int, list[tuple[TokenInfo, ...]]] = {}
        done: dict[int, SequenceResult] = {}
        try:
            async for event in stream:
                tokens.setdefault(event.index, []).append(event.token)
                tops.setdefault(event.index, []).append(event.top_tokens)
                if event.completion is not None:
                    done[event.index] = SequenceResult(
                        event.index, event.completion, tokens[event.index], tops[event.index]
                    )
                    if len(done) == sequences:
                        break
        finally:
            await stream.aclose()
        if len(done) < sequences:
            raise ApiError(500, "Incomplete generation", "incomplete_generation")
        return [done[i] for i in sorted(done)]

    def succeeded(self, kind: str, prepared: Prepared, completion: Completion) -> None:
        """Record a finished request in the tgi_request_* metrics."""
        seconds = time.monotonic() - prepared.request.arrival
        self.metrics.request_succeeded(kind, completion, seconds)


def timing_headers(prepared: Prepared, result: SequenceResult, compute_type: str) -> dict[str, str]:
    """TGI's x-* response headers of a finished (non-streaming) request."""
    total = time.monotonic() - prepared.request.arrival
    timings = result.completion.timings
    generated = result.completion.generated_tokens
    per_token = timings.inference / generated if generated else 0.0
    return {
        "x-compute-type": compute_type,
        "x-compute-time": f"{total:.6f}",
        "x-compute-characters": str(len(prepared.prompt)),
        "x-total-time": str(int(total * 1000)),
        "x-validation-time": str(int(prepared.validation_s * 1000)),
        "x-queue-time": str(int(timings.queue * 1000)),
        "x-inference-time": str(int(timings.inference * 1000)),
        "x-time-per-token": str(int(per_token * 1000)),
        "x-prompt-tokens": str(prepared.input_length),
        "x-generated-tokens": str(generated),
    }


# The name TGI's documentation gives clients for the served model (`model: "tgi"`).
BASE_MODEL_NAME = "tgi"


def adapter_of(pipeline: Pipeline, model_id: str, model: str | None) -> str | None:
    """The LoRA adapter OpenAI's `model` selects: None for the served model (its id, "tgi" as
    TGI's docs tell clients to send unless an adapter is named so, or any name on a server
    without adapters, as TGI ignores it); a 422 for a name that is neither the model nor an
    adapter on a server with adapters."""
    adapters = pipeline.adapters
    if adapters is None or model is None or model in ("", model_id):
        return None
    if model == BASE_MODEL_NAME and model not in adapters.named:
        return None
    if model in adapters.named or adapters.directory is not None:
        return model
    raise invalid(
        f"`model` '{model}' is neither the served model ('{model_id}') nor one of its LoRA "
        f"adapters ({', '.join(adapters.names())}); GET /v1/models lists them"
    )
