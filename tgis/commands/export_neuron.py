"""`tgis export-neuron`: compile a model for AWS Inferentia2 / Trainium."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tgis.commands.options import ModelArg, RevisionOpt

SHAPE = "Static shape (fixed at compile time)"


def command(
    model: ModelArg,
    output: Annotated[
        Path,
        typer.Option(
            "--output", "-o", help="Directory to write the compiled model to.", show_default=False
        ),
    ],
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size", help="Static batch size (concurrent requests).", rich_help_panel=SHAPE
        ),
    ] = 1,
    sequence_length: Annotated[
        int | None,
        typer.Option(
            "--sequence-length",
            help="Static max_length: prompt + new tokens per request.",
            rich_help_panel=SHAPE,
            show_default="min(model positions, 4096)",
        ),
    ] = None,
    num_cores: Annotated[
        int,
        typer.Option(
            "--num-cores",
            help="Neuron cores to shard over (tensor parallel).",
            rich_help_panel=SHAPE,
        ),
    ] = 2,
    auto_cast_type: Annotated[
        str,
        typer.Option(
            "--auto-cast-type", help="Compute dtype: bf16, fp16 or fp32.", rich_help_panel=SHAPE
        ),
    ] = "bf16",
    revision: RevisionOpt = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Validate and show the resulting serve limits; compile nothing."
        ),
    ] = False,
) -> None:
    """Compile MODEL for AWS Neuron with optimum-neuron, for `tgis serve --backend neuron`.

    The shape is checked by the same rules as serving before compiling; the compiled model
    records it (neuron_config.json), and `tgis serve --model-id OUTPUT` derives its limits from it.
    Needs optimum-neuron and the Neuron compiler (an inf2 / trn1 instance, or Dockerfile.neuron).

    [bold]Example[/]

      tgis export-neuron meta-llama/Llama-3.2-1B --batch-size 4 --sequence-length 4096 \\
          --num-cores 2 --auto-cast-type bf16 --output /data/llama-3.2-1b-neuron
    """
    from rich.console import Console

    from tgis.commands.show_config import render_config
    from tgis.config import default_env
    from tgis.hub import read_model_config, resolve_model_dir
    from tgis.neuron_export import export, plan_export

    model_dir = resolve_model_dir(model, revision)
    config_json, _ = read_model_config(model_dir)
    request, serve_config = plan_export(
        model_dir,
        config_json,
        output,
        default_env(),
        batch_size,
        sequence_length,
        num_cores,
        auto_cast_type,
    )
    console = Console()
    console.print(
        f"Export shape: batch_size={request.batch_size} sequence_length={request.sequence_length} "
        f"num_cores={request.num_cores} auto_cast_type={request.auto_cast_type}"
    )
    render_config(console, serve_config)
    if dry_run:
        return
    written = export(request)
    console.print(
        f"[green]Compiled[/] {model} -> {output} (batch_size={written.batch_size}, "
        f"sequence_length={written.sequence_length}, num_cores={written.num_cores}). "
        f"Serve it with: tgis serve --backend neuron --model-id {output}"
    )
