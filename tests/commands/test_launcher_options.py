"""tgis.commands.launcher_options: the launcher flags, declared once, given to serve and warmup."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from tgis.commands import serve, warmup
from tgis.commands.launcher_options import OPTIONS, WARMUP_OPTIONS, launcher_options


def names(command: Any) -> list[str]:
    return list(inspect.signature(command).parameters)


def test_serve_takes_every_launcher_option_then_its_own() -> None:
    assert names(serve.command) == [*OPTIONS, "shutdown_grace", "check", "no_download"]


def test_warmup_takes_the_batch_shaping_options_then_its_own() -> None:
    assert names(warmup.command) == [*WARMUP_OPTIONS, "output", "no_download"]
    assert "port" not in WARMUP_OPTIONS and "max_best_of" not in WARMUP_OPTIONS
    assert set(WARMUP_OPTIONS) <= set(OPTIONS)


def test_values_reach_the_command_as_keywords() -> None:
    seen: dict[str, Any] = {}

    @launcher_options("max_batch_size", "backend")
    def command(verbose: bool = typer.Option(False, "--verbose"), **launcher: Any) -> None:
        seen.update(launcher, verbose=verbose)

    app = typer.Typer()
    app.command()(command)
    result = CliRunner().invoke(app, ["--max-batch-size", "3", "--verbose"])
    assert result.exit_code == 0, result.output
    assert seen == {"max_batch_size": 3, "backend": None, "verbose": True}
    result = CliRunner().invoke(app, ["--port", "1"])
    assert result.exit_code == 2 and "No such option: --port" in result.output


def test_unknown_option_names_are_refused() -> None:
    with pytest.raises(ValueError, match="not launcher options: max_speed"):
        launcher_options("max_batch_size", "max_speed")


def test_paged_engine_switches_take_a_no_form_and_stay_unset_by_default() -> None:
    seen: dict[str, Any] = {}

    @launcher_options("cuda_graphs", "prefix_caching")
    def command(**launcher: Any) -> None:
        seen.update(launcher)

    app = typer.Typer()
    app.command()(command)
    for args, expected in (
        ([], {"cuda_graphs": None, "prefix_caching": None}),
        (["--no-cuda-graphs", "--prefix-caching"], {"cuda_graphs": False, "prefix_caching": True}),
        (["--cuda-graphs", "--no-prefix-caching"], {"cuda_graphs": True, "prefix_caching": False}),
    ):
        seen.clear()
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert seen == expected
