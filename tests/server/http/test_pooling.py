"""A pooling model served over HTTP (`create_pooling_app`, the `tgis serve` path of an
embedding or reranker model): the `openai` client's embeddings and TEI's JSON through httpx,
against sentence-transformers' encode and the cross-encoder; limits, tasks and /info."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from tests.pooling.models import TEXTS, bert_embedder, cross_encoder
from tests.server.conftest import pooling_server

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bert_embedder(tmp_path_factory.mktemp("pool") / "bert-embed", ("mean",), True)


@pytest.fixture(scope="module")
def embed_url(embedder: Path) -> Iterator[str]:
    yield from pooling_server(embedder)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cross_encoder(tmp_path_factory.mktemp("pool") / "bert-rerank")


@pytest.fixture(scope="module")
def rerank_url(reranker: Path) -> Iterator[str]:
    yield from pooling_server(reranker)


def test_the_openai_clients_embeddings_equal_sentence_transformers(
    embedder: Path, embed_url: str
) -> None:
    expected = SentenceTransformer(str(embedder), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )
    client = openai.OpenAI(base_url=f"{embed_url}/v1", api_key="none", max_retries=0)
    # The client asks for base64 unless told otherwise, and decodes it.
    reply = client.embeddings.create(model="bert-embed", input=TEXTS)
    got = torch.tensor([item.embedding for item in reply.data])
    torch.testing.assert_close(got, expected.float(), atol=TOLERANCE, rtol=0)
    assert [item.index for item in reply.data] == list(range(len(TEXTS)))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS)
    floats = client.embeddings.create(model="bert-embed", input=TEXTS[0], encoding_format="float")
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), expected[0].float(), atol=TOLERANCE, rtol=0)  # fmt: skip
    with pytest.raises(openai.UnprocessableEntityError, match="declares no matryoshka_dimensions"):
        client.embeddings.create(model="bert-embed", input="x", dimensions=8)


def test_teis_embed_equals_sentence_transformers(embedder: Path, embed_url: str) -> None:
    oracle = SentenceTransformer(str(embedder), device="cpu")
    expected = oracle.encode(TEXTS, convert_to_tensor=True)
    got = httpx.post(f"{embed_url}/embed", json={"inputs": TEXTS}, timeout=60)
    assert got.status_code == 200, got.text
    torch.testing.assert_close(torch.tensor(got.json()), expected.float(), atol=TOLERANCE, rtol=0)
    # normalize: false is the Pooling module's output, before Normalize.
    raw = httpx.post(f"{embed_url}/embed", json={"inputs": TEXTS[0], "normalize": False}, timeout=60)  # fmt: skip
    pooled = oracle.encode(TEXTS[:1], convert_to_tensor=True, output_value="token_embeddings")[0]
    torch.testing.assert_close(torch.tensor(raw.json()[0]), pooled.mean(0).float(), atol=TOLERANCE, rtol=0)  # fmt: skip


def test_teis_embed_all_gives_each_tokens_state(embedder: Path, embed_url: str) -> None:
    oracle = SentenceTransformer(str(embedder), device="cpu")
    expected = oracle.encode(TEXTS[:2], output_value="token_embeddings")
    got = httpx.post(f"{embed_url}/embed_all", json={"inputs": TEXTS[:2]}, timeout=60)
    assert got.status_code == 200, got.text
    for states, want in zip(got.json(), expected, strict=True):
        torch.testing.assert_close(torch.tensor(states), want.float(), atol=TOLERANCE, rtol=0)
    refused = httpx.post(f"{embed_url}/embed_all", json={"inputs": "a", "dimensions": 8}, timeout=60)  # fmt: skip
    assert refused.status_code == 422 and "/embed_all takes none" in refused.text


def test_teis_dimensions_cut_and_normalize_again(embed_url: str) -> None:
    whole = httpx.post(f"{embed_url}/embed", json={"inputs": "x", "normalize": False}, timeout=60)
    cut = httpx.post(f"{embed_url}/embed", json={"inputs": "x", "dimensions": 8}, timeout=60)
    vector = torch.tensor(whole.json()[0])
    want = torch.nn.functional.normalize(vector[:8], dim=0)
    torch.testing.assert_close(torch.tensor(cut.json()[0]), want, atol=TOLERANCE, rtol=0)
    wide = httpx.post(f"{embed_url}/embed", json={"inputs": "x", "dimensions": 33}, timeout=60)
    assert wide.status_code == 422 and "at most this model's 32, got 33" in wide.text


def test_inputs_past_the_models_length_are_refused_unless_truncated(embed_url: str) -> None:
    long = " ".join(["fox"] * 200)
    refused = httpx.post(f"{embed_url}/embed", json={"inputs": ["x", long]}, timeout=60)
    assert refused.status_code == 422
    assert "`inputs[1]` has" in refused.json()["error"]
    assert "more than this model's 64: shorten it, or set `truncate`" in refused.json()["error"]
    cut = httpx.post(f"{embed_url}/embed", json={"inputs": long, "truncate": True}, timeout=60)
    assert cut.status_code == 200 and len(cut.json()[0]) == 32
    openai_refusal = httpx.post(f"{embed_url}/v1/embeddings", json={"input": long}, timeout=60)
    assert openai_refusal.status_code == 422
    assert "shorten it" in openai_refusal.text and "truncate" not in openai_refusal.text


def test_rerank_scores_equal_the_cross_encoders(reranker: Path, rerank_url: str) -> None:
    query = "what is a tree"
    oracle = CrossEncoder(str(reranker), device="cpu")
    logits = oracle.predict([(query, t) for t in TEXTS], activation_fn=torch.nn.Identity())
    body = {"query": query, "texts": TEXTS, "raw_scores": True, "return_text": True}
    got = httpx.post(f"{rerank_url}/rerank", json=body, timeout=60)
    assert got.status_code == 200, got.text
    ranked = got.json()
    assert [r["index"] for r in ranked] == sorted(range(len(TEXTS)), key=lambda i: -logits[i])
    for r in ranked:
        assert r["score"] == pytest.approx(float(logits[r["index"]]), abs=TOLERANCE)
        assert r["text"] == TEXTS[r["index"]]
    sigmoid = httpx.post(f"{rerank_url}/rerank", json={"query": query, "texts": TEXTS}, timeout=60)
    probabilities = torch.sigmoid(torch.tensor(logits))  # TEI's default: through a sigmoid
    for r in sigmoid.json():
        assert r["score"] == pytest.approx(float(probabilities[r["index"]]), abs=TOLERANCE)


def test_each_server_says_its_task_and_refuses_the_others_routes(
    embed_url: str, rerank_url: str
) -> None:
    info = httpx.get(f"{embed_url}/info", timeout=30).json()
    assert (info["task"], info["pooling"], info["normalized"], info["dimensions"]) == ("embed", ["mean"], True, 32)  # fmt: skip
    assert info["max_input_length"] == 64
    assert httpx.get(f"{rerank_url}/info", timeout=30).json()["task"] == "rerank"
    assert httpx.get(f"{embed_url}/health", timeout=30).status_code == 200
    wrong = httpx.post(f"{embed_url}/rerank", json={"query": "q", "texts": ["a"]}, timeout=30)
    assert wrong.status_code == 424
    assert wrong.json()["error"] == "/rerank: this server's model serves embed, not rerank"
    none = httpx.post(f"{rerank_url}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert none.status_code == 404
    assert "serves rerank, not embeddings" in none.json()["error"]["message"]
    assert httpx.post(f"{embed_url}/embed", json={"inputs": "x"}, timeout=60).status_code == 200
    metrics = httpx.get(f"{embed_url}/metrics", timeout=30).text
    assert 'tgi_request_success{stop_reason="pooled",kind="embed"} ' in metrics


def test_past_the_concurrency_limit_a_request_is_a_429_and_a_leaving_client_cancels(
    embedder: Path,
) -> None:
    """A runner that takes requests but runs none holds the first in flight: the second is
    refused; the first, given up by its client, leaves the runner's queue."""
    from tests.server.conftest import live_server, make_config
    from tgis.hub import read_model_config
    from tgis.pooling.service import load_pooling_service
    from tgis.pooling.spec import read_pooling_spec
    from tgis.server.http.app import create_pooling_app

    spec = read_pooling_spec(embedder, read_model_config(embedder)[0])
    assert spec is not None
    settings = make_config(model_id="held", max_concurrent_requests=1)
    service = load_pooling_service(settings, embedder, spec)
    app = create_pooling_app(service.model, service.runner, settings)
    service.runner.open()  # takes requests; no loop runs them
    state = app.state.tgis_pooling
    try:
        with live_server(app) as (url, _):
            outcome: list[BaseException] = []

            def held() -> None:
                try:
                    httpx.post(f"{url}/embed", json={"inputs": "held"}, timeout=5)
                except httpx.HTTPError as exc:
                    outcome.append(exc)

            first = threading.Thread(target=held)
            first.start()
            deadline = time.monotonic() + 30  # bounds on a hang, not measures
            while not state.admitted:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            refused = httpx.post(f"{url}/embed", json={"inputs": "x"}, timeout=30)
            assert refused.status_code == 429
            assert refused.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
            first.join(30)
            assert isinstance(outcome[0], httpx.ReadTimeout)
            # The client left: its request was cancelled and its place given back.
            while state.admitted or service.runner.in_flight:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        service.runner.stop()


