"""tgis.adapter_store: PEFT LoRA adapters are read as tensors only, checked against the model
(shapes, layers, rank) and refused by name where they cannot be served; the on-demand directory
keeps ids inside it; at most max_loras adapters stay cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from tests.factories import make_lora_adapter, make_vision_dir, tiny_model
from tgis.adapter_store import AdapterStore, LoraShapes, VisionNames
from tgis.errors import InputValidationError


@pytest.fixture(scope="module")
def base() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def adapter(base: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora") / "good"
    make_lora_adapter(base, path, r=4, target_modules=["q_proj", "down_proj"])
    return path


def store(base: PreTrainedModel, directory: Path | None = None, **named: Path) -> AdapterStore:
    return AdapterStore(
        LoraShapes.of(base.config), named=named, directory=directory, dtype=torch.float32,
        device=torch.device("cpu"), max_loras=2, max_rank=8,
    )  # fmt: skip


def copy_of(
    adapter: Path, to: Path, config: dict | None = None, weights: dict | None = None
) -> Path:
    """A copy of `adapter` with config fields and weights replaced."""
    to.mkdir(parents=True)
    settings = json.loads((adapter / "adapter_config.json").read_text())
    (to / "adapter_config.json").write_text(json.dumps({**settings, **(config or {})}))
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({**tensors, **(weights or {})}, to / "adapter_model.safetensors")
    return to


def refusal(base: PreTrainedModel, path: Path) -> str:
    with pytest.raises(InputValidationError) as info:
        store(base, x=path).get("x")
    return str(info.value)


def test_a_peft_adapter_loads_on_the_model(base: PreTrainedModel, adapter: Path) -> None:
    loaded = store(base, good=adapter).get("good")
    assert loaded.rank == 4 and loaded.key.startswith(b"lora:good:")
    assert all(set(layer) == {"q_proj", "down_proj"} for layer in loaded.layers)
    # Same weights, same key; the key is what keeps prefix-cache blocks apart.
    assert store(base, good=adapter).get("good").key == loaded.key


def test_unservable_adapters_are_refused_by_name(
    base: PreTrainedModel, adapter: Path, tmp_path: Path
) -> None:
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "dora": ({"use_dora": True}, None, "DoRA adapters are not served"),
        "saved": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        "bias": ({"bias": "all"}, None, "bias 'all': adapters with biases are not served"),
        "kind": ({"peft_type": "IA3"}, None, "the PEFT adapter is 'IA3'; a LoRA adapter is a "
                 "LORA adapter"),
        "head": (None, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)},
                 "holds 'base_model.model.lm_head.lora_A.weight': only LoRA on the projections"),
        "shape": (None, {key: torch.zeros(4, 7)}, "layer 0 q_proj: lora_A is (4, 7)"),
        "rank": (None, {key: torch.zeros(9, base.config.hidden_size)},
                 "lora_A is (9, "),
        "nan": (None, {key: torch.full((4, base.config.hidden_size), float("nan"))},
                "layer 0 q_proj has values that are not finite numbers"),
        "layer": (None, {key.replace("layers.0", "layers.9"): torch.zeros(4, 2)},
                  "is for layer 9; the model has"),
    }  # fmt: skip
    for name, (config, weights, reason) in cases.items():
        assert reason in refusal(base, copy_of(adapter, tmp_path / name, config, weights)), name
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    assert "has neither adapter_model.safetensors nor adapter_model.bin" in refusal(base, missing)


def test_rank_above_the_limit_is_refused(base: PreTrainedModel, tmp_path: Path) -> None:
    make_lora_adapter(base, tmp_path / "big", r=16, target_modules=["v_proj"])
    assert "has rank 16; this server serves ranks up to 8 (--max-lora-rank)" in refusal(
        base, tmp_path / "big"
    )


def test_the_directory_serves_names_inside_it(
    base: PreTrainedModel, adapter: Path, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    copy_of(adapter, root / "team" / "a")
    copy_of(adapter, root / "b")
    (tmp_path / "outside").symlink_to(adapter)
    (root / "link").symlink_to(tmp_path / "outside")
    served = store(base, root, named=adapter)
    assert served.names() == ["named", "b", "team/a"]
    assert served.get("team/a").name == "team/a"
    for bad, reason in (
        ("../outside", "an adapter id is letters"),
        ("link", "the id resolves outside the adapter directory"),
        ("c", "no adapter 'c' in the adapter directory"),
    ):
        with pytest.raises(InputValidationError, match=reason):
            served.get(bad)
    without = store(base, None, named=adapter)
    with pytest.raises(InputValidationError, match="no such adapter; this server has: named"):
        without.get("b")


def test_at_most_max_loras_stay_cached(
    base: PreTrainedModel, adapter: Path, tmp_path: Path
) -> None:
    root = tmp_path / "adapters"
    for name in ("a", "b", "c"):
        copy_of(adapter, root / name)
    served = store(base, root)
    first = served.get("a")
    served.get("b")
    served.get("a")  # a is now the most recently used
    served.get("c")
    assert served.cached() == ["a", "c"]
    assert served.get("a") is first
    assert served.get("b") is not None and served.cached() == ["a", "b"]  # c went first


# --- a vision-language model's adapters ----------------------------------------------------

LLAVA = VisionNames("llava_next", "language_model", ("vision_tower", "multi_modal_projector"))


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[PreTrainedModel, Path]:
    """A tiny Llava-Next and an adapter PEFT made on it for its language model's q_proj and
    down_proj, with alpha_pattern naming one of them by its path in the model."""
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("llava-lora")
    model = AutoModelForImageTextToText.from_pretrained(make_vision_dir(root / "model")).eval()
    make_lora_adapter(
        model, root / "adapter", 3, r=4,
        target_modules=r".*language_model\.layers\.\d+\.(self_attn\.q_proj|mlp\.down_proj)",
        alpha_pattern={"language_model.layers.1.self_attn.q_proj": 32},
    )  # fmt: skip
    return model, root / "adapter"


def vision_store(model: PreTrainedModel, **named: Path) -> AdapterStore:
    return AdapterStore(
        LoraShapes.of(model.config.get_text_config()), named=named, dtype=torch.float32,
        device=torch.device("cpu"), max_loras=2, max_rank=8, vision=LLAVA,
    )  # fmt: skip


def renamed(adapter: Path, to: Path, old: str, new: str, config: dict) -> Path:
    """A copy of `adapter` whose weight names have `old` replaced by `new`, its config's
    fields replaced by `config`."""
    tensors = load_file(adapter / "adapter_model.safetensors")
    copy_of(adapter, to, config)
    save_file(
        {k.replace(old, new): v for k, v in tensors.items()}, to / "adapter_model.safetensors"
    )
    return to


def test_a_vision_models_adapter_adapts_its_language_model(
    llava: tuple[PreTrainedModel, Path], tmp_path: Path
) -> None:
    """transformers' names (model.language_model), Llava-Next's before 4.52
    (language_model.model) and the text model's (model.layers) load the same factors, with
    alpha_pattern matched on the module's path as PEFT matches it."""
    model, adapter = llava
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in (
        tensors
    )
    layout = "base_model.model.model.language_model."
    legacy = renamed(
        adapter, tmp_path / "legacy", layout, "base_model.model.language_model.model.",
        {"alpha_pattern": {"language_model.model.layers.1.self_attn.q_proj": 32}},
    )  # fmt: skip
    text = renamed(
        adapter, tmp_path / "text", layout, "base_model.model.model.",
        {"alpha_pattern": {"model.layers.1.self_attn.q_proj": 32}},
    )  # fmt: skip
    loaded = {
        name: vision_store(model, **{name: path}).get(name)
        for name, path in (("new", adapter), ("legacy", legacy), ("text", text))
    }
    first = loaded["new"]
    assert all(set(layer) == {"q_proj", "down_proj"} for layer in first.layers)
    for other in (loaded["legacy"], loaded["text"]):
        for mine, theirs in zip(first.layers, other.layers, strict=True):
            for module, (a, b) in mine.items():
                assert torch.equal(a, theirs[module][0]) and torch.equal(b, theirs[module][1])
    # lora_alpha 8 over rank 4 everywhere but layer 1's q_proj (alpha_pattern: 32).
    key = "base_model.model.model.language_model.layers.{}.self_attn.q_proj.lora_B.weight"
    for layer, scale in ((0, 2.0), (1, 8.0)):
        expected = tensors[key.format(layer)].float() * scale
        torch.testing.assert_close(first.layers[layer]["q_proj"][1], expected.t())


