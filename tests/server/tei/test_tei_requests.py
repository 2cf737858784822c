"""TEI's bodies and answers: each route's JSON as text-embeddings-inference takes and gives it,
the 422s by field."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tgis.server.http.errors import ApiError
from tgis.server.tei.requests import (
    EmbedRequest,
    PredictRequest,
    RerankRequest,
    embed_answer,
    parse_embed,
    parse_predict,
    parse_rerank,
    predict_answer,
    rerank_answer,
)


def refused(parse: Any, body: Any) -> str:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 422
    return info.value.message.removeprefix("Input validation error: ")


def test_embed_bodies() -> None:
    assert parse_embed({"inputs": "hi"}, 100) == EmbedRequest(("hi",))
    request = parse_embed(
        {"inputs": [[1, 2], [3]], "normalize": False, "truncate": True,
         "truncation_direction": "Left", "dimensions": 8}, 100,
    )  # fmt: skip
    assert request == EmbedRequest(((1, 2), (3,)), False, True, "left", 8)
    assert refused(lambda b: parse_embed(b, 100), {"inputs": ["a"] * 33}).endswith(
        "more than 32; split it"
    )
    assert refused(
        lambda b: parse_embed(b, 100), {"inputs": "a", "truncation_direction": "up"}
    ) == ('`truncation_direction` must be "right" or "left", got \'up\'')
    named = parse_embed({"inputs": "a", "prompt_name": "query"}, 100)
    assert named == EmbedRequest(("a",), prompt_name="query")
    assert refused(lambda b: parse_embed(b, 100), {"inputs": "a", "prompt_name": 3}) == (
        "`prompt_name` must be a string, got a number"
    )


def test_rerank_bodies_and_answer() -> None:
    request = parse_rerank({"query": "q", "texts": ["a", "b", "c"], "return_text": True})
    assert request == RerankRequest("q", ("a", "b", "c"), return_text=True)
    assert refused(parse_rerank, {"texts": ["a"]}) == "missing field `query`"
    assert refused(parse_rerank, {"query": "q", "texts": []}) == (
        "`texts` must be a non-empty array of strings"
    )
    answer = rerank_answer(request, [0.0, 2.0, -1.0])
    assert [r["index"] for r in answer] == [1, 0, 2]
    assert answer[0] == {"index": 1, "score": 1 / (1 + math.exp(-2.0)), "text": "b"}
    raw = rerank_answer(RerankRequest("q", ("a", "b"), raw_scores=True), [0.5, -0.5])
    assert raw == [{"index": 0, "score": 0.5}, {"index": 1, "score": -0.5}]


def test_predict_bodies_and_answer() -> None:
    assert parse_predict({"inputs": "a"}) == PredictRequest((("a",),), single=True)
    assert parse_predict({"inputs": ["a", "b"]}).inputs == (("a", "b"),)  # a text and its pair
    batch = parse_predict({"inputs": ["a", ["b", "c"], "d"], "raw_scores": True})
    assert batch == PredictRequest((("a",), ("b", "c"), ("d",)), single=False, raw_scores=True)
    assert "such pairs" in refused(parse_predict, {"inputs": [["a", "b", "c"]]})
    labels = ("neg", "pos")
    one = predict_answer(PredictRequest((("a",),), True), [torch.tensor([0.0, 1.0])], labels)
    soft = torch.softmax(torch.tensor([0.0, 1.0]), 0).tolist()
    assert one == [{"score": soft[1], "label": "pos"}, {"score": soft[0], "label": "neg"}]
    two = predict_answer(batch, [torch.tensor([2.0, 1.0])] * 3, labels)
    assert two == [[{"score": 2.0, "label": "neg"}, {"score": 1.0, "label": "pos"}]] * 3


def test_embed_answer_is_one_array_per_input() -> None:
    assert embed_answer([torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25])]) == [
        [1.0, 2.0],
        [0.5, 0.25],
    ]
