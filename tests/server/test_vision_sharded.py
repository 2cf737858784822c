"""A vision-language model over two tensor-parallel shards (gloo, on the CPU): its language
model's slices read from the checkpoint's own names, the first shard's vision tower encoding
the images, whose features reach the other shard with each step; the served tokens and
log-probabilities are transformers' on the same processed inputs (Qwen2-VL's grid positions
and Gemma 3's two-way image rows included), beside a text-only request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from text_generation import Client

from tests.backends.paged.test_tensor_parallel import free_port
from tests.factories import (
    GEMMA3_IMAGE,
    QWEN_VL_IMAGE,
    VisionArch,
    make_vision_dir,
    qwen_vl_processor,
    random_image,
)
from tests.server.conftest import demo_app, live_server
from tests.server.test_vision_routes import NEW_TOKENS, TAIL, data_url, greedy_oracle
from tgis.backends.paged.tensor_parallel import TensorParallelBackend

PLACEHOLDERS = {"llava_next": "<image>", "qwen2_vl": QWEN_VL_IMAGE, "gemma3": GEMMA3_IMAGE}


@pytest.mark.parametrize("arch", list(PLACEHOLDERS))
def test_two_shards_serve_images_as_transformers_does(arch: VisionArch, tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = make_vision_dir(tmp_path, arch)
    processor = (
        qwen_vl_processor(model_dir)
        if arch == "qwen2_vl"
        else AutoProcessor.from_pretrained(model_dir)
    )
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    image = random_image(40, 60, 1)
    inputs = processor(
        text=f"Hello {PLACEHOLDERS[arch]}{TAIL}", images=[image], return_tensors="pt"
    )
    expected, logprobs = greedy_oracle(model, inputs)
    text_only = processor.tokenizer("Hello world", return_tensors="pt")
    with torch.no_grad():
        plain = model.generate(**text_only, max_new_tokens=NEW_TOKENS, do_sample=False)
    plain_expected = plain[0, text_only["input_ids"].shape[1] :].tolist()

    flags: dict[str, Any] = {"num_shard": 2, "master_port": free_port()}
    with demo_app(model_dir, 1024, **flags) as app, live_server(app) as (url, _):
        backend = app.state.tgis.engine.backend
        assert isinstance(backend, TensorParallelBackend)
        assert backend.settings.world == 2
        client = Client(url, timeout=120)
        served = client.generate(f"Hello ![]({data_url(image)}){TAIL}", max_new_tokens=NEW_TOKENS)
        assert served.details is not None
        assert [t.id for t in served.details.tokens] == expected
        assert [t.logprob for t in served.details.tokens] == pytest.approx(logprobs, abs=2e-4)
        text = client.generate("Hello world", max_new_tokens=NEW_TOKENS)
        assert text.details is not None
        assert [t.id for t in text.details.tokens] == plain_expected
