"""export-neuron up to the SDK boundary: parameter mapping, validation, missing SDK, derived limits."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tgis.config import LauncherArgs, ModelFacts, build_serve_config
from tgis.errors import BackendUnavailableError, ConfigError
from tgis.neuron_export import export, plan_export, require_neuron_sdk

LLAMA_CONFIG = {"model_type": "llama", "max_position_embeddings": 4096, "torch_dtype": "float32"}


def plan(
    tmp_path: Path,
    env: dict[str, str] | None = None,
    config: dict[str, Any] | None = None,
    **kw: Any,
):
    return plan_export(tmp_path / "src", config or LLAMA_CONFIG, tmp_path / "out", env or {}, **kw)


def test_parameters_map_to_optimum_neuron_api(tmp_path: Path) -> None:
    request, _ = plan(
        tmp_path, batch_size=4, sequence_length=2048, num_cores=8, auto_cast_type="FP16"
    )
    assert request.neuron_config_kwargs() == {
        "model_name_or_path": str(tmp_path / "src"),
        "batch_size": 4,
        "sequence_length": 2048,
        "tensor_parallel_size": 8,
    }
    assert (request.auto_cast_type, request.torch_dtype) == ("fp16", "float16")


def test_plan_shows_the_limits_serve_will_derive(tmp_path: Path) -> None:
    _, serve = plan(tmp_path, batch_size=4, sequence_length=2048, num_cores=2)
    assert serve.backend == "neuron"
    assert (serve.max_batch_size, serve.max_total_tokens, serve.max_input_tokens) == (4, 2048, 1024)
    assert (serve.max_batch_prefill_tokens, serve.max_batch_total_tokens) == (4096, 8192)
    assert (serve.num_shard, serve.dtype) == (2, "bfloat16")


def test_default_sequence_length_is_model_positions_capped(tmp_path: Path) -> None:
    request, _ = plan(tmp_path, config={"model_type": "gpt2", "n_positions": 1024})
    assert request.sequence_length == 1024
    request, _ = plan(tmp_path, config={"model_type": "llama", "max_position_embeddings": 131072})
    assert request.sequence_length == 4096


@pytest.mark.parametrize(
    ("kw", "env", "expected"),
    [
        (
            {"sequence_length": 8192},
            {},
            "--sequence-length 8192 exceeds the model's 4096 positions",
        ),
        ({"sequence_length": 1}, {}, "--sequence-length 1 must be >= 2"),
        ({"batch_size": 0}, {}, "--batch-size 0 must be >= 1"),
        ({"auto_cast_type": "int8"}, {}, "--auto-cast-type 'int8' is not a Neuron cast type"),
        (
            {"batch_size": 4},
            {"HF_BATCH_SIZE": "8"},
            "HF_BATCH_SIZE=8 does not match the compiled model's batch_size=4",
        ),
        (
            {},
            {"MAX_TOTAL_TOKENS": "512"},
            "MAX_TOTAL_TOKENS=512 must equal the static sequence length (max_length) 4096",
        ),
    ],
)
def test_export_shape_breaks_serving_rules(
    tmp_path: Path, kw: dict[str, Any], env: dict[str, str], expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        plan(tmp_path, env, **kw)
    assert expected in str(info.value)


def test_already_compiled_model_refused(tmp_path: Path) -> None:
    config = {**LLAMA_CONFIG, "neuron": {"batch_size": 1, "sequence_length": 128}}
    with pytest.raises(ConfigError, match="already compiled for Neuron"):
        plan(tmp_path, config=config)


def test_missing_sdk_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optimum.neuron", None)
    with pytest.raises(BackendUnavailableError) as info:
        require_neuron_sdk()
    text = str(info.value)
    assert "\n" not in text
    assert "needs optimum.neuron" in text and "pip install 'tgis[neuron]'" in text


class FakeNeuronConfig:
    """optimum-neuron's NxDNeuronConfig: plain attributes; llama's export default samples on
    the device."""

    def __init__(self, **fields: Any) -> None:
        self.on_device_sampling = True
        self.__dict__.update(fields)


class FakeNeuronModel:
    """Stands in for optimum-neuron 0.4's NeuronModelForCausalLM at its API boundary."""

    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def __init__(self, config: Any, neuron_config: FakeNeuronConfig) -> None:
        self.config, self.neuron_config = config, neuron_config

    @classmethod
    def get_neuron_config(
        cls,
        model_name_or_path: str,
        config: Any = None,
        batch_size: int | None = None,
        sequence_length: int | None = None,
        tensor_parallel_size: int | None = None,
    ) -> FakeNeuronConfig:
        cls.calls.append(
            (
                "get_neuron_config",
                {
                    "model_name_or_path": model_name_or_path,
                    "batch_size": batch_size,
                    "sequence_length": sequence_length,
                    "tp": tensor_parallel_size,
                    "dtype": str(config.dtype),
                },
            )
        )
        return FakeNeuronConfig(
            _serialized_key="NxDNeuronConfig",
            batch_size=batch_size,
            sequence_length=sequence_length,
            tp_degree=tensor_parallel_size,
            torch_dtype=str(config.dtype).replace("torch.", ""),
        )

    @classmethod
    def export(
        cls,
        model_id: str,
        neuron_config: FakeNeuronConfig,
        config: Any = None,
        load_weights: bool = True,
    ) -> FakeNeuronModel:
        cls.calls.append(
            (
                "export",
                {
                    "model_id": model_id,
                    "load_weights": load_weights,
                    "on_device_sampling": neuron_config.on_device_sampling,
                },
            )
        )
        return cls(config, neuron_config)

    def save_pretrained(self, path: Path) -> None:
        self.config.save_pretrained(path)
        (Path(path) / "neuron_config.json").write_text(json.dumps(vars(self.neuron_config)))


