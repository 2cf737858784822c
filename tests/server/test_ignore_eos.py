"""`ignore_eos` (vLLM's extension) through every generating route of `tgis serve`'s app: TGI's
`parameters.ignore_eos` on /generate, /generate_stream and /, OpenAI's top-level field on
/v1/completions and /v1/chat/completions (sent by the `openai` client as vLLM's users do).

The served model is the demo model whose greedy first tokens, for the raw prompt and for the
chat prompt, are made EOS ids (generation_config.json lists them next to its own EOS): without
the flag every answer ends on its first token; with it the EOS is an ordinary token and the
answer runs to its max_new_tokens / max_tokens.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.server.conftest import demo_app, live_server

PROMPT = "def fibonacci(n):"
# Any: the `openai` client's message types are TypedDicts a plain dict literal is not.
MESSAGES: list[Any] = [{"role": "user", "content": "Write a function that adds two numbers."}]
NEW_TOKENS = 8


def greedy_first(model: Any, ids: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())


@pytest.fixture(scope="module")
def eos_first(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with the greedy first token of PROMPT (TGI's and the completions
    route's prompt) and of MESSAGES (the chat route's) made EOS ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    # The server's own encodings: the raw prompt with its special tokens, the chat template's
    # text as it is (the template writes them).
    chat = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    first = {
        greedy_first(model, tokenizer.encode(PROMPT)),
        greedy_first(model, tokenizer.encode(chat, add_special_tokens=False)),
    }
    out = tmp_path_factory.mktemp("eos-first")
    for path in demo_model_dir.iterdir():
        if path.name != "generation_config.json":
            (out / path.name).symlink_to(path)
    generation = json.loads((demo_model_dir / "generation_config.json").read_text())
    assert not first & {generation["eos_token_id"]}, "the demo model picks its own EOS first"
    generation["eos_token_id"] = [generation["eos_token_id"], *sorted(first)]
    (out / "generation_config.json").write_text(json.dumps(generation))
    shutil.copystat(demo_model_dir, out)
    return out


@pytest.fixture(scope="module")
def url(eos_first: Path) -> Iterator[str]:
    with demo_app(eos_first, 256) as app, live_server(app) as (base, _):
        yield base


def generate(url: str, **parameters: Any) -> dict[str, Any]:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    body["parameters"].update(parameters)
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_tgi_generate_stops_at_eos_and_runs_to_max_new_tokens_with_ignore_eos(url: str) -> None:
    stopped = generate(url)["details"]
    assert stopped["finish_reason"] == "eos_token" and stopped["generated_tokens"] == 1
    eos = stopped["tokens"][0]["id"]
    details = generate(url, ignore_eos=True)["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == NEW_TOKENS == len(details["tokens"])
    assert details["tokens"][0]["id"] == eos  # still sampled: only its ending is ignored


def test_tgi_generate_stream_and_compat_route_take_ignore_eos(url: str) -> None:
    parameters = {"max_new_tokens": NEW_TOKENS, "details": True, "ignore_eos": True}
    body = {"inputs": PROMPT, "parameters": parameters}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [
            json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")
        ]
    assert len(events) == NEW_TOKENS
    assert events[-1]["details"]["finish_reason"] == "length"
    compat = httpx.post(f"{url}/", json=body, timeout=60)
    assert compat.status_code == 200, compat.text
    assert compat.json()[0]["details"]["generated_tokens"] == NEW_TOKENS
    plain = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    (stopped,) = httpx.post(f"{url}/", json=plain, timeout=60).json()
    assert stopped["details"]["finish_reason"] == "eos_token"


def test_openai_completions_take_ignore_eos_as_vllm_does(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-")
    stopped = client.completions.create(
        model="tgi", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    full = client.completions.create(
        model="tgi", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == NEW_TOKENS


def test_openai_chat_takes_ignore_eos_streamed_and_not(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-")
    stopped = client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    full = client.chat.completions.create(
        model="tgi", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == NEW_TOKENS
    chunks = list(
        client.chat.completions.create(
            model="tgi", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        full.choices[0].message.content
    )


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/generate",
            {"inputs": PROMPT, "parameters": {"ignore_eos": True,
                                              "grammar": {"type": "regex", "value": "[0-9]+"}}},
            "`grammar` cannot be combined with `ignore_eos`",
        ),
        (
            "/v1/chat/completions",
            {"model": "tgi", "messages": MESSAGES, "ignore_eos": True,
             "response_format": {"type": "json_object"}},
            "`response_format` cannot be combined with `ignore_eos`",
        ),
    ],
)  # fmt: skip
def test_a_grammar_with_ignore_eos_is_a_422_naming_both(
    url: str, path: str, body: dict[str, Any], message: str
) -> None:
    """A complete grammar allows nothing but EOS: ignoring it would leave no token to choose."""
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == 422
    assert message in response.text, response.text


@pytest.mark.parametrize("value", ["yes", 1])
def test_ignore_eos_must_be_a_boolean(url: str, value: Any) -> None:
    body = {"inputs": PROMPT, "parameters": {"ignore_eos": value}}
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 422
    assert "ignore_eos" in response.text, response.text
    completion = {"model": "tgi", "prompt": PROMPT, "ignore_eos": value}
    response = httpx.post(f"{url}/v1/completions", json=completion, timeout=60)
    assert response.status_code == 422
    assert "ignore_eos" in response.text, response.text
