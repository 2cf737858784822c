"""`tgis benchmark --profile vision` against the real server on a tiny random Llava-Next: every
request with its images succeeds through TGI's and OpenAI chat's API, the results say what
was sent, and repeated images come from the server's prefix cache while unique ones are
encoded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tests.factories import make_vision_dir
from tests.server.conftest import demo_app, live_server
from tgis.benchmark.results import validate_results
from tgis.cli import app

runner = CliRunner()
SHORT = ["--kind", "throughput", "--duration", "60", "--warmup", "0", "--max-requests", "4"]
# Two small images and 16 text tokens per request; four answer tokens.
SMALL = ["--images-per-prompt", "2", "--image-size", "40x24", "--prompt-tokens", "16",
         "--decode-tokens", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The base URL of a live server of the model, and the model's directory (its tokenizer)."""
    model_dir = make_vision_dir(tmp_path_factory.mktemp("llava_next"), "llava_next")
    with demo_app(model_dir, 1024) as app_, live_server(app_) as (url, _):
        yield url, model_dir


def bench(url: str, model_dir: Path, tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "results.json"
    result = runner.invoke(
        app,
        ["benchmark", "--url", url, "--tokenizer", str(model_dir), *args, "--output", str(out)],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(out.read_text())
    validate_results(data)
    return data


def image_metrics(url: str) -> tuple[float, float]:
    """The server's counts of images encoded and of images found in its prefix cache."""
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("tgis_images_encoded", "tgis_images_cached"):
            values[name] = float(value)
    return values["tgis_images_encoded"], values["tgis_images_cached"]


@pytest.mark.parametrize("api", ["tgi", "openai-chat"])
def test_the_vision_profile_runs_clean(served: tuple[str, Path], tmp_path: Path, api: str) -> None:
    url, model_dir = served
    data = bench(url, model_dir, tmp_path, "--api", api, "--profile", "vision", *SMALL,
                 "--max-vus", "2", "--requests", "4", *SHORT)  # fmt: skip
    (step,) = data["steps"]
    ok = step["requests"]["ok"]
    assert ok == 4 and step["errors"] == {} and step["requests"]["failed"] == 0
    assert data["config"]["profile"]["name"] == "vision"
    assert data["config"]["profile"]["images"] == {
        "per_prompt": 2, "width": 40, "height": 24, "format": "jpeg", "unique": True,
    }  # fmt: skip
    # The server's prompt count (usage / details.input_length) holds the images' tokens.
    assert step["prompt_tokens"] > ok * (16 + 2 * 16)


def test_repeated_images_come_from_the_prefix_cache_and_unique_ones_are_encoded(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    url, model_dir = served
    runs = {}
    for seed, flag in (("11", "--repeat-images"), ("12", "--unique-images")):
        before = image_metrics(url)
        # One user and 4 requests out of 400 sessions: no session is sent twice.
        data = bench(url, model_dir, tmp_path, "--api", "tgi", "--profile", "vision", *SMALL,
                     flag, "--max-vus", "1", "--requests", "400", "--seed", seed, *SHORT)  # fmt: skip
        (step,) = data["steps"]
        assert step["errors"] == {} and step["requests"]["total"] == 4
        after = image_metrics(url)
        runs[flag] = (step["requests"]["total"], after[0] - before[0], after[1] - before[1])
    requests, encoded, cached = runs["--repeat-images"]
    assert encoded <= requests and cached >= requests
    requests, encoded, cached = runs["--unique-images"]
    assert (encoded, cached) == (2 * requests, 0)
