"""Tensor parallelism on CPU: 2 gloo processes give the greedy tokens of one, alone and in a
batch, on the bundled model (GQA, tied embeddings) and a tiny GQA Llama whose vocabulary does
not divide evenly; a killed shard ends the server with a message naming it."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tests.engine.test_engine import PROMPTS, collect, request, run
from tests.factories import save_model, tiny_model
from tgis.backends.common.quant import Quantization
from tgis.backends.paged import tensor_parallel
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.backends.paged.tensor_parallel import (
    ShardSettings,
    TensorParallelBackend,
    shard_unsupported_reason,
)
from tgis.benchmark.engine_mode import free_port
from tgis.engine.engine import Engine
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.types import GenerationRequest

TOKENS = 256


def settings(
    model_dir: Path, world: int = 2, device: str = "cpu", quantization: Quantization | None = None
) -> ShardSettings:
    return ShardSettings(
        model_dir=str(model_dir), device=device, dtype="float32", max_sequences=8,
        max_sequence_tokens=TOKENS, max_prefill_tokens=64, kv_tokens=8 * TOKENS,
        memory_fraction=None, master_addr="127.0.0.1", master_port=free_port(), world=world,
        quantization=quantization,
    )  # fmt: skip


def engine_over(backend: object, tokenizer: object) -> Engine:
    capacity = backend.capacity  # type: ignore[attr-defined]
    limits = SchedulerLimits(
        max_batch_prefill_tokens=64,
        max_batch_total_tokens=capacity.kv_tokens,
        max_sequences=8,
        prefill_step_tokens=capacity.prefill_step_tokens,
    )
    engine = Engine(backend, tokenizer, limits, 16, (tokenizer.eos_token_id,))  # type: ignore[arg-type, attr-defined]
    engine.start()
    return engine


def tokens_of(engine: Engine, reqs: list[GenerationRequest]) -> list[list[int]]:
    async def together() -> list[list[int]]:
        results = await asyncio.gather(*(collect(engine.generate(r)) for r in reqs))
        return [[e.token.id for e in events] for events in results]

    return run(together())


@pytest.fixture(scope="module")
def tiny_gqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 heads over 2 KV heads, vocabulary 127 (not a multiple of 2), untied head."""
    model = tiny_model(
        "llama", seed=3, vocab_size=127, tie_word_embeddings=False, intermediate_size=64
    )
    return save_model(model, tmp_path_factory.mktemp("gqa"))