def test_the_openapi_document_is_valid_and_holds_what_was_sent_and_answered(
    embed_url: str, rerank_url: str
) -> None:
    from jsonschema import Draft202012Validator
    from openapi_spec_validator import validate

    document = httpx.get(f"{embed_url}/openapi.json", timeout=30).json()
    validate(document)
    assert set(document["paths"]) == {
        "/v1/embeddings", "/embed", "/embed_all", "/rerank", "/predict", "/v1/rerank",
        "/v2/rerank", "/score", "/v1/score", "/openapi.json", "/docs", "/docs/assets/{name}",
    }  # fmt: skip
    assert httpx.get(f"{embed_url}/docs", timeout=30).status_code == 200

    def holds(name: str, value: object) -> None:
        schema = {**document, "$ref": f"#/components/schemas/{name}"}
        Draft202012Validator(schema).validate(value)

    cases = [
        (embed_url, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}, "Embeddings"),
        (embed_url, "/embed", {"inputs": [[5, 6], [7]], "truncate": True}, "Embed"),
        (embed_url, "/embed_all", {"inputs": "x"}, "EmbedAll"),
        (rerank_url, "/rerank", {"query": "q", "texts": TEXTS, "return_text": True}, "Rerank"),
        (rerank_url, "/predict", {"inputs": [["q", "a"], "b"]}, "Predict"),
        (rerank_url, "/v1/rerank", {"query": "q", "documents": [{"text": "a"}, "b"]}, "RerankDocuments"),
        (rerank_url, "/score", {"text_1": "q", "text_2": ["a", "b"]}, "Score"),
    ]  # fmt: skip
    for url, path, body, name in cases:
        holds(f"{name}Request", body)
        answer = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert answer.status_code == 200, (path, answer.text)
        holds(f"{name}Response", answer.json())
    refused = httpx.post(f"{embed_url}/v1/embeddings", json={"input": []}, timeout=30)
    holds("OpenAIError", refused.json())
    holds("ErrorResponse", httpx.post(f"{embed_url}/embed", json={}, timeout=30).json())
