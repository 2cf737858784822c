"""The bodies of TEI's routes and their answers, as text-embeddings-inference (and so its
clients, e.g. huggingface_hub's `feature_extraction` and `text_classification`) sends and
reads them.

- `/embed` and `/embed_all`: `inputs` (a string, strings, token ids or arrays of them),
  `truncate` (default false: an input past the model's length is a 413 in TEI, a 422 naming
  the limit here), `truncation_direction` (`right` or `left`); /embed's `normalize` (default
  true) and `dimensions` (a Matryoshka size); `prompt_name`, one of the model's
  sentence-transformers prompts put before each text (none given: the model's default
  prompt, as sentence-transformers' `encode` applies it). /embed answers one array of floats per input;
  /embed_all one array per token of each input.
- `/rerank`: `query`, `texts`, `truncate`, `truncation_direction`, `raw_scores` (default false:
  the scores through a sigmoid), `return_text`; answers `[{"index", "score", "text"?}]`,
  best first.
- `/predict`: `inputs` (a string, a [text, text pair], or an array of those), `raw_scores`
  (default false: a softmax over the labels, a sigmoid for one), `truncate`; answers each
  input's `[{"score", "label"}]`, best first (one list for one input).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tgis.server.http.errors import invalid
from tgis.server.http.fields import Fields, PoolingInput, pooling_inputs

# TEI's default --max-client-batch-size.
MAX_CLIENT_BATCH = 32
Direction = Literal["right", "left"]


@dataclass(frozen=True)
class EmbedRequest:
    inputs: tuple[PoolingInput, ...]
    normalize: bool = True
    truncate: bool = False
    direction: Direction = "right"
    dimensions: int | None = None
    # One of the model's sentence-transformers prompts, put before each text input; None:
    # its default prompt, if it has one.
    prompt_name: str | None = None


@dataclass(frozen=True)
class RerankRequest:
    query: str
    texts: tuple[str, ...]
    truncate: bool = False
    direction: Direction = "right"
    raw_scores: bool = False
    return_text: bool = False


@dataclass(frozen=True)
class PredictRequest:
    # Each input: one text, or a text and its pair.
    inputs: tuple[tuple[str, ...], ...]
    # Whether `inputs` was one input (answered with one list, not a list of lists).
    single: bool
    truncate: bool = False
    direction: Direction = "right"
    raw_scores: bool = False


def _truncation(f: Fields) -> tuple[bool, Direction]:
    direction = f.string("truncation_direction") or "right"
    if direction.lower() not in ("right", "left"):
        raise invalid(f'`truncation_direction` must be "right" or "left", got {direction!r}')
    return bool(f.boolean("truncate")), direction.lower()  # type: ignore[return-value]


def parse_embed(body: Any, vocab_size: int, max_batch: int = MAX_CLIENT_BATCH) -> EmbedRequest:
    f = Fields(body)
    truncate, direction = _truncation(f)
    prompt_name = f.string("prompt_name")
    inputs = pooling_inputs(body.get("inputs"), "inputs", vocab_size, max_batch)
    normalize = f.boolean("normalize")
    dimensions = f.integer("dimensions")
    if dimensions is not None and dimensions < 1:
        raise invalid(f"`dimensions` must be >= 1, got {dimensions}")
    return EmbedRequest(
        inputs, True if normalize is None else normalize, truncate, direction, dimensions,
        prompt_name,
    )  # fmt: skip


def parse_embed_all(body: Any, vocab_size: int, max_batch: int = MAX_CLIENT_BATCH) -> EmbedRequest:
    """/embed_all's body: /embed's without `normalize` and `dimensions`, which shape pooled
    embeddings only."""
    request = parse_embed(body, vocab_size, max_batch)
    for name in ("normalize", "dimensions"):
        if isinstance(body, dict) and body.get(name) is not None:
            raise invalid(f"`{name}` shapes /embed's pooled embeddings; /embed_all takes none")
    return request


def embed_all_answer(states: Sequence[torch.Tensor]) -> list[list[list[float]]]:
    """Each input's hidden state per token."""
    return [rows.float().tolist() for rows in states]


def parse_rerank(body: Any, max_batch: int = MAX_CLIENT_BATCH) -> RerankRequest:
    f = Fields(body)
    truncate, direction = _truncation(f)
    query = f.required_string("query")
    texts = f.strings("texts")
    if not texts:
        raise invalid("`texts` must be a non-empty array of strings")
    if len(texts) > max_batch:
        raise invalid(f"`texts` holds {len(texts)} texts, more than {max_batch}; split it")
    return RerankRequest(
        query, texts, truncate, direction, bool(f.boolean("raw_scores")),
        bool(f.boolean("return_text")),
    )  # fmt: skip


def parse_predict(body: Any, max_batch: int = MAX_CLIENT_BATCH) -> PredictRequest:
    f = Fields(body)
    truncate, direction = _truncation(f)
    value = body.get("inputs") if isinstance(body, dict) else None
    expected = (
        "`inputs` must be a string, a [text, text pair] array, or an array of strings or "
        "of such pairs"
    )
    if value is None:
        raise invalid("missing field `inputs`")
    # As TEI reads them: two strings are one text and its pair; any other array is a batch.
    single = isinstance(value, str) or (
        isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)
    )
    items = [value] if single else value
    if not isinstance(items, list) or not items:
        raise invalid(expected)
    if len(items) > max_batch:
        raise invalid(f"`inputs` holds {len(items)} inputs, more than {max_batch}; split it")
    inputs: list[tuple[str, ...]] = []
    for item in items:
        if isinstance(item, str):
            inputs.append((item,))
        elif (
            isinstance(item, list) and len(item) in (1, 2) and all(isinstance(v, str) for v in item)
        ):
            inputs.append(tuple(item))
        else:
            raise invalid(expected)
    return PredictRequest(tuple(inputs), single, truncate, direction, bool(f.boolean("raw_scores")))


def embed_answer(vectors: Sequence[torch.Tensor]) -> list[list[float]]:
    return [vector.float().tolist() for vector in vectors]


def rerank_answer(request: RerankRequest, logits: Sequence[float]) -> list[dict[str, Any]]:
    """Each text's score (its logit, or through a sigmoid unless `raw_scores`), best first."""
    results = []
    for index, logit in enumerate(logits):
        score = logit if request.raw_scores else 1.0 / (1.0 + math.exp(-logit))
        result: dict[str, Any] = {"index": index, "score": score}
        if request.return_text:
            result["text"] = request.texts[index]
        results.append(result)
    results.sort(key=lambda r: r["score"], reverse=True)
    return results


def predict_answer(
    request: PredictRequest, logits: Sequence[torch.Tensor], labels: Sequence[str]
) -> list[dict[str, Any]] | list[list[dict[str, Any]]]:
    """Each input's labels with their scores, best first: a softmax over the labels (a sigmoid
    for one label) unless `raw_scores`."""
    answers = []
    for row in logits:
        scores = row.float()
        if not request.raw_scores:
            scores = torch.sigmoid(scores) if scores.numel() == 1 else torch.softmax(scores, 0)
        ranked = sorted(zip(scores.tolist(), labels, strict=True), reverse=True)
        answers.append([{"score": score, "label": label} for score, label in ranked])
    return answers[0] if request.single else answers
