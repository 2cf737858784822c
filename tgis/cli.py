"""The `tgis` command line: one Typer app, one module per subcommand in tgis.commands.

Commands raise TgisError; `main` prints it as one line on stderr and exits 1. With TGIS_DEBUG=1
the traceback is shown instead.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from tgis import __version__
from tgis.commands import (
    benchmark,
    convert_to_safetensors,
    download_weights,
    export_neuron,
    serve,
    warmup,
)
from tgis.config import debug_enabled
from tgis.errors import TgisError

app = typer.Typer(
    name="tgis",
    help="Text-generation inference toolkit: fetch, convert, compile, warm up, serve and load-test LLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

LIFECYCLE = "Model lifecycle"
SERVING = "Serving"
app.command("download-weights", rich_help_panel=LIFECYCLE)(download_weights.command)
app.command("convert-to-safetensors", rich_help_panel=LIFECYCLE)(convert_to_safetensors.command)
app.command("export-neuron", rich_help_panel=LIFECYCLE)(export_neuron.command)
app.command("warmup", rich_help_panel=SERVING)(warmup.command)
app.command("serve", rich_help_panel=SERVING)(serve.command)
app.command("benchmark", rich_help_panel="Benchmarking")(benchmark.command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tgis {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", help="Show the version and exit.", callback=_version, is_eager=True
        ),
    ] = False,
) -> None:
    """Text-generation inference toolkit: fetch, convert, compile, warm up, serve and load-test LLMs."""


def main() -> None:
    """Console-script entry point."""
    try:
        app(standalone_mode=False)
    except TgisError as exc:
        if debug_enabled():
            raise
        message = f"[bold red]error:[/] {escape(exc.message)}"
        if exc.hint:
            message += f"; {escape(exc.hint)}"
        err_console.print(message, markup=True, highlight=False)
        sys.exit(1)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors: click's own message names the option
        show = getattr(exc, "show", None)
        if show is None:
            raise
        show()
        sys.exit(getattr(exc, "exit_code", 2))
    except Exception as exc:
        if debug_enabled():
            raise
        err_console.print(
            f"[bold red]error:[/] {type(exc).__name__}: {escape(str(exc))} "
            "(set TGIS_DEBUG=1 for the traceback)",
            markup=True,
            highlight=False,
        )
        sys.exit(1)
