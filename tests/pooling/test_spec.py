"""What a model is for, read from sentence-transformers' files or its architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pooling.models import bert_embedder, cross_encoder, decoder_embedder
from tgis.errors import ConfigError
from tgis.hub import read_model_config
from tgis.pooling.spec import PoolingSpec, read_pooling_spec


def spec_of(directory: Path) -> PoolingSpec | None:
    return read_pooling_spec(directory, read_model_config(directory)[0])


def test_sentence_transformers_modules_say_the_pooling(tmp_path: Path) -> None:
    spec = spec_of(bert_embedder(tmp_path / "a", ("cls", "mean"), normalize=False))
    assert spec == PoolingSpec(
        "embed", ("cls", "mean"), normalize=False, max_length=64, source="sentence-transformers"
    )
    decoder = spec_of(decoder_embedder(tmp_path / "b"))
    assert decoder is not None and (decoder.modes, decoder.normalize) == (("lasttoken",), True)


def test_a_mode_the_pooling_config_leaves_out_takes_sentence_transformers_default(
    tmp_path: Path,
) -> None:
    from sentence_transformers import SentenceTransformer

    directory = bert_embedder(tmp_path / "a", ("lasttoken",))
    settings = directory / "1_Pooling" / "config.json"
    written = json.loads(settings.read_text())
    settings.write_text(json.dumps({k: v for k, v in written.items() if "mean" not in k}))
    spec = spec_of(directory)
    assert spec is not None and spec.modes == ("mean", "lasttoken")  # mean is on by default
    assert (
        SentenceTransformer(str(directory), device="cpu").get_sentence_embedding_dimension() == 64
    )


def test_without_them_the_architecture_decides(tmp_path: Path, demo_model_dir: Path) -> None:
    reranker = spec_of(cross_encoder(tmp_path / "ce"))
    assert reranker == PoolingSpec("rerank", labels=("LABEL_0",))
    bare = bert_embedder(tmp_path / "bare")
    for name in ("modules.json", "sentence_bert_config.json"):
        (bare / name).unlink()
    config = json.loads((bare / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 8]
    (bare / "config.json").write_text(json.dumps(config))
    assert spec_of(bare) == PoolingSpec("embed", ("cls",), normalize=True, dimensions=(16, 8))
    assert spec_of(demo_model_dir) is None  # a causal LM generates
    three = {"architectures": ["BertForSequenceClassification"], "id2label": {"0": "neg", "1": "neu", "2": "pos"}}  # fmt: skip
    assert read_pooling_spec(tmp_path, three) == PoolingSpec(
        "classify", labels=("neg", "neu", "pos")
    )


def test_a_module_tgis_does_not_run_is_refused_by_name(tmp_path: Path) -> None:
    directory = bert_embedder(tmp_path / "dense")
    modules = json.loads((directory / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})  # fmt: skip
    (directory / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match=r"has a sentence_transformers\.models\.Dense module"):
        spec_of(directory)
    (directory / "modules.json").write_text(json.dumps(modules[:1]))
    with pytest.raises(ConfigError, match="has no Pooling module"):
        spec_of(directory)
    (directory / "modules.json").write_text(json.dumps(modules[:2]))
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False}))  # fmt: skip
    with pytest.raises(ConfigError, match="turns no pooling mode on"):
        spec_of(directory)
