"""Rich tables of benchmark results: one run's steps, and two runs compared step by step.

    console.print(results_table(data))
    if (warning := token_check_warning(data)) is not None:
        console.print(warning)
    if (warning := short_output_warning(data)) is not None:
        console.print(warning)
    console.print(compare_table(read_results("a.json"), read_results("b.json")))
    console.print(engine_compare_table(read_results("a.json"), read_results("b.json")))

Compared steps are matched by position among the steps of the same kind (a sweep's rate steps
depend on the throughput each run found, so their targets differ between runs); compared
`--engine` runs by batch size. A ratio is B / A, so > 1 means B is larger (better for
throughput, worse for latency).
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from tgis.benchmark.images import describe_images

# A step's token_check ratio further than this from 1 is worth a warning.
TOKEN_CHECK_TOLERANCE = 0.10

# (header, getter of one step summary) for the compare table.
COMPARED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("output tok/s", ("output_tokens_per_s",)),
    ("req/s", ("requests_per_s",)),
    ("TTFT p50", ("ttft_s", "p50")),
    ("TTFT p99", ("ttft_s", "p99")),
    ("ITL p50", ("itl_s", "p50")),
    ("ITL p99", ("itl_s", "p99")),
    ("e2e p50", ("e2e_s", "p50")),
)


def target_label(step: dict[str, Any]) -> str:
    """`8 users` for a throughput step, `2.50 req/s` for a rate step."""
    if step["kind"] == "throughput":
        return f"{int(step['target'])} users"
    return f"{step['target']:.2f} req/s"


def images_label(images: Any) -> str | None:
    """A profile's `images` in words (see images.describe_images); None without images."""
    return describe_images(images) if isinstance(images, dict) else None


