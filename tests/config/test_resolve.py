"""tgis.config.resolve: the seeds' example launches validate, and every rule refuses what it must."""

from __future__ import annotations

from pathlib import Path

import pytest

from tgis.config import (
    DEMO_MODEL,
    LauncherArgs,
    ModelFacts,
    NeuronExport,
    build_serve_config,
)
from tgis.errors import ConfigError

MISTRAL = ModelFacts("mistral", 32768)
LLAMA2 = ModelFacts("llama", 4096)
LLAMA31 = ModelFacts("llama", 131072)
GPT2 = ModelFacts("gpt2", 1024)
LLAMA2_NEURON_BUDGET = ModelFacts(
    "llama",
    4096,
    NeuronExport(batch_size=1, sequence_length=2048, num_cores=2, auto_cast_type="fp16"),
)


def build(facts: ModelFacts = GPT2, env: dict[str, str] | None = None, **flags: object):
    return build_serve_config(LauncherArgs(**flags), facts, env or {})


def error_of(facts: ModelFacts = GPT2, env: dict[str, str] | None = None, **flags: object) -> str:
    with pytest.raises(ConfigError) as info:
        build(facts, env, **flags)
    return str(info.value)


# --- the seeds' example launches ---------------------------------------------------------


def test_seed000_tpu_mistral_example_validates() -> None:
    config = build(
        MISTRAL,
        {"HF_BATCH_SIZE": "1", "HF_SEQUENCE_LENGTH": "1024"},
        model_id="mistralai/Mistral-7B-v0.1",
        backend="tpu",
        max_concurrent_requests=1,
        max_input_length=512,
        max_total_tokens=1024,
        max_batch_prefill_tokens=512,
        max_batch_total_tokens=1024,
    )
    assert config.static_shape is not None
    assert (config.static_shape.batch_size, config.static_shape.sequence_length) == (1, 1024)
    assert config.max_input_tokens == 512
    assert config.max_batch_size == 1
    assert config.max_batch_total_tokens == 1024


def test_seed002_neuron_hub_exported_model_example_validates() -> None:
    config = build(
        LLAMA2_NEURON_BUDGET,
        model_id="aws-neuron/Llama-2-7b-hf-neuron-budget",
        backend="neuron",
        max_batch_size=1,
        max_input_length=1024,
        max_total_tokens=2048,
    )
    assert config.max_batch_prefill_tokens == 1024  # advised: batch_size x max_input_length
    assert config.max_batch_total_tokens == 2048
    assert config.num_shard == 2
    assert config.dtype == "float16"
    assert config.notes == ()


def test_seed002_neuron_export_at_startup_example_validates() -> None:
    env = {
        "HF_BATCH_SIZE": "1",
        "HF_SEQUENCE_LENGTH": "4096",
        "HF_AUTO_CAST_TYPE": "fp16",
        "HF_NUM_CORES": "2",
    }
    config = build(
        LLAMA2,
        env,
        model_id="NousResearch/Llama-2-7b-chat-hf",
        backend="neuron",
        max_batch_size=1,
        max_input_length=3164,
        max_total_tokens=4096,
    )
    assert config.static_shape is not None
    assert config.static_shape.num_cores == 2
    assert config.static_shape.auto_cast_type == "fp16"
    assert config.max_batch_prefill_tokens == 3164
    assert config.max_batch_total_tokens == 4096


def test_seed002_neuron_local_model_derives_everything_from_config_neuron() -> None:
    config = build(LLAMA2_NEURON_BUDGET, backend="auto")
    assert config.backend == "neuron"
    assert config.max_batch_size == 1
    assert config.max_total_tokens == 2048
    assert config.max_input_tokens == 1024  # half the window, as the Neuron entrypoint does
    assert config.max_batch_prefill_tokens == 1024
    assert config.max_batch_total_tokens == 2048


def test_seed003_gaudi_basic_example_validates() -> None:
    config = build(LLAMA31, model_id="meta-llama/Meta-Llama-3.1-8B-Instruct", backend="gaudi")
    assert config.max_total_tokens == 4096
    assert config.max_input_tokens == 4095
    assert config.gaudi is not None
    assert config.gaudi.pad_sequence_to_multiple_of == 128
    assert config.gaudi.length_buckets[-2:] == (3968, 4095)
    assert config.gaudi.decode_buckets == tuple(range(8, 129, 8))


def test_seed003_gaudi_fp8_70b_example_validates_on_one_device() -> None:
    """Seed 003's 8-card launch: its sharding is refused (no backend shards yet); without
    --sharded/--num-shard the rest of it validates."""
    env = {
        "QUANT_CONFIG": "./quantization_config/maxabs_quant.json",
        "MAX_TOTAL_TOKENS": "2048",
        "BATCH_BUCKET_SIZE": "256",
        "PREFILL_BATCH_BUCKET_SIZE": "4",
        "PAD_SEQUENCE_TO_MULTIPLE_OF": "64",
    }
    flags: dict[str, object] = {
        "model_id": "meta-llama/Meta-Llama-3.1-70B-Instruct",
        "backend": "gaudi",
        "max_input_tokens": 1024,
        "max_total_tokens": 2048,
        "max_batch_prefill_tokens": 4096,
        "max_batch_size": 256,
        "max_waiting_tokens": 7,
        "waiting_served_ratio": 1.2,
        "max_concurrent_requests": 512,
    }
    assert error_of(LLAMA31, env, **flags, sharded=True, num_shard=8).startswith(
        "--num-shard 8: the gaudi backend runs the model on one device"
    )
    config = build(LLAMA31, env, **flags)
    g = config.gaudi
    assert g is not None
    assert g.quant_config == "./quantization_config/maxabs_quant.json"
    assert (g.decode_batch_size, g.prefill_batch_size, g.length_buckets[-1]) == (256, 4, 1024)
    assert g.decode_buckets == (256,)
    assert len(g.prefill_buckets) == 16  # 1 batch bucket x 16 length buckets of 64
    assert config.num_shard == 1


