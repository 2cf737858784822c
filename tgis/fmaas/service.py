"""`fmaas.GenerationService`: TGIS's four methods over the engine the HTTP routes use.

Generate admits a batch whole or refuses it whole (RESOURCE_EXHAUSTED `Model is overloaded`
when its inputs do not all fit under --max-concurrent-requests) and answers one response per
input, in order. GenerateStream sends what TGIS sends: a first message with the input token
count (and the seed, and the input text when asked), the input tokens when asked, then one
message per token with the new text, and a last one with the stop reason. A client that
cancels a call closes its engine iterators, which frees the sequences at the next step.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import anyio.to_thread
import grpc

from tgis.engine.types import (
    Completion,
    FinishReason,
    GenerationRequest,
    LoraAdapter,
    PromptPrefix,
    TokenInfo,
)
from tgis.errors import GenerationError, InputValidationError, OverloadedError
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas import generation_pb2_grpc as pb_grpc
from tgis.fmaas.convert import Converted, GrpcLimits, convert
from tgis.server.http.generation import close_iterator
from tgis.server.http.state import ServerState
from tgis.server.tgi.tokenize import tokenize_with_offsets

STOP_REASONS = {
    FinishReason.EOS_TOKEN: pb.EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.STOP_SEQUENCE,
    FinishReason.TIME_LIMIT: pb.TIME_LIMIT,
    FinishReason.CANCELLED: pb.CANCELLED,
}


class Refused(Exception):
    """A request ends with a gRPC status (raised inside the service, sent by `_abort`)."""

    def __init__(self, code: grpc.StatusCode, message: str, metric: str) -> None:
        super().__init__(message)
        self.code, self.message, self.metric = code, message, metric


@dataclass
class Input:
    """One input of a request, tokenized, truncated and fitted to the limits."""

    text: str
    request: GenerationRequest
    token_limit: bool
    seed: int | None

    @property
    def ids(self) -> tuple[int, ...]:
        return self.request.input_ids


@dataclass
class Result:
    """One input's generation, gathered from its events."""

    completion: Completion
    tokens: list[TokenInfo] = field(default_factory=list)
    tops: list[tuple[TokenInfo, ...]] = field(default_factory=list)


