"""Vision-language models served by `tgis serve`'s app (tiny random Llava-Next and Idefics3
with their own processors): a prompt with one or two images gives transformers' greedy
`generate()` tokens on the same processed inputs, through TGI's markdown images (the
`text-generation` client) and OpenAI's image_url parts (the `openai` client), alone and
batched with text-only requests; a repeated image is found in the prefix cache (counted in
/metrics); /info and /v1/models say the model takes images; broken or remote images are 422s
naming the field."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from text_generation import Client

from tests.factories import (
    GEMMA3_IMAGE,
    QWEN_VL_IMAGE,
    make_vision_dir,
    qwen_vl_processor,
    random_image,
)
from tests.server.conftest import demo_app, live_server

NEW_TOKENS = 6
TAIL = " The quick brown fox jumps over the lazy dog. Hello world, hello tokens."
IMAGES = [(40, 60, 1), (64, 30, 2)]


def data_url(image: Any, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(
    scope="module", params=["llava_next", "idefics3", "qwen2_vl", "qwen2_5_vl", "gemma3"]
)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """The model directory, its oracle and a live server of it."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    arch = request.param
    model_dir = make_vision_dir(tmp_path_factory.mktemp(arch), arch)
    qwen = arch.startswith("qwen")
    gemma = arch == "gemma3"
    processor = qwen_vl_processor(model_dir) if qwen else AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()

    def expected(text: str, images: list[Any], chat: bool = False) -> list[int]:
        inputs = processor(
            text=text, images=images or None, return_tensors="pt", add_special_tokens=not chat
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    def logprobs(text: str, images: list[Any]) -> list[float]:
        """The greedy tokens' log-probabilities under transformers."""
        return greedy_oracle(model, processor(text=text, images=images, return_tensors="pt"))[1]

    with demo_app(model_dir, 1024) as app, live_server(app) as (url, _):
        yield {
            "logprobs": logprobs,
            "url": url,
            "expected": expected,
            "processor": processor,
            # What stands for an image in the processor's text, and the image token.
            "image": QWEN_VL_IMAGE if qwen else GEMMA3_IMAGE if gemma else "<image>",
            "image_token": "<|image_pad|>"
            if qwen
            else "<image_soft_token>"
            if gemma
            else "<image>",
            # What a prompt may not type: what the processor expands.
            "typed": "<|image_pad|>" if qwen else GEMMA3_IMAGE if gemma else "<image>",
        }


def _images() -> list[Any]:
    return [random_image(h, w, seed) for h, w, seed in IMAGES]


def greedy_oracle(model: Any, inputs: Any) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens on processed `inputs`, and their log-probabilities."""
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(score[0].float(), -1)[token])
        for score, token in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


def _logprobs(url: str, inputs: str) -> list[float]:
    response = Client(url, timeout=60).generate(
        inputs, max_new_tokens=NEW_TOKENS, decoder_input_details=False
    )
    return [t.logprob for t in response.details.tokens]


def test_logprobs_equal_transformers(served: Any) -> None:
    """The served tokens' log-probabilities are transformers' (to float32 rounding): every
    row of the image counts as the model's attention has it (Gemma 3's both ways)."""
    image = random_image(40, 60, 1)
    got = _logprobs(served["url"], f"Hello ![]({data_url(image)}){TAIL}")
    want = served["logprobs"](f"Hello {served['image']}{TAIL}", [image])
    assert got == pytest.approx(want, abs=2e-4)


def _generate(url: str, inputs: str) -> list[int]:
    response = Client(url, timeout=60).generate(
        inputs, max_new_tokens=NEW_TOKENS, decoder_input_details=False
    )
    return [t.id for t in response.details.tokens]


def test_markdown_images_give_generates_tokens(served: Any) -> None:
    """One image, then two (the second a JPEG: its pixels are what count), through the
    text-generation client, each equal to generate() on the processor's inputs."""
    one, two = _images()
    url, expected = served["url"], served["expected"]
    image = served["image"]
    tokens = _generate(url, f"Hello ![a picture]({data_url(one)}){TAIL}")
    assert tokens == expected(f"Hello {image}{TAIL}", [one])
    from PIL import Image

    jpeg = Image.open(io.BytesIO(base64.b64decode(data_url(two, "JPEG").split(",")[1])))
    both = f"![]({data_url(one)}) and ![]({data_url(two, 'JPEG')}){TAIL}"
    assert _generate(url, both) == expected(
        f"{image} and {image}{TAIL}", [one, jpeg.convert("RGB")]
    )
    # The images change the answer: the oracle is not blind to them.
    assert expected(f"Hello {image}{TAIL}", [one]) != expected(f"Hello {image}{TAIL}", [two])


