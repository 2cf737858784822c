"""Percentiles, per-request values, goodput and step summaries on synthetic records."""

from __future__ import annotations

import pytest

from tgis.benchmark.client import RequestRecord
from tgis.benchmark.load import StepResult
from tgis.benchmark.metrics import (
    distribution,
    meets,
    output_lengths,
    parse_slos,
    percentile,
    request_values,
    summarize,
    token_check,
)


def words(text: str) -> int:
    """A stand-in tokenizer: one token per word."""
    return len(text.split())


def answer(
    text: str,
    stream: int,
    special: int = 0,
    finish: str | None = None,
    error: str | None = None,
) -> RequestRecord:
    """A finished record whose stream counted `stream` tokens for `text`."""
    return RequestRecord(
        0.0,
        10,
        16,
        end=1.0,
        token_times=[0.5] * stream,
        output_tokens=stream,
        text=text,
        special_tokens=special,
        finish_reason=finish,
        error=error,
    )


def record(
    start: float, token_times: list[float], end: float, error: str | None = None, prompt: int = 10
) -> RequestRecord:
    return RequestRecord(
        start=start,
        prompt_tokens=prompt,
        max_new_tokens=len(token_times),
        end=end,
        token_times=token_times,
        output_tokens=len(token_times),
        error=error,
    )


