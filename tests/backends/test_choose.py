"""backends/choose.py: one function names the design that serves a model, says why, and
refuses every option that design cannot honour; `load_backend` loads what it chose."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.factories import make_model_dir
from tgis.backends.choose import BackendChoice, choose_backend, compiled_decode, load_backend
from tgis.backends.fallback.backend import TorchDynamicBackend
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.config import LauncherArgs, ModelFacts, ServeConfig, build_serve_config
from tgis.errors import ConfigError
from tgis.hub import read_model_facts

LLAMA = {
    "model_type": "llama",
    "max_position_embeddings": 4096,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 256,
}
GPT2 = {"model_type": "gpt2", "n_positions": 1024}
T5 = {"model_type": "t5", "is_encoder_decoder": True, "n_positions": 512}
DYNAMIC_ROPE = {**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}


def config_of(
    model: dict[str, Any], env: dict[str, str] | None = None, **flags: Any
) -> tuple[ServeConfig, ModelFacts]:
    facts = ModelFacts.from_config(model)
    return build_serve_config(LauncherArgs(**flags), facts, env or {}), facts


def choose(model: dict[str, Any], env: dict[str, str] | None = None, **flags: Any) -> BackendChoice:
    return choose_backend(*config_of(model, env, **flags))


def refusal(model: dict[str, Any], env: dict[str, str] | None = None, **flags: Any) -> str:
    with pytest.raises(ConfigError) as info:
        choose(model, env, **flags)
    return str(info.value)


def test_each_model_gets_its_design_and_the_reason() -> None:
    paged = choose(LLAMA, backend="cuda")
    assert (paged.design, paged.shards) == ("paged", 1)
    assert paged.describe() == "paged engine on cuda: the paged forward runs llama"
    sharded = choose(LLAMA, backend="cpu", num_shard=2)
    assert (sharded.design, sharded.shards) == ("paged", 2)
    assert sharded.describe().startswith("paged engine on cpu x 2 shards: ")
    fallback = choose(GPT2, backend="cpu")
    assert fallback.design == "fallback"
    assert "the paged engine cannot run gpt2: model_type 'gpt2' is not one of" in fallback.reason
    assert "rope type 'dynamic'" in choose(DYNAMIC_ROPE, backend="cpu").reason
    assert choose(T5, backend="cuda").design == "seq2seq"
    tpu = choose(LLAMA, backend="tpu")
    assert tpu.design == "static"
    assert tpu.reason == "the llama family's fixed-shape forward runs llama"
    assert choose(LLAMA, backend="gaudi").design == "static"


def test_model_impl_picks_the_forward_or_says_why_it_cannot() -> None:
    qwen3 = {**LLAMA, "model_type": "qwen3"}
    assert choose(qwen3, backend="cpu").describe() == (
        "paged engine on cpu: the paged forward runs qwen3"
    )
    assert choose(qwen3, backend="cpu", model_impl="tgis").design == "paged"
    forced = choose(qwen3, {"TGIS_MODEL_IMPL": "transformers"}, backend="cpu")
    assert forced.describe() == (
        "fallback engine (transformers' forward, slot cache) on cpu: "
        "TGIS_MODEL_IMPL=transformers asks for transformers' forward"
    )
    assert choose(GPT2, backend="cpu", model_impl="transformers").design == "fallback"
    assert refusal(GPT2, backend="cpu", model_impl="tgis").startswith(
        "--model-impl tgis: the paged engine cannot run gpt2: model_type 'gpt2' is not one of"
    )
    # The paged engine's options go with its forward.
    text = refusal(qwen3, backend="cpu", model_impl="transformers", prefix_caching=True)
    assert text.startswith("--prefix-caching true: prefix caching runs in the paged engine")
    assert "--model-impl transformers asks for transformers' forward" in text
    with pytest.raises(ConfigError, match="--model-impl vllm is not a model implementation"):
        choose(qwen3, backend="cpu", model_impl="vllm")
    with pytest.raises(ConfigError, match="chooses the forward of the cpu and cuda backends"):
        choose(LLAMA, backend="tpu", model_impl="transformers")


@pytest.mark.parametrize("backend", ["tpu", "gaudi"])
def test_static_forwards_refuse_other_families(backend: str) -> None:
    text = refusal(GPT2, backend=backend)
    assert f"the {backend} backend cannot serve gpt2: model_type 'gpt2'" in text
    assert "llama, mistral, qwen2" in text and "--backend cpu or --backend cuda" in text


@pytest.mark.parametrize(
    ("flags", "env", "given"),
    [
        ({"prefix_caching": True}, {}, "--prefix-caching true: prefix caching"),
        ({}, {"SPECULATE": "2"}, "SPECULATE=2: speculative decoding"),
        ({"lora_adapters": "a=/x"}, {}, "--lora-adapters a=/x: LoRA adapters"),
        ({}, {"LORA_ADAPTERS": "a=/x"}, "LORA_ADAPTERS=a=/x: LoRA adapters"),
    ],
)
def test_the_paged_engines_options_are_refused_elsewhere(
    flags: dict[str, Any], env: dict[str, str], given: str, tmp_path: Path
) -> None:
    # A model the paged engine cannot run: named, with why, and the fix.
    text = refusal(GPT2, env, backend="cpu", **flags)
    assert text.startswith(f"{given} runs in the paged engine, which cannot run gpt2: ")
    assert "or serve a model of a family docs/models.md lists for the paged engine" in text
    # A backend of fixed shapes.
    text = refusal(LLAMA, env, backend="gaudi", **flags)
    assert text.startswith(f"{given} runs in the paged engine of the cpu and cuda backends; ")
    assert "gaudi runs a static batch" in text and "--backend cpu/cuda" in text
    # An encoder-decoder model.
    assert refusal(T5, env, backend="cpu", **flags).startswith(
        f"{given} is for decoder-only models; t5 is an encoder-decoder one"
    )


def test_cuda_graphs_and_compile_need_a_design_that_runs_them() -> None:
    assert "--cuda-graphs true: CUDA graphs of decode runs in the paged engine" in refusal(
        GPT2, backend="cuda", cuda_graphs=True
    )
    assert "TGIS_COMPILE=true: compiled decode is for decoder-only models" in refusal(
        T5, {"TGIS_COMPILE": "true"}, backend="cpu"
    )
    # transformers' forward compiles on the fallback engine.
    assert choose(GPT2, backend="cpu", compile=True).design == "fallback"


def test_tensor_parallelism_runs_the_paged_engine_on_several_devices() -> None:
    assert "--num-shard 2: tensor parallelism runs in the paged engine" in refusal(
        GPT2, backend="cpu", num_shard=2
    )
    assert "NUM_SHARD=2: tensor parallelism is for decoder-only models" in refusal(
        T5, {"NUM_SHARD": "2"}, backend="cpu"
    )
    text = refusal(LLAMA, backend="cpu", num_shard=3)
    assert text.startswith("--num-shard 3: 3 shards must divide its ")
    assert "KV heads or be a multiple of them" in text and "--num-shard can be 1, 2, 4" in text
    for flags, given in (
        ({"compile": True}, "--compile true: compiled decode"),
        ({"lora_adapters": "a=/x"}, "--lora-adapters a=/x: LoRA adapters"),
    ):
        text = refusal(LLAMA, backend="cpu", num_shard=2, **flags)
        assert text.startswith(f"{given} runs on one device; --num-shard 2 runs sharded steps")
        assert "or serve on one device (--num-shard 1)" in text


def test_load_backend_loads_the_choice(tmp_path: Path) -> None:
    llama = make_model_dir(tmp_path / "llama", "llama")
    gpt2 = make_model_dir(tmp_path / "gpt2", "gpt2")
    flags = {"backend": "cpu", "max_total_tokens": 64, "max_batch_total_tokens": 512}
    config, facts = config_of(dict(read_model_facts(llama).config), **flags, compile=False)
    paged = load_backend(config, llama)
    assert isinstance(paged, PagedTorchBackend) and paged.compiled is None
    compiled = load_backend(config_of(dict(facts.config), **flags, compile=True)[0], llama)
    assert isinstance(compiled, PagedTorchBackend) and compiled.compiled is not None
    # Unset, the paged engine on one CPU compiles its decode (its packages under --compile-
    # cache, or HF_HOME); sharded, over bitsandbytes' weights or without warmup it does not.
    config = config_of(dict(facts.config), **flags)[0]
    assert config.compile is None
    assert compiled_decode(config, choose_backend(config, facts))
    auto = load_backend(
        config_of(dict(facts.config), **flags, compile_cache=str(tmp_path))[0], llama
    )
    assert isinstance(auto, PagedTorchBackend) and auto.compiled is not None
    assert auto.compiled.packages is not None
    assert auto.compiled.packages.directory.parent == tmp_path
    assert auto.compile_state == "eager"  # until warmup builds or loads its graphs
    choice = choose_backend(config, facts)
    assert not compiled_decode(config, dataclasses.replace(choice, shards=2))
    assert not compiled_decode(config, dataclasses.replace(choice, design="fallback"))
    assert not compiled_decode(dataclasses.replace(config, backend="cuda"), choice)
    assert not compiled_decode(dataclasses.replace(config, warmup_enabled=False), choice)
    assert not compiled_decode(dataclasses.replace(config, quantize="bitsandbytes"), choice)
    config, _ = config_of(dict(read_model_facts(gpt2).config), **flags, compile=True)
    slot = load_backend(config, gpt2)
    assert isinstance(slot, TorchDynamicBackend) and slot.compiled
    # Unset on a model the fallback engine serves, decode is eager: a cache would keep nothing.
    config, _ = config_of(dict(read_model_facts(gpt2).config), **flags, compile_cache="/c")
    with pytest.raises(ConfigError, match="keeps the compiled decode's packages, and fallback"):
        load_backend(config, gpt2)


def test_quantize_is_checked_against_backend_checkpoint_and_engine() -> None:
    """--quantize resolves with int4's default group, runs on the paged engine (the engine line
    says so), and every misuse names the setting and the fix."""
    choice = choose(LLAMA, backend="cpu", quantize="int4")
    assert choice.reason == "the paged forward runs llama over int4 (groups of 64) weights"
    config, _ = config_of(LLAMA, {"QUANTIZE": "INT8"}, backend="cpu")
    assert (config.quantize, config.quantize_group_size) == ("int8", None)
    config, _ = config_of(LLAMA, backend="cuda", quantize="int4", quantize_group_size=128)
    assert (config.quantize, config.quantize_group_size) == ("int4", 128)
    config, _ = config_of(LLAMA, backend="cpu", quantize="int8", compile=True)
    assert (config.quantize, config.compile) == ("int8", True)
    cases = {
        "--quantize fp8: fp8 multiplies in float8": {"backend": "cpu", "quantize": "fp8"},
        "--quantize-group-size 48 is not an int4 group size": {
            "backend": "cpu", "quantize": "int4", "quantize_group_size": 48,
        },
        "--quantize-group-size 64 sets int4's groups; --quantize int8 has none": {
            "backend": "cpu", "quantize": "int8", "quantize_group_size": 64,
        },
        "--quantize-group-size 64 sets int4's groups, and no --quantize": {
            "backend": "cpu", "quantize_group_size": 64,
        },
        "--quantize awq names a format of pre-quantized checkpoints": {
            "backend": "cpu", "quantize": "awq",
        },
        "--quantize eetq is not a tgis method (use --quantize int8, the same method": {
            "backend": "cuda", "quantize": "eetq",
        },
        "--quantize nf5 is not a quantization method (use one of int8, int4, fp8, "
        "bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4)": {
            "backend": "cpu", "quantize": "nf5",
        },
        "--quantize int8: weights are quantized by the paged engine's forward": {
            "backend": "tpu", "quantize": "int8", "max_batch_size": 1,
        },
    }  # fmt: skip
    for expected, flags in cases.items():
        assert refusal(LLAMA, **flags).startswith(expected), flags
    assert "QUANTIZE=int8: weight quantization runs in the paged engine" in refusal(
        GPT2, {"QUANTIZE": "int8"}, backend="cpu"
    )


def test_bitsandbytes_methods_need_the_package_and_run_eagerly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TGI's bitsandbytes values are methods of their own on cpu and cuda; with --compile, or
    where the package is not installed, they are refused naming the fix."""
    for method in ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"):
        config, _ = config_of(LLAMA, backend="cuda", quantize=method.upper())
        assert (config.quantize, config.quantize_group_size) == (method, None)
    assert choose(LLAMA, backend="cpu", quantize="bitsandbytes-nf4").reason == (
        "the paged forward runs llama over bitsandbytes-nf4 weights"
    )
    assert "outlier columns on the host" in refusal(
        LLAMA, backend="cuda", quantize="bitsandbytes", cuda_graphs=True
    )
    config, _ = config_of(LLAMA, backend="cuda", quantize="bitsandbytes-nf4", cuda_graphs=True)
    assert config.cuda_graphs
    text = refusal(LLAMA, backend="cpu", quantize="bitsandbytes", compile=True)
    assert text.startswith("--quantize bitsandbytes and --compile true: bitsandbytes' kernels")
    assert "--quantize-group-size 64 sets int4's groups" in refusal(
        LLAMA, backend="cpu", quantize="bitsandbytes-fp4", quantize_group_size=64
    )
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "bitsandbytes" else real(name, *a),
    )
    assert refusal(LLAMA, {"QUANTIZE": "bitsandbytes-nf4"}, backend="cpu") == (
        "QUANTIZE=bitsandbytes-nf4 quantizes through the bitsandbytes package, which is not "
        "installed (pip install 'tgis[bitsandbytes]', or use --quantize int8 or int4 (torch's "
        "own kernels))"
    )


