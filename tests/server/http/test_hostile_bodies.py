"""Bodies a hostile client sends: each is a 4xx that says what is wrong, never a 500, on every
POST route; the server keeps answering."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tests.server.conftest import make_config

ROUTES = {
    "/generate": lambda text: {"inputs": text},
    "/generate_stream": lambda text: {"inputs": text},
    "/": lambda text: {"inputs": text},
    "/tokenize": lambda text: {"inputs": text},
    "/v1/completions": lambda text: {"prompt": text, "max_tokens": 2},
    "/v1/chat/completions": lambda text: {"messages": [{"role": "user", "content": text}]},
}


@pytest.fixture
def small_client(make_app: Callable[..., Starlette]) -> Iterator[TestClient]:
    app = make_app(config=make_config(max_request_body_bytes=10_000))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def post_raw(client: TestClient, path: str, body: bytes) -> tuple[int, str]:
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    return response.status_code, response.text


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_huge_integer_is_a_422(small_client: TestClient, path: str) -> None:
    body = b'{"inputs": "hi", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    status, text = post_raw(small_client, path, body)
    assert status == 422 and "5000-digit integer" in text


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_deep_nesting_is_a_422(small_client: TestClient, path: str) -> None:
    status, text = post_raw(small_client, path, b"[" * 4000 + b"]" * 4000)
    assert status == 422 and "nests deeper than 64 levels" in text


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_lone_surrogate_is_a_422(small_client: TestClient, path: str) -> None:
    body = (str(ROUTES[path]("x")).replace("'x'", '"a\\ud800b"').replace("'", '"')).encode()
    status, text = post_raw(small_client, path, body)
    assert status == 422 and "lone UTF-16 surrogate (U+D800) at character 1" in text


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_body_over_the_limit_is_a_413(small_client: TestClient, path: str) -> None:
    import json

    body = json.dumps(ROUTES[path]("x" * 20_000)).encode()
    status, text = post_raw(small_client, path, body)
    assert status == 413 and "at most 10000 (--max-request-body-bytes)" in text
    assert post_raw(small_client, "/generate", b'{"inputs": "still here"}')[0] == 200


@pytest.mark.parametrize("path", ["/generate", "/tokenize", "/v1/completions"])
def test_a_prompt_longer_than_any_context_is_refused_before_tokenizing(
    client: TestClient, path: str
) -> None:
    import json

    # make_config's max_total_tokens is 128: at most 32 x 128 characters are tokenized.
    body = json.dumps(ROUTES[path]("x" * 5000)).encode()
    status, text = post_raw(client, path, body)
    assert status == 422 and "has 5000 characters" in text and "4096 characters" in text


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_body_that_is_not_json_by_its_type_is_a_415(small_client: TestClient, path: str) -> None:
    response = small_client.post(
        path, content=b"inputs=hi", headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert response.status_code == 415 and "must be JSON" in response.text
    typed = small_client.post(
        path,
        content=b'{"inputs": "hi"}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert typed.status_code != 415


def test_a_wrong_method_says_which_are_allowed(small_client: TestClient) -> None:
    response = small_client.get("/generate")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
