"""LoRA adapters on a vision-language model served by `tgis serve`'s app (tiny random
Llava-Next, Idefics3 and Qwen2-VL, each adapter made with PEFT on the whole
AutoModelForImageTextToText): a request naming an adapter (TGI's `adapter_id`, OpenAI's
`model`) with an image gives the greedy tokens of generate() by the model with that adapter
merged, on the processor's inputs, while base-model requests in the same steps give the base
model's; an adapter that adapts the vision tower is refused naming the module, at request time
(a 422) and at start-up (--lora-adapters)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI

from tests.factories import (
    QWEN_VL_IMAGE,
    make_lora_adapter,
    make_vision_dir,
    qwen_vl_processor,
    random_image,
)
from tests.server.conftest import demo_app, live_server
from tests.server.test_vision_routes import TAIL, data_url
from tgis.errors import ConfigError

NEW_TOKENS = 6
NAMED, ON_DEMAND, VISION = "named", "team/on-demand", "vision"
# The language model's projections, wherever the family keeps its language model.
LANGUAGE = r".*\.(language_model|text_model)\.layers\.\d+\.(self_attn|mlp)\.({})"
ALL = "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
# The vision towers' attention projections (CLIP's and SigLIP's q_proj, Qwen2-VL's qkv).
TOWER = r".*\.(vision_tower|vision_model|visual)\..*\.(q_proj|qkv)"


@pytest.fixture(scope="module", params=["llava_next", "idefics3", "qwen2_vl"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """A server of the model with one adapter named at start-up and an adapter directory
    (one language-model adapter, one that adapts the vision tower too), and the oracles."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    arch = request.param
    root = tmp_path_factory.mktemp(f"lora-{arch}")
    model_dir = make_vision_dir(root / "model", arch)
    qwen = arch.startswith("qwen")
    processor = qwen_vl_processor(model_dir) if qwen else AutoProcessor.from_pretrained(model_dir)
    base = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    models = {
        None: base,
        NAMED: make_lora_adapter(base, root / "named", 3, target_modules=LANGUAGE.format(ALL)),
        ON_DEMAND: make_lora_adapter(
            base, root / "dir" / ON_DEMAND, 4, r=2, lora_alpha=16,
            target_modules=LANGUAGE.format("q_proj|v_proj|down_proj"),
        ),
    }  # fmt: skip
    make_lora_adapter(
        base, root / "dir" / VISION, 5, target_modules=f"{TOWER}|{LANGUAGE.format(ALL)}"
    )

    def expected(
        adapter: str | None, text: str, images: list[Any], chat: bool = False
    ) -> list[int]:
        inputs = processor(
            text=text, images=images or None, return_tensors="pt", add_special_tokens=not chat
        )
        with torch.no_grad():
            out = models[adapter].generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    flags = {
        "lora_adapters": f"{NAMED}={root / 'named'}",
        "lora_adapter_dir": str(root / "dir"),
    }
    with demo_app(model_dir, 1024, **flags) as app, live_server(app) as (url, _):
        yield {
            "arch": arch,
            "url": url,
            "root": root,
            "model_dir": model_dir,
            "expected": expected,
            "processor": processor,
            "image": QWEN_VL_IMAGE if qwen else "<image>",
        }


def _generate(url: str, inputs: str, adapter: str | None) -> list[int]:
    parameters: dict[str, Any] = {"max_new_tokens": NEW_TOKENS, "details": True}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    response = httpx.post(
        f"{url}/generate", json={"inputs": inputs, "parameters": parameters}, timeout=60
    )
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_adapters_on_image_prompts_give_the_merged_models_tokens_batched_with_the_base(
    served: dict[str, Any],
) -> None:
    """Each adapter, and the base model, on two images at once: every answer is generate()'s
    of its own model."""
    url, expected, image = served["url"], served["expected"], served["image"]
    pictures = [random_image(40, 60, 1), random_image(64, 30, 2)]
    runs = [
        (adapter, picture)
        for adapter in (NAMED, None, ON_DEMAND, None)
        for picture in pictures[: 2 if adapter is None else 1]
    ]
    wanted = [expected(adapter, f"Hello {image}{TAIL}", [picture]) for adapter, picture in runs]
    # Each adapter changes the answer: the oracle tells them apart.
    assert len({tuple(w) for w in wanted}) == 4
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = [
            pool.submit(_generate, url, f"Hello ![]({data_url(picture)}){TAIL}", adapter)
            for adapter, picture in runs
        ]
        got = [f.result() for f in futures]
    assert got == wanted


def test_openai_model_names_the_adapter_of_an_image_chat(served: dict[str, Any]) -> None:
    url, expected, processor = served["url"], served["expected"], served["processor"]
    picture = random_image(48, 48, 3)
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(picture)}},
                {"type": "text", "text": "Describe it."},
            ],
        }
    ]
    parts = [{"type": "image"}, {"type": "text", "text": "Describe it."}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True
    )
    for adapter in (ON_DEMAND, NAMED):
        answer = client.chat.completions.create(
            model=adapter, messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        ids = expected(adapter, prompt, [picture], chat=True)
        assert answer.choices[0].message.content == processor.tokenizer.decode(
            ids, skip_special_tokens=True
        )
        assert answer.model == adapter


def test_an_adapter_of_the_vision_tower_is_refused_naming_the_module(
    served: dict[str, Any],
) -> None:
    url = served["url"]
    response = httpx.post(
        f"{url}/generate",
        json={"inputs": "Hello", "parameters": {"max_new_tokens": 2, "adapter_id": VISION}},
    )
    assert response.status_code == 422
    error = response.json()["error"]
    tower = {"llava_next": "model.vision_tower", "idefics3": "model.vision_model"}
    part = tower.get(served["arch"], "model.visual")
    assert f"adapter_id '{VISION}': adapter_model.safetensors holds 'base_model.model.{part}." in (
        error
    )
    assert f"which is in {served['arch']}'s vision tower or projector ({part}): only the " in error
    assert "language model's projections (q_proj, k_proj, v_proj, o_proj, gate_proj" in error
    # The server serves on, with and without adapters.
    assert _generate(url, "Hello", ON_DEMAND)
    assert _generate(url, "Hello", None)


def test_a_vision_adapter_named_at_start_up_is_refused(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    model_dir = make_vision_dir(tmp_path / "model", "llava_next")
    base = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    make_lora_adapter(base, tmp_path / "tower", 6, target_modules=["q_proj"])
    with (
        pytest.raises(ConfigError) as info,
        demo_app(model_dir, 1024, lora_adapters=f"tower={tmp_path / 'tower'}"),
    ):
        pass
    message = str(info.value)
    assert message.startswith(f"--lora-adapters tower={tmp_path / 'tower'}: ")
    assert "LoRA on model.vision_tower.vision_model.encoder.layers." in message
    assert "only the language model's projections" in message
    assert "train the adapter with target_modules that match modules under " in message
