"""tgis.convert: .bin -> safetensors, tied weights once, verified, atomic, no silent overwrite."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.factories import make_model_dir, tiny_model
from tgis import convert
from tgis.convert import (
    ALIASES_KEY,
    ConversionReport,
    convert_to_safetensors,
    dedupe_shared,
    same_tensor,
)
from tgis.errors import ConversionError

PROMPT = torch.tensor([[1, 5, 9, 17, 33, 65, 2]])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """Build each (arch, weights) model dir once per module; tests convert a fresh copy."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, weights: str) -> Path:
        if (arch, weights) not in cache:
            cache[(arch, weights)] = make_model_dir(root / f"{arch}-{weights}", arch, weights)  # type: ignore[arg-type]
        return cache[(arch, weights)]

    return get


def fresh(built: Callable[[str, str], Path], arch: str, weights: str, dest: Path) -> Path:
    return Path(shutil.copytree(built(arch, weights), dest / f"{arch}-{weights}"))


def logits_of(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
    with torch.no_grad():
        return model(PROMPT).logits


def reference_logits(arch: str) -> torch.Tensor:
    with torch.no_grad():
        return tiny_model(arch, seed=0)(PROMPT).logits  # type: ignore[arg-type]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_single_bin_with_tied_embeddings_is_written_once_with_alias(
    built: Callable[[str, str], Path], tmp_path: Path
) -> None:
    model_dir = fresh(built, "llama", "bin", tmp_path)
    original = torch.load(model_dir / "pytorch_model.bin", weights_only=True)
    assert "lm_head.weight" in original  # the .bin holds both names of the tied matrix

    report = convert_to_safetensors(model_dir)

    assert report == ConversionReport(
        model_dir=model_dir,
        source_files=("pytorch_model.bin",),
        written_files=("model.safetensors",),
        tensors=len(original) - 1,
        aliases=(("lm_head.weight", "model.embed_tokens.weight"),),
        bytes_written=(model_dir / "model.safetensors").stat().st_size,
        index_file=None,
    )
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(original) - {"lm_head.weight"}
        metadata = handle.metadata()
    assert metadata["format"] == "pt"
    assert json.loads(metadata[ALIASES_KEY]) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert torch.equal(logits_of(model_dir), reference_logits("llama"))
    assert leftovers(model_dir) == []


def test_sharded_bin_becomes_sharded_safetensors_with_the_same_structure(
    built: Callable[[str, str], Path], tmp_path: Path
) -> None:
    model_dir = fresh(built, "gpt2", "sharded-bin", tmp_path)
    bin_index = json.loads((model_dir / "pytorch_model.bin.index.json").read_text())
    bin_shards = sorted(set(bin_index["weight_map"].values()))
    assert len(bin_shards) > 2

    report = convert_to_safetensors(model_dir)

    n = len(bin_shards)
    shard_names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert report.written_files == (*shard_names, "model.safetensors.index.json")
    assert report.sharded and report.index_file == "model.safetensors.index.json"
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert index["metadata"][ALIASES_KEY] == {"lm_head.weight": "transformer.wte.weight"}
    # Same tensor -> shard mapping as the .bin index: shard i of the .bin became shard i here.
    expected = {
        name: shard_names[bin_shards.index(shard)]
        for name, shard in bin_index["weight_map"].items()
        if name != "lm_head.weight"
    }
    assert index["weight_map"] == expected
    for name, shard in index["weight_map"].items():
        with safe_open(str(model_dir / shard), framework="pt") as handle:
            assert name in handle.keys()  # noqa: SIM118 (safe_open handles have no __contains__)
    sizes = sum(t.numel() * t.element_size() for t in _all_tensors(model_dir, shard_names))
    assert index["metadata"]["total_size"] == sizes
    assert torch.equal(logits_of(model_dir), reference_logits("gpt2"))


def _all_tensors(model_dir: Path, shards: list[str]) -> list[torch.Tensor]:
    tensors = []
    for shard in shards:
        with safe_open(str(model_dir / shard), framework="pt") as handle:
            tensors += [handle.get_tensor(k) for k in handle.keys()]  # noqa: SIM118
    return tensors


