"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed).

    plot_results(path, [("run", data)])                    # one run
    plot_results(path, [("a.json", a), ("b.json", b)])     # runs overlaid, for --compare
    plot_engine(path, [("a.json", a), ("b.json", b)])      # --engine runs (one or several)

Three panels: output throughput against median end-to-end latency (one point per step), then
the TTFT and ITL percentiles (p50, p90, p99) of each step, in milliseconds. An `--engine` run
has four: prefill and decode-step latency and throughput against batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tgis.benchmark.report import target_label

LATENCY_PERCENTILES = ("p50", "p90", "p99")
_STYLES = {"p50": "-", "p90": "--", "p99": ":"}


def _ms(step: dict[str, Any], metric: str, q: str) -> float:
    summary = step.get(metric)
    return summary[q] * 1000 if summary else float("nan")


def plot_results(path: str | Path, runs: Sequence[tuple[str, dict[str, Any]]]) -> Path:
    """Write the plot of `runs` (label, results document) to `path` as a PNG; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ax_tp, ax_ttft, ax_itl) = plt.subplots(1, 3, figsize=(16, 5), layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (label, data) in enumerate(runs):
        colour = colours[index % len(colours)]
        steps = data["steps"]
        xs = list(range(1, len(steps) + 1))
        by_throughput = sorted(steps, key=lambda s: s["output_tokens_per_s"])
        ax_tp.plot(
            [s["output_tokens_per_s"] for s in by_throughput],
            [_ms(s, "e2e_s", "p50") for s in by_throughput],
            "o-",
            color=colour,
            label=label,
        )
        for step in steps:
            ax_tp.annotate(
                target_label(step),
                (step["output_tokens_per_s"], _ms(step, "e2e_s", "p50")),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 4),
            )
        for ax, metric in ((ax_ttft, "ttft_s"), (ax_itl, "itl_s")):
            for q in LATENCY_PERCENTILES:
                ax.plot(
                    xs,
                    [_ms(s, metric, q) for s in steps],
                    _STYLES[q],
                    marker="o",
                    color=colour,
                    label=f"{label} {q}" if len(runs) > 1 else q,
                )
    ax_tp.set(
        title="Throughput vs latency",
        xlabel="output tokens/s",
        ylabel="e2e latency p50 (ms)",
    )
    for ax, name in ((ax_ttft, "Time to first token"), (ax_itl, "Inter-token latency")):
        ax.set(title=name, xlabel="step", ylabel="ms")
        longest = max((len(d["steps"]) for _, d in runs), default=0)
        ax.set_xticks(range(1, longest + 1))
    for ax in (ax_tp, ax_ttft, ax_itl):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)
    return out


def plot_engine(path: str | Path, runs: Sequence[tuple[str, dict[str, Any]]]) -> Path:
    """Write the PNG of in-process runs (label, results document with `engine_steps`), overlaid
    one colour per run: prefill and decode-step latency (p50, p90, p99) and throughput, each
    against batch size; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(12, 8), layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    every_batch = sorted({s["batch_size"] for _, d in runs for s in d.get("engine_steps", [])})
    for column, (phase, name) in enumerate((("prefill", "Prefill"), ("decode", "Decode step"))):
        ax_lat, ax_tp = axes[0][column], axes[1][column]
        for index, (label, data) in enumerate(runs):
            colour = colours[index % len(colours)]
            steps = sorted(data.get("engine_steps", []), key=lambda s: s["batch_size"])
            batches = [s["batch_size"] for s in steps]
            for q in LATENCY_PERCENTILES:
                ax_lat.plot(
                    batches,
                    [_ms(s, f"{phase}_latency_s", q) for s in steps],
                    _STYLES[q],
                    marker="o",
                    color=colour,
                    label=f"{label} {q}" if len(runs) > 1 else q,
                )
            ax_tp.plot(
                batches,
                [s[f"{phase}_tokens_per_s"] for s in steps],
                "o-",
                color=colour,
                label=label,
            )
        ax_lat.set(title=f"{name} latency", xlabel="batch size", ylabel="ms")
        ax_tp.set(title=f"{name} throughput", xlabel="batch size", ylabel="tokens/s")
        ax_lat.legend(fontsize=8)
        if len(runs) > 1:
            ax_tp.legend(fontsize=8)
        for ax in (ax_lat, ax_tp):
            ax.set_xticks(every_batch)
            ax.grid(True, alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)
    return out