def test_kv_cache_dtype_is_checked_against_values_backend_and_engine() -> None:
    """--kv-cache-dtype (env KV_CACHE_DTYPE): auto is the model's dtype, a float8 name a
    float8 pool of the paged engine; another name, a static backend or a model the paged
    engine cannot run is refused naming the setting and the fix."""
    config, _ = config_of(LLAMA, backend="cpu", kv_cache_dtype="FP8_E4M3FN")
    assert config.kv_cache_dtype == "fp8_e4m3fn"
    config, _ = config_of(LLAMA, {"KV_CACHE_DTYPE": "fp8_e5m2"}, backend="cuda")
    assert config.kv_cache_dtype == "fp8_e5m2"
    config, _ = config_of(LLAMA, backend="cpu", kv_cache_dtype="auto")
    assert config.kv_cache_dtype is None
    config, _ = config_of(LLAMA, backend="cuda", kv_cache_dtype="fp8")  # vLLM's names
    assert config.kv_cache_dtype == "fp8_e4m3fn"
    config, _ = config_of(LLAMA, backend="cuda", kv_cache_dtype="fp8_e4m3")
    assert config.kv_cache_dtype == "fp8_e4m3fn"
    assert refusal(LLAMA, backend="cpu", kv_cache_dtype="int8") == (
        "--kv-cache-dtype int8 is not a KV cache dtype "
        "(use one of auto, fp8_e4m3fn, fp8_e5m2 (vLLM's fp8 and fp8_e4m3 name fp8_e4m3fn))"
    )
    assert "decode graphs are recorded over flash attention" in refusal(
        LLAMA, backend="cuda", kv_cache_dtype="fp8_e5m2", cuda_graphs=True
    )
    text = refusal(LLAMA, backend="tpu", kv_cache_dtype="fp8_e4m3fn", max_batch_size=1)
    assert text.startswith("--kv-cache-dtype fp8_e4m3fn: a float8 KV cache is the paged engine's")
    assert "drop --kv-cache-dtype (KV_CACHE_DTYPE)" in text
    assert refusal(GPT2, {"KV_CACHE_DTYPE": "fp8_e4m3fn"}, backend="cpu").startswith(
        "KV_CACHE_DTYPE=fp8_e4m3fn: a float8 KV cache runs in the paged engine, which cannot "
        "run gpt2"
    )