def test_verification_catches_a_corrupted_result_and_keeps_nothing(
    built: Callable[[str, str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = fresh(built, "llama", "bin", tmp_path)
    real_save = convert._save_file

    def corrupting_save(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
        tampered = dict(tensors)
        name = "model.layers.1.mlp.down_proj.weight"
        tampered[name] = tampered[name].clone()
        tampered[name][0, 0] += 1.0  # one flipped value among thousands
        real_save(tampered, path, meta)

    monkeypatch.setattr(convert, "_save_file", corrupting_save)
    with pytest.raises(ConversionError) as caught:
        convert_to_safetensors(model_dir)

    assert caught.value.message == (
        "verification failed (pytorch_model.bin -> model.safetensors): "
        "tensor 'model.layers.1.mlp.down_proj.weight' differs after conversion"
    )
    assert not (model_dir / "model.safetensors").exists()
    assert leftovers(model_dir) == []


def test_verification_catches_a_missing_tensor(
    built: Callable[[str, str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = fresh(built, "llama", "bin", tmp_path)
    real_save = convert._save_file

    def dropping_save(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
        real_save({k: v for k, v in tensors.items() if k != "model.norm.weight"}, path, meta)

    monkeypatch.setattr(convert, "_save_file", dropping_save)
    with pytest.raises(ConversionError, match=r"'model\.norm\.weight' is missing"):
        convert_to_safetensors(model_dir)
    assert not (model_dir / "model.safetensors").exists()


def test_a_crash_mid_write_leaves_no_half_written_file(
    built: Callable[[str, str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = fresh(built, "llama", "sharded-bin", tmp_path)
    before = sorted(p.name for p in model_dir.iterdir())
    real_save = convert._save_file
    calls: list[Path] = []

    def crashing_save(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
        calls.append(path)
        if len(calls) < 3:
            real_save(tensors, path, meta)
            return
        path.write_bytes(b"\x00" * 1000)  # the first bytes of a file ...
        raise OSError(28, "No space left on device")  # ... then the disk fills up

    monkeypatch.setattr(convert, "_save_file", crashing_save)
    with pytest.raises(ConversionError) as caught:
        convert_to_safetensors(model_dir)

    assert "No space left on device" in caught.value.message
    assert len(calls) == 3 and all(p.parent == model_dir for p in calls)
    # Neither the two finished shards, nor the broken third, nor an index appeared.
    assert sorted(p.name for p in model_dir.iterdir()) == before


def test_existing_safetensors_are_not_overwritten_without_force(
    built: Callable[[str, str], Path], tmp_path: Path
) -> None:
    model_dir = fresh(built, "llama", "bin", tmp_path)
    target = model_dir / "model.safetensors"
    target.write_bytes(b"user data")

    with pytest.raises(ConversionError) as caught:
        convert_to_safetensors(model_dir)
    assert caught.value.message == f"{target} already exists"
    assert caught.value.hint is not None and "--force" in caught.value.hint
    assert target.read_bytes() == b"user data"

    report = convert_to_safetensors(model_dir, force=True)
    assert report.written_files == ("model.safetensors",)
    assert torch.equal(logits_of(model_dir), reference_logits("llama"))


def test_force_removes_outputs_of_an_earlier_layout(
    built: Callable[[str, str], Path], tmp_path: Path
) -> None:
    model_dir = fresh(built, "llama", "sharded-bin", tmp_path)
    stale = model_dir / "model.safetensors"
    stale.write_bytes(b"an earlier single-file conversion")
    report = convert_to_safetensors(model_dir, force=True)
    assert report.index_file == "model.safetensors.index.json"
    assert not stale.exists()
    assert torch.equal(logits_of(model_dir), reference_logits("llama"))


def test_nothing_to_convert(tmp_path: Path) -> None:
    with pytest.raises(
        ConversionError, match=r"neither pytorch_model\.bin nor pytorch_model\.bin\.index\.json"
    ):
        convert_to_safetensors(tmp_path)


def test_missing_shard_is_named(built: Callable[[str, str], Path], tmp_path: Path) -> None:
    model_dir = fresh(built, "llama", "sharded-bin", tmp_path)
    (model_dir / "pytorch_model-00002-of-00006.bin").unlink()
    with pytest.raises(ConversionError, match=r"pytorch_model-00002-of-00006\.bin is listed"):
        convert_to_safetensors(model_dir)


class NotATensor:
    """A pickled object that weights_only=True must refuse to load."""


def test_pickles_with_code_are_refused(tmp_path: Path) -> None:
    torch.save({"weight": torch.ones(2), "evil": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConversionError, match=r"cannot load .*pytorch_model\.bin safely"):
        convert_to_safetensors(tmp_path)
    torch.save({"weight": torch.ones(2), "step": 3}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="'step' is a int, not a tensor"):
        convert_to_safetensors(tmp_path)


def test_non_contiguous_and_overlapping_views_are_stored_standalone(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "transposed": base.t(),  # non-contiguous view of base
        "rows": base[1:3],  # contiguous view into the middle of base's storage
        "same_rows": base[1:3],  # identical view: an alias of "rows"
        "full": base,
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "half": torch.randn(3, 5).to(torch.bfloat16)[:, ::2],  # strided bf16
    }
    torch.save(state, tmp_path / "pytorch_model.bin")

    report = convert_to_safetensors(tmp_path)

    assert report.aliases == (("same_rows", "rows"),)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(state) - {"same_rows"}
        for name, tensor in state.items():
            assert same_tensor(handle.get_tensor("rows" if name == "same_rows" else name), tensor)


def test_untied_config_keeps_both_names(tmp_path: Path) -> None:
    shared = torch.randn(8, 4)
    torch.save({"embed.weight": shared, "lm_head.weight": shared}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))

    report = convert_to_safetensors(tmp_path)

    assert report.aliases == () and report.tensors == 2
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == ["embed.weight", "lm_head.weight"]


def test_dedupe_keeps_the_embedding_and_drops_the_output_head() -> None:
    embed = torch.randn(5, 3)
    state = {"lm_head.weight": embed, "model.embed_tokens.weight": embed, "other": torch.ones(2)}
    stored, aliases = dedupe_shared(state, lambda name: name == "lm_head.weight")
    assert list(stored) == ["model.embed_tokens.weight", "other"]
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}


def test_same_tensor_is_bit_exact() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert same_tensor(nan, nan.clone())  # torch.equal says False for NaN
    assert not same_tensor(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert not same_tensor(torch.zeros(2), torch.zeros(1, 2))
    assert not same_tensor(torch.tensor([0.0]), torch.tensor([-0.0]))
