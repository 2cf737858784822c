"""Render a resolved ServeConfig for people (serve --check, warmup, export-neuron)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tgis.config import ServeConfig


def render_config(console: Console, config: ServeConfig) -> None:
    """A two-column table of the resolved limits, then the advisory notes."""
    table = Table(title="Resolved configuration", show_header=False, title_justify="left")
    table.add_column("setting", style="bold")
    table.add_column("value")
    for key, value in config.summary().items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items() if v is not None)
        table.add_row(key, escape(str(value)))
    console.print(table)
    for note in config.notes:
        console.print(f"[cyan]note:[/] {escape(note)}")
