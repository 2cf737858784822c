"""`tgis convert-to-safetensors` through the CLI: local directories and cached Hub models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from tests.factories import make_model_dir
from tests.fakehub import FakeHub, fake_hub_fixture, set_offline  # noqa: F401
from tgis.cli import app
from tgis.errors import ConversionError, ModelNotFoundError
from tgis.hub import fetch_weights, resolve_model_dir

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, BaseException | None]:
    result = runner.invoke(app, ["convert-to-safetensors", *args], terminal_width=200)
    return result.exit_code, result.output, result.exception


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cv")
    return {
        "bin": make_model_dir(root / "gpt2-bin", "gpt2", "bin"),
        "sharded": make_model_dir(root / "llama-sharded", "llama", "sharded-bin"),
    }


def test_help_has_an_example() -> None:
    code, output, _ = invoke("--help")
    assert code == 0
    assert "tgis convert-to-safetensors ./my-model" in output and "--force" in output


def test_local_directory_then_refusal_then_force(built: dict[str, Path], tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(built["bin"], tmp_path / "gpt2"))

    code, output, exc = invoke(str(model_dir))
    assert (code, exc) == (0, None)
    assert "lm_head.weight = transformer.wte.weight" in output
    assert "done 1 file written, 28 tensors verified" in output
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()  # noqa: SIM118 (no __contains__)

    code, _, exc = invoke(str(model_dir))
    assert code == 1 and isinstance(exc, ConversionError)
    assert exc.message == f"{model_dir / 'model.safetensors'} already exists"
    assert exc.hint == "pass --force to overwrite it"

    code, _, exc = invoke(str(model_dir), "--force")
    assert (code, exc) == (0, None)


def test_sharded_directory(built: dict[str, Path], tmp_path: Path) -> None:
    model_dir = Path(shutil.copytree(built["sharded"], tmp_path / "llama"))
    code, output, exc = invoke(str(model_dir))
    assert (code, exc) == (0, None)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 6
    assert "model.safetensors.index.json" in output


def test_cached_hub_model_converted_offline(
    fake_hub: FakeHub, built: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.add_repo("org/gpt2-bin", built["bin"])
    fetch_weights("org/gpt2-bin", auto_convert=False, console=None)
    set_offline(monkeypatch)

    code, _, exc = invoke("org/gpt2-bin")

    assert (code, exc) == (0, None)
    assert (resolve_model_dir("org/gpt2-bin") / "model.safetensors").is_file()


def test_uncached_hub_model_says_to_download_first(fake_hub: FakeHub) -> None:
    code, _, exc = invoke("org/not-downloaded")
    assert code == 1 and isinstance(exc, ModelNotFoundError)
    assert exc.hint is not None
    assert exc.hint.startswith("run `tgis download-weights org/not-downloaded` first")


def test_directory_without_bin(tmp_path: Path) -> None:
    code, _, exc = invoke(str(tmp_path))
    assert code == 1 and isinstance(exc, ConversionError)
    assert "neither pytorch_model.bin nor pytorch_model.bin.index.json" in exc.message
