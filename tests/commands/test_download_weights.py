"""`tgis download-weights` through the CLI, against the fake Hub."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import run_tgis
from tests.factories import make_model_dir
from tests.fakehub import FakeHub, fake_hub_fixture, set_offline  # noqa: F401
from tgis.cli import app
from tgis.errors import HubError, ModelNotFoundError
from tgis.hub import resolve_model_dir

runner = CliRunner()


@pytest.fixture(scope="module")
def llama_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("dl") / "llama-bin", "llama", "bin")


def invoke(*args: str) -> tuple[int, str, BaseException | None]:
    result = runner.invoke(app, ["download-weights", *args], terminal_width=200)
    return result.exit_code, result.output, result.exception


def test_help_has_an_example_and_grouped_options() -> None:
    code, output, _ = invoke("--help")
    assert code == 0
    assert "tgis download-weights bigscience/bloom-560m" in output
    for text in ("--extension", "--auto-convert", "--no-auto-convert", "--revision", "Download"):
        assert text in output


def test_download_converts_then_skips_cached_files(
    fake_hub: FakeHub, llama_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = fake_hub.add_repo("org/llama-bin", llama_bin)
    n_files = len(repo.files)

    code, output, exc = invoke("org/llama-bin")

    assert (code, exc) == (0, None)
    snapshot = resolve_model_dir("org/llama-bin")
    assert f"{n_files} downloaded" in output and "1 converted" in output
    assert "0 already cached" in output and str(snapshot) in output.replace("\n", "")
    assert (snapshot / "model.safetensors").is_file()

    fake_hub.log.clear()
    code, output, exc = invoke("org/llama-bin")

    assert (code, exc) == (0, None)
    assert f"0 downloaded (0.0 MB), {n_files} already cached, 0 converted" in output
    assert "cached      pytorch_model.bin" in output
    assert fake_hub.downloads() == []
    set_offline(monkeypatch)
    assert resolve_model_dir("org/llama-bin") == snapshot


def test_extension_and_no_auto_convert(fake_hub: FakeHub, llama_bin: Path) -> None:
    files = {p.name: p.read_bytes() for p in llama_bin.iterdir()}
    fake_hub.add_repo("org/llama-bin", {**files, "README.md": b"# card", "docs/a.md": b"x"})

    code, output, exc = invoke("org/llama-bin", "--extension", ".json,.md", "--no-auto-convert")

    assert (code, exc) == (0, None)
    names = sorted(p.name for p in resolve_model_dir("org/llama-bin").iterdir())
    assert names == sorted(["README.md", *(f for f in files if f.endswith(".json"))])
    assert "0 converted" in output


def test_bin_without_auto_convert_is_not_converted(fake_hub: FakeHub, llama_bin: Path) -> None:
    fake_hub.add_repo("org/llama-bin", llama_bin)
    code, _, exc = invoke("org/llama-bin", "--no-auto-convert")
    assert (code, exc) == (0, None)
    snapshot = resolve_model_dir("org/llama-bin")
    assert (snapshot / "pytorch_model.bin").is_file()
    assert not (snapshot / "model.safetensors").exists()


def test_revision_from_flag_and_from_env(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.add_repo("org/tagged", {"model.safetensors": b"w"}, branches=("v1",))

    code, _, exc = invoke("org/tagged")  # there is no main branch
    assert code == 1 and isinstance(exc, HubError)
    assert exc.message == "revision 'main' not found in org/tagged"

    code, _, exc = invoke("org/tagged", "--revision", "v1")
    assert (code, exc) == (0, None)
    monkeypatch.setenv("REVISION", "v1")  # TGI's launcher variable
    code, output, exc = invoke("org/tagged")
    assert (code, exc) == (0, None) and "1 already cached" in output
    assert resolve_model_dir("org/tagged", "v1").name == fake_hub.repos["org/tagged"].sha


def test_missing_repo_is_a_tgis_error(fake_hub: FakeHub) -> None:
    code, _, exc = invoke("org/nope")
    assert code == 1 and isinstance(exc, ModelNotFoundError)
    assert exc.message == f"model repository org/nope not found on {fake_hub.url}"


def test_errors_are_one_line_in_a_real_process(fake_hub: FakeHub, tmp_path: Path) -> None:
    """End to end: environment variables only (no monkeypatching), error on one stderr line."""
    fake_hub.add_repo("org/gated", {"model.safetensors": b"w"}, gated_token="hf_ok")
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HUB_CACHE": str(tmp_path / "cache")}

    result = run_tgis("download-weights", "org/gated", env=env, timeout=60)

    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0] == (
        f"error: org/gated is a gated or private repository and {fake_hub.url} refused access "
        "(HTTP 401); accept its terms on the Hub, then set HF_TOKEN to a token with access to it"
    )

    result = run_tgis("download-weights", "org/gated", env={**env, "HF_TOKEN": "hf_ok"})
    assert result.returncode == 0, result.stderr
    assert "1 downloaded" in result.stdout
    snapshot = tmp_path / "cache" / "models--org--gated" / "snapshots"
    assert os.listdir(snapshot) == [fake_hub.repos["org/gated"].sha]
