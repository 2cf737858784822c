"""OpenAI routes: parameter mapping, response shapes, logprobs, usage, streaming chunks."""

from __future__ import annotations

import json
from typing import Any

from starlette.testclient import TestClient

from tests.server.fakes import FakeEngine

PROMPT = "Hello world"
MESSAGES = [{"role": "user", "content": "Hi"}]


def expected_text(engine: FakeEngine, tokens: int, index: int = 0) -> str:
    return engine.tokenizer.decode(engine.sequence_ids(index, tokens), skip_special_tokens=True)


def post(client: TestClient, path: str, status: int = 200, **body: Any) -> Any:
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


def chunks(text: str) -> list[Any]:
    assert text.rstrip().endswith("data: [DONE]")
    datas = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(d) for d in datas[:-1]]


def test_completion_shape_and_usage(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=5, temperature=0)
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "tiny-llama"
    assert body["choices"] == [
        {"index": 0, "text": expected_text(engine, 5), "logprobs": None, "finish_reason": "length"}
    ]
    prompt_tokens = len(engine.tokenizer.encode(PROMPT))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
    }


def test_sampling_parameters_map_to_tgi(client: TestClient, engine: FakeEngine) -> None:
    post(client, "/v1/completions", prompt=PROMPT, max_tokens=2, temperature=0)
    assert engine.requests[-1].params.do_sample is False
    post(client, "/v1/completions", prompt=PROMPT, max_tokens=2, temperature=0.7, top_p=1.0, seed=3)
    params = engine.requests[-1].params
    assert (params.do_sample, params.temperature, params.top_p, params.seed) == (True, 0.7, None, 3)
    post(client, "/v1/completions", prompt=PROMPT, frequency_penalty=0.5, presence_penalty=0.25)
    params = engine.requests[-1].params
    assert params.do_sample is True  # OpenAI's default temperature is 1: sampling
    assert (params.frequency_penalty, params.presence_penalty) == (0.5, 0.25)
    assert params.max_new_tokens == 16  # OpenAI's default max_tokens for completions


def test_stop_is_cut_from_the_text(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=20, stop="fox")
    assert engine.requests[-1].params.include_stop_sequence is False
    assert engine.requests[-1].params.stop == ("fox",)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "fox" not in choice["text"] and choice["text"].endswith("brown ")


def test_completion_logprobs(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=3, logprobs=2)
    assert engine.requests[-1].params.top_n_tokens == 2
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    tokens = logprobs["tokens"]
    assert len(tokens) == len(logprobs["token_logprobs"]) == 3
    # logprobs=2: the two best per step, the chosen token's own logprob among them.
    assert [len(top) for top in logprobs["top_logprobs"]] == [2, 2, 2]
    for token, value, top in zip(
        tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert top[token] == value
    # Each token's character offset in the text: the lengths of the tokens before it.
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert logprobs["text_offset"] == offsets


def test_echo_prepends_the_prompt_with_its_logprobs(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=2, echo=True, logprobs=0)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT + expected_text(engine, 2)
    prompt_tokens = len(engine.tokenizer.encode(PROMPT))
    assert len(choice["logprobs"]["tokens"]) == prompt_tokens + 2
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert choice["logprobs"]["top_logprobs"] is None


def test_token_id_prompts_and_batches(client: TestClient, engine: FakeEngine) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    post(client, "/v1/completions", prompt=ids, max_tokens=2)
    assert engine.requests[-1].input_ids == tuple(ids)
    error = post(client, "/v1/completions", 422, prompt=[1, 5000], max_tokens=2)
    assert "token id 5000 is outside the vocabulary" in error["error"]["message"]
    body = post(client, "/v1/completions", prompt=["Hello", "world"], max_tokens=2)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == 4


def test_n_returns_several_sampled_choices(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, "/v1/completions", prompt=PROMPT, max_tokens=3, n=2, temperature=0.8)
    assert engine.requests[-1].params.best_of == 2
    texts = [c["text"] for c in body["choices"]]
    assert texts == [expected_text(engine, 3, 0), expected_text(engine, 3, 1)]
    assert body["usage"]["completion_tokens"] == 6


def test_n_limits(client: TestClient) -> None:
    error = post(client, "/v1/completions", 422, prompt=PROMPT, n=2, temperature=0)
    assert error["error"]["message"] == (
        "Input validation error: `n` > 1 needs sampling: set `temperature` above 0"
    )
    error = post(client, "/v1/completions", 422, prompt=PROMPT, n=3)
    assert "`n` must be <= 2" in error["error"]["message"]


def test_completion_stream_chunks_and_usage(client: TestClient, engine: FakeEngine) -> None:
    response = client.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    got = chunks(response.text)
    assert "".join(c["choices"][0]["text"] for c in got[:-1]) == expected_text(engine, 4)
    assert got[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in got[:-1])
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 4


def test_chat_uses_the_chat_template(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, "/v1/chat/completions", messages=MESSAGES, max_tokens=3)
    rendered = engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|assistant|>")
    expected_ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert engine.requests[-1].input_ids == tuple(expected_ids)
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": expected_text(engine, 3)},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"]["prompt_tokens"] == len(expected_ids)


