"""`tgis serve` and `tgis warmup` fetch a Hub model missing from the Hugging Face cache, as
`tgis download-weights` does, unless HF_HUB_OFFLINE=1 or --no-download (against the fake Hub)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.factories import make_model_dir
from tests.fakehub import FakeHub, fake_hub_fixture, set_offline  # noqa: F401
from tgis.cli import app
from tgis.errors import ModelNotCachedError
from tgis.hub import resolve_model_dir, serving_model_dir

runner = CliRunner()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("fetch") / "llama", "llama", "safetensors")


def test_a_missing_model_is_fetched_once_then_read_from_the_cache(
    fake_hub: FakeHub, llama: Path
) -> None:
    repo = fake_hub.add_repo("org/llama", llama)
    folder = serving_model_dir("org/llama")
    assert folder == resolve_model_dir("org/llama")  # where download-weights puts it
    assert sorted(p.name for p in folder.iterdir()) == sorted(repo.files)
    assert len(fake_hub.downloads()) == len(repo.files)
    fake_hub.log.clear()
    assert serving_model_dir("org/llama") == folder
    assert fake_hub.log == []  # cached: the Hub is not asked again


def test_offline_or_no_download_say_how_to_fetch_it(
    fake_hub: FakeHub, llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.add_repo("org/llama", llama)
    with pytest.raises(ModelNotCachedError) as refused:
        serving_model_dir("org/llama", "v2", download=False)
    assert "--no-download keeps the server from fetching it" in refused.value.message
    assert refused.value.hint is not None
    assert "run `tgis download-weights org/llama --revision v2`" in refused.value.hint
    assert "drop --no-download" in refused.value.hint
    set_offline(monkeypatch)
    with pytest.raises(ModelNotCachedError) as offline:
        serving_model_dir("org/llama")
    assert "HF_HUB_OFFLINE=1 keeps the server from fetching it" in offline.value.message
    assert offline.value.hint is not None and "unset HF_HUB_OFFLINE" in offline.value.hint
    assert fake_hub.log == []


def test_serve_fetches_the_model_it_is_given(fake_hub: FakeHub, llama: Path) -> None:
    fake_hub.add_repo("org/llama", llama)
    refused = runner.invoke(
        app, ["serve", "--model-id", "org/llama", "--no-download", "--check"], terminal_width=200
    )
    assert isinstance(refused.exception, ModelNotCachedError) and fake_hub.downloads() == []
    assert "--no-download keeps the server from fetching it" in str(refused.exception)
    served = runner.invoke(
        app, ["serve", "--model-id", "org/llama", "--backend", "cpu", "--check"], terminal_width=200
    )
    assert served.exit_code == 0, served.output
    assert "org/llama is not in the Hugging Face cache: downloading it" in served.output
    assert (resolve_model_dir("org/llama") / "model.safetensors").is_file()
