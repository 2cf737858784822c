"""TGIS's request semantics: defaults, every validation message in its order, the length rule."""

from __future__ import annotations

import math

import pytest

from tgis.errors import InputValidationError
from tgis.fmaas import generation_pb2 as pb
from tgis.fmaas.convert import GrpcLimits, convert

LIMITS = GrpcLimits.of(max_sequence_length=200, max_new_tokens=169)


def params(**parts: object) -> pb.Parameters:
    return pb.Parameters(**parts)  # type: ignore[arg-type]


def sample(**sampling: object) -> pb.Parameters:
    return params(method=pb.SAMPLE, sampling=pb.SamplingParameters(**sampling))  # type: ignore[arg-type]


def refused(p: pb.Parameters, limits: GrpcLimits = LIMITS) -> str:
    with pytest.raises(InputValidationError) as info:
        convert(p, limits)
    return str(info.value)


def test_greedy_defaults_are_tgis() -> None:
    converted = convert(params(), LIMITS)
    p = converted.params
    assert not p.do_sample and converted.fit(5, 0, LIMITS).seed is None
    assert p.max_new_tokens == 20 and p.min_new_tokens == 0  # 0 means 20
    assert p.temperature is p.top_k is p.top_p is p.typical_p is p.repetition_penalty is None
    assert p.include_stop_sequence is True and p.skip_special_tokens is True
    assert p.truncate is None and p.time_limit_ms is None and p.length_penalty is None


def test_greedy_ignores_sampling_fields() -> None:
    p = convert(params(sampling=pb.SamplingParameters(temperature=0.01, top_k=5, seed=3)), LIMITS)
    assert not p.params.do_sample and p.params.top_k is None
    assert p.fit(5, 0, LIMITS).seed is None


def test_sampling_zero_values_mean_disabled_and_a_random_32_bit_seed() -> None:
    converted = convert(sample(), LIMITS)
    p = converted.params
    assert p.do_sample and p.temperature is None and p.top_p is None and p.typical_p is None
    # One seed per input: a batch's identical inputs still sample apart.
    seeds = {converted.fit(5, 0, LIMITS).seed for _ in range(20)}
    assert all(s is not None and 0 <= s < 2**32 for s in seeds) and len(seeds) > 1
    given = convert(sample(seed=2**63 + 5), LIMITS)
    assert {given.fit(5, 0, LIMITS).seed for _ in range(3)} == {2**63 + 5}
    assert convert(sample(seed=0), LIMITS).fit(5, 0, LIMITS).seed == 0  # present, though 0


def test_sampling_values_reach_the_engine() -> None:
    p = convert(
        params(
            method=pb.SAMPLE,
            sampling=pb.SamplingParameters(temperature=0.7, top_k=4, top_p=0.9, typical_p=0.5),
            decoding=pb.DecodingParameters(
                repetition_penalty=1.2,
                length_penalty=pb.DecodingParameters.LengthPenalty(start_index=3, decay_factor=1.5),
            ),
            stopping=pb.StoppingCriteria(
                max_new_tokens=9,
                min_new_tokens=2,
                time_limit_millis=500,
                stop_sequences=["\n"],
                include_stop_sequence=False,
            ),
            truncate_input_tokens=7,
        ),
        LIMITS,
    ).params
    assert p.temperature == pytest.approx(0.7) and p.top_k == 4
    assert p.top_p == pytest.approx(0.9) and p.typical_p == pytest.approx(0.5)
    assert p.repetition_penalty == pytest.approx(1.2) and p.length_penalty == (3, 1.5)
    assert (p.max_new_tokens, p.min_new_tokens, p.time_limit_ms) == (9, 2, 500)
    assert p.stop == ("\n",) and p.include_stop_sequence is False and p.truncate == 7


def test_server_defaults_for_stop_sequences_and_special_tokens() -> None:
    limits = GrpcLimits.of(200, 169, default_include_stop_seqs=False, output_special_tokens=True)
    p = convert(params(), limits).params
    assert p.include_stop_sequence is False and p.skip_special_tokens is False
    kept = params(stopping=pb.StoppingCriteria(include_stop_sequence=True))
    assert convert(kept, limits).params.include_stop_sequence is True


