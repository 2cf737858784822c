"""The slow-client settings: --header-timeout-s, --body-timeout-s, --keep-alive-timeout-s."""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tgis.cli import app
from tgis.commands.show_config import render_config
from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.errors import ConfigError

GPT2 = ModelFacts("gpt2", 1024)
NAMES = ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s")


def build(env: dict[str, str] | None = None, **flags: object):
    return build_serve_config(LauncherArgs(**flags), GPT2, env or {})


def error_of(env: dict[str, str] | None = None, **flags: object) -> str:
    with pytest.raises(ConfigError) as info:
        build(env, **flags)
    return str(info.value)


def test_defaults() -> None:
    config = build()
    assert (config.header_timeout_s, config.body_timeout_s, config.keep_alive_timeout_s) == (
        10.0,
        60.0,
        5.0,
    )
    assert not {name for name, _ in config.sources} & set(NAMES)


def test_variables_and_flags_set_them_flags_first() -> None:
    env = {"HEADER_TIMEOUT_S": "2.5", "BODY_TIMEOUT_S": "30", "KEEP_ALIVE_TIMEOUT_S": "75"}
    config = build(env, keep_alive_timeout_s=1.5)
    assert (config.header_timeout_s, config.body_timeout_s, config.keep_alive_timeout_s) == (
        2.5,
        30.0,
        1.5,
    )
    sources = dict(config.sources)
    assert sources["header_timeout_s"] == "HEADER_TIMEOUT_S"
    assert sources["body_timeout_s"] == "BODY_TIMEOUT_S"
    assert sources["keep_alive_timeout_s"] == "--keep-alive-timeout-s"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_only_positive_finite_seconds(name: str, value: float) -> None:
    flag = "--" + name.replace("_", "-")
    message = error_of(**{name: value})
    assert message.startswith(f"{flag} {value} must be a positive number of seconds"), message
    assert f"set {flag} to seconds such as" in message


def test_a_bad_variable_is_named() -> None:
    assert "HEADER_TIMEOUT_S='soon' is not a number" in error_of({"HEADER_TIMEOUT_S": "soon"})
    assert "BODY_TIMEOUT_S=0.0 must be a positive number" in error_of({"BODY_TIMEOUT_S": "0"})


def test_check_output_shows_them_with_their_source() -> None:
    console = Console(record=True, width=200)
    render_config(console, build({"BODY_TIMEOUT_S": "45"}, header_timeout_s=3.0))
    rows = {
        line.split("│")[1].strip(): line
        for line in console.export_text().splitlines()
        if line.count("│") >= 3
    }
    assert "3.0" in rows["header_timeout_s"] and "--header-timeout-s" in rows["header_timeout_s"]
    assert "45.0" in rows["body_timeout_s"] and "BODY_TIMEOUT_S" in rows["body_timeout_s"]
    assert "5.0" in rows["keep_alive_timeout_s"]


def test_serve_takes_the_flags() -> None:
    out = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200).output
    for name in NAMES:
        assert "--" + name.replace("_", "-") in out
        assert f"{name.upper()}]" in out  # the end of its `[env: ...]`, however it wraps