def test_a_vision_models_adapter_of_its_tower_or_projector_is_refused(
    llava: tuple[PreTrainedModel, Path], tmp_path: Path
) -> None:
    model, adapter = llava
    base = "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"
    weight = load_file(adapter / "adapter_model.safetensors")[base]
    cases = {
        "tower": (
            "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn."
            "q_proj.lora_A.weight",
            "LoRA on model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj, which "
            "is in llava_next's vision tower or projector (model.vision_tower): only the "
            "language model's projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
            "down_proj) can be adapted; train the adapter with target_modules that match "
            "modules under model.language_model alone",
        ),
        "projector": (
            "base_model.model.model.multi_modal_projector.linear_1.lora_A.weight",
            "(model.multi_modal_projector): only the language model's projections",
        ),
        "legacy": (
            "base_model.model.vision_tower.vision_model.encoder.layers.1.mlp.fc1.lora_A.weight",
            "which is in llava_next's vision tower or projector (vision_tower)",
        ),
        "head": (
            "base_model.model.lm_head.lora_A.weight",
            "only LoRA on the language model's projections (q_proj, k_proj, v_proj, o_proj, "
            "gate_proj, up_proj, down_proj) is served for llava_next",
        ),
    }
    for name, (key, reason) in cases.items():
        path = copy_of(adapter, tmp_path / name, weights={key: weight})
        with pytest.raises(InputValidationError) as info:
            vision_store(model, x=path).get("x")
        assert f"holds {key!r}" in str(info.value), name
        assert reason in str(info.value), name
