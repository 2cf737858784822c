"""Requests with LoRA adapters in the engine: a batch mixing adapters and the base model gives
each request the greedy tokens of the model with its adapter merged, alone, together and
after one another (prefix-cache blocks are never shared across adapters); a backend without
adapters refuses the request and keeps serving."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from tests.engine.test_engine import PROMPTS, collect, request, run, tokenizer
from tests.engine.test_poison_batch import make_engine, paged_backend, slot_backend
from tests.engine.test_speculation import EDIT, outputs
from tests.factories import make_lora_adapter
from tgis.adapter_store import AdapterStore, LoraShapes
from tgis.backends.common.device import load_causal_lm
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine.types import GenerationRequest
from tgis.errors import InputValidationError

__all__ = ["tokenizer"]
NAMES = ("all", "attn")


@pytest.fixture(scope="module")
def merged(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[AdapterStore, dict[str | None, PreTrainedModel]]]:
    base = load_causal_lm(demo_model_dir, torch.device("cpu"), "float32")
    root = tmp_path_factory.mktemp("lora")
    models: dict[str | None, PreTrainedModel] = {None: copy.deepcopy(base)}
    models["all"] = make_lora_adapter(base, root / "all", 1, r=8, lora_alpha=32)
    models["attn"] = make_lora_adapter(
        base, root / "attn", 2, r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "o_proj"]
    )
    store = AdapterStore(
        LoraShapes.of(base.config), named={n: root / n for n in NAMES}, dtype=torch.float32,
        device=torch.device("cpu"), max_loras=4, max_rank=8,
    )  # fmt: skip
    yield store, models


def requests(tokenizer: Any, store: AdapterStore) -> list[tuple[str | None, GenerationRequest]]:
    chosen: list[str | None] = [None, "all", "attn", "all", None, "attn"]
    # The same long prompt (several KV blocks) under the base model and two adapters.
    prompts = [EDIT, EDIT, EDIT, PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    made = []
    for i, (name, prompt) in enumerate(zip(chosen, prompts, strict=True)):
        r = request(tokenizer, prompt, f"l{i}", max_new_tokens=10, ignore_eos=True)
        made.append((name, replace(r, adapter=store.get(name) if name else None)))
    return made


def expected(
    models: dict[str | None, PreTrainedModel], demo_model_dir: Path, tokenizer: Any,
    reqs: list[tuple[str | None, GenerationRequest]],
) -> list[list[int]]:  # fmt: skip
    got = []
    for name, req in reqs:
        backend = PagedTorchBackend(
            copy.deepcopy(models[name]), max_sequences=4, max_sequence_tokens=256,
            max_prefill_tokens=512, kv_tokens=1024,
        )  # fmt: skip
        engine = make_engine(backend, demo_model_dir, tokenizer)
        try:
            got.append(outputs(engine, [replace(req, adapter=None)])[0])
        finally:
            engine.stop()
    return got


def test_mixed_adapters_give_each_request_its_merged_model(
    merged: tuple[AdapterStore, dict[str | None, PreTrainedModel]],
    demo_model_dir: Path,
    tokenizer: Any,
) -> None:
    store, models = merged
    reqs = requests(tokenizer, store)
    want = expected(models, demo_model_dir, tokenizer, reqs)
    # The adapters change the greedy tokens (else this test could not fail).
    assert len({tuple(w) for w in want[:3]}) == 3
    engine = make_engine(
        paged_backend(demo_model_dir), demo_model_dir, tokenizer, prefix_caching=True
    )
    try:
        assert outputs(engine, [r for _, r in reqs]) == want
        # One after another, the same prompt under each adapter: with prefix caching on, a
        # shared block would hand one adapter's K/V to another.
        assert [outputs(engine, [r])[0] for _, r in reqs] == want
    finally:
        engine.stop()


def test_a_backend_without_adapters_refuses_the_request(
    merged: tuple[AdapterStore, dict[str | None, PreTrainedModel]],
    demo_model_dir: Path,
    tokenizer: Any,
) -> None:
    store, _ = merged
    engine = make_engine(slot_backend(demo_model_dir), demo_model_dir, tokenizer)
    try:
        (_, adapted), plain = requests(tokenizer, store)[1], request(tokenizer, PROMPTS[0])
        with pytest.raises(InputValidationError, match=r"LoRA adapters .* not available on the"):
            run(collect(engine.generate(adapted)))
        assert len(run(collect(engine.generate(plain)))) == 12
    finally:
        engine.stop()
