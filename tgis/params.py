"""One request's generation parameters (TGI's `parameters` object, plus TGIS's extras).

Frozen and validated by `validate` against the server's limits; every violation raises
InputValidationError with TGI's message (HTTP 422, error_type "validation").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from tgis.errors import InputValidationError

if TYPE_CHECKING:
    from tgis.config import ServeConfig

# Characters a prompt may have per token of the context (RequestLimits.max_prompt_chars).
CHARS_PER_TOKEN = 32
# torch.Generator seeds are unsigned 64-bit integers, as TGI's `seed` (u64).
MAX_SEED = 2**64 - 1


GrammarKind = Literal["json", "regex", "lark", "llguidance"]
# JSON without free whitespace between tokens: a model cannot loop on spaces or newlines.
# (A Lark grammar's `%json` schemas say so in their own "x-guidance" key.)
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: a JSON schema (`value` is its JSON text), a
    regular expression (Rust `regex` syntax: no lookaround, no backreferences) or a grammar in
    llguidance's Lark syntax (what tool calls are built into). `source` names the request field
    the grammar came from, for error messages."""

    kind: GrammarKind
    value: str
    source: str = "grammar"

    @classmethod
    def json_schema(cls, schema: Any, source: str = "grammar") -> GrammarSpec:
        return cls("json", json.dumps(schema), source)  # key order kept: properties come in it

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str, source: str = "grammar") -> GrammarSpec:
        return cls("lark", grammar, source)

    @classmethod
    def llguidance(cls, grammar: str, source: str = "grammar") -> GrammarSpec:
        """llguidance's own grammar text (a set of named grammars that refer to each other:
        what a chat route composes from a reasoning block and a request's grammar)."""
        return cls("llguidance", grammar, source)

    def grammar(self) -> str:
        """llguidance's grammar text."""
        import llguidance as llg

        if self.kind == "json":
            return llg.LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        if self.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(self.value)
        if self.kind == "llguidance":
            return self.value
        return llg.LLMatcher.grammar_from_regex(self.value)

    def problem(self) -> str | None:
        """Why the grammar cannot be used (a schema or regex error), or None."""
        import llguidance as llg

        error = llg.LLMatcher.validate_grammar(self.grammar())
        if not error:
            return None
        lines = error.splitlines()
        # A regex error's reason is on its own line ("error: unclosed counted repetition").
        reason = next((line for line in lines if line.startswith("error: ")), "")
        return f"{lines[0]} {reason.removeprefix('error: ')}".strip()


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` tokens inside a reasoning block: once they are spent, the block's end
    marker (`end_ids`) is the only output allowed until it is written. The block starts where
    the output does when the prompt opened it (`opened`), else at the start marker's ids
    (`start_ids`); only the first block counts. Markers are matched by their token ids."""

    tokens: int
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    opened: bool = False


@dataclass(frozen=True)
class GenerateParameters:
    """Everything a client may ask of one generation. Defaults are TGI's."""

    # Sampling (batched as per-row tensors by tgis.engine.sampling).
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    # TGIS's exponential length penalty: (start_index, decay_factor). Once more than
    # start_index tokens are generated, the EOS logits grow by |logit| * (decay_factor ^
    # (generated - start_index) - 1), as HF's ExponentialDecayLengthPenalty does.
    length_penalty: tuple[int, float] | None = None
    # OpenAI's logit_bias: (token id, bias) pairs added to the raw logits before every other
    # processor (+-100 bans or forces a token in practice).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Stopping.
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    # True: the matched stop sequence stays in the text (TGI); False: it is cut (OpenAI, TGIS).
    include_stop_sequence: bool = True
    ignore_eos: bool = False
    time_limit_ms: int | None = None
    # Input handling.
    truncate: int | None = None
    # Output.
    return_full_text: bool = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    best_of: int | None = None
    skip_special_tokens: bool = True
    # Special tokens whose text stays in the output although skip_special_tokens is on: the
    # markers a chat route parses (a reasoning block's, a model's own tool-call tokens).
    kept_special_ids: tuple[int, ...] = ()
    # Output constrained to a JSON schema or a regex (TGI's `grammar`, OpenAI's response_format).
    grammar: GrammarSpec | None = None
    # A cap on the reasoning block's length (Anthropic's `thinking.budget_tokens`).
    thinking_budget: ThinkingBudget | None = None

    @property
    def sampling_warpers(self) -> bool:
        """True when a warper that only makes sense when sampling is active.

        TGI's server samples whenever one is (`sampling = do_sample or has_warpers`), whatever
        `do_sample` says; `validate` folds that into `do_sample`.
        """
        return (
            (self.temperature is not None and self.temperature != 1.0)
            or (self.top_k is not None and self.top_k != 0)
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.typical_p is not None and self.typical_p < 1.0)
        )


@dataclass(frozen=True)
class RequestLimits:
    """The server's per-request limits (TGI's router `Validation` fields)."""

    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    # The largest max_new_tokens a request may ask for (--max-new-tokens); None: what fits.
    max_new_tokens: int | None = None

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt in characters, refused before tokenizing beyond it: far more
        than any tokenizer packs into the context, far fewer than a body that only costs
        tokenizing time."""
        return CHARS_PER_TOKEN * self.max_total_tokens

    @classmethod
    def from_config(cls, config: ServeConfig) -> RequestLimits:
        """The limits `tgis serve` was started with."""
        return cls(
            max_best_of=config.max_best_of,
            max_stop_sequences=config.max_stop_sequences,
            max_top_n_tokens=config.max_top_n_tokens,
            max_input_tokens=config.max_input_tokens,
            max_total_tokens=config.max_total_tokens,
            max_new_tokens=config.max_new_tokens,
        )


def _fail(message: str) -> InputValidationError:
    return InputValidationError(message)


def _check_stream(params: GenerateParameters) -> None:
    # TGI's generate_stream handler refuses these before validating anything else.
    if params.best_of is not None and params.best_of != 1:
        raise _fail("`best_of` != 1 is not supported when streaming tokens")
    if params.decoder_input_details:
        raise _fail("`decoder_input_details` == true is not supported when streaming tokens")


def _check_best_of(params: GenerateParameters, limits: RequestLimits) -> int:
    best_of = 1 if params.best_of is None else params.best_of
    if best_of != 1 and limits.max_best_of == 1:
        raise _fail("`best_of` != 1 is not allowed for this endpoint")
    if not 0 < best_of <= limits.max_best_of:
        raise _fail(f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}")
    # The router's notion of "sampling" (any warper given, even a neutral one).
    sampling = params.do_sample or any(
        v is not None for v in (params.temperature, params.top_k, params.top_p, params.typical_p)
    )
    if best_of > 1 and not sampling:
        raise _fail("you must use sampling when `best_of` is > 1")
    return best_of


# Divisors and probability masses below this become 0 or overflow in a float32 computation
# (logits / 1e-300 is inf): smaller values are refused rather than turned into NaN scores.
MIN_POSITIVE = 1e-4
# The longest time limit a request may set (24 days), well within every clock's range.
MAX_TIME_LIMIT_MS = 2**31 - 1
# OpenAI's `logit_bias`: each bias within +-100 (OpenAI's range), and at most this many tokens.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024


# The largest temperature or repetition penalty: beyond it the distribution is already uniform
# (or the penalty already past any logit's range), and 1 / value leaves float32's normal range
# on the way to inf * 0 = NaN scores.
MAX_FACTOR = 1e4


def _check_small(name: str, value: float | None) -> None:
    if value is not None and value < MIN_POSITIVE:
        raise _fail(
            f"`{name}` must be at least {MIN_POSITIVE} (smaller values overflow the "
            f"computation). Given: {value}"
        )
    if value is not None and name in ("temperature", "repetition_penalty") and value > MAX_FACTOR:
        raise _fail(
            f"`{name}` must be at most {MAX_FACTOR:g} (larger values change nothing but "
            f"overflow the computation). Given: {value}"
        )


def _check_sampling(params: GenerateParameters) -> None:
    # `not (x > 0)` rather than `x <= 0` so that NaN is refused too.
    if params.temperature is not None and not params.temperature > 0.0:
        raise _fail("`temperature` must be strictly positive")
    _check_small("temperature", params.temperature)
    if params.repetition_penalty is not None and not params.repetition_penalty > 0.0:
        raise _fail("`repetition_penalty` must be strictly positive")
    _check_small("repetition_penalty", params.repetition_penalty)
    if params.frequency_penalty is not None and not -2.0 <= params.frequency_penalty <= 2.0:
        raise _fail("`frequency_penalty` must be >= -2.0 and <= 2.0")
    if params.presence_penalty is not None and not -2.0 <= params.presence_penalty <= 2.0:
        raise _fail("`presence_penalty` must be >= -2.0 and <= 2.0")
    if params.top_p is not None and not 0.0 < params.top_p < 1.0:
        raise _fail("`top_p` must be > 0.0 and < 1.0")
    _check_small("top_p", params.top_p)
    if params.typical_p is not None and not 0.0 < params.typical_p < 1.0:
        raise _fail("`typical_p` must be > 0.0 and < 1.0")
    _check_small("typical_p", params.typical_p)
    if params.top_k is not None and params.top_k <= 0:
        raise _fail("`top_k` must be strictly positive")
    if len(params.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise _fail(
            f"`logit_bias` supports up to {MAX_LOGIT_BIAS_TOKENS} tokens. "
            f"Given: {len(params.logit_bias)}"
        )
    for token, bias in params.logit_bias:
        if token < 0:
            raise _fail(f"`logit_bias` token ids must be >= 0. Given: {token}")
        # `not (|x| <= limit)` so that NaN is refused too.
        if not abs(bias) <= MAX_LOGIT_BIAS:
            raise _fail(
                f"`logit_bias` values must be >= -{MAX_LOGIT_BIAS:g} and <= "
                f"{MAX_LOGIT_BIAS:g}. Given: {bias} for token {token}"
            )
    if params.length_penalty is not None:
        start_index, decay_factor = params.length_penalty
        if start_index < 0:
            raise _fail("`length_penalty.start_index` must be >= 0")
        if not 1.0 <= decay_factor <= 10.0:
            raise _fail("`length_penalty.decay_factor` must be >= 1.0 and <= 10.0")


def _check_lengths(
    params: GenerateParameters, input_length: int, limits: RequestLimits, prefix_length: int = 0
) -> int:
    """Validate the token budget; return the effective max_new_tokens. A prompt prefix's
    virtual tokens count as `inputs` tokens."""
    if params.truncate is not None and not 0 < params.truncate <= limits.max_input_tokens:
        raise _fail(
            f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. "
            f"Given: {params.truncate}"
        )
    if params.truncate is not None:
        input_length = min(input_length, params.truncate)
    input_length += prefix_length
    # TGI 3: an unset max_new_tokens means "as many as the context allows" (and the server's
    # --max-new-tokens allow).
    cap = limits.max_new_tokens
    if params.max_new_tokens is None:
        max_new_tokens = max(limits.max_total_tokens - input_length, 0)
        if cap is not None:
            max_new_tokens = min(max_new_tokens, cap)
    else:
        max_new_tokens = params.max_new_tokens
        if cap is not None and max_new_tokens > cap:
            raise _fail(f"`max_new_tokens` must be <= {cap}. Given: {max_new_tokens}")
    if input_length + max_new_tokens > limits.max_total_tokens:
        raise _fail(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
        )
    # max_new_tokens can only default to 0 when the prompt fills the whole context.
    if input_length > limits.max_input_tokens or max_new_tokens == 0:
        raise _fail(
            f"`inputs` must have less than {limits.max_input_tokens} tokens. Given: {input_length}"
        )
    return max_new_tokens


def validate(
    params: GenerateParameters,
    input_length: int,
    limits: RequestLimits,
    stream: bool = False,
    prefix_length: int = 0,
) -> GenerateParameters:
    """Check one request against the server's limits, in TGI's order and with its messages.

    `input_length` is the prompt's length in tokens before `truncate` (`prefix_length`: the
    virtual tokens of its prompt prefix, counted with it). Returns a normalized
    copy: `max_new_tokens` set (default: what fits in `max_total_tokens`), neutral values
    (temperature 1.0, penalties 1.0 / 0.0, top_n_tokens 0) turned into None, and `do_sample`
    set whenever TGI's server would sample (an active warper, or best_of > 1).
    Raises InputValidationError (HTTP 422) on the first violation.
    """
    if stream:
        _check_stream(params)
    best_of = _check_best_of(params, limits)
    _check_sampling(params)
    if params.max_new_tokens is not None and params.max_new_tokens <= 0:
        raise _fail("`max_new_tokens` must be strictly positive")
    if len(params.stop) > limits.max_stop_sequences:
        raise _fail(
            f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
            f"Given: {len(params.stop)}"
        )
    if params.seed is not None:
        if best_of > 1:
            raise _fail("`seed` must not be set when `best_of` > 1")
        if not 0 <= params.seed <= MAX_SEED:
            raise _fail(f"`seed` must be >= 0 and <= {MAX_SEED}. Given: {params.seed}")
    top_n = params.top_n_tokens
    if top_n is not None and not 0 <= top_n <= limits.max_top_n_tokens:
        raise _fail(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {top_n}")
    if input_length <= 0:
        raise _fail("`inputs` cannot be empty")
    max_new_tokens = _check_lengths(params, input_length, limits, prefix_length)
    if not 0 <= params.min_new_tokens <= max_new_tokens:
        raise _fail(
            f"`min_new_tokens` must be >= 0 and <= `max_new_tokens` ({max_new_tokens}). "
            f"Given: {params.min_new_tokens}"
        )
    _check_grammar(params)
    budget = params.thinking_budget
    if budget is not None and budget.tokens < 1:
        raise _fail(f"`thinking.budget_tokens` must be >= 1. Given: {budget.tokens}")
    if params.time_limit_ms is not None and not 0 < params.time_limit_ms <= MAX_TIME_LIMIT_MS:
        raise _fail(
            f"`time_limit_ms` must be > 0 and <= {MAX_TIME_LIMIT_MS}. Given: {params.time_limit_ms}"
        )
    return _normalize(params, max_new_tokens, best_of)


def _check_grammar(params: GenerateParameters) -> None:
    grammar = params.grammar
    if grammar is None:
        return
    if params.ignore_eos or params.min_new_tokens:
        # Named by the field the grammar came from: `response_format` or `tools` on the chat
        # routes, where `grammar` is no field of the request.
        raise _fail(
            f"`{grammar.source}` cannot be combined with `ignore_eos` or `min_new_tokens`: a "
            "complete grammar ends with EOS"
        )
    problem = grammar.problem()
    if problem is not None:
        what = {"json": "JSON schema", "regex": "regex", "lark": "grammar"}[grammar.kind]
        raise _fail(f"`{grammar.source}` is not a usable {what}: {problem}")


def _normalize(params: GenerateParameters, max_new_tokens: int, best_of: int) -> GenerateParameters:
    def unless(value: float | None, neutral: float) -> float | None:
        return None if value is None or value == neutral else value

    return replace(
        params,
        do_sample=params.do_sample or params.sampling_warpers or best_of > 1,
        temperature=unless(params.temperature, 1.0),
        repetition_penalty=unless(params.repetition_penalty, 1.0),
        frequency_penalty=unless(params.frequency_penalty, 0.0),
        presence_penalty=unless(params.presence_penalty, 0.0),
        top_n_tokens=params.top_n_tokens or None,
        max_new_tokens=max_new_tokens,
        stop=tuple(params.stop),
    )


def truncate_ids(ids: list[int], truncate: int | None) -> list[int]:
    """Keep the last `truncate` ids (TGI truncates from the left); None keeps them all."""
    if truncate is None or truncate >= len(ids):
        return list(ids)
    return list(ids[len(ids) - truncate :])