def test_seed003_gaudi_llava_example_validates() -> None:
    config = build(
        ModelFacts("llava_next", 32768),
        {"PREFILL_BATCH_BUCKET_SIZE": "1", "BATCH_BUCKET_SIZE": "1"},
        model_id="llava-hf/llava-v1.6-mistral-7b-hf",
        backend="gaudi",
        max_input_tokens=4096,
        max_batch_prefill_tokens=16384,
        max_total_tokens=8192,
        max_batch_size=4,
    )
    g = config.gaudi
    assert g is not None
    assert g.prefill_batch_size == 4  # 16384 / 4096
    assert g.decode_buckets == (1, 2, 3, 4)


# --- TGI's general rules and defaults ----------------------------------------------------


def test_defaults_follow_tgi_launcher() -> None:
    config = build(GPT2)
    assert config.model_id == DEMO_MODEL
    assert (config.max_total_tokens, config.max_input_tokens) == (1024, 1023)
    assert config.max_batch_prefill_tokens == 1023 + 50
    assert config.max_batch_total_tokens is None
    assert (config.max_concurrent_requests, config.max_best_of, config.max_stop_sequences) == (
        128,
        2,
        4,
    )
    assert (config.max_top_n_tokens, config.max_waiting_tokens, config.waiting_served_ratio) == (
        5,
        None,
        None,
    )
    assert config.admission(paged=False) == (0.3, 20)  # TGI's, on the slot engine
    assert config.backend == "cpu"


def test_default_context_capped_at_4096_with_a_note() -> None:
    config = build(LLAMA31)
    assert config.max_total_tokens == 4096
    assert "--max-total-tokens 131072" in config.notes[0]


def test_prefill_default_with_batch_size() -> None:
    assert build(GPT2, max_batch_size=4, max_total_tokens=512).max_batch_prefill_tokens == 4 * 511


def test_a_pooling_models_batch_budget_defaults_to_teis() -> None:
    bert = ModelFacts("bert", 512, pooling=True)
    assert build(bert, backend="cpu").max_batch_prefill_tokens == 16384
    generator = build(GPT2, backend="cpu")  # TGI's: one longest prompt and a margin
    assert generator.max_batch_prefill_tokens == generator.max_input_tokens + 50
    assert (
        build(bert, backend="cpu", max_batch_prefill_tokens=2048).max_batch_prefill_tokens == 2048
    )


def test_rerank_tokens_make_a_causal_lm_pool_and_take_its_budget() -> None:
    qwen = ModelFacts("qwen3", 40960)
    config = build(qwen, backend="cpu", rerank_tokens="yes,no", rerank_template="/t.jinja")
    assert (config.rerank_tokens, config.rerank_template) == (("yes", "no"), "/t.jinja")
    assert config.max_batch_prefill_tokens == 16384
    from_env = build(qwen, {"TGIS_RERANK_TOKENS": "yes,no"}, backend="cpu")
    assert from_env.rerank_tokens == ("yes", "no")
    assert build(qwen, backend="cpu").rerank_tokens == ()


def test_env_fallbacks_use_launcher_names() -> None:
    env = {"MODEL_ID": "gpt2", "MAX_TOTAL_TOKENS": "512", "MAX_INPUT_LENGTH": "100", "PORT": "8080"}
    config = build(GPT2, env)
    assert (config.model_id, config.max_total_tokens, config.max_input_tokens, config.port) == (
        "gpt2",
        512,
        100,
        8080,
    )


def test_flag_wins_over_env() -> None:
    assert build(GPT2, {"MAX_TOTAL_TOKENS": "512"}, max_total_tokens=256).max_total_tokens == 256


def test_max_input_tokens_and_alias_both_set() -> None:
    message = error_of(max_input_tokens=10, max_input_length=10)
    assert "both --max-input-tokens and --max-input-length are set: they are one setting" in message


def test_max_input_must_be_below_max_total() -> None:
    message = error_of(max_input_tokens=512, max_total_tokens=512)
    assert message == (
        "--max-input-tokens 512 must be < --max-total-tokens 512 "
        "(lower --max-input-tokens to at most 511, or raise --max-total-tokens above 512)"
    )


def test_env_value_is_named_by_its_variable() -> None:
    message = error_of(env={"MAX_INPUT_TOKENS": "600"}, max_total_tokens=512)
    assert message.startswith("MAX_INPUT_TOKENS=600 must be < --max-total-tokens 512")


def test_max_total_beyond_model_positions() -> None:
    message = error_of(GPT2, max_total_tokens=2048)
    assert "--max-total-tokens 2048 exceeds the model's 1024 positions" in message
    assert "set --max-total-tokens 1024 or less" in message


