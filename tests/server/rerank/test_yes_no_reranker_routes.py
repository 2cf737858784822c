"""A causal LM served as a reranker by its yes/no answer (--rerank-tokens, --rerank-template):
vLLM's /v1/rerank and /score and TEI's /rerank give each document the probability of "yes"
against "no" that transformers' logits give for the templated pair; /info says its task."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.pooling.models import NO, TEXTS, YES, yes_no_reranker
from tests.server.conftest import pooling_server

QUERY = "what is a tree"
TEMPLATE = "<query>{{ query }}</query><document>{{ document }}</document>answer:"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return yes_no_reranker(tmp_path_factory.mktemp("yes-no") / "lm", seed=5)


@pytest.fixture(scope="module")
def url(model_dir: Path) -> Iterator[str]:
    template = model_dir.parent / "rerank.jinja"
    template.write_text(TEMPLATE)
    yield from pooling_server(
        model_dir, rerank_tokens=(YES, NO), rerank_template=str(template),
        max_batch_prefill_tokens=2048,
    )  # fmt: skip


@pytest.fixture(scope="module")
def probabilities(model_dir: Path) -> list[float]:
    """transformers: softmax over the two tokens' logits after each templated pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    yes, no = (tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in (YES, NO))
    out = []
    for text in TEXTS:
        prompt = TEMPLATE.replace("{{ query }}", QUERY).replace("{{ document }}", text)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        out.append(float(torch.softmax(logits[[yes, no]], 0)[0]))
    return out


def test_every_rerank_route_gives_the_probability_of_yes(
    url: str, probabilities: list[float]
) -> None:
    assert httpx.get(f"{url}/info", timeout=30).json()["task"] == "rerank"
    answer = httpx.post(
        f"{url}/v1/rerank", json={"query": QUERY, "documents": TEXTS}, timeout=60
    ).json()
    assert [r["index"] for r in answer["results"]] == sorted(
        range(len(TEXTS)), key=lambda i: -probabilities[i]
    )
    for r in answer["results"]:
        assert r["relevance_score"] == pytest.approx(probabilities[r["index"]], abs=1e-5)
    tei = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": TEXTS}, timeout=60).json()
    assert {r["index"]: r["score"] for r in tei} == pytest.approx(
        dict(enumerate(probabilities)), abs=1e-5
    )
    score = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": TEXTS}, timeout=60).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(probabilities, abs=1e-5)


def test_a_document_too_long_is_cut_keeping_the_question(url: str) -> None:
    long = " ".join(TEXTS * 40)
    refused = httpx.post(f"{url}/rerank", json={"query": QUERY, "texts": [long]}, timeout=60)
    assert refused.status_code == 422 and "truncate" in refused.text, refused.text
    cut = httpx.post(
        f"{url}/rerank", json={"query": QUERY, "texts": [long], "truncate": True}, timeout=60
    )
    assert cut.status_code == 200, cut.text
    assert 0.0 < cut.json()[0]["score"] < 1.0
