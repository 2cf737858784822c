"""Aggregate a step's request records into its summary (the `steps[]` entries of results).

Latency distributions cover successful requests only, in seconds:

    ttft_s  time to first token: request sent -> first token received
    itl_s   inter-token latency: every gap between consecutive token events, all requests pooled
    tpot_s  time per output token of each request: (e2e - ttft) / (output tokens - 1)
    e2e_s   end-to-end latency: request sent -> stream finished

Each is summarized as p50/p90/p95/p99 (linear interpolation between order statistics, as
numpy's default) and mean, or null when no request measured it. Token and request rates divide
by the step's `elapsed` seconds (see StepResult.elapsed) and count successful requests only.

Goodput is the rate of successful requests that met every SLO given, e.g. `ttft=500ms,itl=50ms`:
`ttft`, `tpot` and `e2e` bound the request's own value, `itl` bounds the mean of its gaps.

`output_lengths` sets each successful answer's output tokens against the max_new_tokens it
asked for: an answer that ended at EOS is shorter, and a run of short answers measures less
work than its profile (random-weight models pick EOS early; `--ignore-eos` asks the server to
run every answer to its length).

Output tokens are counted from the stream (TGI: one event per token; OpenAI: one per content
chunk, or the server's `usage.completion_tokens`). Given `count_tokens` (the benchmark's
tokenizer), `token_check` re-tokenizes each successful answer and compares: a TGI record's
special tokens (the EOS) have no text, so its stream count less those is compared; an OpenAI
answer that stopped (`finish_reason` "stop") and whose stream count is the tokenizer's plus one
agrees (the server counted its EOS), and that EOS is left out of `stream_tokens`.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from tgis.benchmark.client import RequestRecord
from tgis.benchmark.load import StepResult

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "itl", "tpot", "e2e")
_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}
_SLO = re.compile(r"^\s*(\w+)\s*=\s*([0-9]*\.?[0-9]+)\s*(ms|us|s)\s*$")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of non-empty `values`, interpolating linearly."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    """{"p50", "p90", "p95", "p99", "mean"} of `values`, or None when there are none."""
    if not values:
        return None
    summary = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    summary["mean"] = sum(values) / len(values)
    return summary


def parse_slos(text: str) -> dict[str, float]:
    """`"ttft=500ms,itl=50ms"` -> {"ttft": 0.5, "itl": 0.05} (seconds). Units: ms, s, us."""
    slos: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _SLO.match(part)
        if match is None:
            raise ValueError(
                f"bad SLO {part!r}: write METRIC=VALUE with a unit, e.g. ttft=500ms,itl=50ms"
            )
        name, value, unit = match.groups()
        if name not in SLO_METRICS:
            raise ValueError(f"unknown SLO metric {name!r}: use one of {', '.join(SLO_METRICS)}")
        slos[name] = float(value) * _UNITS[unit]
    return slos


def gaps(record: RequestRecord) -> list[float]:
    """Seconds between consecutive token events of one request."""
    times = record.token_times
    return [b - a for a, b in itertools.pairwise(times)]


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first, or None with fewer than 2 tokens."""
    if record.output_tokens < 2 or record.ttft is None:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def request_values(record: RequestRecord) -> dict[str, float | None]:
    """The per-request values SLOs are checked against."""
    between = gaps(record)
    return {
        "ttft": record.ttft,
        "itl": sum(between) / len(between) if between else None,
        "tpot": tpot(record),
        "e2e": record.latency,
    }


def meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    """True when `record` succeeded and no SLO is exceeded (an unmeasured value, e.g. the ITL
    of a one-token answer, cannot exceed one; a missing first token fails a ttft SLO)."""
    if not record.ok:
        return False
    values = request_values(record)
    for name, limit in slos.items():
        value = values[name]
        if value is None and name == "ttft":
            return False
        if value is not None and value > limit:
            return False
    return True


