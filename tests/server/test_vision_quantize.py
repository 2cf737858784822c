"""--quantize on a vision-language model served by `tgis serve`'s app (tiny random Llava-Next,
Idefics3 and Qwen2-VL): the language model's projections are quantized as a text model's are,
and a prompt with images gives generate()'s greedy tokens by the dequantized reference (the
model whose language-model projections compute their quantized weight's arithmetic,
common/quant.py's `reference`, and whose lm_head does as the method says), batched with a
text-only prompt; the vision tower and projector keep their weights, in the serving dtype. A
pre-quantized vision-language checkpoint is refused at load, naming why."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from tests.backends.models.test_quantized import PROJECTIONS, _computing
from tests.factories import QWEN_VL_IMAGE, make_vision_dir, qwen_vl_processor, random_image
from tests.server.conftest import demo_app, live_server
from tests.server.test_vision_routes import TAIL, data_url
from tgis.backends.common.device import load_model
from tgis.backends.common.quant import Int4Linear, Int8Linear, Quantization
from tgis.errors import ConfigError
from tgis.vision.families import vision_family_of

NEW_TOKENS = 6
CASES = [
    pytest.param(("llava_next", Quantization("int8")), id="llava_next-int8"),
    pytest.param(("idefics3", Quantization("int8")), id="idefics3-int8"),
    pytest.param(("qwen2_vl", Quantization("int8")), id="qwen2_vl-int8"),
    # The tiny models' projections are 32 and 64 columns wide: groups of 32.
    pytest.param(("llava_next", Quantization("int4", 32)), id="llava_next-int4"),
    pytest.param(("qwen2_vl", Quantization("int4", 32)), id="qwen2_vl-int4"),
]


def dequantized_reference(model: PreTrainedModel, quantization: Quantization) -> PreTrainedModel:
    """A copy of the vision-language `model` whose language model's projections (and lm_head,
    as `quantization` says) compute their quantized weight's reference arithmetic; the vision
    tower and projector as they are (some of their modules share the projections' names)."""
    family = vision_family_of(model.config.to_dict())
    assert family is not None
    copied: Any = copy.deepcopy(model)
    dtype = next(model.parameters()).dtype
    language = getattr(copied.model, family.language_model)
    for name, module in language.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            canon = quantization.quantize(module.weight.detach())
            module.forward = _computing(canon, dtype, module.bias)  # type: ignore[method-assign]
    head = copied.get_output_embeddings()
    canon = quantization.head(head.weight.detach())
    if canon is not None:
        head.forward = _computing(canon, dtype, None)
    return copied.eval()


@pytest.fixture(scope="module", params=CASES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    arch, quantization = request.param
    model_dir = make_vision_dir(tmp_path_factory.mktemp(arch), arch)
    qwen = arch.startswith("qwen")
    processor = qwen_vl_processor(model_dir) if qwen else AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    reference = dequantized_reference(model, quantization)

    def expected(text: str, images: list[Any]) -> tuple[list[int], list[float]]:
        """The reference's greedy tokens, and at each the gap between its two likeliest."""
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = reference.generate(
                **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, output_scores=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        gaps = [
            float(score[0].float().log_softmax(-1).topk(2).values.diff().abs())
            for score in out.scores
        ]
        return out.sequences[0, inputs["input_ids"].shape[1] :].tolist(), gaps

    flags = {"quantize": quantization.method, "quantize_group_size": quantization.group_size}
    with demo_app(model_dir, 1024, **flags) as app, live_server(app) as (url, _):
        yield {
            "url": url,
            "backend": app.state.tgis.engine.backend,
            "model": model,
            "quantization": quantization,
            "expected": expected,
            "image": QWEN_VL_IMAGE if qwen else "<image>",
        }


def _generate(url: str, inputs: str) -> list[int]:
    response = httpx.post(
        f"{url}/generate",
        json={"inputs": inputs, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_image_prompts_give_the_dequantized_references_tokens(served: dict[str, Any]) -> None:
    """Two image prompts and a text-only one, one at a time: each is the reference's
    generate(); then at once, in one batch."""
    url, expected, image = served["url"], served["expected"], served["image"]
    one, two = random_image(40, 60, 1), random_image(64, 30, 2)
    prompts = [
        (f"Hello ![]({data_url(one)}){TAIL}", f"Hello {image}{TAIL}", [one]),
        (f"Hello world.{TAIL}", f"Hello world.{TAIL}", []),
        (f"![]({data_url(one)}) and ![]({data_url(two)}){TAIL}", f"{image} and {image}{TAIL}",
         [one, two]),
    ]  # fmt: skip
    wanted = [expected(text, images) for _, text, images in prompts]
    assert [_generate(url, p[0]) for p in prompts] == [tokens for tokens, _ in wanted]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _generate(url, p[0]), prompts))
    for tokens, (reference, gaps) in zip(got, wanted, strict=True):
        # Equal, up to a near-tie that a batch may break the other way: int8's kernel runs
        # steps of few rows, and a step of more rows multiplies the dequantized weight
        # (common/quant.py, INT8_KERNEL_ROWS), which rounds otherwise; the tokens before it
        # agree.
        differ = next(
            (i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), None
        )
        if differ is None:
            assert tokens == reference
        else:
            assert gaps[differ] < 0.05, (tokens, reference, gaps)
    assert wanted[0][0] != wanted[2][0]  # the images count


def test_the_language_model_is_quantized_and_the_vision_tower_untouched(
    served: dict[str, Any],
) -> None:
    backend, model = served["backend"], served["model"]
    quantization: Quantization = served["quantization"]
    assert backend.runtime()["quantization"] == quantization.method
    layer = backend.path.layers[0]
    kernel = Int4Linear if quantization.method == "int4" else Int8Linear
    assert isinstance(layer.qkv_w, kernel) and isinstance(layer.o_w, kernel)
    assert isinstance(
        backend.path.lm_head, Int8Linear if quantization.method == "int4" else torch.Tensor
    )
    encoder = backend.vision
    language = getattr(encoder.inner, encoder.family.language_model)
    assert language.layers[0].self_attn.q_proj.weight.is_meta  # the float weights are released
    served_parts = dict(encoder.inner.named_parameters())
    original = dict(model.model.named_parameters())
    tower = [name for name in original if not name.startswith(f"{encoder.family.language_model}.")]
    assert tower and set(encoder.parts()) == {name.split(".", 1)[0] for name in tower} - {
        "image_newline"
    }
    for name in tower:
        weight = served_parts[name]
        assert weight.dtype == torch.float32 and not weight.is_meta, name
        assert torch.equal(weight, original[name]), name


def test_a_pre_quantized_vision_checkpoint_is_refused_at_load(tmp_path: Path) -> None:
    model_dir = make_vision_dir(tmp_path, "llava_next")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        load_model(model_dir, torch.device("cpu"), "float32")
    message = str(info.value)
    assert message.startswith(
        "config.json's quantization_config (gptq): tgis reads pre-quantized checkpoints of text "
        "models; llava_next is a vision-language model"
    )
    assert "serve llava_next's float checkpoint, with --quantize int8 or int4" in message