def test_prefill_must_hold_one_max_prompt() -> None:
    message = error_of(max_input_tokens=500, max_total_tokens=1000, max_batch_prefill_tokens=400)
    assert "--max-batch-prefill-tokens 400 must be >= --max-input-tokens 500" in message
    assert "set --max-batch-prefill-tokens 500 or more" in message


def test_prefill_must_fit_batch_total() -> None:
    message = error_of(
        max_total_tokens=512, max_batch_prefill_tokens=4096, max_batch_total_tokens=2048
    )
    assert "--max-batch-prefill-tokens 4096 must be <= --max-batch-total-tokens 2048" in message


def test_max_total_must_fit_batch_total() -> None:
    message = error_of(
        max_total_tokens=1024,
        max_input_tokens=100,
        max_batch_prefill_tokens=200,
        max_batch_total_tokens=512,
    )
    assert "--max-total-tokens 1024 must be <= --max-batch-total-tokens 512" in message
    assert "raise --max-batch-total-tokens to at least 1024" in message


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"max_concurrent_requests": 0}, "--max-concurrent-requests 0 must be >= 1"),
        ({"max_best_of": 0}, "--max-best-of 0 must be >= 1"),
        ({"max_stop_sequences": -1}, "--max-stop-sequences -1 must be >= 0"),
        ({"waiting_served_ratio": 0.0}, "--waiting-served-ratio 0.0 must be > 0"),
        ({"backend": "tpuv5"}, "--backend 'tpuv5' is not a backend"),
        ({"dtype": "int4"}, "--dtype 'int4' is not a supported dtype"),
    ],
)
def test_value_rules(flags: dict[str, object], expected: str) -> None:
    assert expected in error_of(**flags)


def test_env_parse_errors_name_the_variable() -> None:
    assert error_of(env={"MAX_TOTAL_TOKENS": "lots"}) == (
        "MAX_TOTAL_TOKENS='lots' is not an integer (set MAX_TOTAL_TOKENS to a whole number)"
    )
    assert "WARMUP_ENABLED='maybe' is not a boolean" in error_of(env={"WARMUP_ENABLED": "maybe"})


def test_dtype_aliases_normalized() -> None:
    assert build(dtype="bf16").dtype == "bfloat16"
    assert build(dtype="half").dtype == "float16"


# --- static shapes: tpu ------------------------------------------------------------------

TPU_ENV = {"HF_BATCH_SIZE": "4", "HF_SEQUENCE_LENGTH": "1024"}


def test_tpu_derives_unset_limits_from_shape() -> None:
    config = build(MISTRAL, TPU_ENV, backend="tpu")
    assert (config.max_concurrent_requests, config.max_batch_size) == (4, 4)
    assert (config.max_total_tokens, config.max_input_tokens) == (1024, 1023)
    assert config.max_batch_prefill_tokens == 4 * 1023
    assert config.max_batch_total_tokens == 4096


def test_tpu_shape_from_flags_without_env() -> None:
    config = build(MISTRAL, backend="tpu", max_batch_size=2, max_total_tokens=512)
    assert config.static_shape is not None
    assert (config.static_shape.batch_size, config.static_shape.sequence_length) == (2, 512)


def test_tpu_concurrent_requests_must_equal_batch_size() -> None:
    message = error_of(MISTRAL, TPU_ENV, backend="tpu", max_concurrent_requests=128)
    assert message == (
        "--max-concurrent-requests 128 must equal the static batch size 4 (HF_BATCH_SIZE) on the tpu "
        "backend (set --max-concurrent-requests 4, or change HF_BATCH_SIZE / HF_SEQUENCE_LENGTH)"
    )


def test_tpu_max_batch_size_must_equal_batch_size() -> None:
    assert "--max-batch-size 8 must equal the static batch size 4" in error_of(
        MISTRAL, TPU_ENV, backend="tpu", max_batch_size=8
    )


def test_tpu_max_total_must_equal_max_length() -> None:
    message = error_of(MISTRAL, TPU_ENV, backend="tpu", max_total_tokens=2048)
    assert (
        "--max-total-tokens 2048 must equal the static sequence length (max_length) 1024" in message
    )
    assert "set --max-total-tokens 1024" in message


def test_tpu_max_input_must_be_below_max_length() -> None:
    message = error_of(MISTRAL, TPU_ENV, backend="tpu", max_input_tokens=1024)
    assert (
        "--max-input-tokens 1024 must be lower than the static sequence length (max_length) 1024"
        in message
    )


def test_tpu_prefill_must_equal_batch_times_input() -> None:
    message = error_of(
        MISTRAL, TPU_ENV, backend="tpu", max_input_tokens=512, max_batch_prefill_tokens=512
    )
    assert (
        "--max-batch-prefill-tokens 512 must be batch_size x max_input_tokens = 4 x 512 = 2048"
        in message
    )


def test_tpu_batch_total_must_equal_max_tokens() -> None:
    message = error_of(MISTRAL, TPU_ENV, backend="tpu", max_batch_total_tokens=8192)
    assert (
        "--max-batch-total-tokens 8192 must equal batch_size x max_length = 4 x 1024 = 4096"
        in message
    )


# --- static shapes: neuron ---------------------------------------------------------------