def test_openai_image_parts_and_text_requests_batched(served: Any) -> None:
    """Chat requests with images beside text-only completions, at once: each answer is its
    prompt's alone."""
    one, two = _images()
    url, expected, processor = served["url"], served["expected"], served["processor"]
    client = OpenAI(base_url=f"{url}/v1", api_key="none")

    def chat(image: Any) -> str:
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ]
        answer = client.chat.completions.create(
            model="tgis", messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        return str(answer.choices[0].message.content)

    def text(prompt: str) -> str:
        out = client.completions.create(
            model="tgis", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
        )
        return out.choices[0].text

    parts = [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )

    def oracle(image: Any) -> str:
        ids = expected(prompt, [image], chat=True)
        return str(processor.tokenizer.decode(ids, skip_special_tokens=True))

    alone_text = text("Hello world")
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, one), pool.submit(text, "Hello world"), pool.submit(chat, two)]
        got = [f.result() for f in futures]
    assert got[0] == oracle(one)
    assert got[2] == oracle(two)
    assert got[0] != got[2]
    assert got[1] == alone_text


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_repeated_image_comes_from_the_prefix_cache(served: Any) -> None:
    """The same image with the same text before it: its rows' blocks are found in the cache,
    the image is not encoded again, and the answer is the same."""
    url = served["url"]
    image = random_image(48, 48, 7)
    inputs = f"Look ![]({data_url(image)}){TAIL}{TAIL}"
    encoded, cached = _metric(url, "tgis_images_encoded"), _metric(url, "tgis_images_cached")
    first = _generate(url, inputs)
    assert _metric(url, "tgis_images_encoded") == encoded + 1
    assert _generate(url, inputs) == first
    assert _metric(url, "tgis_images_encoded") == encoded + 1
    assert _metric(url, "tgis_images_cached") == cached + 1
    # Another image at the same place shares no block with it.
    other = f"Look ![]({data_url(random_image(48, 48, 8))}){TAIL}{TAIL}"
    _generate(url, other)
    assert _metric(url, "tgis_images_encoded") == encoded + 2


def test_info_and_models_say_the_model_takes_images(served: Any) -> None:
    url = served["url"]
    assert httpx.get(f"{url}/info").json()["input_modalities"] == ["text", "image"]
    assert httpx.get(f"{url}/info").json()["model_pipeline_tag"] == "image-text-to-text"
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ("![](data:image/png;base64,aGVsbG8=)", "`inputs (image 1)` is not a PNG, JPEG"),
        ("![](https://example.com/a.png)", "--allow-image-urls"),
        ("![](data:text/plain;base64,aGVsbG8=)", "image/png, image/jpeg"),
    ],
)
def test_bad_images_are_422s_naming_them(served: Any, inputs: str, message: str) -> None:
    url = served["url"]
    response = httpx.post(
        f"{url}/generate", json={"inputs": inputs, "parameters": {"max_new_tokens": 2}}
    )
    assert response.status_code == 422
    assert message in response.json()["error"]
    # The server serves on.
    assert (
        httpx.post(
            f"{url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
        ).status_code
        == 200
    )


