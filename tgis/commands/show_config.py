"""Render a resolved ServeConfig for people (serve --check, warmup, export-neuron)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tgis.config import ServeConfig

if TYPE_CHECKING:
    from tgis.backends.choose import BackendChoice

# Launcher settings shown under another name in the resolved configuration.
_SETTING_OF = {
    "grpc": "grpc_port",
    "tls_cert_path": "tls",
    "tls_key_path": "tls",
    "tls_client_ca_cert_path": "tls",
    "cors_allow_origin": "cors_allow_origins",
}

# Values longer than this (a model path, a list of adapters) are printed whole below the table
# (an 80-column terminal leaves the value column about 30 when a variable sets something)
# rather than cut to the terminal's width inside it.
LONG_VALUE = 30


def render_config(
    console: Console, config: ServeConfig, choice: BackendChoice | None = None
) -> None:
    """The resolved settings with the flag or variable that set each (blank: a default or
    derived value), then the backend `choice` that serves the model and why, then the
    advisory notes."""
    table = Table(title="Resolved configuration", title_justify="left")
    # Folded, never cut: a narrow terminal wraps a cell instead of ending it in an ellipsis.
    table.add_column("setting", style="bold", overflow="fold")
    table.add_column("value", overflow="fold")
    table.add_column("set by", style="cyan", overflow="fold")
    sources: dict[str, list[str]] = {}
    for name, spelled in config.sources:
        sources.setdefault(_SETTING_OF.get(name, name), []).append(spelled)
    long: list[tuple[str, str]] = []
    for key, value in config.summary().items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items() if v is not None)
        text = str(value)
        if len(text) > LONG_VALUE:
            long.append((key, text))
            text = "(below)"
        table.add_row(key, escape(text), escape(", ".join(sources.get(key, []))))
    console.print(table)
    for key, text in long:
        console.print(f"[bold]{key}[/]: {escape(text)}", soft_wrap=True, highlight=False)
    if choice is not None:
        console.print(f"[bold]engine[/]: {escape(choice.describe())}", soft_wrap=True)
        from tgis.backends.choose import compiled_decode

        if config.compile is None and compiled_decode(config, choice):
            console.print(
                "[bold]decode[/]: compiled (the default here: a first start decodes eagerly "
                "while its graphs compile in a process of its own; --no-compile opts out)",
                soft_wrap=True,
            )
    for note in config.notes:
        console.print(f"[cyan]note:[/] {escape(note)}")
