"""Tiny random causal LMs of every architecture the torch backend supports, built once.

Shapes: hidden 64, 2 layers, vocab 256, float32. Models are built once per session and never
changed: `make_backend` gives the backend a copy (backends re-point weights at fused tensors
and hook lm_head), so the shared model stays the untouched reference for `generate`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from tests.factories import tiny_model
from tgis.backends.fallback.backend import TorchDynamicBackend

VOCAB = 256
HIDDEN = 64
_ROPE = {"hidden_size": HIDDEN, "vocab_size": VOCAB}
# name -> (factory architecture, overrides)
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("llama", {**_ROPE, "intermediate_size": 128}),
    "mistral": ("mistral", {**_ROPE, "intermediate_size": 128}),
    "qwen2": ("qwen2", {**_ROPE, "intermediate_size": 128}),
    "gpt2": ("gpt2", {"n_embd": HIDDEN, "vocab_size": VOCAB}),
    "gpt_neox": ("gpt_neox", _ROPE),
    "bloom": ("bloom", _ROPE),
    "falcon": ("falcon", _ROPE),
    "falcon_new": ("falcon", {**_ROPE, "new_decoder_architecture": True, "num_kv_heads": 2}),
    "falcon_alibi": ("falcon", {**_ROPE, "alibi": True}),
}
ALL_VARIANTS = tuple(VARIANTS)
# Prompts of different lengths; token ids avoid the special ids 0..3.
PROMPTS = ((5, 17, 42, 99, 7, 63, 120), (200, 11), (9, 8, 7, 6, 5, 4, 30, 31, 32, 33, 34, 35, 36))


@pytest.fixture(scope="session")
def tiny_lm() -> Callable[..., PreTrainedModel]:
    """`tiny_lm(name, **overrides)`: a float32 random model of VARIANTS[name], built once per
    distinct (name, overrides) in the session."""
    built: dict[tuple[str, str], PreTrainedModel] = {}

    def get(name: str, **overrides: object) -> PreTrainedModel:
        key = (name, repr(sorted(overrides.items())))
        if key not in built:
            arch, fields = VARIANTS[name]
            built[key] = tiny_model(arch, seed=0, **{**fields, **overrides})  # type: ignore[arg-type]
        return built[key]

    return get


def make_backend(
    model: PreTrainedModel,
    max_sequences: int = 16,
    max_sequence_tokens: int = 64,
    **kwargs: object,
) -> TorchDynamicBackend:
    """A backend over a copy of `model` with an explicit KV budget (no memory probing)."""
    return TorchDynamicBackend(
        copy.deepcopy(model),
        max_sequences=max_sequences,
        max_sequence_tokens=max_sequence_tokens,
        kv_tokens=max_sequences * max_sequence_tokens,
        **kwargs,  # type: ignore[arg-type]
    )


def greedy_reference(model: PreTrainedModel, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    """What `model.generate(do_sample=False)` produces after `prompt` (no EOS stop)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=3,
        )
    return out[0, len(prompt) :].tolist()