def test_a_pre_quantized_checkpoint_is_detected_and_checked() -> None:
    """quantization_config selects the method with no flag; repeating it is fine, asking for
    another, a group size, fp8 on a CPU, --compile or a static backend is refused by name."""
    gptq = {**LLAMA, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}
    config, _ = config_of(gptq, backend="cpu")
    assert (config.quantize, config.quantize_group_size, config.quantized_checkpoint) == (
        "gptq", 128, True,
    )  # fmt: skip
    assert choose(gptq, backend="cpu").reason == (
        "the paged forward runs llama over gptq (groups of 128) weights"
    )
    config, _ = config_of(gptq, backend="cpu", quantize="gptq")
    assert config.quantize == "gptq"
    text = refusal(gptq, backend="cpu", quantize="int8")
    assert text.startswith("--quantize int8 asks for another quantization of a checkpoint")
    assert "gptq checkpoint, 4-bit weights in groups of 128" in text
    assert "drop --quantize (QUANTIZE)" in text
    assert "stored" in refusal(gptq, backend="cpu", quantize_group_size=64)
    config, _ = config_of(gptq, backend="cpu", compile=True)
    assert (config.quantize, config.compile) == ("gptq", True)
    assert "the tpu backend runs its own" in refusal(gptq, backend="tpu", max_batch_size=1)
    fp8 = {**LLAMA, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert "a CPU has no fast float8 matmul" in refusal(fp8, backend="cpu")
    config, _ = config_of(fp8, backend="cuda")
    assert (config.quantize, config.quantize_group_size) == ("fp8", None)
    refused = {
        "quantization_config.bits is 8": {"quant_method": "gptq", "bits": 8},
        "quantization_config.version is 'gemv'": {"quant_method": "awq", "bits": 4, "version": "gemv"},
        "quantization_config.quant_method is 'bitsandbytes'": {"quant_method": "bitsandbytes"},
        "quantization_config.format is 'marlin-24'": {
            "quant_method": "compressed-tensors", "format": "marlin-24",
        },
        "quantization_config.config_groups.group_0.weights.strategy is 'tensor'": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"weights": {
                "num_bits": 4, "type": "int", "strategy": "tensor",
            }}},
        },
    }  # fmt: skip
    for expected, declared in refused.items():
        text = refusal({**LLAMA, "quantization_config": declared}, backend="cpu")
        assert text.startswith(f"config.json's {expected}"), text
        assert "--quantize int8 or int4" in text
    text = refusal(LLAMA, backend="cpu", quantize="gptq")
    assert "this checkpoint's config.json declares no quantization_config" in text