def test_a_placeholder_typed_in_the_text_is_refused(served: Any) -> None:
    url = served["url"]
    image = data_url(random_image(32, 32))
    response = httpx.post(
        f"{url}/generate",
        json={
            "inputs": f"{served['typed']} ![]({image})",
            "parameters": {"max_new_tokens": 2},
        },
    )
    assert response.status_code == 422
    assert "may not hold the image placeholder" in response.json()["error"]


def test_a_text_model_refuses_image_parts(client: Any) -> None:
    """A text-only model (the scripted engine's app): an image part is a 422 naming it."""
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
                    ],
                }
            ]
        },
    )
    assert response.status_code == 422
    assert (
        "messages[0].content[0].image_url.url` is an image, and this model takes none"
        in (response.json()["error"]["message"])
    )


def test_truncate_into_an_image_is_refused(served: Any) -> None:
    url = served["url"]
    image = data_url(random_image(32, 32))
    response = httpx.post(
        f"{url}/generate",
        json={
            "inputs": f"Hello ![]({image}){TAIL}",
            "parameters": {"max_new_tokens": 2, "truncate": 10},
        },
    )
    assert response.status_code == 422
    assert "would cut" in response.json()["error"]


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Llava-Next server started with one image per request, 64x64 pixels and 4 KB per
    image at most, and remote image URLs allowed."""
    model_dir = make_vision_dir(tmp_path_factory.mktemp("limited"), "llava_next")
    flags = {
        "max_images_per_request": 1,
        "max_image_pixels": 64 * 64,
        "max_image_bytes": 4096,
        "allow_image_urls": True,
    }
    with demo_app(model_dir, 1024, **flags) as app, live_server(app) as (url, _):
        yield url


def test_the_count_and_pixel_limit_flags_are_applied(limited: str) -> None:
    from PIL import Image

    def refusal(inputs: str) -> str:
        response = httpx.post(
            f"{limited}/generate", json={"inputs": inputs, "parameters": {"max_new_tokens": 2}}
        )
        assert response.status_code == 422
        return str(response.json()["error"])

    two = "".join(f"![]({data_url(Image.new('RGB', (32, 32), c))})" for c in ("red", "blue"))
    assert "at most 1 are allowed per request (the server's --max-images-per-request)" in (
        refusal(two)
    )
    wide = f"![]({data_url(Image.new('RGB', (65, 64), 'red'))})"  # a few hundred bytes
    assert (
        "is 65x64 = 4160 pixels; images may have at most 4096 pixels (the server's "
        "--max-image-pixels)" in refusal(wide)
    )


def test_the_byte_limit_flag_is_applied(limited: str) -> None:
    noise = data_url(random_image(60, 60, 3))  # ~11 KB of random pixels as PNG
    response = httpx.post(
        f"{limited}/generate",
        json={"inputs": f"![]({noise})", "parameters": {"max_new_tokens": 2}},
    )
    assert response.status_code == 422
    assert (
        "images may be at most 4096 bytes (the server's --max-image-bytes)"
        in (response.json()["error"])
    )
    small = data_url(random_image(8, 8, 3))
    response = httpx.post(
        f"{limited}/generate",
        json={"inputs": f"Hi ![]({small})", "parameters": {"max_new_tokens": 2}},
    )
    assert response.status_code == 200


def test_allowed_image_urls_are_fetched_from_public_addresses_only(limited: str) -> None:
    """With --allow-image-urls the server fetches, but not from its own loopback: a URL
    naming 127.0.0.1 is refused before any connection is made."""
    response = httpx.post(
        f"{limited}/generate",
        json={"inputs": "![](http://127.0.0.1:9/a.png)", "parameters": {"max_new_tokens": 2}},
    )
    assert response.status_code == 422
    error = response.json()["error"]
    assert "'127.0.0.1' resolves to 127.0.0.1, an address this server does not fetch" in error
    assert "--allow-image-urls" not in error


def test_tokenize_counts_the_image_tokens(served: Any) -> None:
    """/tokenize gives the processor's ids, image tokens included; each token spans its text
    in `inputs`, and the tokens the processor put in the image's place span its markdown."""
    url, processor = served["url"], served["processor"]
    image = random_image(40, 60, 1)
    markdown = f"![a picture]({data_url(image)})"
    inputs = f"Hello {markdown}{TAIL}"
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": inputs}).json()
    ids = processor(text=f"Hello {served['image']}{TAIL}", images=[image], return_tensors="pt")
    assert [t["id"] for t in tokens] == ids["input_ids"][0].tolist()
    at = inputs.index(markdown)  # ASCII: characters are bytes
    image_id = processor.tokenizer.convert_tokens_to_ids(served["image_token"])
    in_image = [t for t in tokens if t["start"] == at and t["stop"] == at + len(markdown)]
    assert sum(t["id"] == image_id for t in in_image) == sum(t["id"] == image_id for t in tokens)
    assert all(t["text"] == markdown for t in in_image)
    rest = [t for t in tokens if t not in in_image and t["stop"] > t["start"]]
    assert "".join(t["text"] for t in rest) == inputs.replace(markdown, "")
    assert all(inputs[t["start"] : t["stop"]] == t["text"] for t in tokens)
    # `truncate` keeps the last tokens, and may not cut into the image (or away).
    first = next(i for i, t in enumerate(tokens) if t["id"] == image_id)
    keep = len(tokens) - first

    def truncated(n: int) -> httpx.Response:
        return httpx.post(f"{url}/tokenize", json={"inputs": inputs, "parameters": {"truncate": n}})

    assert truncated(keep).json() == tokens[first:]
    assert truncated(keep - 1).status_code == 422
    assert "would cut" in truncated(5).json()["error"]


