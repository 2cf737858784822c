"""`tgis convert-to-safetensors`: turn PyTorch .bin weights into verified .safetensors."""

from __future__ import annotations

from typing import Annotated

import typer

from tgis.commands.options import ModelArg, RevisionOpt

CONVERT_PANEL = "Conversion"


def command(
    model: ModelArg,
    revision: RevisionOpt = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Overwrite .safetensors files that already exist.",
            rich_help_panel=CONVERT_PANEL,
            show_default=True,
        ),
    ] = False,
) -> None:
    """Convert the .bin weights of MODEL_OR_PATH to .safetensors next to them.

    MODEL_OR_PATH is a local directory or a Hub model already in the HF cache
    (see download-weights). Reads pytorch_model.bin, or the shards listed in
    pytorch_model.bin.index.json, with torch.load(weights_only=True). Writes
    model.safetensors, or model-0000i-of-0000n.safetensors and an index.

    Tied weights (lm_head = embeddings) are stored once, the alias recorded in
    the metadata. Every tensor is checked against the original before the
    files are moved into place, so a failure leaves no half-written file.

    [bold]Examples[/]

      tgis convert-to-safetensors ./my-model
      tgis convert-to-safetensors bigscience/bloom-560m --force
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from tgis.config import LauncherArgs, default_env, model_reference
    from tgis.convert import convert_to_safetensors
    from tgis.hub import resolve_model_dir

    model, revision = model_reference(
        LauncherArgs(model_id=model, revision=revision), default_env()
    )
    model_dir = resolve_model_dir(model, revision)
    report = convert_to_safetensors(model_dir, force=force)
    out = Console(highlight=False)
    table = Table(title=Text(f"{model} -> safetensors"), show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # paths are long: wrap them, never cut them
    aliases = ", ".join(f"{alias} = {kept}" for alias, kept in report.aliases) or "none"
    rows = {
        "directory": str(report.model_dir),
        "read": ", ".join(report.source_files),
        "wrote": ", ".join(report.written_files),
        "tensors": str(report.tensors),
        "aliases": aliases,
        "size": f"{report.bytes_written / 1e6:.1f} MB",
    }
    for key, value in rows.items():
        table.add_row(key, Text(value))  # Text: paths and names are not rich markup
    out.print(table)
    n = len(report.written_files)
    out.print(
        f"[bold green]done[/] {n} file{'s' if n != 1 else ''} written, "
        f"{report.tensors} tensors verified"
    )