def test_server_max_new_tokens_stays_below_the_sequence_length() -> None:
    assert GrpcLimits.of(200, 1024).max_new_tokens == 199


@pytest.mark.parametrize(
    ("p", "message"),
    [
        (sample(temperature=0.02), "temperature must be >= 0.05"),
        (sample(temperature=math.nan), "temperature must be >= 0.05"),
        (sample(top_p=1.5), "top_p must be > 0.0 and <= 1.0"),
        (sample(top_p=-0.1), "top_p must be > 0.0 and <= 1.0"),
        (sample(typical_p=1.01), "typical_p must be <= 1.0"),
        (params(stopping=pb.StoppingCriteria(max_new_tokens=170)), "max_new_tokens must be <= 169"),
        (
            params(stopping=pb.StoppingCriteria(max_new_tokens=5, min_new_tokens=6)),
            "min_new_tokens must be <= max_new_tokens",
        ),
        (
            params(decoding=pb.DecodingParameters(repetition_penalty=-1.0)),
            "repetition_penalty must be > 0.0",
        ),
        (
            params(
                decoding=pb.DecodingParameters(
                    length_penalty=pb.DecodingParameters.LengthPenalty(decay_factor=0.5)
                )
            ),
            "length_penalty must be >= 1.0 and <= 10.0",
        ),
        (
            params(stopping=pb.StoppingCriteria(stop_sequences=["a"] * 7)),
            "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes",
        ),
        (
            params(stopping=pb.StoppingCriteria(stop_sequences=["a", ""])),
            "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes",
        ),
        (
            params(stopping=pb.StoppingCriteria(stop_sequences=["é" * 121])),  # 242 bytes
            "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes",
        ),
        (
            params(response=pb.ResponseOptions(token_logprobs=True)),
            "must request input and/or generated tokens to request extra token detail",
        ),
        (
            params(response=pb.ResponseOptions(generated_tokens=True, top_n_tokens=6)),
            "top_n_tokens must be <= 5",
        ),
    ],
)
def test_each_rule_has_tgis_message(p: pb.Parameters, message: str) -> None:
    assert refused(p) == message


def test_rules_are_checked_in_tgis_order() -> None:
    both = sample(temperature=0.01, top_p=2.0)
    assert refused(both) == "temperature must be >= 0.05"
    tokens = params(
        stopping=pb.StoppingCriteria(max_new_tokens=500, min_new_tokens=600),
        response=pb.ResponseOptions(token_ranks=True),
    )
    assert refused(tokens) == "max_new_tokens must be <= 169"


def test_a_stop_sequence_of_240_bytes_is_allowed() -> None:
    p = params(stopping=pb.StoppingCriteria(stop_sequences=["é" * 120]))
    assert convert(p, LIMITS).params.stop == ("é" * 120,)


def test_length_rule_cuts_max_new_tokens_to_fit_and_marks_token_limit() -> None:
    converted = convert(params(stopping=pb.StoppingCriteria(max_new_tokens=100)), LIMITS)
    fitted = converted.fit(186, 0, LIMITS)
    assert fitted.token_limit and fitted.params.max_new_tokens == 14
    fits = converted.fit(100, 0, LIMITS)
    assert not fits.token_limit and fits.params.max_new_tokens == 100


def test_length_rule_messages() -> None:
    stopping = pb.StoppingCriteria(max_new_tokens=160, min_new_tokens=150)
    converted = convert(params(stopping=stopping), LIMITS)
    with pytest.raises(InputValidationError) as info:
        converted.fit(200, 0, LIMITS)
    assert str(info.value) == "input tokens (200) plus prefix length (0) must be < 200"
    with pytest.raises(InputValidationError) as info:
        converted.fit(69, 0, LIMITS)
    assert str(info.value) == (
        "input tokens (69) plus prefix length (0) plus min_new_tokens (150) must be <= 200"
    )