def test_percentile_interpolates_linearly() -> None:
    values = [float(x) for x in range(10, 0, -1)]  # 10..1, unsorted
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([3.0], 95) == 3.0
    with pytest.raises(ValueError, match="percentile of no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"percentile must be within 0\.\.100, got 101"):
        percentile(values, 101)


def test_distribution() -> None:
    assert distribution([]) is None
    summary = distribution([1.0, 2.0, 3.0, 4.0])
    assert summary == pytest.approx({"p50": 2.5, "p90": 3.7, "p95": 3.85, "p99": 3.97, "mean": 2.5})


def test_parse_slos() -> None:
    assert parse_slos("ttft=500ms,itl=50ms") == pytest.approx({"ttft": 0.5, "itl": 0.05})
    assert parse_slos(" e2e = 2s , tpot=1500us ") == pytest.approx({"e2e": 2.0, "tpot": 0.0015})
    assert parse_slos("") == {}
    with pytest.raises(ValueError, match=r"bad SLO 'ttft=500': write METRIC=VALUE with a unit"):
        parse_slos("ttft=500")
    with pytest.raises(ValueError, match="unknown SLO metric 'latency'"):
        parse_slos("latency=1s")


def test_request_values() -> None:
    r = record(0.0, [0.2, 0.3, 0.5], 0.6)
    values = request_values(r)
    assert values["ttft"] == pytest.approx(0.2)
    assert values["itl"] == pytest.approx(0.15)  # gaps 0.1 and 0.2
    assert values["tpot"] == pytest.approx((0.6 - 0.2) / 2)
    assert values["e2e"] == pytest.approx(0.6)


def test_goodput_checks_every_slo() -> None:
    slos = {"ttft": 0.5, "itl": 0.05}
    assert meets(record(0, [0.4, 0.44, 0.48], 0.5), slos)
    assert not meets(record(0, [0.6, 0.61], 0.62), slos)  # slow first token
    assert not meets(record(0, [0.1, 0.2, 0.3], 0.3), slos)  # slow decoding
    assert not meets(record(0, [0.1, 0.11], 0.12, error="timeout"), slos)
    assert not meets(record(0, [], 0.1), slos)  # no first token
    assert meets(record(0, [0.1], 0.1), slos)  # one token: no gap to exceed


def test_summarize_a_step() -> None:
    step = StepResult("rate", 2.0, measure_from=100.0, stop_at=102.0, warmup_requests=3)
    step.records = [
        record(100.0, [100.1, 100.12, 100.14], 100.15),
        record(100.5, [100.9, 100.92], 100.93, prompt=20),
        record(101.0, [101.1], 103.0, error="timeout"),
        record(101.5, [], 101.6, error="http_500"),
        record(101.6, [], 101.7, error="http_500"),
    ]
    s = summarize(step, {"ttft": 0.2})
    assert s["elapsed_s"] == pytest.approx(3.0)  # the timed-out request ended at 103
    assert s["requests"] == {"total": 5, "ok": 2, "failed": 3, "warmup": 3}
    assert s["errors"] == {"http_500": 2, "timeout": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.25)
    assert s["ttft_s"]["mean"] == pytest.approx(0.25)
    assert s["itl_s"]["mean"] == pytest.approx(0.02)
    assert s["e2e_s"]["p99"] == pytest.approx(0.15 + 0.99 * (0.43 - 0.15))
    assert s["output_tokens"] == 5 and s["prompt_tokens"] == 30
    assert s["output_tokens_per_s"] == pytest.approx(5 / 3)
    assert s["total_tokens_per_s"] == pytest.approx(35 / 3)
    assert s["requests_per_s"] == pytest.approx(2 / 3)
    goodput = s["goodput"]
    assert goodput.pop("slos_s") == {"ttft": 0.2}
    assert goodput == pytest.approx({"requests": 1, "requests_per_s": 1 / 3, "fraction": 0.2})


def test_summarize_an_empty_step() -> None:
    s = summarize(StepResult("throughput", 4, 0.0, 1.0))
    assert s["ttft_s"] is None and s["itl_s"] is None and s["tpot_s"] is None
    assert s["requests"]["total"] == 0 and s["requests_per_s"] == 0.0
    assert s["goodput"] is None


def test_token_check_leaves_out_tgi_special_tokens() -> None:
    records = [
        answer("a b c", 4, special=1),  # 3 words and the EOS
        answer("d e", 2),  # cut at max_new_tokens: no special token
        answer("x y z", 9, error="timeout"),  # failed: not checked
    ]
    assert token_check(records, words) == {
        "requests": 2,
        "stream_tokens": 5,
        "tokenizer_tokens": 5,
        "agreeing_requests": 2,
        "ratio": 1.0,
    }


def test_token_check_allows_the_eos_of_a_stopped_openai_answer() -> None:
    records = [
        answer("a b c", 4, finish="stop"),  # usage counted the EOS
        answer("d e f", 3, finish="length"),
        answer("g h", 3, finish="length"),  # one more but not a stop: disagrees
        answer("i j", 4, finish="stop"),  # two more: disagrees
    ]
    check = token_check(records, words)
    assert check["requests"] == 4 and check["agreeing_requests"] == 2
    assert check["stream_tokens"] == 3 + 3 + 3 + 4  # the EOS left out of the first only
    assert check["tokenizer_tokens"] == 10
    assert check["ratio"] == pytest.approx(10 / 13)


def test_token_check_reports_a_mismatch() -> None:
    """Chunks carrying two tokens each, counted one per chunk, without usage."""
    records = [answer("a b c d", 2, finish="stop"), answer("e f g h i j", 3, finish="length")]
    check = token_check(records, words)
    assert check == {
        "requests": 2,
        "stream_tokens": 5,
        "tokenizer_tokens": 10,
        "agreeing_requests": 0,
        "ratio": 2.0,
    }
    assert token_check([answer("", 0)], words)["ratio"] is None  # no stream tokens


def test_summarize_checks_tokens_only_with_a_tokenizer() -> None:
    step = StepResult("throughput", 1, 0.0, 1.0)
    step.records = [answer("a b", 3, special=1), answer("c", 1, error="http_500")]
    assert summarize(step)["token_check"] is None
    check = summarize(step, count_tokens=words)["token_check"]
    assert check["requests"] == 1 and check["agreeing_requests"] == 1
    assert check["stream_tokens"] == check["tokenizer_tokens"] == 2


def asked(max_new_tokens: int, output_tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(0.0, 10, max_new_tokens, end=1.0, output_tokens=output_tokens, error=error)


def test_output_lengths_set_the_answers_against_what_they_asked() -> None:
    records = [
        asked(8, 8),
        asked(8, 3),  # ended at EOS
        asked(16, 2),
        asked(16, 16),
        asked(8, 0, error="timeout"),  # failed: not counted
    ]
    assert output_lengths(records) == {
        "requests": 4,
        "short_requests": 2,
        "tokens": {"min": 2, "p50": pytest.approx(5.5), "mean": pytest.approx(29 / 4), "max": 16},
        "asked": {"min": 8, "mean": 12.0, "max": 16},
    }
    assert output_lengths([asked(8, 8)])["short_requests"] == 0
    assert output_lengths([asked(8, 0, error="http_500")]) is None


def test_summarize_records_the_output_lengths() -> None:
    step = StepResult("throughput", 1, 0.0, 1.0)
    step.records = [asked(6, 2), asked(6, 6), asked(6, 1, error="http_500")]
    lengths = summarize(step)["output_lengths"]
    assert lengths["requests"] == 2 and lengths["short_requests"] == 1
    assert lengths["tokens"]["min"] == 2 and lengths["asked"] == {"min": 6, "mean": 6.0, "max": 6}
    assert summarize(StepResult("throughput", 1, 0.0, 1.0))["output_lengths"] is None