def test_neuron_prefill_mismatch_is_advice_not_error() -> None:
    config = build(
        LLAMA2_NEURON_BUDGET, backend="neuron", max_batch_prefill_tokens=2000, max_input_tokens=1000
    )
    assert any(
        "should be batch_size x max_input_tokens = 1 x 1000 = 1000" in n for n in config.notes
    )


def test_neuron_env_must_match_compiled_shape() -> None:
    message = error_of(LLAMA2_NEURON_BUDGET, {"HF_BATCH_SIZE": "4"}, backend="neuron")
    assert message.startswith("HF_BATCH_SIZE=4 does not match the compiled model's batch_size=1")
    assert "HF_SEQUENCE_LENGTH=4096 does not match" in error_of(
        LLAMA2_NEURON_BUDGET, {"HF_SEQUENCE_LENGTH": "4096"}, backend="neuron"
    )
    assert "HF_NUM_CORES=8 does not match the compiled model's num_cores=2" in error_of(
        LLAMA2_NEURON_BUDGET, {"HF_NUM_CORES": "8"}, backend="neuron"
    )
    assert "HF_AUTO_CAST_TYPE=bf16 does not match" in error_of(
        LLAMA2_NEURON_BUDGET, {"HF_AUTO_CAST_TYPE": "bf16"}, backend="neuron"
    )


def test_neuron_flags_must_match_compiled_shape() -> None:
    assert "--max-batch-size 4 must equal the static batch size 1 (config.neuron)" in error_of(
        LLAMA2_NEURON_BUDGET, backend="neuron", max_batch_size=4
    )
    assert (
        "--max-total-tokens 4096 must equal the static sequence length (max_length) 2048"
        in error_of(LLAMA2_NEURON_BUDGET, backend="neuron", max_total_tokens=4096)
    )
    assert "--num-shard 4 does not match the 2 Neuron cores" in error_of(
        LLAMA2_NEURON_BUDGET, backend="neuron", num_shard=4
    )
    assert "--dtype bfloat16 does not match the model's auto_cast_type fp16" in error_of(
        LLAMA2_NEURON_BUDGET, backend="neuron", dtype="bfloat16"
    )


def test_neuron_model_refuses_other_backends() -> None:
    assert "the model was exported for Neuron" in error_of(LLAMA2_NEURON_BUDGET, backend="cpu")


def test_neuron_facts_from_optimum_neuron_config_json() -> None:
    facts = ModelFacts.from_config(
        {"model_type": "llama", "max_position_embeddings": 4096},
        {"batch_size": 2, "sequence_length": 512, "tp_degree": 2, "torch_dtype": "bfloat16"},
    )
    assert facts.neuron == NeuronExport(2, 512, 2, "bf16", "neuron_config.json")
    legacy = ModelFacts.from_config(
        {
            "neuron": {
                "batch_size": 1,
                "sequence_length": 2048,
                "num_cores": 2,
                "auto_cast_type": "fp16",
            }
        }
    )
    assert legacy.neuron is not None and legacy.neuron.source == "config.json `neuron`"


def test_neuron_config_without_shape_is_an_error() -> None:
    with pytest.raises(ConfigError, match="lacks integer `batch_size` and `sequence_length`"):
        ModelFacts.from_config({"neuron": {"num_cores": 2}})


# --- gaudi ---------------------------------------------------------------------------------


def test_gaudi_pad_above_max_input_is_explained() -> None:
    message = error_of(LLAMA31, backend="gaudi", max_input_tokens=100, max_total_tokens=120)
    assert message == (
        "PAD_SEQUENCE_TO_MULTIPLE_OF=128 cannot be higher than --max-input-tokens 100: every prompt would "
        "be padded past the longest allowed prompt (set PAD_SEQUENCE_TO_MULTIPLE_OF to 100 or less, "
        "or raise --max-input-tokens)"
    )


def test_gaudi_length_buckets_end_at_max_input() -> None:
    config = build(
        LLAMA31,
        {"PAD_SEQUENCE_TO_MULTIPLE_OF": "64"},
        backend="gaudi",
        max_input_tokens=200,
        max_total_tokens=400,
    )
    assert config.gaudi is not None and config.gaudi.length_buckets == (64, 128, 192, 200)


def test_gaudi_batch_rounding_note() -> None:
    config = build(LLAMA31, backend="gaudi", max_batch_size=10)
    assert config.gaudi is not None and config.gaudi.decode_batch_size == 16
    assert any("--max-batch-size 10 is padded to 16" in n for n in config.notes)


def test_gaudi_env_validation() -> None:
    assert "BATCH_BUCKET_SIZE=0 must be >= 1" in error_of(
        LLAMA31, {"BATCH_BUCKET_SIZE": "0"}, backend="gaudi"
    )
    assert "ENABLE_HPU_GRAPH='sometimes' is not a boolean" in error_of(
        LLAMA31, {"ENABLE_HPU_GRAPH": "sometimes"}, backend="gaudi"
    )
    assert "PROF_RANKS='a,b' is not a comma-separated list" in error_of(
        LLAMA31, {"PROF_RANKS": "a,b"}, backend="gaudi"
    )


