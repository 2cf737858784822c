"""The CLI as a user meets it: help, version, one-line errors, TGIS_DEBUG tracebacks."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import run_tgis
from tgis import __version__
from tgis.cli import app

runner = CliRunner()
COMMANDS = ("download-weights", "convert-to-safetensors", "export-neuron", "serve", "benchmark")


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"tgis {__version__}"


def test_root_help_lists_commands_in_groups() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in (*COMMANDS, "Model lifecycle", "Serving"):
        assert name in result.output


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_help_has_an_example(name: str) -> None:
    result = runner.invoke(app, [name, "--help"], terminal_width=120)
    assert result.exit_code == 0
    assert "Example" in result.output
    assert f"tgis {name}" in result.output


def test_serve_help_groups_options_and_shows_env_and_defaults() -> None:
    out = runner.invoke(app, ["serve", "--help"], terminal_width=200).output
    for panel in ("Model", "Request limits", "Batching", "Backend and device", "Server"):
        assert panel in out
    assert "[env: MAX_TOTAL_TOKENS]" in out
    assert "max-total-tokens - 1" in out  # derived defaults are spelled out


def test_serve_check_resolves_the_bundled_model() -> None:
    result = run_tgis("serve", "--check")
    assert result.returncode == 0, result.stderr
    assert "demo-model" in result.stdout
    assert "max_total_tokens" in result.stdout
    # The backend that would serve it, and why.
    assert "engine: paged engine on cpu: the paged forward runs llama" in result.stdout


def test_serve_check_refuses_what_the_chosen_engine_cannot_do() -> None:
    result = run_tgis("serve", "--check", "--backend", "cpu", "--num-shard", "3")
    assert result.returncode == 1
    assert result.stderr.startswith("error: --num-shard 3: 3 shards must divide its ")


def test_config_error_is_one_line_naming_flag_and_fix() -> None:
    result = run_tgis("serve", "--check", "--max-input-tokens", "900", "--max-total-tokens", "800")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0] == (
        "error: --max-input-tokens 900 must be < --max-total-tokens 800; "
        "lower --max-input-tokens to at most 799, or raise --max-total-tokens above 900"
    )


def test_env_error_names_the_variable() -> None:
    result = run_tgis("serve", "--check", env={"MAX_TOTAL_TOKENS": "many"})
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: MAX_TOTAL_TOKENS='many' is not an integer; set MAX_TOTAL_TOKENS to a whole number"
    )


def test_tgis_debug_shows_traceback() -> None:
    result = run_tgis("serve", "--check", env={"MAX_TOTAL_TOKENS": "many", "TGIS_DEBUG": "1"})
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "ConfigError" in result.stderr


def test_missing_model_names_it_and_suggests_download(tmp_path: Path) -> None:
    result = run_tgis(
        "serve",
        "--check",
        "--model-id",
        "nobody/absent-model",
        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)},
    )
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "nobody/absent-model" in result.stderr and "tgis download-weights" in result.stderr


def test_usage_error_names_the_flag() -> None:
    result = run_tgis("serve", "--max-total-tokens", "lots")
    assert result.returncode == 2
    assert "--max-total-tokens" in result.stderr


def test_export_neuron_without_sdk_fails_with_one_line(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    result = run_tgis(
        "export-neuron",
        str(demo_model_dir),
        "--output",
        str(tmp_path / "out"),
        "--batch-size",
        "2",
        "--sequence-length",
        "512",
    )
    assert result.returncode == 1
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and "export-neuron needs optimum.neuron" in err[0]
    assert "batch_size=2 sequence_length=512" in result.stdout  # validated before the SDK check
    assert not (tmp_path / "out").exists()


def test_export_neuron_dry_run_shows_serve_limits(demo_model_dir: Path, tmp_path: Path) -> None:
    result = run_tgis(
        "export-neuron",
        str(demo_model_dir),
        "--output",
        str(tmp_path / "out"),
        "--batch-size",
        "4",
        "--sequence-length",
        "512",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    assert "max_batch_total_tokens" in result.stdout and "2048" in result.stdout
