"""Error responses: TGI's JSON and status codes, no tracebacks, API keys, CORS, draining."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tests.server.fakes import FakeEngine

PROMPT = "Hello world"


def error_of(client: TestClient, status: int, path: str = "/generate", **kwargs: Any) -> Any:
    response = client.post(path, **kwargs)
    assert response.status_code == status, response.text
    return response.json()


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"temperature": -1.0}, "`temperature` must be strictly positive"),
        ({"top_p": 1.5}, "`top_p` must be > 0.0 and < 1.0"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
        ({"top_n_tokens": 9}, "`top_n_tokens` must be >= 0 and <= 5. Given: 9"),
        ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ],
)
def test_validation_errors_carry_tgi_messages(
    client: TestClient, parameters: dict[str, Any], message: str
) -> None:
    body = error_of(client, 422, json={"inputs": PROMPT, "parameters": parameters})
    assert body == {"error": f"Input validation error: {message}", "error_type": "validation"}


def test_too_long_inputs_are_refused(client: TestClient, engine: FakeEngine) -> None:
    text = "Hello world " * 18
    length = len(engine.tokenizer.encode(text))
    assert 100 < length < 128
    body = error_of(client, 422, json={"inputs": text, "parameters": {"max_new_tokens": 1}})
    assert body["error"] == (
        f"Input validation error: `inputs` must have less than 100 tokens. Given: {length}"
    )
    # truncate brings the same prompt within the limit.
    payload = {"inputs": text, "parameters": {"max_new_tokens": 1, "truncate": 100}}
    assert client.post("/generate", json=payload).status_code == 200


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({"parameters": {}}, "missing field `inputs`"),
        ({"inputs": 3}, "`inputs` must be a string, got a number"),
        (
            {"inputs": "x", "parameters": {"temperature": "hot"}},
            "`parameters.temperature` must be a number, got a string",
        ),
        (
            {"inputs": "x", "parameters": {"max_new_tokens": 2.5}},
            "`parameters.max_new_tokens` must be a non-negative integer",
        ),
        (
            {"inputs": "x", "parameters": {"max_new_tokens": -1}},
            "`parameters.max_new_tokens` must be a non-negative integer, got -1",
        ),
        (
            {"inputs": "x", "parameters": {"details": "yes"}},
            "`parameters.details` must be a boolean",
        ),
        (
            {"inputs": "x", "parameters": {"stop": "fox"}},
            "`parameters.stop` must be an array of strings",
        ),
        ({"inputs": "x", "parameters": []}, "`parameters` must be a JSON object, got an array"),
        ([1, 2], "the request body must be a JSON object, got an array"),
    ],
)
def test_wrong_types_name_the_field(client: TestClient, payload: Any, fragment: str) -> None:
    body = error_of(client, 422, json=payload)
    assert body["error_type"] == "validation"
    assert fragment in body["error"]


def test_malformed_json_is_a_422(client: TestClient) -> None:
    body = error_of(
        client, 422, content=b'{"inputs": ', headers={"content-type": "application/json"}
    )
    assert body["error"].startswith("Input validation error: the request body is not valid JSON")


def test_unsupported_tgi_features_are_refused(client: TestClient) -> None:
    body = error_of(client, 422, json={"inputs": PROMPT, "parameters": {"watermark": True}})
    assert "`parameters.watermark` is not supported" in body["error"]
    body = error_of(client, 422, json={"inputs": PROMPT, "parameters": {"adapter_id": "x"}})
    assert (
        "adapter_id 'x': this server has no LoRA adapters (start it with --lora-adapters"
        in (body["error"])
    )


@pytest.mark.parametrize(
    ("grammar", "fragment"),
    [
        ({"type": "regex", "value": "[0-9]{3"}, "not a usable regex"),
        ({"type": "json", "value": {"type": "strng"}}, "not a usable JSON schema: Invalid type"),
        ({"type": "json", "value": "{not json"}, "`parameters.grammar.value` is not JSON"),
        ({"type": "xml", "value": "a"}, 'must be "json" or "regex"'),
        ({"type": "regex"}, "missing field `parameters.grammar.value`"),
    ],
)
def test_unusable_grammars_are_a_422(client: TestClient, grammar: Any, fragment: str) -> None:
    body = error_of(client, 422, json={"inputs": PROMPT, "parameters": {"grammar": grammar}})
    assert fragment in body["error"]


def test_overloaded_is_a_429(client: TestClient, engine: FakeEngine) -> None:
    engine.overloaded = True
    body = error_of(client, 429, json={"inputs": PROMPT})
    assert body == {"error": "Model is overloaded", "error_type": "overloaded"}


def test_generation_failure_is_a_424(client: TestClient, engine: FakeEngine) -> None:
    engine.fail_after = 1
    body = error_of(client, 424, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}})
    assert body == {
        "error": "Request failed during generation: the fake backend failed",
        "error_type": "generation",
    }
    assert engine.in_flight == 0


def test_unexpected_errors_are_a_500_without_details(
    client: TestClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(request: Any) -> Any:
        raise RuntimeError("secret internals /etc/passwd")

    monkeypatch.setattr(engine, "generate", broken)
    for path, payload in (
        ("/generate", {"inputs": PROMPT}),
        ("/generate_stream", {"inputs": PROMPT}),
    ):
        response = client.post(path, json=payload)
        assert response.status_code == 500
        assert response.json() == {"error": "Internal server error", "error_type": "internal"}
    response = client.post("/v1/completions", json={"prompt": PROMPT})
    assert response.status_code == 500
    assert "secret" not in response.text and "Traceback" not in response.text


def test_unknown_routes_answer_json(client: TestClient) -> None:
    response = client.get("/nope")
    assert response.status_code == 404
    assert response.json()["error_type"] == "not_found"
    assert client.get("/generate").status_code == 405


def test_api_key_guards_generation_routes(make_app: Callable[..., Starlette]) -> None:
    with TestClient(make_app(api_key="s3cret")) as client:
        unauthorized = {"error": "Unauthorized", "error_type": "authentication"}
        for path in ("/generate", "/generate_stream", "/", "/tokenize"):
            response = client.post(path, json={"inputs": PROMPT, "prompt": PROMPT})
            assert response.status_code == 401, path
            assert response.json() == unauthorized
        # The /v1/ routes answer in OpenAI's shape, /v1/messages in Anthropic's.
        response = client.post("/v1/completions", json={"prompt": PROMPT})
        assert response.status_code == 401
        assert response.json()["error"]["message"] == "Unauthorized"
        response = client.post("/v1/messages", json={})
        assert response.status_code == 401
        assert response.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "Unauthorized"},
        }
        assert (
            client.post(
                "/generate", json={"inputs": PROMPT}, headers={"x-api-key": "s3cret"}
            ).status_code
            == 200
        )
        assert (
            client.post(
                "/generate", json={"inputs": PROMPT}, headers={"x-api-key": "nope"}
            ).status_code
            == 401
        )
        assert client.get("/v1/models").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert client.post("/generate", json={"inputs": PROMPT}, headers=wrong).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert client.post("/generate", json={"inputs": PROMPT}, headers=good).status_code == 200
        assert client.get("/v1/models", headers=good).status_code == 200
        for path in ("/health", "/info", "/metrics", "/docs", "/openapi.json", "/"):
            assert client.get(path).status_code == 200, path


def test_cors_when_origins_are_given(make_app: Callable[..., Starlette]) -> None:
    origin = "https://ui.example"
    preflight = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    with TestClient(make_app(cors_origins=[origin], api_key="k")) as client:
        response = client.options("/generate", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == origin
        response = client.get("/info", headers={"Origin": origin})
        assert response.headers["access-control-allow-origin"] == origin
    with TestClient(make_app()) as client:
        assert (
            "access-control-allow-origin"
            not in client.get("/info", headers={"Origin": origin}).headers
        )


def test_draining_refuses_new_generation_requests(client: TestClient, app: Starlette) -> None:
    app.state.tgis.lifecycle.begin_drain()
    body = error_of(client, 503, json={"inputs": PROMPT})
    assert body == {"error": "Server is shutting down", "error_type": "unavailable"}
    body = error_of(client, 503, "/v1/completions", json={"prompt": PROMPT})
    assert body["error"]["message"] == "Server is shutting down"
    for path in ("/v1/chat/completions", "/v1/responses"):
        assert error_of(client, 503, path, json={})["error"]["message"] == "Server is shutting down"
    body = error_of(client, 503, "/v1/messages", json={})
    assert body == {
        "type": "error",
        "error": {"type": "api_error", "message": "Server is shutting down"},
    }
    assert client.get("/health").status_code == 503
    assert client.get("/info").status_code == 200
    assert client.get("/metrics").status_code == 200