def test_gaudi_profiler_and_graph_variables_read() -> None:
    env = {
        "PROF_WAITSTEP": "10",
        "PROF_WARMUPSTEP": "10",
        "PROF_STEP": "1",
        "PROF_PATH": "/tmp/p",
        "PROF_RANKS": "0,1",
        "PROF_RECORD_SHAPES": "True",
        "ENABLE_HPU_GRAPH": "false",
        "WARMUP_ENABLED": "false",
        "QUEUE_THRESHOLD_MS": "250",
    }
    config = build(LLAMA31, env, backend="gaudi")
    g = config.gaudi
    assert g is not None and g.profiling and g.prof_ranks == (0, 1) and g.prof_record_shapes
    assert not g.enable_hpu_graph
    assert (config.warmup_enabled, g.queue_threshold_ms) == (False, 250)
    assert (g.rank, g.lazy_mode) == (0, True)
    g = build(LLAMA31, {"RANK": "3", "PT_HPU_LAZY_MODE": "0"}, backend="gaudi").gaudi
    assert g is not None and (g.rank, g.lazy_mode, g.queue_threshold_ms) == (3, False, 120)
    assert "RANK='x' is not an integer" in error_of(LLAMA31, {"RANK": "x"}, backend="gaudi")


def test_gaudi_skip_tokenizer_refused() -> None:
    assert error_of(LLAMA31, {"SKIP_TOKENIZER_IN_TGI": "true"}, backend="gaudi") == (
        "SKIP_TOKENIZER_IN_TGI=true asks for requests and responses made of token ids, which "
        "tgis's HTTP APIs do not take: the server always tokenizes (unset SKIP_TOKENIZER_IN_TGI "
        "(or set it to false))"
    )
    assert build(LLAMA31, {"SKIP_TOKENIZER_IN_TGI": "false"}, backend="gaudi").gaudi is not None


@pytest.mark.parametrize("backend", ["cpu", "cuda", "tpu"])
def test_gaudi_variables_refused_on_other_backends(backend: str) -> None:
    env = {"QUEUE_THRESHOLD_MS": "250", "BATCH_BUCKET_SIZE": "16"}
    assert error_of(LLAMA31, env, backend=backend) == (
        "BATCH_BUCKET_SIZE, QUEUE_THRESHOLD_MS configure the gaudi backend (seed 003's "
        f"settings), but the backend is {backend} (unset BATCH_BUCKET_SIZE, "
        "QUEUE_THRESHOLD_MS, or serve with --backend gaudi)"
    )


@pytest.mark.parametrize("backend", ["tpu", "gaudi"])
@pytest.mark.parametrize(
    ("flags", "env", "named"),
    [
        ({"num_shard": 2}, {}, "--num-shard 2"),
        ({"sharded": True}, {}, "--sharded true"),
        ({}, {"NUM_SHARD": "4"}, "NUM_SHARD=4"),
    ],
)
def test_sharding_refused_on_the_one_device_backends(
    backend: str, flags: dict[str, object], env: dict[str, str], named: str
) -> None:
    message = error_of(LLAMA31, env, backend=backend, **flags)
    assert message.startswith(f"{named}: the {backend} backend runs the model on one device")
    assert "--num-shard shards models on cpu and cuda" in message
    assert build(LLAMA31, backend=backend, num_shard=1, sharded=False).num_shard == 1


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_cpu_and_cuda_shard_with_tensor_parallelism(backend: str) -> None:
    config = build(LLAMA31, {"NUM_SHARD": "2", "MASTER_PORT": "29600"}, backend=backend)
    assert (config.num_shard, config.master_addr, config.master_port) == (2, "127.0.0.1", 29600)
    assert build(LLAMA31, backend=backend, num_shard=4, sharded=True).num_shard == 4
    assert "set --num-shard" in error_of(LLAMA31, backend=backend, sharded=True)
    assert "contradicts" in error_of(LLAMA31, backend=backend, num_shard=2, sharded=False)
    assert "is not a port" in error_of(LLAMA31, backend=backend, num_shard=2, master_port=70000)


def test_neuron_sharding_follows_its_cores() -> None:
    budget = LLAMA2_NEURON_BUDGET  # compiled for 2 cores
    assert build(budget, backend="neuron", sharded=True).num_shard == 2
    assert "--sharded false contradicts" in error_of(budget, backend="neuron", sharded=False)
    one_core = build_serve_config(
        LauncherArgs(backend="neuron"), GPT2, {"HF_NUM_CORES": "1", "HF_BATCH_SIZE": "1"}
    )
    assert one_core.num_shard == 1
    assert "but the model runs on one Neuron core" in error_of(
        GPT2, {"HF_NUM_CORES": "1"}, backend="neuron", sharded=True
    )


