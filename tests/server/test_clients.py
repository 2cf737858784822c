"""The Python clients users already have work unchanged against a live server (127.0.0.1)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette

from tests.server.conftest import live_server
from tests.server.fakes import FakeEngine

PROMPT = "Hello world"
MESSAGES = [{"role": "user", "content": "Hi"}]
API_KEY = "test-key"


@pytest.fixture
def url(make_app: Callable[..., Starlette]) -> Iterator[str]:
    with live_server(make_app()) as (base_url, _):
        yield base_url


def expected_text(engine: FakeEngine, tokens: int, index: int = 0) -> str:
    return engine.tokenizer.decode(engine.sequence_ids(index, tokens), skip_special_tokens=True)


def test_text_generation_client(url: str, engine: FakeEngine) -> None:
    from text_generation import Client

    client = Client(url, timeout=10)
    response = client.generate(PROMPT, max_new_tokens=4, decoder_input_details=True, top_n_tokens=2)
    assert response.generated_text == expected_text(engine, 4)
    assert response.details.generated_tokens == 4
    assert response.details.finish_reason == "length"
    assert len(response.details.prefill) == len(engine.tokenizer.encode(PROMPT))
    assert len(response.details.top_tokens) == 4
    best = client.generate(PROMPT, max_new_tokens=3, best_of=2, do_sample=True)
    assert best.generated_text == expected_text(engine, 3, index=1)
    assert len(best.details.best_of_sequences) == 1
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=5, top_n_tokens=1))
    assert len(streamed) == 5
    assert streamed[-1].generated_text == expected_text(engine, 5)
    assert streamed[-1].details.generated_tokens == 5
    assert all(len(r.top_tokens) == 1 for r in streamed)


def test_text_generation_client_errors(url: str, engine: FakeEngine) -> None:
    from text_generation import Client
    from text_generation.errors import OverloadedError, ValidationError

    client = Client(url, timeout=10)
    with pytest.raises(ValidationError, match="`max_new_tokens` must be <= 128"):
        client.generate(PROMPT, max_new_tokens=99999)
    engine.overloaded = True
    with pytest.raises(OverloadedError, match="Model is overloaded"):
        client.generate(PROMPT, max_new_tokens=2)


def test_huggingface_hub_inference_client(url: str, engine: FakeEngine) -> None:
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=url, timeout=10)
    text = client.text_generation(PROMPT, max_new_tokens=3, return_full_text=False)
    assert text == expected_text(engine, 3)
    outputs: list[Any] = list(
        client.text_generation(PROMPT, max_new_tokens=4, details=True, stream=True)
    )
    assert len(outputs) == 4
    assert outputs[-1].details.finish_reason == "length"
    # The client posts to `/`, where return_full_text defaults to true (text-generation model):
    # TGI's final stream event then carries the prompt too.
    assert outputs[-1].generated_text == PROMPT + expected_text(engine, 4)
    details = client.text_generation(PROMPT, max_new_tokens=2, details=True)
    assert details.details.generated_tokens == 2
    chat = client.chat_completion(MESSAGES, max_tokens=3)
    assert chat.choices[0].message.content == expected_text(engine, 3)
    assert chat.usage.completion_tokens == 3
    pieces = [
        c.choices[0].delta.content
        for c in client.chat_completion(MESSAGES, max_tokens=3, stream=True)
        if c.choices
    ]
    assert "".join(p or "" for p in pieces) == expected_text(engine, 3)


def test_openai_client_with_an_api_key(
    make_app: Callable[..., Starlette], engine: FakeEngine
) -> None:
    import openai

    with live_server(make_app(api_key=API_KEY)) as (base_url, _):
        client = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key=API_KEY, timeout=10, max_retries=0
        )
        completion = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=4, logprobs=1
        )
        assert completion.choices[0].text == expected_text(engine, 4)
        client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=2, logit_bias={"9": 50, "4": -100}
        )
        assert engine.requests[-1].params.logit_bias == ((9, 50.0), (4, -100.0))
        assert completion.usage.completion_tokens == 4
        assert len(completion.choices[0].logprobs.tokens) == 4
        stream = client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=4, stream=True
        )
        assert "".join(c.choices[0].text for c in stream) == expected_text(engine, 4)
        chat = client.chat.completions.create(
            model="tiny-llama", messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2
        )
        assert chat.choices[0].message.content == expected_text(engine, 3)
        assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
        stream = client.chat.completions.create(
            model="tiny-llama",
            messages=MESSAGES,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected_text(engine, 3)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        assert [m.id for m in client.models.list()] == ["tiny-llama"]
        wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="nope", timeout=10, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="Error code: 401"):
            wrong.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=1)
        with pytest.raises(openai.UnprocessableEntityError, match="`n` must be <= 2"):
            client.completions.create(model="tiny-llama", prompt=PROMPT, n=5)
