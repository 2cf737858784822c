"""TGIS's request semantics: gRPC `Parameters` -> the engine's GenerateParameters.

TGIS's defaults (0 means "not set" for every number; max_new_tokens 0 means 20; sampling
fields are read only with method SAMPLE, where temperature 0 means 1), its checks in its order
with its exact messages (each raises InputValidationError, sent as INVALID_ARGUMENT), and its
length rule: input plus max_new_tokens beyond the sequence limit is not an error but cuts
max_new_tokens to fit, and such a request ends with TOKEN_LIMIT instead of MAX_TOKENS.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

from tgis.errors import InputValidationError
from tgis.fmaas import generation_pb2 as pb
from tgis.params import GenerateParameters

DEFAULT_MAX_NEW_TOKENS = 20
MAX_STOP_SEQUENCES = 6
MAX_STOP_SEQUENCE_BYTES = 240
MAX_TOP_N_TOKENS = 5
STOP_SEQUENCES_MESSAGE = (
    f"can specify at most {MAX_STOP_SEQUENCES} non-empty stop sequences, each not more than "
    f"{MAX_STOP_SEQUENCE_BYTES} UTF8 bytes"
)


@dataclass(frozen=True)
class GrpcLimits:
    """The server settings the gRPC API applies (TGIS's launcher flags)."""

    max_sequence_length: int
    max_new_tokens: int
    default_include_stop_seqs: bool = True
    output_special_tokens: bool = False

    @classmethod
    def of(
        cls,
        max_sequence_length: int,
        max_new_tokens: int,
        default_include_stop_seqs: bool = True,
        output_special_tokens: bool = False,
    ) -> GrpcLimits:
        """As TGIS's router sets them: max_new_tokens below max_sequence_length."""
        return cls(
            max_sequence_length,
            min(max_new_tokens, max_sequence_length - 1),
            default_include_stop_seqs,
            output_special_tokens,
        )


@dataclass(frozen=True)
class ResponseOptions:
    """What a response carries besides the text (TGIS's ResponseOptions)."""

    input_text: bool = False
    generated_tokens: bool = False
    input_tokens: bool = False
    token_logprobs: bool = False
    token_ranks: bool = False
    top_n_tokens: int = 0

    @property
    def token_detail(self) -> bool:
        return self.token_logprobs or self.token_ranks or self.top_n_tokens > 0


@dataclass(frozen=True)
class Converted:
    """A request's parameters before its input is known: the engine's parameters (without
    the length rule applied yet) and the response options."""

    params: GenerateParameters
    options: ResponseOptions
    # Sampling without a seed: each input draws its own random 32-bit seed (`fit`).
    random_seed: bool = False

    def fit(self, input_length: int, prefix_length: int, limits: GrpcLimits) -> Fitted:
        """Apply TGIS's length checks to one input (after truncation); a sampled input
        without a seed gets one of its own."""
        total = input_length + prefix_length
        limit = limits.max_sequence_length
        if total >= limit:
            raise InputValidationError(
                f"input tokens ({input_length}) plus prefix length ({prefix_length}) "
                f"must be < {limit}"
            )
        min_new = self.params.min_new_tokens
        if total + min_new > limit:
            raise InputValidationError(
                f"input tokens ({input_length}) plus prefix length ({prefix_length}) plus "
                f"min_new_tokens ({min_new}) must be <= {limit}"
            )
        params = self.params
        if self.random_seed:
            params = replace(params, seed=secrets.randbits(32))
        max_new = params.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        if total + max_new > limit:
            return Fitted(replace(params, max_new_tokens=limit - total), True)
        return Fitted(params, False)


@dataclass(frozen=True)
class Fitted:
    """One input's parameters; `token_limit`: max_new_tokens was cut to the sequence limit."""

    params: GenerateParameters
    token_limit: bool

    @property
    def seed(self) -> int | None:
        """The seed to report: the request's or the one drawn for this input (sampling)."""
        return self.params.seed if self.params.do_sample else None


def convert(params: pb.Parameters, limits: GrpcLimits) -> Converted:
    """TGIS's defaults and checks, in its order. Raises InputValidationError."""
    sampling = params.method == pb.SAMPLE
    temperature, top_k, top_p, typical_p, seed = 0.0, 0, 1.0, 0.0, None
    if sampling:
        s = params.sampling
        temperature = s.temperature or 1.0  # sampling with temperature 0: temperature 1
        top_k = s.top_k
        top_p = s.top_p or 1.0
        typical_p = s.typical_p
        seed = s.seed if s.HasField("seed") else None
    stopping = params.stopping
    max_new_tokens = stopping.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    repetition_penalty = params.decoding.repetition_penalty or 1.0
    length_penalty = None
    if params.decoding.HasField("length_penalty"):
        lp = params.decoding.length_penalty
        length_penalty = (lp.start_index, float(lp.decay_factor))
    response = params.response
    options = ResponseOptions(
        input_text=response.input_text,
        generated_tokens=response.generated_tokens,
        input_tokens=response.input_tokens,
        token_logprobs=response.token_logprobs,
        token_ranks=response.token_ranks,
        top_n_tokens=response.top_n_tokens,
    )
    stops = tuple(stopping.stop_sequences)

    # Written so that NaN fails each check too.
    if temperature != 0.0 and not temperature >= 0.05:
        raise InputValidationError("temperature must be >= 0.05")
    if not 0.0 < top_p <= 1.0:
        raise InputValidationError("top_p must be > 0.0 and <= 1.0")
    if not typical_p <= 1.0:
        raise InputValidationError("typical_p must be <= 1.0")
    if max_new_tokens > limits.max_new_tokens:
        raise InputValidationError(f"max_new_tokens must be <= {limits.max_new_tokens}")
    if stopping.min_new_tokens > max_new_tokens:
        raise InputValidationError("min_new_tokens must be <= max_new_tokens")
    if not repetition_penalty > 0.0:
        raise InputValidationError("repetition_penalty must be > 0.0")
    if length_penalty is not None and not 1.0 <= length_penalty[1] <= 10.0:
        raise InputValidationError("length_penalty must be >= 1.0 and <= 10.0")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InputValidationError(STOP_SEQUENCES_MESSAGE)
    if options.token_detail and not (options.input_tokens or options.generated_tokens):
        raise InputValidationError(
            "must request input and/or generated tokens to request extra token detail"
        )
    if any(not s or len(s.encode()) > MAX_STOP_SEQUENCE_BYTES for s in stops):
        raise InputValidationError(STOP_SEQUENCES_MESSAGE)
    if options.top_n_tokens > MAX_TOP_N_TOKENS:  # TGIS's proto documents the bound
        raise InputValidationError(f"top_n_tokens must be <= {MAX_TOP_N_TOKENS}")

    include_stop = (
        stopping.include_stop_sequence
        if stopping.HasField("include_stop_sequence")
        else limits.default_include_stop_seqs
    )
    engine_params = GenerateParameters(
        do_sample=sampling,
        temperature=None if temperature in (0.0, 1.0) else temperature,
        top_k=top_k or None,
        top_p=None if top_p == 1.0 else top_p,
        typical_p=typical_p if 0.0 < typical_p < 1.0 else None,
        repetition_penalty=None if repetition_penalty == 1.0 else repetition_penalty,
        length_penalty=length_penalty,
        seed=seed,
        max_new_tokens=max_new_tokens,
        min_new_tokens=stopping.min_new_tokens,
        stop=stops,
        include_stop_sequence=include_stop,
        time_limit_ms=stopping.time_limit_millis or None,
        truncate=params.truncate_input_tokens or None,
        # Input-token logprobs, ranks and alternatives come from the prompt's logits.
        decoder_input_details=options.input_tokens and options.token_detail,
        top_n_tokens=options.top_n_tokens or None,
        skip_special_tokens=not limits.output_special_tokens,
    )
    return Converted(engine_params, options, random_seed=sampling and seed is None)
