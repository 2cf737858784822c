"""`tgis benchmark` against the real server: the bundled demo model on the cpu engine, every
profile and every kind for a short while, with no request failing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.server.conftest import live_server
from tgis.benchmark.results import validate_results
from tgis.cli import app
from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.errors import ConfigError
from tgis.hub import read_model_config
from tgis.launch import build_service
from tgis.server import ModelInfo, create_app

runner = CliRunner()
# Lengths small enough for the demo model's 1024-token context over a chat's three turns.
SMALL = ["--prompt-tokens", "24", "--decode-tokens", "6", "--requests", "6", "--seed", "3"]
# Steps end on request counts (60 s only bounds them): a busy machine measures the same requests.
SHORT = ["--duration", "60", "--warmup", "0", "--max-requests", "4", "--warmup-requests", "1"]


@pytest.fixture(scope="module")
def url(demo_model_dir: Path) -> Iterator[str]:
    facts = ModelFacts.from_config(*read_model_config(demo_model_dir))
    args = LauncherArgs(max_total_tokens=512, max_batch_size=8, backend="cpu")
    config = build_serve_config(args, facts, {"WARMUP_ENABLED": "false"})
    service = build_service(config, demo_model_dir)
    info = ModelInfo.from_config(config, max_batch_total_tokens=service.kv_tokens)
    try:
        with live_server(create_app(service.engine, service.tokenizer, config, info)) as (base, _):
            yield base
    finally:
        service.engine.stop()


def run(url: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "results.json"
    result = runner.invoke(app, ["benchmark", "--url", url, *args, "--output", str(out)],
                           env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(out.read_text())
    validate_results(data)
    return data


@pytest.mark.parametrize(
    "profile", ["chat", "code-generation", "code-editing", "classification", "fixed-length"]
)
def test_each_profile_runs_clean(url: str, tmp_path: Path, profile: str) -> None:
    data = run(
        url,
        tmp_path,
        "--profile",
        profile,
        "--kind",
        "throughput",
        "--max-vus",
        "2",
        *SMALL,
        *SHORT,
    )
    (step,) = data["steps"]
    assert step["requests"]["ok"] == 4 and step["errors"] == {}
    assert data["config"]["api"] == "tgi"  # detected from /info


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("rate", ["--rates", "8"]), ("sweep", ["--max-vus", "2", "--num-rates", "2"])],
)
def test_open_loop_kinds(url: str, tmp_path: Path, kind: str, extra: list[str]) -> None:
    data = run(url, tmp_path, "--profile", "fixed-length", "--kind", kind, *extra, *SMALL, *SHORT)
    assert data["steps"] and all(step["errors"] == {} for step in data["steps"])
    assert sum(step["requests"]["ok"] for step in data["steps"]) > 0


@pytest.mark.parametrize("api", ["tgi", "openai-chat"])
def test_json_schema_constrains_every_answer(url: str, tmp_path: Path, api: str) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    data = run(
        url, tmp_path, "--api", api, "--profile", "fixed-length", "--kind", "throughput",
        "--max-vus", "2", "--json-schema", str(path), *SMALL, *SHORT,
    )  # fmt: skip
    (step,) = data["steps"]
    assert step["requests"]["ok"] == 4 and step["errors"] == {}
    assert data["config"]["json_schema"] == schema
    # Answers of at most two integers end well before --decode-tokens: by EOS, not by length.
    assert step["output_tokens"] < 6 * step["requests"]["ok"]


@pytest.mark.parametrize("api", ["tgi", "openai-chat", "openai-completions"])
def test_ignore_eos_is_taken_by_every_api_and_every_answer_runs_to_its_length(
    url: str, tmp_path: Path, api: str
) -> None:
    """tgis serve's request contract takes `ignore_eos` where the benchmark sends it (TGI's
    parameters, the OpenAI bodies' top level): no request is refused and none ends short."""
    data = run(
        url, tmp_path, "--api", api, "--profile", "fixed-length", "--kind", "throughput",
        "--max-vus", "2", "--ignore-eos", *SMALL, *SHORT,
    )  # fmt: skip
    (step,) = data["steps"]
    ok = step["requests"]["ok"]
    assert ok == 4 and step["errors"] == {}
    assert data["config"]["ignore_eos"] is True
    lengths = step["output_lengths"]
    assert lengths["short_requests"] == 0 and lengths["requests"] == ok
    assert lengths["tokens"]["min"] == lengths["asked"]["max"] == 6


def test_json_schema_needs_an_api_that_takes_one(url: str, tmp_path: Path) -> None:
    path = tmp_path / "schema.json"
    path.write_text("[1]")
    result = runner.invoke(app, ["benchmark", "--url", url, "--json-schema", str(path)])
    assert isinstance(result.exception, ConfigError)
    assert "holds no JSON object" in str(result.exception)
    path.write_text("{}")
    result = runner.invoke(
        app, ["benchmark", "--url", url, "--api", "openai-completions", "--json-schema", str(path)]
    )
    assert isinstance(result.exception, ConfigError)
    assert "--json-schema needs TGI's API" in str(result.exception)
