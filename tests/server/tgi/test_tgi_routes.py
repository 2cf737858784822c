"""TGI's routes answer with TGI's JSON: /generate, / (compat), /tokenize, /info, /health."""

from __future__ import annotations

from typing import Any

from starlette.testclient import TestClient

from tests.server.fakes import FakeEngine, logprob

PROMPT = "Hello world"


def expected_text(engine: FakeEngine, tokens: int, index: int = 0) -> str:
    return engine.tokenizer.decode(engine.sequence_ids(index, tokens), skip_special_tokens=True)


def generate(client: TestClient, **parameters: Any) -> Any:
    response = client.post("/generate", json={"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_returns_text_without_details_by_default(
    client: TestClient, engine: FakeEngine
) -> None:
    body = generate(client, max_new_tokens=6)
    assert body == {"generated_text": expected_text(engine, 6)}
    request = engine.requests[-1]
    assert request.input_ids == tuple(engine.tokenizer.encode(PROMPT))
    assert request.params.max_new_tokens == 6
    assert request.params.do_sample is False


def test_generate_without_parameters_uses_the_server_limit(
    client: TestClient, engine: FakeEngine
) -> None:
    response = client.post("/generate", json={"inputs": PROMPT})
    assert response.status_code == 200
    # validate fills max_new_tokens with what fits in max_total_tokens (128).
    assert engine.requests[-1].params.max_new_tokens == 128 - len(engine.requests[-1].input_ids)


def test_details_have_tgi_fields(client: TestClient, engine: FakeEngine) -> None:
    details = generate(client, max_new_tokens=4, details=True)["details"]
    assert set(details) == {"finish_reason", "generated_tokens", "seed", "prefill", "tokens"}
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 4
    assert details["seed"] is None
    assert details["prefill"] == []
    ids = engine.sequence_ids(0, 4)
    assert [t["id"] for t in details["tokens"]] == ids
    for step, token in enumerate(details["tokens"]):
        assert set(token) == {"id", "text", "logprob", "special"}
        assert token["logprob"] == round(logprob(step, 0), 4)
        assert token["special"] is False


def test_decoder_input_details_and_top_tokens(client: TestClient, engine: FakeEngine) -> None:
    details = generate(
        client, max_new_tokens=3, details=True, decoder_input_details=True, top_n_tokens=2
    )["details"]
    prompt_ids = engine.tokenizer.encode(PROMPT)
    assert [t["id"] for t in details["prefill"]] == prompt_ids
    assert set(details["prefill"][0]) == {"id", "text", "logprob"}
    assert details["prefill"][0]["logprob"] is None
    assert len(details["top_tokens"]) == 3
    assert all(len(step) == 2 for step in details["top_tokens"])
    assert set(details["top_tokens"][0][0]) == {"id", "text", "logprob", "special"}


def test_best_of_picks_the_highest_mean_logprob(client: TestClient, engine: FakeEngine) -> None:
    body = generate(client, max_new_tokens=5, best_of=2, do_sample=True, details=True)
    # The fake scores sequence 1 higher than sequence 0: TGI returns the best, then the rest.
    assert body["generated_text"] == expected_text(engine, 5, index=1)
    assert body["details"]["seed"] == 1235
    others = body["details"]["best_of_sequences"]
    assert len(others) == 1
    assert others[0]["generated_text"] == expected_text(engine, 5, index=0)
    assert others[0]["seed"] == 1234
    assert set(others[0]) == {
        "generated_text",
        "finish_reason",
        "generated_tokens",
        "seed",
        "prefill",
        "tokens",
    }
    assert engine.requests[-1].params.best_of == 2


def test_best_of_needs_sampling(client: TestClient) -> None:
    response = client.post("/generate", json={"inputs": PROMPT, "parameters": {"best_of": 2}})
    assert response.status_code == 422
    assert response.json() == {
        "error": "Input validation error: you must use sampling when `best_of` is > 1",
        "error_type": "validation",
    }


def test_return_full_text_prepends_the_prompt(client: TestClient, engine: FakeEngine) -> None:
    body = generate(client, max_new_tokens=3, return_full_text=True)
    assert body["generated_text"] == PROMPT + expected_text(engine, 3)


def test_truncate_keeps_the_last_tokens(client: TestClient, engine: FakeEngine) -> None:
    generate(client, max_new_tokens=2, truncate=3)
    assert engine.requests[-1].input_ids == tuple(engine.tokenizer.encode(PROMPT)[-3:])


def test_stop_sequence_is_kept_as_tgi_does(client: TestClient, engine: FakeEngine) -> None:
    body = generate(client, max_new_tokens=20, stop=["fox"], details=True)
    assert body["generated_text"].endswith("fox")
    assert body["details"]["finish_reason"] == "stop_sequence"


def test_eos_token_is_reported_as_special(client: TestClient, engine: FakeEngine) -> None:
    engine.eos_after = 3
    details = generate(client, max_new_tokens=10, details=True)["details"]
    assert details["finish_reason"] == "eos_token"
    assert details["tokens"][-1]["special"] is True
    assert details["generated_tokens"] == 4


def test_generate_sends_tgi_timing_headers(client: TestClient, engine: FakeEngine) -> None:
    response = client.post(
        "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    )
    assert response.headers["x-generated-tokens"] == "3"
    assert response.headers["x-prompt-tokens"] == str(len(engine.tokenizer.encode(PROMPT)))
    assert response.headers["x-compute-type"] == "cpu"  # the model's device type
    for name in ("x-total-time", "x-validation-time", "x-queue-time", "x-inference-time"):
        assert int(response.headers[name]) >= 0, name  # whole milliseconds


def test_compat_route_returns_a_list(client: TestClient, engine: FakeEngine) -> None:
    response = client.post(
        "/",
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "return_full_text": False}},
    )
    assert response.status_code == 200
    assert response.json() == [{"generated_text": expected_text(engine, 3)}]


