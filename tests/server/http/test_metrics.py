"""/metrics exposes TGIS's tgi_* metrics with TGIS's names, kinds and labels."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tgis.server import Metrics

COUNTERS = [
    "tgi_request_count",
    "tgi_request_input_count",
    "tgi_request_failure",
    "tgi_request_success",
    "tgi_batch_concatenation_count",
    "tgi_batch_inference_count",
    "tgi_batch_inference_success",
    "tgi_batch_inference_failure",
    "tgi_tokenize_request_count",
    "tgi_tokenize_request_input_count",
]
HISTOGRAMS = [
    "tgi_request_max_new_tokens",
    "tgi_request_input_length",
    "tgi_request_raw_input_length",
    "tgi_request_mean_time_per_token_duration",
    "tgi_request_validation_duration",
    "tgi_request_queue_duration",
    "tgi_request_generated_tokens",
    "tgi_request_total_tokens",
    "tgi_request_duration",
    "tgi_request_inference_duration",
    "tgi_batch_inference_batch_size",
    "tgi_batch_inference_duration",
    "tgi_batch_inference_forward_duration",
    "tgi_batch_inference_tokproc_duration",
    "tgi_batch_next_tokens",
    "tgi_tokenize_request_tokens",
    "tgi_tokenize_request_duration",
]
GAUGES = [
    "tgi_batch_current_size",
    "tgi_batch_input_tokens",
    "tgi_batch_max_remaining_tokens",
    "tgi_queue_size",
]


def traffic(client: TestClient, metrics: Metrics) -> str:
    """Some requests and engine steps; returns the exposition."""
    client.post("/generate", json={"inputs": "Hello world", "parameters": {"max_new_tokens": 3}})
    client.post("/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    client.post("/generate", json={"inputs": "Hello", "parameters": {"temperature": -1}})
    client.post("/tokenize", json={"inputs": "Hello world"})
    metrics.on_step("prefill", 2, 24, 0.05, 0.04)
    metrics.on_step("next_token", 2, 2, 0.02, 0.015)
    metrics.on_step_failure("next_token", "oom")
    metrics.on_concatenation()
    metrics.on_batch_state(waiting=3, running=2, input_tokens=30, max_remaining=17)
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return response.text


def samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_every_tgis_metric_is_exposed_with_its_kind(client: TestClient, app: Starlette) -> None:
    text = traffic(client, app.state.tgis.metrics)
    for name in COUNTERS:
        # TGIS's name (what its dashboards scrape) and Prometheus's `_total` convention.
        assert f"# TYPE {name} counter\n" in text, name
        assert f"# TYPE {name}_total counter\n" in text, name
    for name in HISTOGRAMS:
        assert f"# TYPE {name} histogram\n" in text, name
        assert f"{name}_count" in text, name
    for name in GAUGES:
        assert f"# TYPE {name} gauge\n" in text, name
    assert "_created" not in text
    # The exposition parses as Prometheus text.
    assert len(list(text_string_to_metric_families(text))) >= len(COUNTERS + HISTOGRAMS + GAUGES)


def test_values_and_labels(client: TestClient, app: Starlette) -> None:
    got = samples(traffic(client, app.state.tgis.metrics))
    assert got['tgi_request_count{kind="single"}'] == 2
    assert got['tgi_request_count{kind="stream"}'] == 1
    assert got['tgi_request_count_total{kind="single"}'] == 2
    assert got["tgi_request_input_count"] == 3
    assert got['tgi_request_success{stop_reason="MAX_TOKENS",kind="single"}'] == 1
    assert got['tgi_request_success{stop_reason="MAX_TOKENS",kind="stream"}'] == 1
    assert got['tgi_request_failure{err="validation"}'] == 1
    assert got["tgi_request_generated_tokens_sum"] == 5
    assert got["tgi_request_max_new_tokens_sum"] == 5
    assert got["tgi_request_raw_input_length_count"] == 3
    assert got["tgi_tokenize_request_count"] == 1
    assert got["tgi_tokenize_request_tokens_sum"] == 6
    assert got['tgi_batch_inference_count{method="next_token"}'] == 2
    assert got['tgi_batch_inference_success{method="next_token"}'] == 1
    assert got['tgi_batch_inference_failure{method="next_token",reason="oom"}'] == 1
    assert got['tgi_batch_inference_duration_count{method="prefill",makeup="single_only"}'] == 1
    tokproc = got['tgi_batch_inference_tokproc_duration_sum{method="prefill",makeup="single_only"}']
    assert abs(tokproc - 0.01) < 1e-9
    assert got["tgi_batch_next_tokens_sum"] == 24
    assert got["tgi_batch_concatenation_count"] == 1
    assert got["tgi_queue_size"] == 3
    assert got["tgi_batch_current_size"] == 2
    assert got["tgi_batch_input_tokens"] == 30
    assert got["tgi_batch_max_remaining_tokens"] == 17


def test_each_app_has_its_own_registry(make_app: Callable[..., Starlette]) -> None:
    with TestClient(make_app()) as first, TestClient(make_app()) as second:
        first.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 1}})
        assert samples(first.get("/metrics").text)['tgi_request_count{kind="single"}'] == 1
        assert 'tgi_request_count{kind="single"}' not in samples(second.get("/metrics").text)


def test_a_shared_metrics_object_is_used(make_app: Callable[..., Starlette]) -> None:
    metrics = Metrics(max_total_tokens=128, max_batch_size=4)
    with TestClient(make_app(metrics=metrics)) as client:
        metrics.on_batch_state(waiting=5, running=1, input_tokens=10, max_remaining=3)
        assert samples(client.get("/metrics").text)["tgi_queue_size"] == 5


def test_time_to_first_token_is_observed_per_successful_request(
    client: TestClient, app: Starlette
) -> None:
    got = samples(traffic(client, app.state.tgis.metrics))
    # Two requests generated (the fake engine reports 1 ms to the first token); the refused
    # one generated nothing and is not observed.
    assert got["tgis_request_time_to_first_token_seconds_count"] == 2
    assert got["tgis_request_time_to_first_token_seconds_sum"] == pytest.approx(0.002)
