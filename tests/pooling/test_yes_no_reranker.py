"""A causal LM served as a reranker by its yes/no answer (--rerank-tokens, --rerank-template):
the spec it takes, the flags it refuses with the fix, and its scores against transformers'
logits of the two tokens at the templated pair's last position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.pooling.models import NO, TEXTS, YES, bert_embedder, yes_no_reranker
from tgis.errors import ConfigError
from tgis.hub import read_model_config
from tgis.pooling.model import DecoderForward, PoolingModel
from tgis.pooling.spec import PoolingSpec, read_pooling_spec

QUERY = "what is a tree"
TEMPLATE = (
    "judge: the document answers the query\nquery: {{ query }}\ndocument: {{ document }}\nanswer:"
)


def spec_of(
    directory: Path, tokens: tuple[str, ...] = (YES, NO), template: Path | None = None
) -> PoolingSpec:
    spec = read_pooling_spec(directory, read_model_config(directory)[0], tokens, template)
    assert spec is not None
    return spec


def _template(tmp_path: Path, text: str = TEMPLATE) -> Path:
    path = tmp_path / "rerank.jinja"
    path.write_text(text)
    return path


def test_a_causal_lm_with_rerank_tokens_is_a_decoder_reranker(tmp_path: Path) -> None:
    directory = yes_no_reranker(tmp_path / "lm")
    assert read_pooling_spec(directory, read_model_config(directory)[0]) is None  # a generator
    spec = spec_of(directory, template=_template(tmp_path))
    assert (spec.task, spec.decoder, spec.score_tokens, spec.labels) == (
        "rerank",
        True,
        (YES, NO),
        (YES,),
    )
    assert spec.template == TEMPLATE and spec.source == "--rerank-tokens"


@pytest.mark.parametrize("templated", [False, True])
def test_scores_are_the_yes_no_logit_difference_of_transformers(
    tmp_path: Path, templated: bool
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = yes_no_reranker(tmp_path / "lm")
    spec = spec_of(directory, template=_template(tmp_path) if templated else None)
    model = PoolingModel.load(directory, spec, dtype=torch.float32)
    assert isinstance(model.forward, DecoderForward) and model.dimension == 1
    pairs = [(QUERY, text) for text in TEXTS]
    encoded = [model.encode(pair) for pair in pairs]
    got = torch.cat(model.run(encoded).rows)

    oracle = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    yes, no = (tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (YES, NO))
    for score, (query, document), row in zip(got, pairs, encoded, strict=True):
        if templated:
            text = TEMPLATE.replace("{{ query }}", query).replace("{{ document }}", document)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:  # the pair as the tokenizer joins it, as vLLM scores a decoder's pair
            ids = tokenizer(query, document)["input_ids"]
        assert row["input_ids"] == ids
        with torch.no_grad():
            logits = oracle(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(score, logits[yes] - logits[no], atol=1e-5, rtol=0)
        probability = torch.softmax(logits[[yes, no]], 0)[0]
        torch.testing.assert_close(torch.sigmoid(score), probability, atol=1e-6, rtol=0)


def test_a_long_document_is_cut_and_the_templates_end_kept(tmp_path: Path) -> None:
    directory = yes_no_reranker(tmp_path / "lm")
    model = PoolingModel.load(directory, spec_of(directory, template=_template(tmp_path)))
    model.max_length = 80
    long = " ".join(TEXTS * 20)
    whole = model.encode((QUERY, long))["input_ids"]
    assert len(whole) > 80
    tail = model.tokenizer("\nanswer:", add_special_tokens=False)["input_ids"]
    for left in (False, True):
        cut = model.encode((QUERY, long), truncate=True, left=left)["input_ids"]
        assert 70 < len(cut) <= 80 and cut[-len(tail) :] == tail
    head = model.tokenizer("judge:", add_special_tokens=False)["input_ids"]
    assert cut[: len(head)] == head


def test_rerank_tokens_on_an_encoder_are_refused_with_the_fix(tmp_path: Path) -> None:
    directory = bert_embedder(tmp_path / "bert")
    with pytest.raises(ConfigError) as caught:
        spec_of(directory)
    assert "scores a causal LM's answer" in str(caught.value)
    assert "cross-encoder" in (caught.value.hint or "")


@pytest.mark.parametrize(
    ("tokens", "template", "message"),
    [
        ((YES,), None, "it takes two tokens"),
        ((YES, NO, "to"), None, "it takes two tokens"),
        ((YES, NO), "query: {{ query }}", "never places the document"),
        ((YES, NO), "{{ query }} {{ document }} {{ context }}", "does not render"),
        ((YES, NO), "{% if query %}", "does not render"),
        ((YES, NO), "missing", "No such file"),
    ],
)
def test_bad_rerank_flags_are_refused_naming_the_flag(
    tmp_path: Path, tokens: tuple[str, ...], template: str | None, message: str
) -> None:
    directory = yes_no_reranker(tmp_path / "lm")
    path = None
    if template == "missing":
        path = tmp_path / "nowhere.jinja"
    elif template is not None:
        path = _template(tmp_path, template)
    with pytest.raises(ConfigError, match=message) as caught:
        spec_of(directory, tokens, path)
    assert "--rerank-t" in str(caught.value)


def test_a_template_without_rerank_tokens_is_refused(tmp_path: Path) -> None:
    directory = yes_no_reranker(tmp_path / "lm")
    with pytest.raises(ConfigError, match="--rerank-tokens is not given"):
        read_pooling_spec(directory, read_model_config(directory)[0], (), _template(tmp_path))


def test_a_word_of_several_tokens_is_refused_at_load(tmp_path: Path) -> None:
    directory = yes_no_reranker(tmp_path / "lm")
    with pytest.raises(ConfigError, match="'yes' is 3 tokens to this model's tokenizer"):
        PoolingModel.load(directory, spec_of(directory, ("yes", NO)))
