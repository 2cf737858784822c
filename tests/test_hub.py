"""tgis.hub against the fake Hub: selection, caching, conversion, resume, offline, errors."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

import pytest
import torch
from rich.console import Console

from tests.factories import make_model_dir, tiny_model
from tests.fakehub import FakeHub, fake_hub_fixture, set_offline  # noqa: F401
from tgis.errors import HubError, ModelNotFoundError, TgisError
from tgis.hub import (
    RESUME_ATTEMPTS,
    fetch_weights,
    plan_downloads,
    read_model_config,
    resolve_model_dir,
)

PROMPT = torch.tensor([[1, 4, 8, 15, 16, 23, 42]])
SERVING = ["config.json", "generation_config.json"]
TOKENIZER = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny model directories the tests publish on the fake hub (read into memory there)."""
    root = tmp_path_factory.mktemp("hub-models")
    return {
        "llama-bin": make_model_dir(root / "llama-bin", "llama", "bin"),
        "llama-safetensors": make_model_dir(root / "llama-st", "llama", "safetensors"),
        "gpt2-sharded-bin": make_model_dir(root / "gpt2-sharded", "gpt2", "sharded-bin"),
    }


def quiet() -> Console:
    return Console(file=open(os.devnull, "w"), width=120)


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
    with torch.no_grad():
        return model(PROMPT).logits


# --- selection (no network) ----------------------------------------------------------------------


def test_plan_prefers_root_safetensors_and_skips_subfolders() -> None:
    repo = [
        "config.json",
        "model.safetensors",
        "consolidated.safetensors",
        "pytorch_model.bin",
        "training_args.bin",
        "tokenizer.json",
        "README.md",
        "onnx/model.onnx",
        "subdir/model.safetensors",
        "subdir/config.json",
    ]
    plan = plan_downloads(repo, None, auto_convert=True)
    assert plan.files == ("config.json", "model.safetensors", "tokenizer.json")
    assert plan.convert is False


def test_plan_falls_back_to_bin_and_converts() -> None:
    repo = ["config.json", "pytorch_model.bin", "training_args.bin", "tokenizer.model", "x/a.bin"]
    assert plan_downloads(repo, None, auto_convert=True).files == (
        "config.json",
        "pytorch_model.bin",
        "tokenizer.model",
    )
    assert plan_downloads(repo, None, auto_convert=True).convert is True
    assert plan_downloads(repo, None, auto_convert=False).convert is False


def test_plan_extensions() -> None:
    repo = ["config.json", "model.safetensors", "pytorch_model.bin", "README.md", "a.py", "s/b.py"]
    exact = plan_downloads(repo, [".json", "bin", ".md", ".py"], auto_convert=True)
    assert exact.files == ("README.md", "a.py", "config.json", "pytorch_model.bin")
    assert exact.convert is False
    # One extension also brings the serving files, as in TGIS.
    assert plan_downloads(repo, [".bin"], True).files == ("config.json", "pytorch_model.bin")
    with pytest.raises(HubError, match=r"no root-level files with extension \.gguf"):
        plan_downloads(repo, [".gguf"], True, "org/m")


def test_plan_without_weights() -> None:
    with pytest.raises(HubError) as caught:
        plan_downloads(["config.json", "sub/model.safetensors"], None, True, "org/empty")
    assert caught.value.message == (
        "org/empty has no model weights at its root (no .safetensors or .bin files)"
    )


# --- resolving and reading (no network) ----------------------------------------------------------


def test_resolve_local_directory(tmp_path: Path) -> None:
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(ModelNotFoundError, match=r"model directory \./nope does not exist"):
        resolve_model_dir("./nope")


def test_resolve_uncached_model_says_to_download_first(fake_hub: FakeHub) -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_dir("org/never-downloaded", revision="v2")
    assert caught.value.message.startswith(
        "model org/never-downloaded at revision v2 is not in the Hugging Face cache"
    )
    assert caught.value.hint is not None
    assert "run `tgis download-weights org/never-downloaded --revision v2` first" in (
        caught.value.hint
    )
    assert fake_hub.log == []  # resolving never touches the network


