"""The bundled demo model is a real model with a real tokenizer, small enough to ship."""

from __future__ import annotations

import json
import keyword
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MAX_BUNDLE_BYTES = 25 * 1024 * 1024


@pytest.fixture(scope="module")
def model_and_tokenizer(demo_model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(demo_model_dir)


def test_bundle_is_safetensors_and_small(demo_model_dir: Path) -> None:
    names = {p.name for p in demo_model_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
        "README.md",
    } <= names
    assert not any(n.endswith(".bin") for n in names)
    assert sum(p.stat().st_size for p in demo_model_dir.iterdir()) <= MAX_BUNDLE_BYTES


def test_architecture_is_a_small_llama(demo_model_dir: Path, model_and_tokenizer) -> None:
    model, _ = model_and_tokenizer
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA, like current LLMs
    assert 2_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000


def test_tokenizer_round_trips_python_source(model_and_tokenizer) -> None:
    _, tokenizer = model_and_tokenizer
    source = Path(json.__file__).read_text()[:4000]
    ids = tokenizer(source)["input_ids"]
    assert tokenizer.decode(ids) == source
    assert len(ids) < len(source) / 2.5  # BPE merges learned from Python code
    assert tokenizer.decode([tokenizer.eos_token_id]) == "<|endoftext|>"


def test_chat_template_is_chatml(model_and_tokenizer) -> None:
    _, tokenizer = model_and_tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_fibonacci_reads_like_python(demo_model_dir: Path, model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=48, do_sample=False)
    completion = tokenizer.decode(out[0], skip_special_tokens=True)
    body = completion[len("def fibonacci(n):") :]
    assert re.match(r"\n( {4}|\t)\S", body), body  # an indented block follows the def
    words = set(re.findall(r"[A-Za-z_]+", body))
    assert words & set(keyword.kwlist), body  # Python keywords, not noise
    # The model card's sample is what the shipped weights produce.
    assert (
        completion == json.loads((demo_model_dir / "training.json").read_text())["greedy_fibonacci"]
    )