def check_two_shards(
    model_dir: Path, device: str, quantization: Quantization | None = None, world: int = 2
) -> None:
    """Two shards' greedy tokens equal one device's, alone and batched; workers end on close.
    `quantization`: both quantize the weights at load (each shard its own slices)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reqs = [
        request(tokenizer, PROMPTS[i % len(PROMPTS)], f"r{i}", max_new_tokens=10, ignore_eos=True)
        for i in range(4)
    ]
    one = PagedTorchBackend.load(
        model_dir, device, "float32", max_sequences=8, max_sequence_tokens=TOKENS,
        max_prefill_tokens=64, kv_tokens=8 * TOKENS, quantization=quantization,
    )  # fmt: skip
    engine = engine_over(one, tokenizer)
    try:
        expected = [tokens_of(engine, [r])[0] for r in reqs]
    finally:
        engine.stop()
    assert len({tuple(t) for t in expected}) > 1
    sharded = TensorParallelBackend(
        settings(model_dir, world=world, device=device, quantization=quantization)
    )
    engine = engine_over(sharded, tokenizer)
    try:
        assert sharded.capacity.kv_tokens == one.capacity.kv_tokens
        assert [tokens_of(engine, [r])[0] for r in reqs] == expected  # alone
        assert tokens_of(engine, reqs) == expected  # in one batch
    finally:
        engine.stop()
        sharded.close()
    assert all(not w.is_alive() for w in sharded.group.workers)


def test_two_int4_shards_generate_what_one_int4_device_does(demo_model_dir: Path) -> None:
    """int4 groups never straddle a shard, so each shard's quantized slices are one device's
    quantized weight, sliced: the same tokens."""
    check_two_shards(demo_model_dir, "cpu", Quantization("int4", 32))


@pytest.mark.parametrize("fmt", ["gptq-v2", "compressed-int8"])
def test_two_shards_of_a_pre_quantized_checkpoint_generate_what_one_device_does(
    fmt: str, demo_model_dir: Path, tmp_path: Path
) -> None:
    """Each shard reads the stored projections and keeps its rows or whole groups of columns."""
    from transformers import AutoModelForCausalLM

    from tests.backends.common.test_quant_checkpoint import write_checkpoint

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    written = write_checkpoint(model, tmp_path / fmt, fmt)
    for path in demo_model_dir.iterdir():
        if path.is_file() and path.name not in ("config.json", "model.safetensors"):
            shutil.copy(path, written.model_dir / path.name)
    check_two_shards(written.model_dir, "cpu")


@pytest.mark.parametrize("which", ["demo", "tiny-gqa"])
def test_two_shards_generate_what_one_does(
    which: str, demo_model_dir: Path, tiny_gqa_dir: Path
) -> None:
    check_two_shards(demo_model_dir if which == "demo" else tiny_gqa_dir, "cpu")


@pytest.mark.parametrize("family", ["qwen3", "phi3", "olmo2", "gemma2", "qwen3_moe", "mixtral"])
def test_two_shards_of_every_kind_of_family_generate_what_one_does(
    family: str, tmp_path: Path
) -> None:
    """Per-head q/k norms (Qwen3), fused qkv_proj and gate_up_proj sliced part by part (Phi-3),
    q/k norms over a projection split across ranks (OLMo 2), soft-capping and windows
    (Gemma 2), experts split by their widths (Qwen3-MoE, Mixtral)."""
    from tests.backends.models.test_families import family_model

    check_two_shards(save_model(family_model(family, seed=11), tmp_path / family), "cpu")


@pytest.mark.parametrize("family", ["qwen3", "phi3", "olmo2"])
def test_more_shards_than_kv_heads_hold_each_kv_head_on_several(
    family: str, tmp_path: Path
) -> None:
    """4 shards of 4 heads over 2 KV heads: each rank one query head and a copy of its group's
    KV head (k/v with per-head norms, a fused qkv_proj's parts, and OLMo 2's q/k norms over
    the whole projection, whose share here is one head wide)."""
    from tests.backends.models.test_families import family_model

    check_two_shards(save_model(family_model(family, seed=5), tmp_path / family), "cpu", world=4)


def test_qwen2_moe_is_refused_naming_the_valid_shard_count() -> None:
    config = {"model_type": "qwen2_moe", "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 64, "moe_intermediate_size": 32}  # fmt: skip
    assert shard_unsupported_reason(config, 1) is None
    assert shard_unsupported_reason(config, 2) == (
        "transformers' Qwen2-MoE attention derives its head size from hidden_size / heads, so "
        "a rank's share of the heads cannot be built; --num-shard can be 1"
    )
    # An expert width the shard count does not divide is named among the widths.
    experts = {**config, "model_type": "qwen3_moe", "moe_intermediate_size": 30}
    assert shard_unsupported_reason(experts, 2) is None
    assert shard_unsupported_reason(experts, 4) == (
        "4 shards must divide its 4 attention heads and 64/30-wide MLP, and divide its 4 KV "
        "heads or be a multiple of them (each KV head then held by as many shards); "
        "--num-shard can be 1, 2"
    )


def test_a_killed_shard_ends_the_server_naming_it(demo_model_dir: Path) -> None:
    failures: list[str] = []
    done = threading.Event()

    def on_failure(message: str) -> None:
        failures.append(message)
        done.set()

    sharded = TensorParallelBackend(settings(demo_model_dir), on_failure=on_failure)
    try:
        (worker,) = sharded.group.workers
        os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
        assert done.wait(20)
        assert failures == ["shard 1 exited with code -9"]
    finally:
        sharded.close()  # the dead rank is not waited for


def test_a_failed_step_ends_the_group_with_its_error(
    demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank runs each step: one that fails on rank 0 leaves the others out of step."""
    failures: list[str] = []
    sharded = TensorParallelBackend(settings(demo_model_dir), on_failure=failures.append)
    try:

        def lost(message: object) -> None:
            raise RuntimeError("Connection closed by peer")

        monkeypatch.setattr(tensor_parallel, "_broadcast", lost)
        with pytest.raises(RuntimeError, match="closed by peer"):
            sharded.forward([])
        assert failures == [
            "a step failed on rank 0, which leaves the shards out of step: "
            "Connection closed by peer"
        ]
    finally:
        sharded.close()


def test_shard_counts_must_divide_the_heads() -> None:
    config = {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 704}
    assert shard_unsupported_reason(config, 2) is None
    assert shard_unsupported_reason(config, 8) is None  # each KV head on 2 shards
    assert shard_unsupported_reason(config, 3) == (
        "3 shards must divide its 8 attention heads and 704-wide MLP, and divide its 4 KV "
        "heads or be a multiple of them (each KV head then held by as many shards); "
        "--num-shard can be 1, 2, 4, 8"
    )
    # Llama-3.1-405B's shape: 8 KV heads over 16 shards (two hosts of 8 GPUs).
    big = {"num_attention_heads": 128, "num_key_value_heads": 8, "intermediate_size": 53248}
    assert shard_unsupported_reason(big, 16) is None
    assert "--num-shard can be 1, 2, 4, 8, 16, 32, 64, 128" in str(
        shard_unsupported_reason(big, 12)
    )


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_two_gpu_shards_generate_what_one_gpu_does(demo_model_dir: Path) -> None:
    """NCCL between two GPUs: the greedy tokens of one GPU, alone and batched."""
    check_two_shards(demo_model_dir, "cuda")