def test_device_compile_flags_apply_where_they_can() -> None:
    """--prefill-mode (static batch), --compile (cpu/cuda), --cuda-graphs (cuda) are refused
    elsewhere with the flag named; env names work too."""
    tpu = build(
        env={"HF_BATCH_SIZE": "2", "HF_SEQUENCE_LENGTH": "128"},
        backend="tpu",
        prefill_mode="Rebuild",
    )
    assert tpu.prefill_mode == "rebuild"
    assert build(backend="cpu", compile=True).compile is True
    assert build(backend="cuda", env={"TGIS_CUDA_GRAPHS": "true"}).cuda_graphs is True
    assert (
        build(backend="cpu", compile=True, env={"TGIS_COMPILE_CACHE": "/c"}).compile_cache == "/c"
    )
    # On cpu the compiled decode is on unless --no-compile, and its packages go there.
    assert build(backend="cpu", env={"TGIS_COMPILE_CACHE": "/c"}).compile is None
    assert "TGIS_COMPILE_CACHE=/c has nothing to keep on cpu with --no-compile" in error_of(
        backend="cpu", compile=False, env={"TGIS_COMPILE_CACHE": "/c"}
    )
    # Unset, the compiled decode is off where warmup is, or under tensor parallelism: a
    # cache there would keep nothing.
    no_warmup = error_of(backend="cpu", env={"TGIS_COMPILE_CACHE": "/c", "WARMUP_ENABLED": "false"})
    assert (
        "TGIS_COMPILE_CACHE=/c keeps the compiled decode's packages, and here decode stays "
        "eager: WARMUP_ENABLED=false" in no_warmup
    )
    assert "stays eager: --num-shard 2 shards the model" in error_of(
        backend="cpu", num_shard=2, compile_cache="/c"
    )
    assert "has nothing to keep on cuda:" in error_of(backend="cuda", compile_cache="/c")
    assert "has nothing to keep on gaudi" in error_of(backend="gaudi", compile_cache="/c")
    assert "on cuda with --cuda-graphs" in error_of(
        backend="cuda", cuda_graphs=True, compile_cache="/c"
    )
    assert "--prefill-mode all is not a prefill mode (use one of rebuild, insert)" in error_of(
        env={"HF_BATCH_SIZE": "2", "HF_SEQUENCE_LENGTH": "128"}, backend="tpu", prefill_mode="all"
    )
    assert "TGIS_PREFILL_MODE=insert applies to the static batch" in error_of(
        env={"TGIS_PREFILL_MODE": "insert"}, backend="cpu"
    )
    assert "--compile true applies to the cpu and cuda backends" in error_of(
        env={"HF_BATCH_SIZE": "2", "HF_SEQUENCE_LENGTH": "128"}, backend="tpu", compile=True
    )
    assert "--cuda-graphs true applies to the cuda backend, not cpu" in error_of(
        backend="cpu", cuda_graphs=True
    )
    assert "are two ways to compile decode" in error_of(
        backend="cuda", cuda_graphs=True, compile=True
    )
    # Graphs are recorded at warmup: asked for without it, they could not be honoured.
    assert "--cuda-graphs true: decode graphs are recorded at warmup, which" in error_of(
        backend="cuda", cuda_graphs=True, env={"WARMUP_ENABLED": "false"}
    )
    assert build(backend="cuda", env={"WARMUP_ENABLED": "false"}).cuda_graphs is None
    # So is compiled decode.
    assert "--compile true: decode graphs are compiled at warmup, which" in error_of(
        backend="cpu", compile=True, env={"WARMUP_ENABLED": "false"}
    )


def test_paged_engine_options() -> None:
    assert build(backend="cpu").prefix_caching is None  # on wherever the paged engine runs
    assert build(backend="cpu", env={"PREFIX_CACHING": "false"}).prefix_caching is False
    assert build(backend="cuda", prefix_caching=True).prefix_caching is True
    assert build(backend="cpu").speculate == 0
    assert build(backend="cpu", env={"SPECULATE": "4"}).speculate == 4
    assert build(backend="cuda", speculate=16).speculate == 16
    assert "--speculate 17 must be in [0, 16]" in error_of(backend="cpu", speculate=17)
    assert "SPECULATE=-1 must be in [0, 16]" in error_of(backend="cpu", env={"SPECULATE": "-1"})
    assert build(backend="cpu").draft_model is None
    assert build(backend="cpu", speculate=4, draft_model="org/small").draft_model == "org/small"
    drafted = build(backend="cuda", env={"SPECULATE": "3", "DRAFT_MODEL": "/models/small"})
    assert drafted.draft_model == "/models/small"
    assert (
        "--draft-model org/small drafts for speculative decoding, which is off (--speculate "
        "(derived: 0)) (set --speculate (SPECULATE) to the draft tokens per step, such as 4)"
    ) in error_of(backend="cpu", draft_model="org/small")
    assert "DRAFT_MODEL=x drafts for speculative decoding, which is off (--speculate 0)" in (
        error_of(backend="cpu", speculate=0, env={"DRAFT_MODEL": "x"})
    )
    assert "--draft-model x runs on one device; --num-shard 2 shards the model" in error_of(
        backend="cpu", speculate=2, draft_model="x", num_shard=2
    )
    # Async scheduling: unset (the engine decides by device), asked for, or off; never with
    # speculation.
    assert build(backend="cuda").async_scheduling is None
    assert build(backend="cpu", async_scheduling=True).async_scheduling is True
    off = build(backend="cuda", env={"TGIS_ASYNC_SCHEDULING": "false"})
    assert off.async_scheduling is False
    assert (
        "--async-scheduling true and --speculate 4: drafts are proposed from the tokens of the "
        "step before, which async scheduling plans the next step without (drop one of them "
        "(--speculate 0 or --no-async-scheduling))"
    ) in error_of(backend="cuda", async_scheduling=True, speculate=4)
    assert build(backend="cuda", async_scheduling=False, speculate=4).speculate == 4
    assert build(backend="cuda", env={"CUDA_MEMORY_FRACTION": "0.5"}).cuda_memory_fraction == 0.5
    assert "--cuda-memory-fraction 0.9 applies to the cuda backend, not cpu" in error_of(
        backend="cpu", cuda_memory_fraction=0.9
    )
    assert "CUDA_MEMORY_FRACTION=1.5 must be in (0, 1]" in error_of(
        backend="cuda", env={"CUDA_MEMORY_FRACTION": "1.5"}
    )
    assert "--cuda-memory-fraction 0.0 must be in (0, 1]" in error_of(
        backend="cuda", cuda_memory_fraction=0.0
    )