def _get(step: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = step
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def results_table(data: dict[str, Any], title: str | None = None) -> Table:
    """Per step: target, requests, errors, output tok/s, TTFT/ITL p50 and p99, e2e p50 (ms),
    and goodput when SLOs were given."""
    steps = data["steps"]
    with_goodput = any(step.get("goodput") for step in steps)
    config = data.get("config", {})
    profile = config.get("profile", {})
    images = images_label(profile.get("images"))
    table = Table(
        title=title
        or f"tgis benchmark: {config.get('kind', '?')} on {config.get('url', '?')} "
        f"({config.get('api', '?')}, profile {profile.get('name', '?')}"
        f"{', ' + images if images else ''})"
    )
    # An embeddings run answers each request at once: its measures are requests and latency.
    embeddings = config.get("api") == "embeddings"
    first = ("step", "target", "requests", "errors")
    headers = (
        ("req/s", "e2e p50 ms", "e2e p99 ms")
        if embeddings
        else ("output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "e2e p50 ms")
    )  # fmt: skip
    for header in (*first, *headers):
        table.add_column(header, justify="left" if header in ("step", "target") else "right")
    if with_goodput:
        table.add_column("goodput", justify="right")
    for index, step in enumerate(steps, start=1):
        requests = step["requests"]
        row = [f"{index} {step['kind']}", target_label(step), str(requests["ok"]),
               str(requests["failed"])]  # fmt: skip
        if embeddings:
            row += [
                f"{step['requests_per_s']:.1f}",
                _ms(_get(step, ("e2e_s", "p50"))),
                _ms(_get(step, ("e2e_s", "p99"))),
            ]
        else:
            row += [
                f"{step['output_tokens_per_s']:.1f}",
                _ms(_get(step, ("ttft_s", "p50"))),
                _ms(_get(step, ("ttft_s", "p99"))),
                _ms(_get(step, ("itl_s", "p50"))),
                _ms(_get(step, ("itl_s", "p99"))),
                _ms(_get(step, ("e2e_s", "p50"))),
            ]
        if with_goodput:
            goodput = step.get("goodput")
            row.append(
                "-"
                if not goodput
                else f"{goodput['requests_per_s']:.2f}/s ({goodput['fraction']:.0%})"
            )
        table.add_row(*row)
    return table


def token_check_warning(data: dict[str, Any]) -> str | None:
    """A yellow one-line warning (rich markup) when the tokenizer's count of some step's answers
    differs from the stream's by more than TOKEN_CHECK_TOLERANCE; None otherwise."""
    off = []
    for index, step in enumerate(data["steps"], start=1):
        check = step.get("token_check")
        value = check.get("ratio") if isinstance(check, dict) else None
        if isinstance(value, (int, float)) and abs(value - 1) > TOKEN_CHECK_TOLERANCE:
            off.append(f"step {index} {value:.2f}x")
    if not off:
        return None
    config = data.get("config", {})
    eos = ""
    if config.get("ignore_eos") and str(config.get("api", "")).startswith("openai"):
        eos = (
            ", or, with --ignore-eos, the server counts in its usage the EOS tokens it sampled, "
            "which have no text"
        )
    return (
        f"[yellow]warning: the tokenizer counts the answers' tokens differently from the stream "
        f"({', '.join(off)}): the server's chunks may carry several tokens while it sends no "
        f"usage, or --tokenizer may not be the served model's{eos}[/]"
    )


def _asked(asked: dict[str, Any]) -> str:
    """`8 asked`, or `20-600 asked (mean 200.0)` when the answers asked for different lengths."""
    low, high = int(asked["min"]), int(asked["max"])
    if low == high:
        return f"{high} asked"
    return f"{low}-{high} asked (mean {asked['mean']:.1f})"


def short_output_warning(data: dict[str, Any]) -> str | None:
    """A yellow warning (rich markup) naming the steps whose answers came back with fewer
    output tokens than their max_new_tokens: how many, and their mean and min tokens against
    the asked length; None when every answer ran to its length (or no step recorded
    `output_lengths`)."""
    if data.get("config", {}).get("api") == "embeddings":
        return None  # no answer has tokens to count
    short = []
    for index, step in enumerate(data["steps"], start=1):
        lengths = step.get("output_lengths")
        if not isinstance(lengths, dict) or not lengths.get("short_requests"):
            continue
        tokens = lengths["tokens"]
        short.append(
            f"step {index}: {lengths['short_requests']} of {lengths['requests']} requests, "
            f"mean {tokens['mean']:.1f} and min {int(tokens['min'])} tokens against "
            f"{_asked(lengths['asked'])}"
        )
    if not short:
        return None
    config = data.get("config", {})
    if config.get("json_schema") is not None:
        why = "expected with --json-schema: an answer ends once it matches the schema"
    elif config.get("ignore_eos"):
        why = (
            "they were sent with ignore_eos (--ignore-eos), so the server may not honour it, "
            "or its limits cut the answers (tgis serve's --max-new-tokens)"
        )
    else:
        why = (
            "answers that end at EOS measure less work than the workload asks (random-weight "
            "models pick EOS early); --ignore-eos runs every answer to its length on servers "
            "that take vLLM's ignore_eos"
        )
    return f"[yellow]warning: answers came back shorter than asked ({'; '.join(short)}): {why}[/]"


def matched_steps(
    a: dict[str, Any], b: dict[str, Any]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of steps of `a` and `b` with the same kind and position among that kind's steps."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for step in b["steps"]:
        by_kind.setdefault(step["kind"], []).append(step)
    seen: dict[str, int] = {}
    pairs = []
    for step in a["steps"]:
        index = seen.get(step["kind"], 0)
        seen[step["kind"]] = index + 1
        others = by_kind.get(step["kind"], [])
        if index < len(others):
            pairs.append((step, others[index]))
    return pairs


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a, or None when either is missing or a is 0."""
    if a is None or b is None or a == 0:
        return None
    return b / a


def _cell(a: float | None, b: float | None, latency: bool) -> str:
    value = ratio(a, b)
    if value is None:
        return "-"
    shown = (lambda v: _ms(v)) if latency else (lambda v: f"{v:.1f}")
    better = value < 1 if latency else value > 1
    colour = "green" if better and abs(value - 1) > 0.05 else "red" if abs(value - 1) > 0.05 else ""
    text = f"{shown(a)} → {shown(b)} ({value:.2f}x)"
    return f"[{colour}]{text}[/]" if colour else text


def compare_table(
    a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")
) -> Table:
    """Each matching step of `a` and `b`: every COMPARED metric as `A → B (B/A x)`; latencies in
    ms. Green marks B better by more than 5 %, red worse."""
    table = Table(title=f"tgis benchmark: {names[1]} / {names[0]} (ratio B/A)")
    table.add_column("step")
    table.add_column("target A → B")
    for header, path in COMPARED:
        table.add_column(header + (" ms" if len(path) > 1 else ""), justify="right")
    pairs = matched_steps(a, b)
    for index, (sa, sb) in enumerate(pairs, start=1):
        cells = [
            _cell(_get(sa, path), _get(sb, path), latency=len(path) > 1) for _, path in COMPARED
        ]
        table.add_row(f"{index} {sa['kind']}", f"{target_label(sa)} → {target_label(sb)}", *cells)
    if not pairs:
        table.caption = "no steps of the same kind to compare"
    return table


# (header, getter of one engine_steps entry, latency?) for the engine compare table.
ENGINE_COMPARED: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("prefill p50 ms", ("prefill_latency_s", "p50"), True),
    ("prefill tok/s", ("prefill_tokens_per_s",), False),
    ("decode step p50 ms", ("decode_latency_s", "p50"), True),
    ("decode tok/s", ("decode_tokens_per_s",), False),
)
# The serving loop's decode step and its host work, compared where a run measured them.
ENGINE_LOOP_COMPARED: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("loop step p50 ms", ("decode_step_s", "p50"), True),
    ("loop host p50 ms", ("decode_host_s", "p50"), True),
)


def is_engine(data: dict[str, Any]) -> bool:
    """True for the results of an in-process run (`--engine`)."""
    config = data.get("config")
    return isinstance(config, dict) and config.get("mode") == "engine"


def matched_batches(
    a: dict[str, Any], b: dict[str, Any]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of `engine_steps` of `a` and `b` with the same batch size, in `a`'s order."""
    by_batch = {step["batch_size"]: step for step in b.get("engine_steps", [])}
    return [
        (step, by_batch[step["batch_size"]])
        for step in a.get("engine_steps", [])
        if step["batch_size"] in by_batch
    ]


def engine_compare_table(
    a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")
) -> Table:
    """Each batch size of both in-process runs: prefill and decode-step p50 latency (ms) and
    throughput (tokens/s) as `A → B (B/A x)`, coloured as in compare_table."""
    table = Table(title=f"tgis benchmark --engine: {names[1]} / {names[0]} (ratio B/A)")
    table.add_column("batch", justify="right")
    pairs = matched_batches(a, b)
    # The serving loop's columns only where a run measured it (older files did not).
    compared = [
        *ENGINE_COMPARED,
        *(
            column
            for column in ENGINE_LOOP_COMPARED
            if any(_get(step, column[1]) is not None for pair in pairs for step in pair)
        ),
    ]
    for header, _, _ in compared:
        table.add_column(header, justify="right")
    for sa, sb in pairs:
        cells = [
            _cell(_get(sa, path), _get(sb, path), latency=latency) for _, path, latency in compared
        ]
        table.add_row(str(sa["batch_size"]), *cells)
    if not pairs:
        table.caption = "no batch sizes in common to compare"
    return table


def engine_table(data: dict[str, Any]) -> Table:
    """Per batch size of an in-process run, one row each for prefill and for a decode step:
    latency mean, p50, p90, p99 (ms) and throughput (tokens/s), as TGI's
    text-generation-benchmark shows them."""
    config = data.get("config", {})
    table = Table(
        title=f"tgis benchmark --engine: {config.get('model', '?')} on "
        f"{config.get('device', '?')} (prompt {config.get('prompt_tokens', '?')}, "
        f"decode {config.get('decode_tokens', '?')} tokens)"
    )
    table.add_column("batch", justify="right")
    table.add_column("phase")
    for q in ("mean", "p50", "p90", "p99"):
        table.add_column(f"{q} ms", justify="right")
    table.add_column("tok/s", justify="right")
    for step in data.get("engine_steps", []):
        rows = [
            ("prefill_latency_s", "prefill", f"{step['prefill_tokens_per_s']:.1f}"),
            ("decode_latency_s", "decode step", f"{step['decode_tokens_per_s']:.1f}"),
        ]
        if step.get("decode_step_s"):  # the serving loop's step, its forward and host work
            rows += [
                (
                    "decode_step_s",
                    "loop step",
                    _per_s(step["batch_size"], _get(step, ("decode_step_s", "mean"))),
                ),
                ("decode_forward_s", "  forward", ""),
                ("decode_host_s", "  host", ""),
            ]
        if step.get("decode_device_s"):  # a simulated device's busy time, and what it hid
            rows += [
                ("decode_device_s", "  device", ""),
                ("decode_hidden_host_s", "  host hidden", ""),
                ("decode_exposed_host_s", "  host exposed", ""),
            ]
        for index, (key, name, rate) in enumerate(rows):
            table.add_row(
                str(step["batch_size"]) if index == 0 else "",
                name,
                *[_ms(_get(step, (key, q))) for q in ("mean", "p50", "p90", "p99")],
                rate,
                end_section=index == len(rows) - 1,
            )
    return table


def _per_s(count: int, seconds: float | None) -> str:
    return f"{count / seconds:.1f}" if seconds else "-"
