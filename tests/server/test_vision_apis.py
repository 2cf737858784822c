"""Images through OpenAI's Responses API (`input_image` parts, with the `openai` client's
`responses.create`) and Anthropic's Messages API (`image` blocks, with the `anthropic` client's
`messages.create`, `messages.stream` and `messages.count_tokens`), on tiny random Llava-Next and
Idefics3 served by `tgis serve`'s app: the greedy text is transformers' `generate()` on the
processor's inputs for the same chat, usage counts the image's tokens, an image a stored
response carries is sent again and found in the prefix cache; a text model refuses images as
the chat route does, and broken, unsupported or remote images are refused naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.applications import Starlette

from tests.factories import random_image
from tests.server.conftest import live_server
from tests.server.fakes import FakeEngine
from tests.server.test_vision_routes import NEW_TOKENS, TAIL, data_url, served

__all__ = ["served"]

ASK = "Describe it."


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)


def _anthropic(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", timeout=60, max_retries=0)


def _oracle(served: dict[str, Any], chat: list[dict[str, Any]], images: list[Any]) -> str:
    """transformers' greedy text for `chat` (messages of text and `{"type": "image"}` parts)
    rendered by the processor's chat template, on the processor's inputs."""
    processor = served["processor"]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True)
    ids = served["expected"](prompt, images, chat=True)
    return str(processor.tokenizer.decode(ids, skip_special_tokens=True))


def _prompt_tokens(served: dict[str, Any], chat: list[dict[str, Any]], images: list[Any]) -> int:
    processor = served["processor"]
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True)
    inputs = processor(text=prompt, images=images, add_special_tokens=False)
    return len(inputs["input_ids"][0])


def _asked(text: str = ASK) -> list[dict[str, Any]]:
    """One user message of an image and `text`, as the processor's template takes it."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def _base64(image: Any) -> str:
    return data_url(image).split(",", 1)[1]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


# --- Responses ----------------------------------------------------------------------------


def _input_image(image: Any, text: str = ASK, detail: str = "auto") -> list[Any]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": data_url(image), "detail": detail},
                {"type": "input_text", "text": text},
            ],
        }
    ]


def test_an_input_image_gives_generates_text(served: dict[str, Any]) -> None:
    """`responses.create` with an input_image: generate()'s greedy text on the processor's
    inputs, the image's tokens in `input_tokens`; `detail` changes nothing; another image
    another answer."""
    one, two = random_image(40, 60, 1), random_image(64, 30, 2)
    client = _openai(served["url"])

    def answer(image: Any, detail: str = "auto") -> Any:
        return client.responses.create(
            model="tgis", input=_input_image(image, detail=detail),
            max_output_tokens=NEW_TOKENS, temperature=0,
        )  # fmt: skip

    response = answer(one)
    assert response.status in ("completed", "incomplete")
    assert response.output_text == _oracle(served, _asked(), [one])
    assert response.usage is not None
    assert response.usage.input_tokens == _prompt_tokens(served, _asked(), [one])
    assert answer(one, "low").output_text == response.output_text
    assert answer(one, "high").output_text == response.output_text
    assert answer(two).output_text == _oracle(served, _asked(), [two]) != response.output_text


def test_a_stored_responses_image_is_sent_again_from_the_prefix_cache(
    served: dict[str, Any],
) -> None:
    """`previous_response_id` continues a conversation that holds an image: the prompt holds
    it again (generate()'s text for the whole conversation), and its rows come from the prefix
    cache instead of the vision tower."""
    url = served["url"]
    image = random_image(48, 48, 11)
    client = _openai(url)
    text = f"{ASK}{TAIL}{TAIL}"
    first = client.responses.create(
        model="tgis", input=_input_image(image, text), max_output_tokens=NEW_TOKENS,
        temperature=0,
    )  # fmt: skip
    encoded, cached = _metric(url, "tgis_images_encoded"), _metric(url, "tgis_images_cached")
    follow = client.responses.create(
        model="tgis", previous_response_id=first.id, input="And again?",
        max_output_tokens=NEW_TOKENS, temperature=0,
    )  # fmt: skip
    said = first.output_text
    chat = [
        *_asked(text),
        {"role": "assistant", "content": [{"type": "text", "text": said}] if said else []},
        {"role": "user", "content": [{"type": "text", "text": "And again?"}]},
    ]
    assert follow.output_text == _oracle(served, chat, [image])
    assert _metric(url, "tgis_images_encoded") == encoded
    assert _metric(url, "tgis_images_cached") == cached + 1


# --- Messages -----------------------------------------------------------------------------


def _image_block(image: Any, media_type: str = "image/png") -> dict[str, Any]:
    source = {"type": "base64", "media_type": media_type, "data": _base64(image)}
    return {"type": "image", "source": source}


def test_a_base64_image_block_gives_generates_text(served: dict[str, Any]) -> None:
    """`messages.create` with a base64 image block: generate()'s greedy text; the same from
    `messages.stream` and from a url source holding a data URL; `usage.input_tokens` and
    count_tokens count the image's tokens."""
    image = random_image(40, 60, 1)
    client = _anthropic(served["url"])
    blocks = [_image_block(image), {"type": "text", "text": ASK}]
    messages: Any = [{"role": "user", "content": blocks}]
    greedy: Any = {"temperature": 0}
    message = client.messages.create(
        model="tgis", max_tokens=NEW_TOKENS, messages=messages, extra_body=greedy
    )
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == _oracle(served, _asked(), [image])
    tokens = _prompt_tokens(served, _asked(), [image])
    assert message.usage.input_tokens == tokens
    assert client.messages.count_tokens(model="tgis", messages=messages).input_tokens == tokens
    with client.messages.stream(
        model="tgis", max_tokens=NEW_TOKENS, messages=messages, extra_body=greedy
    ) as stream:
        assert "".join(stream.text_stream) == text
    by_url: Any = [
        {
            "role": "user",
            "content": [
                {"type": "image", "source": {"type": "url", "url": data_url(image)}},
                {"type": "text", "text": ASK},
            ],
        }
    ]
    again = client.messages.create(
        model="tgis", max_tokens=NEW_TOKENS, messages=by_url, extra_body=greedy
    )
    assert "".join(b.text for b in again.content if b.type == "text") == text