def test_neuron_export_at_start_up_defaults_within_the_model_positions() -> None:
    """A model not compiled yet gets optimum-neuron's 4096 default, capped at its positions."""
    small = ModelFacts("llama", 1024)
    config = build(small, backend="neuron")
    assert config.max_total_tokens == 1024 and config.static_shape is not None
    assert config.static_shape.sequence_length == 1024
    assert build(ModelFacts("llama", 8192), backend="neuron").max_total_tokens == 4096


# --- TGIS's names, the gRPC port, where values came from ----------------------------------


def test_tgis_names_set_tgis_settings_and_say_so() -> None:
    config = build(
        GPT2,
        {"MAX_SEQUENCE_LENGTH": "512", "DTYPE_STR": "float32"},
        model_name="/models/m",
        max_new_tokens=100,
    )
    assert (config.model_id, config.max_total_tokens, config.dtype) == ("/models/m", 512, "float32")
    sources = dict(config.sources)
    assert sources["max_total_tokens"] == "MAX_SEQUENCE_LENGTH"
    assert sources["dtype"] == "DTYPE_STR"
    assert sources["max_new_tokens"] == "--max-new-tokens"
    assert "max_sequence_length" not in sources  # shown under the setting it sets


@pytest.mark.parametrize(
    ("env", "flags", "names"),
    [
        (
            {},
            {"max_total_tokens": 512, "max_sequence_length": 512},
            ("--max-total-tokens", "--max-sequence-length"),
        ),
        ({"DTYPE_STR": "float32"}, {"dtype": "float32"}, ("--dtype", "DTYPE_STR")),
    ],
)
def test_both_names_of_one_setting_is_an_error(
    env: dict[str, str], flags: dict[str, object], names: tuple[str, str]
) -> None:
    message = error_of(GPT2, env, **flags)
    assert f"both {names[0]} and {names[1]} are set: they are one setting" in message


def test_playground_is_on_unless_turned_off() -> None:
    assert build().playground is True
    assert build(playground=False).playground is False
    assert build(GPT2, {"TGIS_PLAYGROUND": "false"}).playground is False
    assert build(GPT2, {"TGIS_PLAYGROUND": "false"}, playground=True).playground is True
    assert "TGIS_PLAYGROUND" in error_of(GPT2, {"TGIS_PLAYGROUND": "maybe"})


def test_image_settings_default_and_are_checked() -> None:
    config = build()
    assert config.allow_image_urls is False
    assert (config.max_images_per_request, config.max_image_pixels, config.max_image_bytes) == (
        8,
        4096 * 4096,
        20_000_000,
    )
    config = build(
        GPT2,
        {"TGIS_ALLOW_IMAGE_URLS": "true", "MAX_IMAGE_BYTES": "1000"},
        max_images_per_request=0,
        max_image_pixels=64,
    )
    assert config.allow_image_urls is True
    assert (config.max_images_per_request, config.max_image_pixels, config.max_image_bytes) == (
        0,
        64,
        1000,
    )
    assert "--max-images-per-request -1 must be >= 0" in error_of(GPT2, max_images_per_request=-1)
    assert "MAX_IMAGE_PIXELS=0 must be >= 1" in error_of(GPT2, {"MAX_IMAGE_PIXELS": "0"})


def test_grpc_port_defaults_and_conflicts() -> None:
    assert build().grpc_port == 8033
    assert build(GPT2, {"GRPC_PORT": "9000"}).grpc_port == 9000
    assert build(grpc=False).grpc_port is None
    assert "is set but gRPC is off" in error_of(grpc=False, grpc_port=9000)
    assert "other than the HTTP port (3000)" in error_of(grpc_port=3000)
    assert "must be a port from 1 to 65535" in error_of(grpc_port=70000)


def test_grpc_defaults_of_output() -> None:
    config = build()
    assert config.default_include_stop_seqs and not config.output_special_tokens
    assert config.max_new_tokens is None and config.tls is None
    env = {"DEFAULT_INCLUDE_STOP_SEQS": "false", "OUTPUT_SPECIAL_TOKENS": "true"}
    config = build(GPT2, env)
    assert not config.default_include_stop_seqs and config.output_special_tokens
    assert "must be >= 1" in error_of(max_new_tokens=0)


