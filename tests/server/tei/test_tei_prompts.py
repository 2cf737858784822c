"""Sentence-transformers' named prompts over HTTP: TEI's /embed and /embed_all take
`prompt_name`, every embedding route applies the model's default prompt when none is named (as
`encode` does), equal to sentence-transformers; a name the model lacks is a 422 listing its
names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer

from tests.pooling.models import PROMPTS, TEXTS, bert_embedder
from tests.server.conftest import pooling_server


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bert_embedder(
        tmp_path_factory.mktemp("prompts") / "bert", ("mean",), prompts=PROMPTS,
        default_prompt="query", include_prompt=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def url(embedder: Path) -> Iterator[str]:
    yield from pooling_server(embedder)


def test_prompts_named_and_default_equal_sentence_transformers(embedder: Path, url: str) -> None:
    oracle = SentenceTransformer(str(embedder), device="cpu")
    for name in ("passage", "query", None):
        expected = oracle.encode(TEXTS, prompt_name=name, convert_to_tensor=True)
        body = {"inputs": TEXTS} | ({"prompt_name": name} if name else {})
        got = httpx.post(f"{url}/embed", json=body, timeout=60)
        assert got.status_code == 200, got.text
        torch.testing.assert_close(torch.tensor(got.json()), expected.float(), atol=1e-5, rtol=0)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    default = client.embeddings.create(model="bert", input=TEXTS)
    expected = oracle.encode(TEXTS, convert_to_tensor=True)
    got = torch.tensor([d.embedding for d in default.data])
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=0)


def test_embed_all_starts_with_the_prompts_tokens(embedder: Path, url: str) -> None:
    oracle = SentenceTransformer(str(embedder), device="cpu")
    got = httpx.post(
        f"{url}/embed_all", json={"inputs": TEXTS[0], "prompt_name": "passage"}, timeout=60
    ).json()[0]
    expected = oracle.encode(
        TEXTS[0], prompt_name="passage", output_value="token_embeddings", convert_to_tensor=True
    )
    torch.testing.assert_close(torch.tensor(got), expected.float(), atol=1e-5, rtol=0)


def test_a_prompt_the_model_lacks_is_refused_naming_its_prompts(url: str) -> None:
    got = httpx.post(f"{url}/embed", json={"inputs": "a", "prompt_name": "title"}, timeout=60)
    assert got.status_code == 422
    assert (
        "`prompt_name` 'title' is not one of this model's prompts ('query', 'passage')"
        in (got.json()["error"])
    )