def test_read_model_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(TgisError, match=r"config\.json is not valid JSON"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert read_model_config(tmp_path) == ({"model_type": "llama"}, None)
    (tmp_path / "neuron_config.json").write_text(json.dumps({"batch_size": 4}))
    assert read_model_config(tmp_path) == ({"model_type": "llama"}, {"batch_size": 4})


# --- downloads -----------------------------------------------------------------------------------


def test_safetensors_repo_fetches_only_safetensors_and_root_files(
    fake_hub: FakeHub, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = models["llama-safetensors"]
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    files["pytorch_model.bin"] = (models["llama-bin"] / "pytorch_model.bin").read_bytes()
    files["README.md"] = b"# tiny"
    files["extra/model.safetensors"] = files["model.safetensors"]
    files["extra/config.json"] = b"{}"
    fake_hub.add_repo("org/tiny-llama", files)

    report = fetch_weights("org/tiny-llama", console=quiet())

    expected = sorted(["model.safetensors", *SERVING, *TOKENIZER])
    assert sorted(report.downloaded) == expected
    assert files_in(report.snapshot_dir) == expected
    assert [r.path.rsplit("/", 1)[1] for r in fake_hub.downloads()] == sorted(report.downloaded)
    assert report.converted == () and report.skipped == ()
    set_offline(monkeypatch)
    assert resolve_model_dir("org/tiny-llama") == report.snapshot_dir
    with torch.no_grad():
        reference = tiny_model("llama")(PROMPT).logits
    assert torch.equal(logits(report.snapshot_dir), reference)


def test_bin_repo_is_fetched_converted_and_cached(
    fake_hub: FakeHub, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hub.add_repo("org/llama-bin", models["llama-bin"])

    first = fetch_weights("org/llama-bin", console=quiet())

    assert first.converted == ("model.safetensors",)
    assert "model.safetensors" in files_in(first.snapshot_dir)
    assert not (first.snapshot_dir / "model.safetensors").is_symlink()  # a real file, not a blob
    with torch.no_grad():
        reference = tiny_model("llama")(PROMPT).logits
    assert torch.equal(logits(first.snapshot_dir), reference)

    fake_hub.log.clear()
    second = fetch_weights("org/llama-bin", console=quiet())

    assert second.downloaded == () and second.converted == ()
    assert sorted(second.skipped) == sorted(first.downloaded)
    assert fake_hub.downloads() == []  # no second GET of any file
    assert [(r.method, r.path) for r in fake_hub.log] == [("GET", "/api/models/org/llama-bin")]
    set_offline(monkeypatch)
    assert resolve_model_dir("org/llama-bin") == first.snapshot_dir


def test_sharded_bin_repo_becomes_sharded_safetensors(
    fake_hub: FakeHub, models: dict[str, Path]
) -> None:
    fake_hub.add_repo("org/gpt2-sharded", models["gpt2-sharded-bin"])

    report = fetch_weights("org/gpt2-sharded", console=quiet())

    bins = [f for f in report.downloaded if f.endswith(".bin")]
    assert len(bins) > 2 and "pytorch_model.bin.index.json" in report.downloaded
    n = len(bins)
    shards = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert report.converted == (*shards, "model.safetensors.index.json")
    index = json.loads((report.snapshot_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    with torch.no_grad():
        reference = tiny_model("gpt2")(PROMPT).logits
    assert torch.equal(logits(report.snapshot_dir), reference)


def test_no_auto_convert_keeps_bin(fake_hub: FakeHub, models: dict[str, Path]) -> None:
    fake_hub.add_repo("org/llama-bin", models["llama-bin"])
    report = fetch_weights("org/llama-bin", auto_convert=False, console=quiet())
    assert "pytorch_model.bin" in report.downloaded and report.converted == ()
    assert not list(report.snapshot_dir.glob("*.safetensors"))


def test_extensions_fetch_exactly_those_root_files(fake_hub: FakeHub) -> None:
    fake_hub.add_repo(
        "org/mixed",
        {
            "config.json": b"{}",
            "pytorch_model.bin": b"weights",
            "model.safetensors": b"weights",
            "README.md": b"# card",
            "modeling.py": b"print()",
            "tokenizer.model": b"spm",
            "nested/extra.json": b"{}",
        },
    )
    report = fetch_weights("org/mixed", extensions=[".json", ".md", ".py"], console=quiet())
    assert files_in(report.snapshot_dir) == ["README.md", "config.json", "modeling.py"]
    assert {r.path.rsplit("/", 1)[1] for r in fake_hub.downloads()} == set(report.downloaded)


def test_interrupted_download_resumes_with_identical_bytes(fake_hub: FakeHub) -> None:
    payload = os.urandom(200_000)
    fake_hub.add_repo("org/flaky", {"config.json": b"{}", "model.safetensors": payload})
    fake_hub.interrupt("org/flaky", "model.safetensors", after_bytes=70_000)

    report = fetch_weights("org/flaky", console=quiet())

    assert (report.snapshot_dir / "model.safetensors").read_bytes() == payload
    gets = fake_hub.downloads("model.safetensors")
    assert [g.status for g in gets] == [200, 206]
    assert gets[0].range is None
    # Resumed from the bytes already on disk (whole 16 KiB chunks written before the drop).
    resumed = re.fullmatch(r"bytes=(\d+)-", gets[1].range or "")
    assert resumed is not None and 0 < int(resumed[1]) <= 70_000


def test_download_that_keeps_failing_resumes_on_the_next_run(fake_hub: FakeHub) -> None:
    payload = os.urandom(400_000)
    fake_hub.add_repo("org/flaky", {"config.json": b"{}", "model.safetensors": payload})
    fake_hub.interrupt("org/flaky", "model.safetensors", 40_000, times=RESUME_ATTEMPTS + 1)

    with pytest.raises(HubError) as caught:
        fetch_weights("org/flaky", console=quiet())
    assert caught.value.message.startswith(
        f"downloading model.safetensors from {fake_hub.url} failed {RESUME_ATTEMPTS + 1} times"
    )
    assert caught.value.hint == "check the network and run the command again: it resumes"

    report = fetch_weights("org/flaky", console=quiet())
    assert (report.snapshot_dir / "model.safetensors").read_bytes() == payload
    assert report.skipped == ("config.json",)
    last = fake_hub.downloads("model.safetensors")[-1]
    assert last.status == 206 and last.range is not None and last.range != "bytes=0-"


def test_repo_without_siblings_is_listed_through_the_tree(fake_hub: FakeHub) -> None:
    fake_hub.add_repo(
        "org/big",
        {"config.json": b"{}", "model.safetensors": b"w", "sub/model.safetensors": b"w"},
        list_siblings=False,
    )
    report = fetch_weights("org/big", console=quiet())
    assert sorted(report.downloaded) == ["config.json", "model.safetensors"]
    assert any("/tree/" in r.path for r in fake_hub.log)


def test_revision_is_recorded_for_offline_lookup(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = fake_hub.add_repo("org/rev", {"model.safetensors": b"w"}, branches=("main", "v1"))
    report = fetch_weights("org/rev", revision="v1", console=quiet())
    assert report.commit == repo.sha
    set_offline(monkeypatch)
    assert resolve_model_dir("org/rev", revision="v1") == report.snapshot_dir
    assert resolve_model_dir("org/rev", revision=repo.sha) == report.snapshot_dir


# --- errors --------------------------------------------------------------------------------------


def test_missing_repo(fake_hub: FakeHub) -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        fetch_weights("org/does-not-exist", console=quiet())
    expected = f"model repository org/does-not-exist not found on {fake_hub.url}"
    assert caught.value.message == expected
    assert caught.value.hint == (
        "check the model id and --revision; "
        "for a private repo set HF_TOKEN to a token with access to it"
    )


def test_gated_repo_needs_hf_token(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hub.add_repo("org/gated", {"model.safetensors": b"w"}, gated_token="hf_secret")

    with pytest.raises(HubError) as caught:
        fetch_weights("org/gated", console=quiet())
    assert caught.value.message == (
        f"org/gated is a gated or private repository and {fake_hub.url} refused access (HTTP 401)"
    )
    assert caught.value.hint == (
        "accept its terms on the Hub, then set HF_TOKEN to a token with access to it"
    )

    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubError, match=r"refused access \(HTTP 403\)"):
        fetch_weights("org/gated", console=quiet())

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    report = fetch_weights("org/gated", console=quiet())
    assert report.downloaded == ("model.safetensors",)
    assert all(r.authorized for r in fake_hub.log[-2:])


def test_missing_revision(fake_hub: FakeHub) -> None:
    fake_hub.add_repo("org/rev", {"model.safetensors": b"w"})
    with pytest.raises(HubError) as caught:
        fetch_weights("org/rev", revision="v9", console=quiet())
    assert caught.value.message == "revision 'v9' not found in org/rev"
    assert caught.value.hint == "check --revision: a branch, tag or commit of the repository"


def test_repo_without_weights(fake_hub: FakeHub) -> None:
    fake_hub.add_repo("org/card-only", {"README.md": b"# card", "config.json": b"{}"})
    with pytest.raises(HubError, match=r"org/card-only has no model weights at its root"):
        fetch_weights("org/card-only", console=quiet())
    assert fake_hub.downloads() == []


def test_unreachable_hub_names_hf_endpoint(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    with pytest.raises(HubError) as caught:
        fetch_weights("org/anything", console=quiet())
    assert caught.value.message == (
        f"cannot reach the Hub at {dead} (HF_ENDPOINT): [Errno 111] Connection refused"
    )
    assert "HF_ENDPOINT" in (caught.value.hint or "")


def test_offline_mode_refuses_to_download(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_offline(monkeypatch)
    with pytest.raises(HubError, match=r"offline mode is on \(HF_HUB_OFFLINE=1\)"):
        fetch_weights("org/anything", console=quiet())
    assert fake_hub.log == []


def test_local_directory_is_not_downloaded(tmp_path: Path) -> None:
    with pytest.raises(HubError, match=r"is a local directory: there is nothing to download"):
        fetch_weights(str(tmp_path), console=quiet())