def stream_count(record: RequestRecord, tokenizer_count: int) -> tuple[int, bool]:
    """The stream's count of `record` as compared with `tokenizer_count` (the re-tokenized
    text), and whether the two agree (see the module doc)."""
    stream = record.output_tokens - record.special_tokens
    if stream == tokenizer_count + 1 and record.finish_reason == "stop":
        return tokenizer_count, True  # the server's count includes the EOS
    return stream, stream == tokenizer_count


def token_check(
    records: Sequence[RequestRecord], count_tokens: Callable[[str], int]
) -> dict[str, Any]:
    """Stream token counts of the successful `records` against their re-tokenized text:
    {"requests", "stream_tokens", "tokenizer_tokens", "agreeing_requests", "ratio"}, where
    ratio is tokenizer_tokens / stream_tokens (None when the stream counted no tokens)."""
    checked = stream_total = tokenizer_total = agreeing = 0
    for record in records:
        if not record.ok:
            continue
        counted = count_tokens(record.text)
        stream, agrees = stream_count(record, counted)
        checked += 1
        stream_total += stream
        tokenizer_total += counted
        agreeing += int(agrees)
    return {
        "requests": checked,
        "stream_tokens": stream_total,
        "tokenizer_tokens": tokenizer_total,
        "agreeing_requests": agreeing,
        "ratio": tokenizer_total / stream_total if stream_total else None,
    }


def output_lengths(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """The output tokens of the successful `records` against what each asked for:
    {"requests", "short_requests" (fewer tokens than asked), "tokens" (min, p50, mean, max of
    the answers' output tokens), "asked" (min, mean, max of their max_new_tokens)}; None
    when none succeeded."""
    ok = [r for r in records if r.ok]
    if not ok:
        return None
    tokens = [r.output_tokens for r in ok]
    asked = [r.max_new_tokens for r in ok]
    return {
        "requests": len(ok),
        "short_requests": sum(r.output_tokens < r.max_new_tokens for r in ok),
        "tokens": {
            "min": min(tokens),
            "p50": percentile(tokens, 50),
            "mean": sum(tokens) / len(tokens),
            "max": max(tokens),
        },
        "asked": {"min": min(asked), "mean": sum(asked) / len(asked), "max": max(asked)},
    }


def summarize(
    step: StepResult,
    slos: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """The JSON summary of one step (see results.RESULTS_SCHEMA for the exact shape);
    `token_check` is null without `count_tokens` (a tokenizer's count of a text's tokens)."""
    ok = [r for r in step.records if r.ok]
    elapsed = step.elapsed
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    errors = Counter(r.error for r in step.records if r.error is not None)
    per_second = (lambda n: n / elapsed) if elapsed > 0 else (lambda n: 0.0)
    summary: dict[str, Any] = {
        "kind": step.kind,
        "target": step.target,
        "elapsed_s": elapsed,
        "requests": {
            "total": len(step.records),
            "ok": len(ok),
            "failed": len(step.records) - len(ok),
            "warmup": step.warmup_requests,
        },
        "errors": dict(sorted(errors.items())),
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": distribution([g for r in ok for g in gaps(r)]),
        "tpot_s": distribution([t for r in ok if (t := tpot(r)) is not None]),
        "e2e_s": distribution([r.latency for r in ok]),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_tokens_per_s": per_second(output),
        "total_tokens_per_s": per_second(prompt + output),
        "requests_per_s": per_second(len(ok)),
        "goodput": None,
        "token_check": None if count_tokens is None else token_check(ok, count_tokens),
        "output_lengths": output_lengths(ok),
    }
    if slos:
        good = sum(1 for r in step.records if meets(r, slos))
        summary["goodput"] = {
            "slos_s": dict(slos),
            "requests": good,
            "requests_per_s": per_second(good),
            "fraction": good / len(step.records) if step.records else 0.0,
        }
    return summary
