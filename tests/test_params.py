"""Request validation: TGI's messages, its order of checks, and the normalized parameters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tgis.config import ServeConfig
from tgis.errors import InputValidationError
from tgis.params import GenerateParameters, RequestLimits, truncate_ids, validate

LIMITS = RequestLimits(
    max_best_of=2,
    max_stop_sequences=3,
    max_top_n_tokens=4,
    max_input_tokens=10,
    max_total_tokens=16,
)
P = GenerateParameters


def error(params: GenerateParameters, input_length: int = 3, **kw: object) -> str:
    with pytest.raises(InputValidationError) as info:
        validate(params, input_length, kw.pop("limits", LIMITS), **kw)  # type: ignore[arg-type]
    assert str(info.value) == info.value.message  # no hint: the message is TGI's, verbatim
    return info.value.message


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (P(temperature=0.0), "`temperature` must be strictly positive"),
        (P(temperature=-1.0), "`temperature` must be strictly positive"),
        (P(temperature=float("nan")), "`temperature` must be strictly positive"),
        (P(repetition_penalty=0.0), "`repetition_penalty` must be strictly positive"),
        (P(frequency_penalty=2.5), "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        (P(frequency_penalty=-2.01), "`frequency_penalty` must be >= -2.0 and <= 2.0"),
        (P(presence_penalty=3.0), "`presence_penalty` must be >= -2.0 and <= 2.0"),
        (P(top_p=1.0), "`top_p` must be > 0.0 and < 1.0"),
        (P(top_p=0.0), "`top_p` must be > 0.0 and < 1.0"),
        (P(typical_p=1.0), "`typical_p` must be > 0.0 and < 1.0"),
        (P(typical_p=-0.1), "`typical_p` must be > 0.0 and < 1.0"),
        (P(top_k=0), "`top_k` must be strictly positive"),
        (P(top_k=-3), "`top_k` must be strictly positive"),
        (P(max_new_tokens=0), "`max_new_tokens` must be strictly positive"),
        (P(stop=("a", "b", "c", "d")), "`stop` supports up to 3 stop sequences. Given: 4"),
        (P(top_n_tokens=5), "`top_n_tokens` must be >= 0 and <= 4. Given: 5"),
        (P(top_n_tokens=-1), "`top_n_tokens` must be >= 0 and <= 4. Given: -1"),
        (P(best_of=3, do_sample=True), "`best_of` must be > 0 and <= 2. Given: 3"),
        (P(best_of=0), "`best_of` must be > 0 and <= 2. Given: 0"),
        (P(best_of=2), "you must use sampling when `best_of` is > 1"),
        (P(best_of=2, do_sample=True, seed=1), "`seed` must not be set when `best_of` > 1"),
        (P(truncate=0), "`truncate` must be strictly positive and less than 10. Given: 0"),
        (P(truncate=11), "`truncate` must be strictly positive and less than 10. Given: 11"),
        (
            P(max_new_tokens=14),
            "`inputs` tokens + `max_new_tokens` must be <= 16. Given: 3 `inputs` tokens and 14 `max_new_tokens`",
        ),
        (
            P(min_new_tokens=5, max_new_tokens=4),
            "`min_new_tokens` must be >= 0 and <= `max_new_tokens` (4). Given: 5",
        ),
        (P(time_limit_ms=0), "`time_limit_ms` must be > 0 and <= 2147483647. Given: 0"),
        (P(seed=-1), "`seed` must be >= 0 and <= 18446744073709551615. Given: -1"),
        (
            P(logit_bias=((3, 100.5),)),
            "`logit_bias` values must be >= -100 and <= 100. Given: 100.5 for token 3",
        ),
        (
            P(logit_bias=((3, float("nan")),)),
            "`logit_bias` values must be >= -100 and <= 100. Given: nan for token 3",
        ),
        (P(logit_bias=((-1, 1.0),)), "`logit_bias` token ids must be >= 0. Given: -1"),
        (
            P(logit_bias=tuple((i, 1.0) for i in range(1025))),
            "`logit_bias` supports up to 1024 tokens. Given: 1025",
        ),
    ],
)
def test_each_violation_has_tgis_message(params: GenerateParameters, message: str) -> None:
    assert error(params) == message


def test_input_length_messages() -> None:
    assert error(P(), input_length=0) == "`inputs` cannot be empty"
    # TGI checks the total first: a too-long prompt with max_new_tokens set fails on the total.
    assert error(P(max_new_tokens=2), input_length=15) == (
        "`inputs` tokens + `max_new_tokens` must be <= 16. Given: 15 `inputs` tokens and 2 `max_new_tokens`"
    )
    assert error(P(max_new_tokens=2), input_length=11) == (
        "`inputs` must have less than 10 tokens. Given: 11"
    )
    # Without max_new_tokens the total always fits, so the input limit speaks.
    assert error(P(), input_length=12) == "`inputs` must have less than 10 tokens. Given: 12"
    # truncate makes a long prompt acceptable: only the last 8 tokens count.
    assert validate(P(truncate=8, max_new_tokens=8), 50, LIMITS).max_new_tokens == 8


def test_streaming_refuses_best_of_and_prefill_details() -> None:
    assert (
        error(P(best_of=2, do_sample=True), stream=True)
        == "`best_of` != 1 is not supported when streaming tokens"
    )
    assert (
        error(P(decoder_input_details=True), stream=True)
        == "`decoder_input_details` == true is not supported when streaming tokens"
    )
    validate(P(best_of=1, decoder_input_details=False), 3, LIMITS, stream=True)
    validate(P(decoder_input_details=True), 3, LIMITS, stream=False)


def test_best_of_disabled_when_server_allows_one() -> None:
    one = replace(LIMITS, max_best_of=1)
    assert (
        error(P(best_of=2, do_sample=True), limits=one)
        == "`best_of` != 1 is not allowed for this endpoint"
    )
    assert validate(P(best_of=1), 3, one).best_of == 1


def test_best_of_accepts_any_sampling_parameter_as_sampling() -> None:
    # TGI's router counts any warper given, even a neutral one, as "sampling".
    out = validate(P(best_of=2, temperature=1.0), 3, LIMITS)
    assert out.do_sample and out.temperature is None


def test_checks_run_in_tgis_order() -> None:
    # best_of before temperature, temperature before top_p, stop count before top_n_tokens.
    bad = P(best_of=3, temperature=0.0, top_p=2.0, stop=("a",) * 9, top_n_tokens=99)
    assert error(bad) == "`best_of` must be > 0 and <= 2. Given: 3"
    assert error(replace(bad, best_of=None)) == "`temperature` must be strictly positive"
    assert error(replace(bad, best_of=None, temperature=None)) == "`top_p` must be > 0.0 and < 1.0"
    assert error(replace(bad, best_of=None, temperature=None, top_p=None)).startswith("`stop`")


def test_max_new_tokens_defaults_to_what_fits() -> None:
    assert validate(P(), 3, LIMITS).max_new_tokens == 13
    assert validate(P(), 10, LIMITS).max_new_tokens == 6
    assert validate(P(truncate=4), 9, LIMITS).max_new_tokens == 12
    assert validate(P(max_new_tokens=5), 3, LIMITS).max_new_tokens == 5


def test_prompt_filling_the_whole_context_is_refused() -> None:
    full = replace(LIMITS, max_input_tokens=16)
    assert error(P(), input_length=16, limits=full) == (
        "`inputs` must have less than 16 tokens. Given: 16"
    )


def test_normalization_follows_tgis_server() -> None:
    plain = validate(P(), 3, LIMITS)
    assert not plain.do_sample
    # TGI's server samples whenever a warper is active, whatever do_sample says.
    for warper in (P(temperature=0.5), P(top_k=5), P(top_p=0.9), P(typical_p=0.5)):
        assert validate(warper, 3, LIMITS).do_sample, warper
    neutral = validate(
        P(
            temperature=1.0,
            repetition_penalty=1.0,
            frequency_penalty=0.0,
            presence_penalty=0.0,
            top_n_tokens=0,
        ),
        3,
        LIMITS,
    )
    assert not neutral.do_sample
    assert neutral.temperature is None and neutral.repetition_penalty is None
    assert neutral.frequency_penalty is None and neutral.presence_penalty is None
    assert neutral.top_n_tokens is None
    kept = validate(P(repetition_penalty=1.2, top_n_tokens=2, stop=("x",), seed=7), 3, LIMITS)
    assert (kept.repetition_penalty, kept.top_n_tokens, kept.stop, kept.seed) == (
        1.2,
        2,
        ("x",),
        7,
    )


def test_limits_from_config() -> None:
    config = ServeConfig(
        model_id="m",
        revision=None,
        backend="cpu",
        dtype=None,
        num_shard=1,
        port=80,
        hostname="0.0.0.0",
        max_concurrent_requests=128,
        max_best_of=3,
        max_stop_sequences=6,
        max_top_n_tokens=7,
        max_input_tokens=100,
        max_total_tokens=200,
        max_batch_prefill_tokens=256,
        max_batch_total_tokens=None,
        max_batch_size=None,
        max_waiting_tokens=20,
        waiting_served_ratio=1.2,
    )
    assert RequestLimits.from_config(config) == RequestLimits(3, 6, 7, 100, 200)


def test_truncate_ids_keeps_the_last_tokens() -> None:
    ids = [5, 6, 7, 8]
    assert truncate_ids(ids, 2) == [7, 8]
    assert truncate_ids(ids, 4) == ids
    assert truncate_ids(ids, 10) == ids
    assert truncate_ids(ids, None) == ids
    assert truncate_ids(ids, 2) is not ids


def test_the_servers_max_new_tokens_caps_requests_when_set() -> None:
    capped = replace(LIMITS, max_new_tokens=5)
    assert validate(P(), 3, capped).max_new_tokens == 5  # unset: what fits, then the cap
    assert validate(P(max_new_tokens=4), 3, capped).max_new_tokens == 4
    assert error(P(max_new_tokens=6), limits=capped) == "`max_new_tokens` must be <= 5. Given: 6"
    assert validate(P(), 3, LIMITS).max_new_tokens == 13  # no cap: what fits


def test_length_penalty_is_checked() -> None:
    assert validate(P(length_penalty=(2, 1.5)), 3, LIMITS).length_penalty == (2, 1.5)
    message = "`length_penalty.decay_factor` must be >= 1.0 and <= 10.0"
    assert error(P(length_penalty=(2, 0.5))) == message
    assert error(P(length_penalty=(2, float("nan")))) == message
    assert error(P(length_penalty=(-1, 2.0))) == "`length_penalty.start_index` must be >= 0"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (P(time_limit_ms=10**320), "`time_limit_ms` must be > 0 and <= 2147483647. Given: 1"),
        (P(temperature=1e-300), "`temperature` must be at least 0.0001"),
        (P(top_p=1e-300), "`top_p` must be at least 0.0001"),
        (P(typical_p=1e-300), "`typical_p` must be at least 0.0001"),
        (P(repetition_penalty=1e-300), "`repetition_penalty` must be at least 0.0001"),
        (P(temperature=1e300), "`temperature` must be at most 10000"),
        (P(repetition_penalty=1e5), "`repetition_penalty` must be at most 10000"),
    ],
)
def test_values_that_would_overflow_are_refused(params: GenerateParameters, message: str) -> None:
    """Each once stopped the engine or turned scores into NaN (a time limit of 1e320 ms
    overflowed a division at admission; 1e-300 is 0 in float32; 1 / 1e300 is 0 in float32,
    and the EOS mask of min_new_tokens times it NaN)."""
    assert error(params).startswith(message)
