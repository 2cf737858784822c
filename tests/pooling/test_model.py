"""Pooling models against their oracles: sentence-transformers' `encode` (every pooling mode,
normalized or not, an encoder and a decoder embedder) and a cross-encoder's logits; each row's
output the same whatever batch it runs in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from tests.pooling.models import (
    PAD_ID,
    PROMPTS,
    TEXTS,
    bert_embedder,
    cross_encoder,
    decoder_cross_encoder,
    decoder_embedder,
    encoder_embedder,
)
from tgis.errors import InputValidationError
from tgis.hub import read_model_config
from tgis.pooling.model import DecoderForward, PoolingModel, finish_embedding
from tgis.pooling.spec import MODES, read_pooling_spec

TOLERANCE = 1e-5


def load(directory: Path) -> PoolingModel:
    spec = read_pooling_spec(directory, read_model_config(directory)[0])
    assert spec is not None
    return PoolingModel.load(directory, spec, dtype=torch.float32)


@pytest.mark.parametrize(
    ("modes", "normalize"),
    [(("mean",), True), (("cls",), False), (("max",), True), (("lasttoken",), True),
     (("mean_sqrt_len",), False), (("weightedmean",), True), (("cls", "mean"), False)],
)  # fmt: skip
def test_embeddings_equal_sentence_transformers_encode(
    tmp_path: Path, modes: tuple[str, ...], normalize: bool
) -> None:
    directory = bert_embedder(tmp_path / "bert", modes, normalize)
    model = load(directory)
    assert model.spec.modes == tuple(m for m in MODES if m in modes)
    assert model.dimension == 32 * len(modes)
    oracle = SentenceTransformer(str(directory), device="cpu")
    expected = oracle.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    rows = model.run([model.encode(t) for t in TEXTS]).rows
    got = torch.stack([finish_embedding(row, None, model.spec.normalize) for row in rows])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected.float(), atol=TOLERANCE, rtol=0)
    if normalize:
        torch.testing.assert_close(got.norm(dim=1), torch.ones(len(TEXTS)))


@pytest.mark.parametrize("arch", ["xlm-roberta", "modernbert"])
def test_roberta_and_modernbert_style_encoders_equal_sentence_transformers(
    tmp_path: Path, arch: str
) -> None:
    directory = encoder_embedder(tmp_path / arch, arch, ("mean", "cls"))
    model = load(directory)
    assert not model.packed  # encoders run as transformers' model
    oracle = SentenceTransformer(str(directory), device="cpu")
    expected = oracle.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    rows = model.run([model.encode(t) for t in TEXTS]).rows
    got = torch.stack([finish_embedding(row, None, True) for row in rows])
    torch.testing.assert_close(got, expected.float(), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("modes", [("lasttoken",), ("mean",), ("cls", "lasttoken")])
def test_a_decoder_embedder_on_the_paged_layers_pools_as_sentence_transformers_does(
    tmp_path: Path, modes: tuple[str, ...]
) -> None:
    directory = decoder_embedder(tmp_path / "qwen", modes)
    model = load(directory)
    assert (model.spec.modes, model.spec.normalize, model.spec.decoder) == (modes, True, True)
    assert isinstance(model.forward, DecoderForward)
    oracle = SentenceTransformer(str(directory), device="cpu")
    expected = oracle.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    rows = model.run([model.encode(t) for t in TEXTS]).rows
    got = torch.stack([finish_embedding(row, None, True) for row in rows])
    torch.testing.assert_close(got, expected.float(), atol=TOLERANCE, rtol=0)


def test_a_decoder_embedders_token_embeddings_equal_sentence_transformers(
    tmp_path: Path,
) -> None:
    directory = decoder_embedder(tmp_path / "qwen")
    model = load(directory)
    oracle = SentenceTransformer(str(directory), device="cpu")
    rows = model.run([model.encode(t) for t in TEXTS], tokens=True).rows
    for text, row in zip(TEXTS, rows, strict=True):
        expected = oracle.encode(text, output_value="token_embeddings", convert_to_tensor=True)
        torch.testing.assert_close(row, expected.float(), atol=TOLERANCE, rtol=0)


def test_a_decoder_embedder_in_bfloat16_stays_with_transformers_in_bfloat16(
    tmp_path: Path,
) -> None:
    """The GPU's dtype on the CPU: the paged layers in bfloat16 against sentence-transformers
    over transformers' bfloat16 model."""
    directory = decoder_embedder(tmp_path / "qwen", ("mean",))
    spec = read_pooling_spec(directory, read_model_config(directory)[0])
    assert spec is not None
    model = PoolingModel.load(directory, spec, dtype=torch.bfloat16)
    oracle = SentenceTransformer(
        str(directory), device="cpu", model_kwargs={"dtype": torch.bfloat16}
    )
    expected = oracle.encode(TEXTS, convert_to_tensor=True).float()
    got = torch.stack(
        [
            finish_embedding(row, None, True)
            for row in model.run([model.encode(t) for t in TEXTS]).rows
        ]
    )
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=1)
    assert cosine.min() > 0.999, cosine
    assert torch.isfinite(got).all()