# --- refusals -----------------------------------------------------------------------------


@pytest.fixture
def text_model(app: Starlette, engine: FakeEngine) -> Iterator[tuple[str, FakeEngine]]:
    """A live server of a text model (the scripted engine's app)."""
    with live_server(app) as (url, _):
        yield url, engine


def test_a_text_model_refuses_images_in_both_apis(text_model: tuple[str, FakeEngine]) -> None:
    """The chat route's refusal: a 422 (Responses) or Anthropic's 400 naming the image's
    field, before the engine sees anything."""
    url, engine = text_model
    image = random_image(8, 8)
    with pytest.raises(openai.UnprocessableEntityError) as responses:
        _openai(url).responses.create(model="tgis", input=_input_image(image))
    assert (
        "`input[0].content[0].image_url` is an image, and this model takes none"
        in responses.value.message
    )
    client = _anthropic(url)
    for block, field in [
        (_image_block(image), "source.data"),
        ({"type": "image", "source": {"type": "url", "url": data_url(image)}}, "source.url"),
    ]:
        messages: Any = [{"role": "user", "content": [{"type": "text", "text": ASK}, block]}]
        refusal = f"`messages[0].content[1].{field}` is an image, and this model takes none"
        with pytest.raises(anthropic.BadRequestError) as created:
            client.messages.create(model="tgis", max_tokens=4, messages=messages)
        assert created.value.status_code == 400
        assert refusal in created.value.body["error"]["message"]  # type: ignore[index]
        with pytest.raises(anthropic.BadRequestError) as counted:
            client.messages.count_tokens(model="tgis", messages=messages)
        assert refusal in counted.value.body["error"]["message"]  # type: ignore[index]
    assert engine.requests == []


PNG = data_url(random_image(8, 8))
REMOTE = "https://example.com/a.png"


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "input_image", "image_url": "data:image/png;base64,%%%", "detail": "auto"},
         "`input[0].content[0].image_url` is not valid base64"),
        ({"type": "input_image", "file_id": "file-1", "detail": "auto"},
         "`input[0].content[0].file_id`: uploaded files are not stored here; send the image "
         "itself as `image_url`"),
        ({"type": "input_image", "image_url": PNG, "detail": "ultra"},
         "`input[0].content[0].detail` must be one of auto, low, high, original"),
        ({"type": "input_image", "image_url": REMOTE, "detail": "auto"},
         "`input[0].content[0].image_url` is a remote URL"),
        ({"type": "input_image", "image_url": {"url": PNG}, "detail": "auto"},
         "`input[0].content[0].image_url` must be a string"),
        ({"type": "input_file", "file_id": "file-1"},
         "`input[0].content[0].type` 'input_file' is not served here"),
    ],
)  # fmt: skip
def test_bad_input_images_are_422s_naming_the_field(
    served: dict[str, Any], part: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        _openai(served["url"]).responses.create(
            model="tgis", input=[{"role": "user", "content": [part]}]
        )
    assert message in caught.value.message
    if "remote URL" in message:
        assert "--allow-image-urls" in caught.value.message


def test_an_image_in_a_function_call_output_is_refused(served: dict[str, Any]) -> None:
    items: Any = [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_image", "image_url": PNG, "detail": "auto"}],
        },
    ]
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        _openai(served["url"]).responses.create(model="tgis", input=items)
    assert "`input[1].output[0]`: images in a function_call_output" in caught.value.message


def _source(**source: str) -> dict[str, Any]:
    return {"type": "image", "source": source}


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (_source(type="base64", media_type="image/bmp", data="AAAA"),
         "`messages[0].content[0].source.media_type` must be one of image/jpeg, image/png, "
         "image/gif, image/webp, got 'image/bmp'"),
        (_source(type="base64", media_type="image/png", data="%%%"),
         "`messages[0].content[0].source.data` is not valid base64"),
        (_source(type="base64", media_type="image/png", data="aGVsbG8="),
         "`messages[0].content[0].source.data` is not a PNG, JPEG, WebP or GIF image"),
        (_source(type="url", url=REMOTE),
         "`messages[0].content[0].source.url` is a remote URL"),
        (_source(type="file", file_id="file_1"),
         "`messages[0].content[0].source.type` 'file' is not served here"),
        ({"type": "image"}, "missing field `messages[0].content[0].source`"),
        ({"type": "tool_result", "tool_use_id": "t1",
          "content": [_source(type="base64", media_type="image/png", data="AAAA")]},
         "`messages[0].content[0].content[0].type` 'image' is not served here"),
    ],
)  # fmt: skip
def test_bad_image_blocks_are_400s_naming_the_field(
    served: dict[str, Any], block: dict[str, Any], message: str
) -> None:
    messages: Any = [{"role": "user", "content": [block, {"type": "text", "text": ASK}]}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        _anthropic(served["url"]).messages.create(model="tgis", max_tokens=4, messages=messages)
    assert caught.value.status_code == 400
    error = caught.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and message in error["message"]
    if "remote URL" in message:
        assert "--allow-image-urls" in error["message"]
