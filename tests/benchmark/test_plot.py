"""PNG plots of --engine runs: one run, and two runs overlaid for --compare."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.benchmark.conftest import engine_results
from tgis.benchmark.plot import plot_engine

PNG = b"\x89PNG\r\n\x1a\n"
A = {1: (0.010, 0.002), 2: (0.016, 0.0025), 4: (0.030, 0.003)}
B = {1: (0.005, 0.002), 8: (0.050, 0.004)}


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The figures plot_engine closes, kept open for inspection until the test ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    close = plt.close
    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for figure in kept:
        close(figure)


def test_two_engine_runs_are_overlaid(tmp_path: Path, figures: list[Any]) -> None:
    out = plot_engine(
        tmp_path / "sub" / "cmp.png", [("a.json", engine_results(A)), ("b.json", engine_results(B))]
    )
    assert out.read_bytes().startswith(PNG)
    (figure,) = figures
    prefill_latency, decode_latency = figure.axes[0], figure.axes[1]
    prefill_tp = figure.axes[2]
    labels = [t.get_text() for t in prefill_latency.get_legend().get_texts()]
    assert labels == [f"{run} {q}" for run in ("a.json", "b.json") for q in ("p50", "p90", "p99")]
    assert [t.get_text() for t in prefill_tp.get_legend().get_texts()] == ["a.json", "b.json"]
    a_p50, b_p50 = decode_latency.get_lines()[0], decode_latency.get_lines()[3]
    assert list(a_p50.get_xdata()) == [1, 2, 4] and list(b_p50.get_xdata()) == [1, 8]
    assert list(b_p50.get_ydata()) == pytest.approx([2.0, 4.0])  # ms
    assert a_p50.get_color() != b_p50.get_color()
    assert list(prefill_tp.get_xticks()) == [1, 2, 4, 8]  # every batch size of either run
    assert list(prefill_tp.get_lines()[1].get_ydata()) == pytest.approx([25600.0, 20480.0])


def test_one_engine_run_keeps_plain_percentile_labels(tmp_path: Path, figures: list[Any]) -> None:
    out = plot_engine(tmp_path / "e.png", [("engine", engine_results(A))])
    assert out.read_bytes().startswith(PNG)
    (figure,) = figures
    assert [t.get_text() for t in figure.axes[0].get_legend().get_texts()] == ["p50", "p90", "p99"]
    assert figure.axes[2].get_legend() is None