@pytest.mark.parametrize("arch", ["llava_next", "qwen2_vl", "gemma3"])
def test_prefill_chunks_that_split_an_image(
    arch: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks of 16 tokens: an image's rows (and, for Qwen2-VL, its grid positions)
    split over several steps give the same tokens as generate(); Gemma 3's image, whose rows
    attend to each other both ways, is computed in one chunk."""
    from dataclasses import replace

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tgis import launch

    limits = launch.scheduler_limits
    monkeypatch.setattr(
        launch,
        "scheduler_limits",
        lambda *args: replace(limits(*args), max_batch_prefill_tokens=16),
    )

    model_dir = make_vision_dir(tmp_path, arch)  # type: ignore[arg-type]
    qwen, gemma = arch.startswith("qwen"), arch == "gemma3"
    processor = qwen_vl_processor(model_dir) if qwen else AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    image = random_image(40, 60, 1)
    placeholder = QWEN_VL_IMAGE if qwen else GEMMA3_IMAGE if gemma else "<image>"
    image_id = processor.tokenizer.convert_tokens_to_ids(
        "<|image_pad|>" if qwen else "<image_soft_token>" if gemma else "<image>"
    )
    # Words before the image until its rows cross a chunk's end (position 16).
    for words in range(24):
        lead = "Hello" + " a" * words
        inputs = processor(text=f"{lead} {placeholder}{TAIL}", images=[image], return_tensors="pt")
        rows = (inputs["input_ids"][0] == image_id).nonzero().flatten().tolist()
        if rows[0] < 16 <= rows[-1]:
            break
    else:
        raise AssertionError("no prompt puts the image across a chunk's end")
    expected, want = greedy_oracle(model, inputs)
    assert inputs["input_ids"].shape[1] > 2 * 16
    with demo_app(model_dir, 1024) as app, live_server(app) as (url, _):
        served = f"{lead} ![]({data_url(image)}){TAIL}"
        assert _generate(url, served) == expected
        assert _logprobs(url, served) == pytest.approx(want, abs=2e-4)