def test_int4_groups_must_fit_each_shards_columns() -> None:
    """Row-parallel projections split their inputs: each rank's share must hold whole groups."""
    model = {**LLAMA, "hidden_size": 192}  # 8 heads of 24: each shard's o takes 96 columns
    text = refusal(model, backend="cpu", num_shard=2, quantize="int4", quantize_group_size=64)
    assert "each of 2 shards takes 96 input columns of a row-parallel projection" in text
    assert "--quantize-group-size can be one dividing 96, 128" in text
    flags = {"backend": "cpu", "num_shard": 2, "quantize": "int4", "quantize_group_size": 32}
    assert choose(model, **flags).shards == 2


def test_load_backend_quantizes_the_weights(tmp_path: Path) -> None:
    llama = make_model_dir(tmp_path / "llama", "llama")
    flags = {"backend": "cpu", "max_total_tokens": 64, "max_batch_total_tokens": 512}
    config, _ = config_of(dict(read_model_facts(llama).config), **flags, quantize="int8")
    backend = load_backend(config, llama)
    assert isinstance(backend, PagedTorchBackend)
    assert backend.runtime()["quantization"] == "int8"


def test_load_backend_reads_a_pre_quantized_checkpoint(tmp_path: Path) -> None:
    """A GPTQ checkpoint resolves to its method with no flag and loads as stored: /info's
    runtime names it, and the projections run the int4 kernel."""
    from transformers import AutoModelForCausalLM

    from tests.backends.common.test_quant_checkpoint import write_checkpoint
    from tgis.backends.common.quant import Int4Linear

    llama = make_model_dir(tmp_path / "llama", "llama")
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    gptq = write_checkpoint(model, tmp_path / "gptq", "gptq-v2").model_dir
    for path in llama.iterdir():
        if path.is_file() and path.name not in ("config.json", "model.safetensors"):
            shutil.copy(path, gptq / path.name)
    flags = {"backend": "cpu", "max_total_tokens": 64, "max_batch_total_tokens": 512}
    config, _ = config_of(dict(read_model_facts(gptq).config), **flags)
    assert (config.quantize, config.quantized_checkpoint) == ("gptq", True)
    backend = load_backend(config, gptq)
    assert isinstance(backend, PagedTorchBackend)
    assert backend.runtime()["quantization"] == "gptq"
    assert (
        backend.weights
        == "quantized: gptq checkpoint, 4-bit weights in groups of 32; lm_head as stored"
    )
    assert isinstance(backend.path.layers[0].qkv_w, Int4Linear)


