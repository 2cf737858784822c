"""`tgis warmup`: compile / capture every shape bucket ahead of serving, and report it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tgis.commands.launcher_options import (
    WARMUP_OPTIONS,
    NoDownload,
    launcher_options,
    resolve_launcher_config,
)

if TYPE_CHECKING:
    from rich.table import Table

    from tgis.warmup import WarmupReport


@launcher_options(*WARMUP_OPTIONS)
def command(
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Also write the report as JSON here."),
    ] = None,
    no_download: NoDownload = False,
    **launcher: Any,
) -> None:
    """Compile / capture every shape bucket ahead of serving, and time each one.

    Loads the backend with the configuration `tgis serve` would use and runs every step shape
    it will meet (prefill per batch and length bucket, decode per batch bucket).

    On tpu each shape is an XLA program; with --compile-cache they persist, so a following
    `tgis serve` with the same cache and limits loads them instead of compiling. On gaudi
    each decode bucket is an HPU graph; on cpu/cuda warmup sizes the KV budget from free
    memory (reported as the largest --max-batch-total-tokens that fits) and, with --compile,
    compiles the decode step. The flags and environment variables are serve's.

    [bold]Examples[/]

      tgis warmup --model-id ./llama --backend tpu --compile-cache /data/xla-cache
      tgis warmup --backend cpu --max-batch-size 16 --output warmup.json
    """
    import logging

    from rich.console import Console

    from tgis.backends.choose import choose_backend, load_backend
    from tgis.commands.show_config import render_config

    config, model_dir, facts = resolve_launcher_config(launcher, download=not no_download)
    choice = choose_backend(config, facts)
    console = Console()
    render_config(console, config, choice)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    loaded = load_backend(config, model_dir, choice, compile_in_background=False)
    try:
        report = _warm(console, loaded, config)
    finally:
        close = getattr(loaded, "close", None)
        if close is not None:  # tensor-parallel shards
            close()
    console.print(report_table(report))
    for line in report_lines(report):
        console.print(line)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
        console.print(f"report: {output}")


def _warm(console: Any, loaded: Any, config: Any) -> WarmupReport:
    """Run the warmup plan with a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from tgis.warmup import run_warmup

    progress = Progress(
        TextColumn("[bold]warmup[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        console=console,
    )
    with progress:
        task = progress.add_task("", total=None, last="")
        return run_warmup(
            loaded,
            config,
            on_plan=lambda plan: progress.update(task, total=len(plan)),
            on_shape=lambda t: progress.update(
                task,
                advance=1,
                description=t.shape.label(),
                last=f"{t.seconds:.2f} s, {t.compiled} compiled",
            ),
        )


def report_table(report: WarmupReport) -> Table:
    """One row per shape: phase, rows, length, seconds, graphs compiled."""
    from rich.table import Table

    table = Table(title=f"tgis warmup: {report.backend} on {report.device}")
    for header in ("shape", "rows", "length", "seconds", "compiled"):
        table.add_column(header, justify="left" if header == "shape" else "right")
    for t in report.timings:
        table.add_row(
            t.shape.label(),
            str(t.shape.rows),
            str(t.shape.length),
            f"{t.seconds:.3f}",
            str(t.compiled),
        )
    table.caption = (
        f"{len(report.timings)} shapes, {report.seconds:.1f} s, {report.compiled} compiled"
    )
    return table


def report_lines(report: WarmupReport) -> list[str]:
    """What to do with the result: the KV budget and where compiled programs went."""
    if report.block_size:
        lines = [
            f"KV cache: {report.kv_tokens} tokens in {report.kv_tokens // report.block_size} "
            f"blocks of {report.block_size} ({report.kv_bytes_per_token} bytes per token), "
            f"shared by up to {report.max_sequences} sequences of at most "
            f"{report.max_sequence_tokens} tokens, each holding the blocks its tokens fill"
        ]
    else:
        lines = [
            f"KV budget: {report.kv_tokens} tokens = {report.max_sequences} sequences x "
            f"{report.max_sequence_tokens} tokens ({report.kv_bytes_per_token} bytes per token)"
        ]
    budget = report.kv_budget_tokens
    if budget is not None and budget > report.kv_tokens:
        lines.append(
            f"free memory holds {budget} tokens of KV cache: the largest "
            f"--max-batch-total-tokens that fits is {budget} (raise --max-concurrent-requests "
            f"or --max-batch-size to use it)"
        )
    if report.compile_cache:
        lines.append(
            f"compiled programs persist in {report.compile_cache}: serve with "
            f"--compile-cache {report.compile_cache} and the same limits to skip compiling"
        )
    return lines
