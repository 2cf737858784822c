"""OpenAI's /v1/embeddings body and answer: every form of `input`, the 422s by field, and
base64 the way the `openai` client decodes it."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest
import torch

from tgis.server.http.errors import ApiError
from tgis.server.openai.embeddings import (
    MAX_INPUTS,
    EmbeddingsRequest,
    embeddings_response,
    parse_embeddings_request,
)

VOCAB, SIZE = 100, 32


def parse(body: Any, matryoshka: tuple[int, ...] = ()) -> EmbeddingsRequest:
    return parse_embeddings_request(body, VOCAB, SIZE, matryoshka)


def refused(body: Any, matryoshka: tuple[int, ...] = ()) -> str:
    with pytest.raises(ApiError) as info:
        parse(body, matryoshka)
    assert info.value.status == 422
    return info.value.message.removeprefix("Input validation error: ")


def test_every_form_of_input() -> None:
    assert parse({"input": "hi", "model": "m"}) == EmbeddingsRequest("m", ("hi",))
    assert parse({"input": ["a", "b"]}).inputs == ("a", "b")
    assert parse({"input": [1, 2, 3]}).inputs == ((1, 2, 3),)
    assert parse({"input": [[1, 2], [3]]}).inputs == ((1, 2), (3,))
    request = parse({"input": "x", "encoding_format": "base64", "dimensions": 8}, (16, 8))
    assert (request.encoding_format, request.dimensions) == ("base64", 8)
    assert parse({"input": "x", "dimensions": SIZE}, (16,)).dimensions == SIZE


def test_bad_bodies_are_refused_by_field() -> None:
    assert refused({}) == "missing field `input`"
    assert refused({"input": []}) == "`input` must not be empty"
    assert refused({"input": ""}) == "`input` must not be an empty string"
    assert refused({"input": ["a", ""]}) == "`input[1]` must not be an empty string"
    assert "an array of arrays of token ids" in refused({"input": [["a"]]})
    assert "an array of arrays of token ids" in refused({"input": 3})
    assert refused({"input": [[1], [100]]}) == (
        "`input[1]` holds token id 100, beyond the vocabulary of 100 (ids 0 to 99)"
    )
    assert refused({"input": ["a"] * (MAX_INPUTS + 1)}).endswith(
        f"more than {MAX_INPUTS}; split it"
    )
    assert refused({"input": "x", "encoding_format": "int8"}) == (
        '`encoding_format` must be "float" or "base64", got \'int8\''
    )
    assert "declares no matryoshka_dimensions" in refused({"input": "x", "dimensions": 8})
    assert refused({"input": "x", "dimensions": 12}, (16, 8)) == (
        "`dimensions` must be one of 8, 16, 32 for this model, got 12"
    )
    assert refused({"input": "x", "user": 5}) == "`user` must be a string, got a number"


def test_the_answer_in_floats_and_in_base64_as_the_client_decodes_it() -> None:
    vectors = [torch.tensor([0.5, -1.25, 3.0]), torch.tensor([1e-8, 2.0, -0.0])]
    floats = embeddings_response(vectors, "m", "float", 7)
    assert floats == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [0.5, -1.25, 3.0]},
            {"object": "embedding", "index": 1, "embedding": vectors[1].tolist()},
        ],
        "model": "m",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    packed = embeddings_response(vectors, "m", "base64", 7)
    for item, vector in zip(packed["data"], vectors, strict=True):
        # openai-python: np.frombuffer(base64.b64decode(data), dtype="float32").tolist()
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="float32")
        assert decoded.tolist() == vector.tolist()