def test_compat_route_defaults_to_full_text_for_text_generation_models(
    client: TestClient, engine: FakeEngine
) -> None:
    # TGI: return_full_text defaults to true on `/` when the pipeline tag is text-generation.
    response = client.post("/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert response.json() == [{"generated_text": PROMPT + expected_text(engine, 3)}]


def test_compat_route_streams_when_asked(client: TestClient) -> None:
    response = client.post(
        "/", json={"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3}}
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.count("data:") == 3


def test_tokenize_gives_ids_texts_and_byte_offsets(client: TestClient, engine: FakeEngine) -> None:
    text = "Hello wörld"
    response = client.post("/tokenize", json={"inputs": text})
    assert response.status_code == 200
    tokens = response.json()
    assert [t["id"] for t in tokens] == engine.tokenizer.encode(text)
    raw = text.encode()
    for token in tokens:
        assert set(token) == {"id", "text", "start", "stop"}
        assert raw[token["start"] : token["stop"]].decode() == token["text"]
    assert tokens[-1]["stop"] == len(raw)  # bytes, not characters (ö is two bytes)


def test_tokenize_truncates(client: TestClient, engine: FakeEngine) -> None:
    response = client.post("/tokenize", json={"inputs": PROMPT, "parameters": {"truncate": 2}})
    assert [t["id"] for t in response.json()] == engine.tokenizer.encode(PROMPT)[-2:]


def test_info_reports_tgi_fields(client: TestClient) -> None:
    info = client.get("/info").json()
    assert info["model_id"] == "tiny-llama"
    assert info["max_input_tokens"] == info["max_input_length"] == 100
    assert info["max_total_tokens"] == 128
    assert info["max_best_of"] == 2
    assert info["model_pipeline_tag"] == "text-generation"
    assert info["model_device_type"] == "cpu"
    for key in ("model_sha", "model_dtype", "version", "sha", "docker_label", "router"):
        assert key in info


def test_health_follows_the_engine(client: TestClient, engine: FakeEngine) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/").status_code == 200
    engine.is_healthy = False
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"error": "unhealthy", "error_type": "healthcheck"}


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if "$ref" in node else []
        return found + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def test_openapi_describes_every_route(client: TestClient, app: Any) -> None:
    document = client.get("/openapi.json").json()
    assert document["openapi"].startswith("3.")
    schemas = document["components"]["schemas"]
    for route in app.routes:
        operations = document["paths"][route.path]
        for method in route.methods - {"HEAD"}:
            operation = operations[method.lower()]
            ok = operation["responses"]["200"]
            if route.path not in ("/", "/health") or method == "POST":
                assert ok["content"], (route.path, method)
            if method == "POST":
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                assert body["$ref"].split("/")[-1] in schemas
                # Bad bodies: 422, or 400 on Anthropic's routes (as its clients expect).
                refusal = "400" if route.path.startswith("/v1/messages") else "422"
                assert refusal in operation["responses"], route.path
    for reference in _refs(document):
        assert reference.split("/")[-1] in schemas, reference
    assert schemas["Details"]["required"] == [
        "finish_reason",
        "generated_tokens",
        "seed",
        "prefill",
        "tokens",
    ]


def test_docs_page_loads_the_schema(client: TestClient) -> None:
    response = client.get("/docs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert 'url: "openapi.json"' in response.text
    assert "SwaggerUIBundle" in response.text


def test_openapi_document_is_a_valid_3_1_document(client: TestClient) -> None:
    """Fuzzers and client generators read it: 3.1's numeric exclusiveMinimum in a document
    that said 3.0 made four operations unreadable."""
    from openapi_spec_validator import validate

    document = client.get("/openapi.json").json()
    assert document["openapi"] == "3.1.0"
    validate(document)


def test_health_generates_a_token_when_idle_and_fails_when_that_fails(
    client: TestClient, engine: Any
) -> None:
    assert client.get("/health").status_code == 200
    assert engine.requests[-1].request_id == "health"  # it asked the engine for a token
    assert engine.requests[-1].params.max_new_tokens == 1
    engine.fail_after = 0  # every forward fails
    response = client.get("/health")
    assert response.status_code == 503
    assert "the health generation failed: the fake backend failed" in response.json()["error"]
    engine.fail_after = None
    assert client.get("/health").status_code == 200