@pytest.fixture
def fake_sdk(monkeypatch: pytest.MonkeyPatch) -> type[FakeNeuronModel]:
    FakeNeuronModel.calls = []
    for name in ("optimum", "optimum.neuron", "neuronxcc", "neuronx_distributed"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["optimum.neuron"].NeuronModelForCausalLM = FakeNeuronModel  # type: ignore[attr-defined]
    return FakeNeuronModel


def test_export_calls_sdk_and_served_limits_follow(
    tmp_path: Path, fake_sdk: type[FakeNeuronModel]
) -> None:
    from transformers import LlamaConfig

    src = tmp_path / "src"
    LlamaConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=512
    ).save_pretrained(src)
    (src / "tokenizer.json").write_text("{}")
    request, _ = plan_export(
        src,
        json.loads((src / "config.json").read_text()),
        tmp_path / "out",
        {},
        batch_size=2,
        sequence_length=256,
        num_cores=2,
        auto_cast_type="bf16",
    )
    written = export(request)
    assert (written.batch_size, written.sequence_length, written.num_cores) == (2, 256, 2)
    assert fake_sdk.calls == [
        (
            "get_neuron_config",
            {
                "model_name_or_path": str(src),
                "batch_size": 2,
                "sequence_length": 256,
                "tp": 2,
                "dtype": "torch.bfloat16",
            },
        ),
        # Host sampling needs logits: on-device sampling is turned off before compiling.
        ("export", {"model_id": str(src), "load_weights": False, "on_device_sampling": False}),
    ]
    assert (tmp_path / "out" / "tokenizer.json").exists()
    # What `tgis serve --backend neuron --model-id out` derives from the written model:
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    neuron_json = json.loads((tmp_path / "out" / "neuron_config.json").read_text())
    serve = build_serve_config(LauncherArgs(), ModelFacts.from_config(out_config, neuron_json), {})
    assert serve.backend == "neuron"
    assert (serve.max_batch_size, serve.max_total_tokens, serve.max_input_tokens) == (2, 256, 128)
    assert (serve.max_batch_total_tokens, serve.num_shard, serve.dtype) == (512, 2, "bfloat16")