class GenerationService(pb_grpc.GenerationServiceServicer):
    """TGIS's API over one served model (the HTTP app's ServerState)."""

    def __init__(
        self, state: ServerState, limits: GrpcLimits, kind: int = pb.ModelInfoResponse.DECODER_ONLY
    ) -> None:
        self.state = state
        self.engine = state.engine
        self.tokenizer = state.tokenizer
        self.metrics = state.metrics
        self.limits = limits
        self.kind = kind

    # --- methods ------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.BatchedGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedGenerationResponse:
        arrival = time.monotonic()
        texts = [r.text for r in request.requests]
        kind = "single" if len(texts) == 1 else "batch"
        self.metrics.request_received(kind, len(texts))
        try:
            self._check_open()
            if not texts:  # before the parameters are read, as TGIS answers it
                return pb.BatchedGenerationResponse()
            converted, prefix, adapter = await self._convert(request)
            inputs = [
                await self._prepare(text, converted, prefix, adapter, arrival) for text in texts
            ]
            self._reserve(len(inputs))
            results = await self._run_all(inputs)
        except Refused as refused:
            await self._abort(context, refused)
        except asyncio.CancelledError:
            self.metrics.request_failed("cancelled")
            raise
        responses = []
        for inp, result in zip(inputs, results, strict=True):
            responses.append(self._response(inp, converted, result))
            self._succeeded(kind, inp, result.completion)
        return pb.BatchedGenerationResponse(responses=responses)

    async def GenerateStream(
        self, request: pb.SingleGenerationRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerationResponse]:
        arrival = time.monotonic()
        self.metrics.request_received("stream")
        try:
            self._check_open()
            if not request.HasField("request"):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "missing request", "validation")
            converted, prefix, adapter = await self._convert(request)
            inp = await self._prepare(request.request.text, converted, prefix, adapter, arrival)
            self._reserve(1)
        except Refused as refused:
            await self._abort(context, refused)
            return
        options = converted.options
        iterator = self.engine.generate(inp.request, reserved=True)
        entered = False
        try:
            first = pb.GenerationResponse(input_token_count=len(inp.ids))
            if inp.seed is not None:
                first.seed = inp.seed
            if options.input_text:
                first.text = inp.text
            yield first
            if options.input_tokens and not options.token_detail:
                yield self._input_message(inp, converted)
            generated = 0
            entered = True
            async for event in iterator:
                if event.prefill and options.input_tokens:
                    yield self._input_message(inp, converted, event.prefill, event.prefill_top)
                generated += 1
                message = pb.GenerationResponse(generated_token_count=generated, text=event.text)
                if options.generated_tokens:
                    message.tokens.append(self._token(event.token, event.top_tokens, converted))
                if event.completion is not None:
                    self._finish_message(message, inp, converted, event.completion)
                    yield message
                    self._succeeded("stream", inp, event.completion)
                    return
                if message.text or message.tokens:
                    yield message
        except (GenerationError, InputValidationError) as exc:
            await self._abort(context, _engine_failure(exc))
        except (asyncio.CancelledError, GeneratorExit):
            # A cancelled call raises CancelledError where the stream awaits the engine; one
            # cancelled while grpc sends a message closes the stream at its `yield` instead.
            self.metrics.request_failed("cancelled")
            raise
        finally:
            if entered:
                await close_iterator(iterator)
            else:
                self.engine.release(1)

    async def Tokenize(
        self, request: pb.BatchedTokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchedTokenizeResponse:
        start = time.monotonic()
        truncate = request.truncate_input_tokens or None
        responses, total = [], 0
        for item in request.requests:
            tokens = await anyio.to_thread.run_sync(
                tokenize_with_offsets, self.tokenizer, item.text, truncate
            )
            response = pb.TokenizeResponse(token_count=len(tokens))
            if request.return_tokens:
                ids = [t["id"] for t in tokens]
                response.tokens.extend(self.tokenizer.convert_ids_to_tokens(ids))
            if request.return_offsets:
                response.offsets.extend(
                    pb.TokenizeResponse.Offset(start=t["start"], end=t["stop"]) for t in tokens
                )
            responses.append(response)
            total += len(tokens)
        self.metrics.tokenize_request(len(responses), total, time.monotonic() - start)
        return pb.BatchedTokenizeResponse(responses=responses)

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        return pb.ModelInfoResponse(
            model_kind=self.kind,  # type: ignore[arg-type]
            max_sequence_length=self.limits.max_sequence_length,
            max_new_tokens=self.limits.max_new_tokens,
        )

    # --- admission ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.state.lifecycle.draining:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "Server is shutting down", "unavailable")

    async def _convert(
        self, request: pb.BatchedGenerationRequest | pb.SingleGenerationRequest
    ) -> tuple[Converted, PromptPrefix | None, LoraAdapter | None]:
        """The request's parameters, its prompt prefix (`prefix_id`) and its LoRA adapter
        (`adapter_id`, field 4 as the TGIS adapter for vLLM numbers it)."""
        try:
            converted = convert(request.params, self.limits)
            prefix_id = request.prefix_id if request.HasField("prefix_id") else None
            prefix = await self.state.pipeline.prefix(prefix_id)
            adapter_id = request.adapter_id if request.HasField("adapter_id") else None
            adapter = await self.state.pipeline.adapter(adapter_id)
        except InputValidationError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "validation") from None
        return converted, prefix, adapter

    async def _prepare(
        self,
        text: str,
        converted: Converted,
        prefix: PromptPrefix | None,
        adapter: LoraAdapter | None,
        arrival: float,
    ) -> Input:
        """Tokenize, truncate (the last truncate_input_tokens are kept), check the lengths
        (the prefix's virtual tokens count)."""
        try:
            self.state.pipeline.check_length(text)
        except InputValidationError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "validation") from None
        ids = await self.state.pipeline.encode(text)
        self.metrics.raw_input(len(ids))
        truncate = converted.params.truncate
        if truncate is not None and truncate < len(ids):
            ids = ids[len(ids) - truncate :]
        try:
            if not ids:
                raise InputValidationError("the input text has no tokens")
            fitted = converted.fit(len(ids), prefix.tokens if prefix else 0, self.limits)
        except InputValidationError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "validation") from None
        request = GenerationRequest(
            uuid.uuid4().hex, tuple(ids), fitted.params, arrival, prefix, adapter
        )
        self.metrics.validated(len(ids), fitted.params.max_new_tokens, time.monotonic() - arrival)
        return Input(text, request, fitted.token_limit, fitted.seed)

    def _reserve(self, count: int) -> None:
        try:
            self.engine.reserve(count)
        except OverloadedError:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "Model is overloaded", "overloaded"
            ) from None

    async def _abort(self, context: grpc.aio.ServicerContext, refused: Refused) -> NoReturn:
        """End the call with the status (`context.abort` raises)."""
        self.metrics.request_failed(refused.metric)
        await context.abort(refused.code, refused.message)
        raise AssertionError("grpc's abort returned")

    # --- generation ---------------------------------------------------------------------------

    async def _run_all(self, inputs: Sequence[Input]) -> list[Result]:
        """Every input through the engine at once (their places are reserved)."""
        entered = [0]
        tasks = [asyncio.ensure_future(self._collect(inp.request, entered)) for inp in inputs]
        try:
            return list(await asyncio.gather(*tasks))
        except (GenerationError, InputValidationError) as exc:
            raise _engine_failure(exc) from None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # A task cancelled before it started never used its place: give it back.
            self.engine.release(len(inputs) - entered[0])

    async def _collect(self, request: GenerationRequest, entered: list[int]) -> Result:
        """One input's events into a Result; its iterator is closed whatever happens."""
        iterator = self.engine.generate(request, reserved=True)
        entered[0] += 1  # the loop below enters the iterator, which gives the place back
        tokens: list[TokenInfo] = []
        tops: list[tuple[TokenInfo, ...]] = []
        try:
            async for event in iterator:
                tokens.append(event.token)
                tops.append(event.top_tokens)
                if event.completion is not None:
                    return Result(event.completion, tokens, tops)
        finally:
            await close_iterator(iterator)
        raise GenerationError("the generation ended without a last token", "check the server log")

    def _succeeded(self, kind: str, inp: Input, completion: Completion) -> None:
        reason = pb.StopReason.Name(self._stop_reason(inp, completion))
        seconds = time.monotonic() - inp.request.arrival
        self.metrics.request_succeeded(kind, completion, seconds, stop_reason=reason)

    # --- responses ----------------------------------------------------------------------------

    def _stop_reason(self, inp: Input, completion: Completion) -> int:
        if completion.finish_reason is FinishReason.LENGTH:
            return pb.TOKEN_LIMIT if inp.token_limit else pb.MAX_TOKENS
        return STOP_REASONS[completion.finish_reason]

    def _response(self, inp: Input, converted: Converted, result: Result) -> pb.GenerationResponse:
        completion, options = result.completion, converted.options
        text = completion.generated_text
        response = pb.GenerationResponse(
            input_token_count=len(inp.ids),
            text=inp.text + text if options.input_text else text,
        )
        self._finish_message(response, inp, converted, completion)
        if options.generated_tokens:
            response.tokens.extend(
                self._token(t, top, converted)
                for t, top in zip(result.tokens, result.tops, strict=True)
            )
        if options.input_tokens:
            response.input_tokens.extend(
                self._input_tokens(inp, completion.prefill, completion.prefill_top, converted)
            )
        return response

    def _finish_message(
        self,
        message: pb.GenerationResponse,
        inp: Input,
        converted: Converted,
        completion: Completion,
    ) -> None:
        message.generated_token_count = completion.generated_tokens
        message.stop_reason = self._stop_reason(inp, completion)  # type: ignore[assignment]
        if completion.stop_sequence is not None:
            message.stop_sequence = completion.stop_sequence
        if inp.seed is not None:
            message.seed = inp.seed

    def _token(
        self, token: TokenInfo, top: Sequence[TokenInfo], converted: Converted
    ) -> pb.TokenInfo:
        """A token as TGIS gives it: the tokenizer's token string, and the details asked
        for (top tokens carry a logprob only with token_logprobs)."""
        options = converted.options
        info = pb.TokenInfo(text=self._piece(token.id))
        if options.token_logprobs and token.logprob is not None:
            info.logprob = token.logprob
        if options.token_ranks and token.rank is not None:
            info.rank = token.rank
        if options.top_n_tokens:
            for alternative in top:
                entry = info.top_tokens.add(text=self._piece(alternative.id))
                if options.token_logprobs and alternative.logprob is not None:
                    entry.logprob = alternative.logprob
        return info

    def _piece(self, token_id: int) -> str:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        return piece if isinstance(piece, str) else ""

    def _input_tokens(
        self,
        inp: Input,
        prefill: Sequence[TokenInfo],
        prefill_top: Sequence[Sequence[TokenInfo]],
        converted: Converted,
    ) -> list[pb.TokenInfo]:
        """The input tokens; with token detail, the first has logprob NaN and rank 0 (no
        prediction precedes it), as TGIS gives it."""
        if not prefill:
            return [pb.TokenInfo(text=self._piece(i)) for i in inp.ids]
        tops = list(prefill_top) or [()] * len(prefill)
        infos = [self._token(t, top, converted) for t, top in zip(prefill, tops, strict=True)]
        if converted.options.token_logprobs:
            infos[0].logprob = math.nan
        return infos

    def _input_message(
        self,
        inp: Input,
        converted: Converted,
        prefill: Sequence[TokenInfo] = (),
        prefill_top: Sequence[Sequence[TokenInfo]] = (),
    ) -> pb.GenerationResponse:
        """A stream's message with the input tokens."""
        message = pb.GenerationResponse(input_token_count=len(inp.ids))
        message.input_tokens.extend(self._input_tokens(inp, prefill, prefill_top, converted))
        return message


def _engine_failure(exc: Exception) -> Refused:
    if isinstance(exc, InputValidationError):
        return Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "validation")
    return Refused(
        grpc.StatusCode.UNKNOWN, f"Request failed during generation: {exc}", "generation"
    )


__all__ = ["GenerationService", "Refused"]
