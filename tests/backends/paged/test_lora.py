"""LoRA adapters in the paged forward (tgis.backends.paged.lora): a packed step mixing adapters and
the base model gives each row the logits of the model with its adapter merged into the
weights; the adapter's scale follows PEFT (lora_alpha, rslora, rank and alpha patterns, some
layers only); greedy decoding through the scheduler matches the merged model's generate."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.paged_driver import greedy
from tests.factories import make_lora_adapter, tiny_model
from tgis.adapter_store import AdapterStore, LoraShapes
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine.backend import PackedItem
from tgis.engine.types import LoraAdapter

PROMPTS = [[5, 9, 14, 3, 27, 8], [11, 4, 4, 19], [30, 2, 7, 7, 12, 40, 6]]


def store(base: PreTrainedModel, adapters: dict[str, Path], max_rank: int = 16) -> AdapterStore:
    return AdapterStore(
        LoraShapes.of(base.config), named=adapters, dtype=torch.float32,
        device=torch.device("cpu"), max_loras=4, max_rank=max_rank,
    )  # fmt: skip


def paged(model: PreTrainedModel) -> PagedTorchBackend:
    return PagedTorchBackend(
        model, max_sequences=8, max_sequence_tokens=64, max_prefill_tokens=64, kv_tokens=256,
        block_size=4,
    )  # fmt: skip


def prompt_logits(
    backend: PagedTorchBackend, adapters: list[LoraAdapter | None]
) -> list[torch.Tensor]:
    """Logits at every prompt position of one packed step, PROMPTS[i] under adapters[i]."""
    items, next_block = [], 0
    for seq_id, (prompt, adapter) in enumerate(zip(PROMPTS, adapters, strict=True)):
        blocks = tuple(range(next_block, next_block + 2))
        next_block += 2
        items.append(PackedItem(seq_id, tuple(prompt), 0, blocks, True, True, adapter=adapter))
    out = backend.forward(items).prompt
    return [t for t in out if t is not None]


def reference(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.fixture(scope="module")
def base() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def adapters(
    base: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, PreTrainedModel]]:
    root = tmp_path_factory.mktemp("adapters")
    made: dict[str, tuple[Path, PreTrainedModel]] = {}
    for name, seed, config in (
        ("all", 1, {}),
        ("attn-r8", 2, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
        ("rslora", 3, {"use_rslora": True, "lora_alpha": 4}),
        ("patterns", 4, {"rank_pattern": {"down_proj": 2}, "alpha_pattern": {"up_proj": 32},
                         "layers_to_transform": [1]}),
    ):  # fmt: skip
        path = root / name
        made[name] = (path, make_lora_adapter(base, path, seed, binary=name == "rslora", **config))
    return made


def test_a_mixed_step_gives_each_row_its_merged_model(
    base: PreTrainedModel, adapters: dict[str, tuple[Path, PreTrainedModel]]
) -> None:
    served = store(base, {name: path for name, (path, _) in adapters.items()})
    backend = paged(copy.deepcopy(base))
    assert backend.capacity.lora
    for pair in (("all", "attn-r8"), ("rslora", "patterns")):
        chosen = [served.get(pair[0]), None, served.get(pair[1])]
        got = prompt_logits(backend, chosen)
        models = [adapters[pair[0]][1], base, adapters[pair[1]][1]]
        for logits, model, prompt in zip(got, models, PROMPTS, strict=True):
            torch.testing.assert_close(logits, reference(model, prompt), atol=2e-4, rtol=1e-4)
    # One adapter on every row takes the whole-step path.
    whole = prompt_logits(backend, [served.get("all")] * 3)
    for logits, prompt in zip(whole, PROMPTS, strict=True):
        torch.testing.assert_close(
            logits, reference(adapters["all"][1], prompt), atol=2e-4, rtol=1e-4
        )
    # The adapter changes the output: the test would see an adapter left out.
    assert not torch.allclose(whole[0], reference(base, PROMPTS[0]), atol=1e-2)


def test_fused_gate_up_takes_the_stacked_update_in_one_piece(
    base: PreTrainedModel,
    adapters: dict[str, tuple[Path, PreTrainedModel]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # cuda fuses gate and up into one matmul; the cpu runs them apart (FUSE_GATE_UP).
    from tgis.backends.models import decoder

    monkeypatch.setitem(decoder.FUSE_GATE_UP, "cpu", True)
    served = store(base, {name: path for name, (path, _) in adapters.items()})
    backend = paged(copy.deepcopy(base))
    assert backend.path.fuse_gate_up
    got = prompt_logits(backend, [served.get("patterns"), served.get("all"), None])
    models = [adapters["patterns"][1], adapters["all"][1], base]
    for logits, model, prompt in zip(got, models, PROMPTS, strict=True):
        torch.testing.assert_close(logits, reference(model, prompt), atol=2e-4, rtol=1e-4)


def test_greedy_decoding_with_adapters_matches_merged_generate(
    base: PreTrainedModel, adapters: dict[str, tuple[Path, PreTrainedModel]]
) -> None:
    served = store(base, {name: path for name, (path, _) in adapters.items()})
    backend = paged(copy.deepcopy(base))
    names: list[str | None] = ["all", None, "attn-r8"]
    chosen = [served.get(n) if n else None for n in names]
    got = greedy(backend, PROMPTS, 8, adapters=chosen)
    for tokens, name, prompt in zip(got, names, PROMPTS, strict=True):
        model = adapters[name][1] if name else base
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
            )
        assert tokens == out[0, len(prompt) :].tolist()


def test_adapter_factors_are_scaled_once(base: PreTrainedModel, tmp_path: Path) -> None:
    make_lora_adapter(base, tmp_path / "a", r=2, lora_alpha=6, target_modules=["o_proj"])
    adapter = store(base, {"a": tmp_path / "a"}).get("a")
    assert adapter.rank == 2 and adapter.name == "a"
    a, b = adapter.layers[0]["o_proj"]
    hidden = base.config.hidden_size
    assert a.shape == (hidden, 2) and b.shape == (2, hidden)
    layers = base.config.num_hidden_layers
    assert all(set(layer) == {"o_proj"} for layer in adapter.layers)
    assert adapter.nbytes == layers * (hidden * 2 + 2 * hidden) * 4  # float32 a and b
