"""A decoder embedder served over HTTP (Qwen3-Embedding's layout: a causal LM's base model with
sentence-transformers' last-token pooling): its batches run on the paged engine's layers, and
the `openai` client's embeddings, TEI's /embed and /embed_all equal sentence-transformers'
encode, many clients at once as alone."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer

from tests.pooling.models import TEXTS, decoder_embedder
from tests.server.conftest import pooling_server

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return decoder_embedder(tmp_path_factory.mktemp("decoder") / "qwen-embed", seed=7)


@pytest.fixture(scope="module")
def url(embedder: Path) -> Iterator[str]:
    yield from pooling_server(embedder)


def test_every_embedding_route_equals_sentence_transformers(embedder: Path, url: str) -> None:
    oracle = SentenceTransformer(str(embedder), device="cpu")
    expected = oracle.encode(TEXTS, convert_to_tensor=True).float()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    reply = client.embeddings.create(model="qwen-embed", input=TEXTS)
    got = torch.tensor([item.embedding for item in reply.data])
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)
    tei = httpx.post(f"{url}/embed", json={"inputs": TEXTS}, timeout=60).json()
    torch.testing.assert_close(torch.tensor(tei), expected, atol=TOLERANCE, rtol=0)
    states = httpx.post(f"{url}/embed_all", json={"inputs": TEXTS[3]}, timeout=60).json()[0]
    token_states = oracle.encode(TEXTS[3], output_value="token_embeddings", convert_to_tensor=True)
    torch.testing.assert_close(torch.tensor(states), token_states.float(), atol=TOLERANCE, rtol=0)
    info = httpx.get(f"{url}/info", timeout=30).json()
    assert info["task"] == "embed" and info["dimensions"] == 32


def test_concurrent_clients_get_what_each_gets_alone(embedder: Path, url: str) -> None:
    expected = SentenceTransformer(str(embedder), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    )

    def one(i: int) -> list[float]:
        body = {"inputs": TEXTS[i % len(TEXTS)]}
        return httpx.post(f"{url}/embed", json=body, timeout=60).json()[0]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # the server admits 8 at once
        answers = list(pool.map(one, range(40)))
    for i, answer in enumerate(answers):
        torch.testing.assert_close(
            torch.tensor(answer), expected[i % len(TEXTS)].float(), atol=TOLERANCE, rtol=0
        )
