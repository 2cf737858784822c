"""vLLM's, Cohere's and Jina's rerank (/v1/rerank, /v2/rerank) and vLLM's /score over a
cross-encoder: scores equal the cross-encoder's logits through a sigmoid; top_n, documents as
objects, pair by pair; the API key; 422s by field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from sentence_transformers import CrossEncoder

from tests.pooling.models import TEXTS, cross_encoder
from tests.server.conftest import pooling_server

QUERY = "what is a tree"


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cross_encoder(tmp_path_factory.mktemp("rerank") / "ce", seed=3)


@pytest.fixture(scope="module")
def url(reranker: Path) -> Iterator[str]:
    yield from pooling_server(reranker, api_key="secret")


@pytest.fixture(scope="module")
def scores(reranker: Path) -> list[float]:
    oracle = CrossEncoder(str(reranker), device="cpu")
    logits = oracle.predict([(QUERY, t) for t in TEXTS], activation_fn=torch.nn.Identity())
    return torch.sigmoid(torch.tensor(logits)).tolist()


AUTH = {"Authorization": "Bearer secret"}


def test_rerank_orders_documents_by_the_cross_encoders_scores(
    url: str, scores: list[float]
) -> None:
    documents = [TEXTS[0], *({"text": t} for t in TEXTS[1:])]
    body = {"model": "ce", "query": QUERY, "documents": documents, "top_n": 3}
    for path in ("/v1/rerank", "/v2/rerank"):
        got = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)
        assert got.status_code == 200, got.text
        answer = got.json()
        best = sorted(range(len(TEXTS)), key=lambda i: -scores[i])[:3]
        assert [r["index"] for r in answer["results"]] == best
        for r in answer["results"]:
            assert r["relevance_score"] == pytest.approx(scores[r["index"]], abs=1e-5)
            assert r["document"] == {"text": TEXTS[r["index"]]}
        assert answer["model"] == "ce" and answer["id"].startswith("rerank-")
        assert answer["usage"]["total_tokens"] > len(TEXTS)
    bare = httpx.post(
        f"{url}/v1/rerank", json={**body, "top_n": 0, "return_documents": False}, headers=AUTH,
        timeout=60,
    )  # fmt: skip
    assert len(bare.json()["results"]) == len(TEXTS)
    assert all("document" not in r for r in bare.json()["results"])


def test_score_pairs_one_against_many_or_pair_by_pair(url: str, scores: list[float]) -> None:
    one = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": TEXTS}, headers=AUTH, timeout=60)  # fmt: skip
    assert one.status_code == 200, one.text
    assert [d["index"] for d in one.json()["data"]] == list(range(len(TEXTS)))
    for d in one.json()["data"]:
        assert d["object"] == "score" and d["score"] == pytest.approx(scores[d["index"]], abs=1e-5)
    pairwise = httpx.post(
        f"{url}/v1/score", json={"text_1": [QUERY] * 2, "text_2": TEXTS[:2]}, headers=AUTH,
        timeout=60,
    )  # fmt: skip
    assert [d["score"] for d in pairwise.json()["data"]] == pytest.approx(scores[:2], abs=1e-5)


def test_refusals_name_the_field_and_the_key_is_required(url: str) -> None:
    def post(path: str, body: object) -> httpx.Response:
        return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)

    assert httpx.post(f"{url}/v1/rerank", json={"query": "q", "documents": ["a"]}, timeout=60).status_code == 401  # fmt: skip
    assert "`documents[1]` must be a string" in post("/v1/rerank", {"query": "q", "documents": ["a", 3]}).text  # fmt: skip
    assert "missing field `query`" in post("/v1/rerank", {"documents": ["a"]}).text
    mismatch = post("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert mismatch.status_code == 422
    assert "give one `text_1` or as many as `text_2`" in mismatch.text