def test_lora_adapter_settings(tmp_path: Path) -> None:
    plain = build(backend="cpu")
    assert (plain.lora_adapters, plain.lora_adapter_dir) == ((), None)
    assert (plain.max_loras, plain.max_lora_rank) == (8, 64)
    config = build(
        backend="cuda", lora_adapters=" support=/a/support , org/sql-lora,x.y=/b ",
        lora_adapter_dir=str(tmp_path), max_loras=2, env={"MAX_LORA_RANK": "16"},
    )  # fmt: skip
    assert config.lora_adapters == (
        ("support", "/a/support"), ("org/sql-lora", "org/sql-lora"), ("x.y", "/b"),
    )  # fmt: skip
    assert (config.lora_adapter_dir, config.max_loras, config.max_lora_rank) == (
        str(tmp_path), 2, 16,
    )  # fmt: skip
    assert "LORA_ADAPTERS=a=/x,a=/y names 'a' twice" in error_of(
        backend="cpu", env={"LORA_ADAPTERS": "a=/x,a=/y"}
    )
    assert "--lora-adapters =/x: '=/x' is not name=path" in error_of(
        backend="cpu", lora_adapters="=/x"
    )
    assert "--lora-adapters ../up=/x: '../up=/x' is not name=path" in error_of(
        backend="cpu", lora_adapters="../up=/x"
    )
    assert "--max-loras 0 must be in [1, 1024]" in error_of(backend="cpu", max_loras=0)
    assert "MAX_LORA_RANK=2000 must be in [1, 1024]" in error_of(
        backend="cpu", env={"MAX_LORA_RANK": "2000"}
    )
    assert f"--lora-adapter-dir {tmp_path / 'none'} is not a directory" in error_of(
        backend="cpu", lora_adapter_dir=str(tmp_path / "none")
    )


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_multi_node_settings_from_torchrun_variables(backend: str) -> None:
    env = {
        "NUM_SHARD": "16", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29600", "TGIS_SOCKET_IFNAME": "eth1", "TGIS_JOIN_TIMEOUT_S": "90",
        "TGIS_NODE_TIMEOUT_S": "12",
    }  # fmt: skip
    config = build(LLAMA31, env, backend=backend)
    assert (config.num_shard, config.nnodes, config.node_rank) == (16, 2, 1)
    assert (config.master_addr, config.master_port, config.socket_ifname) == (
        "10.0.0.1", 29600, "eth1",
    )  # fmt: skip
    assert (config.join_timeout_s, config.node_timeout_s) == (90.0, 12.0)
    # A flag wins over its variable; one node by default.
    assert build(LLAMA31, env, backend=backend, node_rank=0).node_rank == 0
    plain = build(LLAMA31, backend=backend, num_shard=2)
    assert (plain.nnodes, plain.node_rank, plain.socket_ifname) == (1, 0, None)
    assert (plain.join_timeout_s, plain.node_timeout_s) == (600.0, 30.0)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            {"num_shard": 3, "nnodes": 2, "master_addr": "10.0.0.1"},
            "--num-shard 3 does not divide over --nnodes 2: every node runs the same number "
            "of shards (set --num-shard to a multiple of 2",
        ),
        (
            {"num_shard": 4, "nnodes": 2, "node_rank": 2, "master_addr": "10.0.0.1"},
            "--node-rank 2 is not a node of --nnodes 2 (number the nodes 0 to 1",
        ),
        (
            {"num_shard": 4, "nnodes": 2},
            "--master-addr (derived: 127.0.0.1) is a loopback address, which the other nodes "
            "of --nnodes 2 cannot reach (set --master-addr (MASTER_ADDR) to node 0's address",
        ),
        (
            {"num_shard": 4, "nnodes": 2, "master_addr": "localhost"},
            "--master-addr localhost is a loopback address",
        ),
        ({"nnodes": 0}, "--nnodes 0 must be >= 1"),
        ({"node_rank": -1}, "--node-rank -1 must be >= 0"),
        ({"num_shard": 2, "node_timeout_s": 0.0}, "--node-timeout-s 0.0 must be a positive"),
        ({"num_shard": 2, "join_timeout_s": -1.0}, "--join-timeout-s -1.0 must be a positive"),
    ],
)
def test_multi_node_settings_are_checked(flags: dict[str, object], expected: str) -> None:
    assert error_of(LLAMA31, backend="cpu", **flags).startswith(expected)


def test_multi_node_is_refused_on_the_one_host_backends() -> None:
    message = error_of(LLAMA31, backend="tpu", nnodes=2, node_rank=1)
    assert message.startswith("--nnodes 2: the tpu backend runs on one host")
    assert "drop --nnodes and --node-rank" in message
    alone = error_of(LLAMA31, {"NODE_RANK": "1"}, backend="gaudi")
    assert alone.startswith("NODE_RANK=1: the gaudi backend runs on one host")


def test_attention_backend_is_normalised_and_refused_where_it_chooses_nothing() -> None:
    assert build(backend="cpu").attention_backend is None
    assert build(backend="cpu", attention_backend="auto").attention_backend is None
    assert build(backend="cuda", attention_backend=" Triton ").attention_backend == "triton"
    env = build(backend="cpu", env={"TGIS_ATTENTION_BACKEND": "torch"})
    assert env.attention_backend == "torch"
    assert error_of(backend="cpu", attention_backend="sdpa") == (
        "--attention-backend sdpa is not an attention backend (use one of auto, triton, flash, "
        "torch)"
    )
    assert "flash attention over KV pages runs on CUDA; this is the cpu backend" in error_of(
        backend="cpu", attention_backend="flash"
    )
    assert error_of(backend="cpu", env={"TGIS_ATTENTION_BACKEND": "flash"}).startswith(
        "TGIS_ATTENTION_BACKEND=flash: flash attention over KV pages runs on CUDA"
    )
    assert "the cpu and cuda backends; gaudi runs its own" in error_of(
        backend="gaudi", attention_backend="torch"
    )