QWEN_VL_TEXT = {
    "model_type": "qwen2_vl_text", "num_hidden_layers": 2, "hidden_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
    "intermediate_size": 128, "rope_scaling": {"type": "mrope", "mrope_section": [16, 8, 8]},
}  # fmt: skip
VISION = {
    "llava_next": {"model_type": "llava_next", "text_config": LLAMA},
    "qwen2_vl": {"model_type": "qwen2_vl", "text_config": QWEN_VL_TEXT},
    # Qwen2-VL's first configs: the language model's settings at the top level.
    "qwen2_vl legacy": {**QWEN_VL_TEXT, "model_type": "qwen2_vl"},
    "qwen2_5_vl": {
        "model_type": "qwen2_5_vl",
        "text_config": {**QWEN_VL_TEXT, "model_type": "qwen2_5_vl_text"},
    },
    "gemma3": {"model_type": "gemma3", "text_config": {**LLAMA, "model_type": "gemma3_text"}},
}


@pytest.mark.parametrize("name", list(VISION))
def test_vision_language_models_run_their_language_model_in_the_paged_engine(
    name: str,
) -> None:
    choice = choose(VISION[name], backend="cpu")
    assert choice.design == "paged"
    kind = VISION[name]["model_type"]
    assert f"the paged forward runs {kind}'s language model" in choice.reason
    assert "its images: " in choice.reason
    sharded = choose(VISION[name], backend="cpu", num_shard=2)
    assert (sharded.design, sharded.shards) == ("paged", 2)
    assert "tensor-parallel (the vision tower whole on the first shard); its images: " in (
        sharded.reason
    )