@pytest.mark.parametrize(
    ("modes", "include_prompt"),
    [(("mean",), True), (("mean",), False), (("max",), False), (("cls", "lasttoken"), False)],
)
def test_named_prompts_are_applied_as_sentence_transformers_applies_them(
    tmp_path: Path, modes: tuple[str, ...], include_prompt: bool
) -> None:
    directory = bert_embedder(
        tmp_path / "bert", modes, prompts=PROMPTS, default_prompt="query",
        include_prompt=include_prompt,
    )  # fmt: skip
    model = load(directory)
    assert model.spec.prompts == tuple(PROMPTS.items()) and model.spec.default_prompt == "query"
    assert model.spec.include_prompt is include_prompt
    oracle = SentenceTransformer(str(directory), device="cpu")
    for name in (None, "query", "passage"):
        expected = oracle.encode(TEXTS, prompt_name=name, convert_to_tensor=True)
        prompt = model.prompt(name)
        assert prompt == PROMPTS[name or "query"]
        rows = model.run([model.encode(t, prompt=prompt) for t in TEXTS]).rows
        got = torch.stack([finish_embedding(row, None, True) for row in rows])
        torch.testing.assert_close(got, expected.float(), atol=TOLERANCE, rtol=0)
    with pytest.raises(
        InputValidationError,
        match="'title' is not one of this model's prompts \\('query', 'passage'\\)",
    ):
        model.prompt("title")


def test_a_model_without_prompts_refuses_a_prompt_name(tmp_path: Path) -> None:
    model = load(bert_embedder(tmp_path / "bert"))
    assert model.prompt(None) is None
    with pytest.raises(InputValidationError, match="prompts: it has none"):
        model.prompt("query")


def test_rerank_scores_equal_the_cross_encoders_logits(tmp_path: Path) -> None:
    directory = cross_encoder(tmp_path / "ce")
    model = load(directory)
    assert model.spec.task == "rerank" and model.dimension == 1
    query = "what is a tree"
    pairs = [(query, text) for text in TEXTS]
    oracle = CrossEncoder(str(directory), device="cpu")
    logits = oracle.predict(pairs, activation_fn=torch.nn.Identity(), convert_to_tensor=True)
    got = torch.cat(model.run([model.encode(pair) for pair in pairs]).rows)
    torch.testing.assert_close(got, logits.float().view(-1), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_a_decoder_sequence_classifier_on_the_paged_layers_gives_transformers_logits(
    tmp_path: Path, num_labels: int
) -> None:
    from transformers import AutoModelForSequenceClassification

    directory = decoder_cross_encoder(tmp_path / "qwen-cls", num_labels)
    model = load(directory)
    assert model.spec.task == ("rerank" if num_labels == 1 else "classify")
    assert model.packed and model.dimension == num_labels
    pairs = [("what is a tree", text) for text in TEXTS]
    encoded = [model.encode(pair) for pair in pairs]
    # A row that ends with the pad token: transformers scores its last token that is not one.
    encoded.append({"input_ids": [*encoded[0]["input_ids"], PAD_ID, PAD_ID]})
    got = torch.stack(model.run(encoded).rows)
    oracle = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32)
    for row, ids in zip(got, encoded, strict=True):
        with torch.no_grad():
            expected = oracle(torch.tensor([ids["input_ids"]])).logits[0]
        torch.testing.assert_close(row, expected, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(got[-1], got[0], atol=TOLERANCE, rtol=0)
    if num_labels == 1:  # and as sentence-transformers' CrossEncoder scores the pairs
        logits = CrossEncoder(str(directory), device="cpu").predict(
            pairs, activation_fn=torch.nn.Identity(), convert_to_tensor=True
        )
        torch.testing.assert_close(got[:-1, 0], logits.float(), atol=TOLERANCE, rtol=0)


def test_each_row_is_the_same_alone_and_in_any_batch(tmp_path: Path) -> None:
    model = load(bert_embedder(tmp_path / "bert", ("mean",), True))
    encoded = [model.encode(t) for t in TEXTS]
    alone = [model.run([row]).rows[0] for row in encoded]
    backwards = model.run(encoded[::-1]).rows[::-1]
    for one, other in zip(alone, backwards, strict=True):
        torch.testing.assert_close(one, other, atol=TOLERANCE, rtol=0)


def test_truncation_cuts_to_the_models_longest_input(tmp_path: Path) -> None:
    model = load(bert_embedder(tmp_path / "bert"))
    assert model.max_length == 64  # sentence_bert_config's max_seq_length, under 128 positions
    long = " ".join(["fox"] * 200)
    assert len(model.encode(long)["input_ids"]) > 64
    assert len(model.encode(long, truncate=True)["input_ids"]) == 64


def test_a_matryoshka_cut_is_normalized_again() -> None:
    vector = torch.arange(1.0, 9.0)
    cut = finish_embedding(vector, 4, normalize=True)
    torch.testing.assert_close(cut, torch.nn.functional.normalize(vector[:4], dim=0))
    assert finish_embedding(vector, 4, normalize=False).tolist() == vector[:4].tolist()
    assert finish_embedding(vector, None, normalize=False) is vector
    torch.testing.assert_close(finish_embedding(vector, 99, True).norm(), torch.tensor(1.0))
