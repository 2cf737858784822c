"""`tgis download-weights`: fill the local Hugging Face cache so that serving needs no network."""

from __future__ import annotations

from typing import Annotated

import typer

from tgis.commands.options import ModelArg, RevisionOpt

DOWNLOAD_PANEL = "Download"


def command(
    model: ModelArg,
    revision: RevisionOpt = None,
    extension: Annotated[
        str | None,
        typer.Option(
            "--extension",
            help=(
                "Comma-separated extensions of the root-level files to download instead of the "
                'default selection, e.g. ".json,.bin,.md,.model,.py". A single extension also '
                "brings the config and tokenizer files."
            ),
            rich_help_panel=DOWNLOAD_PANEL,
            show_default=".safetensors, else .bin",
        ),
    ] = None,
    auto_convert: Annotated[
        bool,
        typer.Option(
            "--auto-convert/--no-auto-convert",
            help="Convert downloaded .bin weights to .safetensors when the repo has none.",
            rich_help_panel=DOWNLOAD_PANEL,
            show_default=True,
        ),
    ] = True,
) -> None:
    """Download MODEL's weights from the Hugging Face Hub into the local HF cache.

    Fetches the root-level .safetensors weights or, if the repository has none,
    its .bin weights, converted to .safetensors inside the cache. Always fetches
    the config and tokenizer files a server needs; skips files already cached.

    The cache is HF_HUB_CACHE (default HF_HOME/hub). Serve with the same cache,
    offline if you like (HF_HUB_OFFLINE=1). Private and gated models need
    HF_TOKEN; HF_ENDPOINT selects a mirror.

    [bold]Examples[/]

      tgis download-weights bigscience/bloom-560m
      tgis download-weights bigscience/bloom-560m --no-auto-convert
      tgis download-weights google/flan-t5-small --extension ".json,.bin,.model"
    """
    from rich.console import Console
    from rich.markup import escape

    from tgis.config import LauncherArgs, default_env, model_reference
    from tgis.hub import fetch_weights

    model, revision = model_reference(
        LauncherArgs(model_id=model, revision=revision), default_env()
    )
    extensions = [e.strip() for e in extension.split(",") if e.strip()] if extension else None
    out = Console(highlight=False)
    log = Console(stderr=True, highlight=False)
    report = fetch_weights(model, revision, extensions, auto_convert, console=log)
    size = f"{report.bytes_downloaded / 1e6:.1f} MB"
    out.print(
        f"[bold green]done[/] {escape(model)}@{report.commit[:12]}: "
        f"{len(report.downloaded)} downloaded ({size}), {len(report.skipped)} already cached, "
        f"{len(report.converted)} converted -> {escape(str(report.snapshot_dir))}",
        soft_wrap=True,
    )