def test_vision_language_models_refuse_what_they_cannot_do() -> None:
    llava = VISION["llava_next"]
    assert "--model-impl transformers: llava_next is a vision-language model" in refusal(
        llava, backend="cpu", model_impl="transformers"
    )
    assert "the tpu backend serves text models; llava_next is a vision-language model" in (
        refusal(llava, backend="tpu")
    )
    unknown_rope = {**QWEN_VL_TEXT, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    assert "rope type 'dynamic'" in refusal(
        {"model_type": "qwen2_vl", "text_config": unknown_rope}, backend="cpu"
    )
    # Sharded: the language model's widths must divide, and LoRA runs on one device.
    assert "--num-shard 3: " in refusal(llava, backend="cpu", num_shard=3)
    assert refusal(llava, backend="cpu", num_shard=2, lora_adapters="a=/x").startswith(
        "--lora-adapters a=/x: LoRA adapters runs on one device; --num-shard 2 runs sharded"
    )
    # A pre-quantized checkpoint: the loader reads a text model's names.
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    text = refusal({**llava, "quantization_config": gptq}, backend="cpu")
    assert text.startswith(
        "config.json's quantization_config (gptq): tgis reads pre-quantized checkpoints of text "
        "models; llava_next is a vision-language model"
    )
    assert "serve llava_next's float checkpoint, with --quantize int8 or int4" in text


@pytest.mark.parametrize("name", list(VISION))
def test_vision_language_models_take_lora_adapters_and_quantize_their_language_model(
    name: str, tmp_path: Path
) -> None:
    model = VISION[name]
    kind = model["model_type"]
    for flags in (
        {"lora_adapters": "a=/x"},
        {"lora_adapter_dir": str(tmp_path)},
        {"lora_adapters": "a=/x", "quantize": "int8"},
    ):
        assert choose(model, backend="cpu", **flags).design == "paged", flags
    reason = choose(model, backend="cuda", quantize="int4").reason
    assert reason.startswith(f"the paged forward runs {kind}'s language model (")
    assert ") over int4 (groups of 64) weights (the vision tower's unquantized); its images: " in (
        reason
    )
