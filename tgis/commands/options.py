"""Options shared by several commands, as Annotated aliases (one definition each)."""

from __future__ import annotations

from typing import Annotated

import typer

MODEL_PANEL = "Model"

ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="Model id on the Hugging Face Hub (org/name) or a local directory.",
        show_default=False,
    ),
]
RevisionOpt = Annotated[
    str | None,
    typer.Option(
        "--revision",
        help="Branch, tag or commit of the model repository. [env: REVISION]",
        rich_help_panel=MODEL_PANEL,
        show_default="main",
    ),
]