def test_chat_max_completion_tokens_and_text_parts(client: TestClient, engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    post(client, "/v1/chat/completions", messages=messages, max_completion_tokens=2, max_tokens=9)
    assert engine.requests[-1].params.max_new_tokens == 2
    # The text part is rendered as the plain string content would be.
    rendered = engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    expected_ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert engine.requests[-1].input_ids == tuple(expected_ids)


def test_chat_logprobs(client: TestClient) -> None:
    body = post(
        client,
        "/v1/chat/completions",
        messages=MESSAGES,
        max_tokens=2,
        logprobs=True,
        top_logprobs=3,
    )
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 3
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_chat_stream(client: TestClient, engine: FakeEngine) -> None:
    response = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "stream": True}
    )
    got = chunks(response.text)
    assert all(c["object"] == "chat.completion.chunk" for c in got)
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"]["content"] for c in got)
    assert text == expected_text(engine, 3)
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in got[-1]


def test_chat_without_template_is_a_clear_422(make_app: Any, plain_tokenizer: Any) -> None:
    with TestClient(make_app(tokenizer=plain_tokenizer)) as client:
        error = post(client, "/v1/chat/completions", 422, messages=MESSAGES)
    assert error["error"]["type"] == "validation"
    assert "no chat template" in error["error"]["message"]


def test_unsupported_features_are_refused(client: TestClient) -> None:
    error = post(client, "/v1/completions", 422, prompt=PROMPT, suffix="x")
    assert "`suffix` is not supported" in error["error"]["message"]
    error = post(client, "/v1/chat/completions", 422, messages=[])
    assert "`messages` must be a non-empty array" in error["error"]["message"]


def test_logit_bias_reaches_the_engine_and_bad_values_are_named(
    client: TestClient, engine: FakeEngine
) -> None:
    """logit_bias (token id -> -100..100) on both routes reaches the engine's parameters;
    a key that is not a token id, a value out of range or a token past the vocabulary is a
    422 naming the field."""
    post(client, "/v1/chat/completions", 200, messages=MESSAGES, logit_bias={"5": 100, "7": -3.5})
    assert engine.requests[-1].params.logit_bias == ((5, 100.0), (7, -3.5))
    post(client, "/v1/completions", 200, prompt=PROMPT, logit_bias={"11": -100})
    assert engine.requests[-1].params.logit_bias == ((11, -100.0),)
    post(client, "/v1/completions", 200, prompt=PROMPT, logit_bias={})
    assert engine.requests[-1].params.logit_bias == ()
    for bias, message in (
        ({"x": 1}, "logit_bias"),
        ({"5": 101}, "logit_bias"),
        ({"5": "high"}, "logit_bias"),
        ({"999999": 1}, "logit_bias"),
    ):
        error = post(client, "/v1/chat/completions", 422, messages=MESSAGES, logit_bias=bias)
        assert message in error["error"]["message"], (bias, error)


def test_openai_errors_keep_status_codes(client: TestClient, engine: FakeEngine) -> None:
    engine.overloaded = True
    error = post(client, "/v1/chat/completions", 429, messages=MESSAGES)
    assert error == {
        "error": {
            "message": "Model is overloaded",
            "type": "overloaded",
            "param": None,
            "code": 429,
        }
    }


def test_models(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "tiny-llama"
    assert body["data"][0]["object"] == "model"


def test_stream_with_n_and_several_prompts(client: TestClient, engine: FakeEngine) -> None:
    response = client.post(
        "/v1/completions",
        json={"prompt": ["Hello", "world"], "max_tokens": 3, "n": 2, "stream": True, "echo": True},
    )
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks(response.text):
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finished.add(choice["index"])
    assert finished == {0, 1, 2, 3}
    assert texts[0] == "Hello" + expected_text(engine, 3, 0)
    assert texts[1] == "Hello" + expected_text(engine, 3, 1)
    assert texts[2] == "world" + expected_text(engine, 3, 0)
    assert texts[3] == "world" + expected_text(engine, 3, 1)


def test_error_in_a_stream_is_an_event(client: TestClient, engine: FakeEngine) -> None:
    engine.fail_after = 2
    response = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, "stream": True}
    )
    assert response.status_code == 200
    got = chunks(response.text)
    assert got[-1] == {
        "error": {
            "message": "Request failed during generation: the fake backend failed",
            "type": "generation",
            "param": None,
            "code": 424,
        }
    }
