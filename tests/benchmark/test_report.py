"""The tables of report.py: --engine runs compared per batch size, the token-check and
short-answer warnings, the images a run's title names."""

from __future__ import annotations

import copy
import io
from typing import Any

from rich.console import Console
from rich.table import Table

from tests.benchmark.conftest import engine_results
from tests.benchmark.test_results import results
from tgis.benchmark.images import ImageSpec
from tgis.benchmark.profiles import get_profile
from tgis.benchmark.report import (
    engine_compare_table,
    is_engine,
    results_table,
    short_output_warning,
    token_check_warning,
)

# Per batch size: (prefill p50 s, decode-step p50 s).
A = {1: (0.010, 0.002), 2: (0.016, 0.0025), 4: (0.030, 0.003)}
B = {1: (0.005, 0.00204), 2: (0.016, 0.004), 8: (0.050, 0.004)}


def cells(table: Table) -> list[list[str]]:
    """The table's rows as the markup of their cells."""
    columns = [list(column.cells) for column in table.columns]
    return [[str(column[row]) for column in columns] for row in range(table.row_count)]


def text(table: Table) -> str:
    console = Console(width=200, file=io.StringIO())
    console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_engine_runs_compare_per_batch_size() -> None:
    a, b = engine_results(A), engine_results(B)
    assert is_engine(a) and is_engine(b) and not is_engine(results())
    table = engine_compare_table(a, b, ("a.json", "b.json"))
    assert [c.header for c in table.columns] == [
        "batch",
        "prefill p50 ms",
        "prefill tok/s",
        "decode step p50 ms",
        "decode tok/s",
    ]
    assert cells(table) == [
        [
            "1",
            "[green]10.0 → 5.0 (0.50x)[/]",  # latency halved: better
            "[green]12800.0 → 25600.0 (2.00x)[/]",
            "2.0 → 2.0 (1.02x)",  # within 5 %: no colour
            "500.0 → 490.2 (0.98x)",
        ],
        [
            "2",
            "16.0 → 16.0 (1.00x)",
            "16000.0 → 16000.0 (1.00x)",
            "[red]2.5 → 4.0 (1.60x)[/]",  # slower decode steps: worse
            "[red]800.0 → 500.0 (0.62x)[/]",
        ],
    ]  # batch sizes 4 (A only) and 8 (B only) have no row
    assert "b.json / a.json" in text(table)


def test_engine_runs_without_common_batch_sizes() -> None:
    table = engine_compare_table(engine_results({16: (0.01, 0.001)}), engine_results(B))
    assert table.row_count == 0
    assert table.caption == "no batch sizes in common to compare"


def with_ratios(*ratios: float | None) -> dict[str, Any]:
    data = copy.deepcopy(results())
    step = data["steps"][0]
    data["steps"] = []
    for value in ratios:
        check = {**step["token_check"], "ratio": value}
        data["steps"].append({**step, "token_check": check})
    return data


def test_token_check_warning_names_the_steps_off_by_more_than_10_percent() -> None:
    assert token_check_warning(with_ratios(1.0, 0.91, 1.09, None)) is None
    data = with_ratios(1.0, 2.0, 0.85)
    data["steps"].append({k: v for k, v in data["steps"][0].items() if k != "token_check"})
    warning = token_check_warning(data)
    assert warning is not None and "\n" not in warning
    assert warning.startswith("[yellow]warning:") and warning.endswith("[/]")
    assert "(step 2 2.00x, step 3 0.85x)" in warning
    assert "several tokens" in warning and "no usage" in warning
    assert "--tokenizer may not be the served model's" in warning
    assert token_check_warning(engine_results(A)) is None  # no steps


def with_lengths(*steps: tuple[int, int, float, int, int, int]) -> dict[str, Any]:
    """Steps of (requests, short ones, mean and min tokens, min and max asked)."""
    data = copy.deepcopy(results())
    step = data["steps"][0]
    data["steps"] = [
        {
            **step,
            "output_lengths": {
                "requests": requests,
                "short_requests": short,
                "tokens": {"min": least, "p50": mean, "mean": mean, "max": high},
                "asked": {"min": low, "mean": (low + high) / 2, "max": high},
            },
        }
        for requests, short, mean, least, low, high in steps
    ]
    return data


def test_short_output_warning_names_the_steps_and_their_lengths() -> None:
    assert short_output_warning(with_lengths((20, 0, 8.0, 8, 8, 8))) is None
    data = with_lengths((20, 0, 8.0, 8, 8, 8), (20, 12, 3.5, 2, 8, 8), (5, 5, 30.0, 1, 20, 600))
    data["steps"].append({k: v for k, v in data["steps"][0].items() if k != "output_lengths"})
    warning = short_output_warning(data)
    assert warning is not None and "\n" not in warning
    assert warning.startswith("[yellow]warning: answers came back shorter than asked")
    assert warning.endswith("[/]")
    assert "step 2: 12 of 20 requests, mean 3.5 and min 2 tokens against 8 asked" in warning
    assert (
        "step 3: 5 of 5 requests, mean 30.0 and min 1 tokens against 20-600 asked (mean 310.0)"
        in warning
    )
    assert "step 1" not in warning and "step 4" not in warning
    assert "--ignore-eos runs every answer to its length" in warning
    data["config"]["ignore_eos"] = True
    assert "may not honour it" in (short_output_warning(data) or "")
    data["config"]["json_schema"] = {"type": "object"}
    assert "expected with --json-schema" in (short_output_warning(data) or "")
    assert short_output_warning(engine_results(A)) is None  # no steps


def test_the_token_check_warning_names_the_eos_of_an_ignore_eos_openai_run() -> None:
    data = with_ratios(0.75)
    assert "EOS" not in (token_check_warning(data) or "")
    data["config"].update(ignore_eos=True, api="openai-chat")
    assert "EOS tokens it sampled" in (token_check_warning(data) or "")


def test_engine_runs_compare_the_serving_loop_where_measured() -> None:
    a, b = engine_results(A), engine_results(B)
    for data, (step_s, host_s) in ((a, (0.0030, 0.0010)), (b, (0.0024, 0.0004))):
        first = data["engine_steps"][0]
        first["decode_step_s"] = {q: step_s for q in ("p50", "p90", "p95", "p99", "mean")}
        first["decode_host_s"] = {q: host_s for q in ("p50", "p90", "p95", "p99", "mean")}
    table = engine_compare_table(a, b)
    headers = [c.header for c in table.columns]
    assert headers[-2:] == ["loop step p50 ms", "loop host p50 ms"]
    assert cells(table)[0][-2:] == [
        "[green]3.0 → 2.4 (0.80x)[/]",
        "[green]1.0 → 0.4 (0.40x)[/]",
    ]
    assert cells(table)[1][-2:] == ["-", "-"]  # batch 2 measured no loop


def test_the_results_title_names_the_images() -> None:
    data = copy.deepcopy(results())
    assert "profile chat)" in str(results_table(data).title)
    data["config"]["profile"] = (
        get_profile("vision").with_images(ImageSpec(3, 64, 48, "png", False)).to_dict()
    )
    assert str(results_table(data).title).endswith(
        "(tgi, profile vision, 3 images 64x48 png per request, repeated)"
    )
