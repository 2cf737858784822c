"""`tgis benchmark` against an embedding server: detected from its /info, each request one
JSON answer, a step's requests/s and latency in the results."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.benchmark.test_cli_benchmark import SHORT, SMALL, bench
from tests.pooling.models import bert_embedder
from tests.server.conftest import pooling_server
from tgis.benchmark.results import validate_results


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bert_embedder(tmp_path_factory.mktemp("bench") / "embedder")


@pytest.fixture(scope="module")
def url(embedder: Path) -> Iterator[str]:
    yield from pooling_server(embedder)


def test_a_throughput_step_of_embeddings(url: str, embedder: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = bench(
        "--url", url, "--kind", "throughput", "--max-vus", "3", "--tokenizer", str(embedder),
        *SMALL, *SHORT, "--output", str(out),
    )  # fmt: skip
    data = json.loads(out.read_text())
    validate_results(data)
    assert data["config"]["api"] == "embeddings"  # /info says the model embeds
    (step,) = data["steps"]
    assert step["requests"]["ok"] == 6 and not step["errors"], step
    assert step["requests_per_s"] > 0
    assert step["e2e_s"]["p50"] > 0 and step["e2e_s"]["p99"] >= step["e2e_s"]["p50"]
    assert step["output_tokens"] == 0
    table = " ".join(result.output.split())
    assert "req/s" in table and "e2e p99 ms" in table and "TTFT" not in table
    assert "warning" not in result.output  # no tokens asked of an embedding
