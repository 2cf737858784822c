"""tgis.launch: the scheduler's budgets come from the config and the loaded backend."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.engine.test_engine import request, tokenizer
from tests.engine.test_speculation import EDIT, Counts, outputs
from tests.factories import make_lora_adapter, make_model_dir, tiny_model, tiny_tokenizer
from tests.server.conftest import make_config
from tgis.backends.choose import load_backend
from tgis.config import GaudiSettings, check_kv_budget
from tgis.engine.backend import BackendCapacity
from tgis.engine.draft import DraftModelProposer
from tgis.errors import ConfigError, ModelNotFoundError
from tgis.launch import (
    StartupTimes,
    backend_runtime,
    build_service,
    load_draft_model,
    scheduler_limits,
    service_info,
    vocabulary_mismatch,
)
from tgis.server.http.metrics import Metrics

__all__ = ["tokenizer"]

CAPACITY = BackendCapacity(
    max_sequences=6, max_sequence_tokens=128, kv_tokens=768, kv_bytes_per_token=64,
    prefill_step_tokens=96,
)  # fmt: skip


def test_scheduler_limits_combine_config_and_capacity() -> None:
    config = make_config(max_batch_size=4, max_waiting_tokens=7, waiting_served_ratio=1.2)
    limits = scheduler_limits(config, CAPACITY, 700)
    assert (limits.max_batch_prefill_tokens, limits.max_batch_total_tokens) == (150, 700)
    assert (limits.max_sequences, limits.max_batch_size, limits.batch_limit) == (6, 4, 4)
    assert (limits.max_waiting_tokens, limits.waiting_served_ratio) == (7, 1.2)
    assert limits.prefill_step_tokens == 96
    assert limits.queue_threshold_ms is None  # first come, first served


def test_each_engine_gets_the_admission_policy_in_force() -> None:
    """TGI's policy on the slot engine (its defaults where unset); on the paged engine only
    when either setting is given, the other then at TGI's default."""
    paged = replace(CAPACITY, block_size=16)
    unset = make_config()
    assert (unset.waiting_served_ratio, unset.max_waiting_tokens) == (None, None)
    for config, on_slot, on_paged in (
        (unset, (0.3, 20), (0.0, 0)),
        (make_config(waiting_served_ratio=1.2), (1.2, 20), (1.2, 20)),
        (make_config(max_waiting_tokens=4), (0.3, 4), (0.3, 4)),
    ):
        for capacity, want in ((CAPACITY, on_slot), (paged, on_paged)):
            limits = scheduler_limits(config, capacity, 700)
            assert (limits.waiting_served_ratio, limits.max_waiting_tokens) == want


def test_info_reports_the_admission_policy_in_force(demo_model_dir: Path) -> None:
    for overrides, want in (({}, (0.0, 0)), ({"waiting_served_ratio": 2.0}, (2.0, 20))):
        config = make_config(warmup_enabled=False, **overrides)
        service = build_service(config, demo_model_dir, start_engine=False)
        try:
            info = service_info(service)
            assert (info.waiting_served_ratio, info.max_waiting_tokens) == want
        finally:
            service.stop()


def test_async_scheduling_reaches_the_engine(demo_model_dir: Path) -> None:
    """--async-scheduling on a CPU (which schedules serially by default) and off."""
    from tgis.engine.step_runner import PackedSteps, PipelinedSteps

    for asked, runner in ((None, PackedSteps), (True, PipelinedSteps), (False, PackedSteps)):
        config = make_config(warmup_enabled=False, async_scheduling=asked)
        service = build_service(config, demo_model_dir, start_engine=False)
        try:
            assert type(service.engine.runner) is runner
        finally:
            service.stop()


def test_gaudi_queue_threshold_reaches_the_scheduler() -> None:
    config = make_config(backend="gaudi", gaudi=GaudiSettings(queue_threshold_ms=250))
    assert scheduler_limits(config, CAPACITY, 700).queue_threshold_ms == 250


def test_kv_budget_is_the_smaller_of_flag_and_capacity() -> None:
    assert check_kv_budget(make_config(), 768) == 768
    assert check_kv_budget(make_config(max_batch_total_tokens=300), 768) == 300
    assert check_kv_budget(make_config(max_batch_total_tokens=5000), 768) == 768
    with pytest.raises(ConfigError) as info:
        check_kv_budget(make_config(max_total_tokens=128), 100)
    assert str(info.value) == (
        "--max-total-tokens 128 must be <= the KV cache the cpu backend holds (100 tokens): one "
        "full-length request could never fit in the batch (lower --max-total-tokens to 100, or "
        "raise the KV cache (free device memory, or --max-batch-total-tokens) to at least 128)"
    )


def test_the_runtime_says_how_the_backend_runs(tmp_path: Path) -> None:
    """What the start-up log and /info say: the engine, its attention path and why, the
    decode graphs recorded (none on a CPU), the weights' layout, the KV pool (its dtype the
    model's without --kv-cache-dtype) and the dtype."""
    llama = make_model_dir(tmp_path / "llama", "llama")
    gpt2 = make_model_dir(tmp_path / "gpt2", "gpt2")
    paged = load_backend(make_config(max_batch_total_tokens=512, dtype="float32"), llama)
    facts = backend_runtime(paged)
    # The weight layout this CPU measured faster, and the times that chose it.
    assert re.fullmatch(
        r"(oneDNN packed|plain \[out, in\]) \(decode-shaped float32 matmuls: .*\)",
        facts.pop("weights"),
    )
    assert facts.pop("weight_bytes") == paged.path.weight_bytes() > 0
    assert facts == {
        "engine": "paged",
        "attention": "plain torch over head-major KV blocks (flash attention needs CUDA; "
        "this is cpu)",
        "cuda_graphs": [],
        "compiled_decode": [],
        "compiled_decode_state": "off",
        "quantization": None,
        "kv_blocks": 512 // paged.block_size,
        "kv_block_size": paged.block_size,
        "kv_tokens": 512,
        "kv_cache_dtype": "float32",
        "dtype": "float32",
        "attention_backend": "torch",
        "attention_race_ms": {},  # one kernel runs here: nothing to race
    }
    slot = backend_runtime(load_backend(make_config(max_batch_total_tokens=512), gpt2))
    assert slot["engine"] == "slot" and slot["kv_tokens"] == 512 and "kv_blocks" not in slot


def test_quantized_weights_show_in_the_runtime_and_the_metrics(tmp_path: Path) -> None:
    """/info's runtime names the method and the weights' bytes; the app publishes them as the
    tgis_weight_bytes gauge labelled with the method."""
    from tests.server.fakes import FakeEngine
    from tgis.server import ModelInfo, create_app

    llama = make_model_dir(tmp_path / "llama", "llama")
    config = make_config(max_batch_total_tokens=512, dtype="float32", quantize="int8")
    facts = backend_runtime(load_backend(config, llama))
    assert facts["quantization"] == "int8"
    assert facts["weights"] == (
        "quantized: int8 weight-only, per output channel; lm_head unquantized"
    )
    metrics = Metrics()
    info = ModelInfo.from_config(config, runtime=facts)
    tokenizer = tiny_tokenizer()
    create_app(FakeEngine(tokenizer), tokenizer, config, info, metrics=metrics)
    text = metrics.render().decode()
    assert f'tgis_weight_bytes{{quantization="int8"}} {float(facts["weight_bytes"])}' in text


def test_vocabulary_mismatch_names_the_first_difference() -> None:
    assert vocabulary_mismatch({"a": 0, "b": 1}, {"b": 1, "a": 0}) is None
    assert vocabulary_mismatch({"a": 0, "b": 1}, {"a": 0, "b": 2}) == (
        "2 tokens and 2; 'b' is id 1 in the model's and id 2 in the draft's"
    )
    assert vocabulary_mismatch({"a": 0, "b": 1}, {"a": 0}) == (
        "2 tokens and 1; 'b' is id 1 in the model's and absent in the draft's"
    )
    assert vocabulary_mismatch({"a": 0}, {"a": 0, "c": 1}) == (
        "1 tokens and 2; the draft's has tokens the model's lacks"
    )


def test_a_draft_model_drafts_for_the_served_model(demo_model_dir: Path, tokenizer: Any) -> None:
    metrics = Metrics(128, 8)
    config = make_config(speculate=4, draft_model=str(demo_model_dir), warmup_enabled=False)
    service = build_service(config, demo_model_dir, observer=metrics)
    try:
        proposer = service.engine.proposer
        assert isinstance(proposer, DraftModelProposer)
        assert proposer.backend.capacity.kv_tokens == service.backend.capacity.kv_tokens
        assert proposer.vocab_size == len(tokenizer)
        reqs = [request(tokenizer, EDIT, "e", max_new_tokens=24, ignore_eos=True)]
        assert len(outputs(service.engine, reqs)[0]) == 24
    finally:
        service.stop()
    # The model drafting for itself: every draft token is its own greedy choice.
    counts = Counts(metrics)
    assert counts.drafted > 10 and counts.accepted == counts.drafted


def test_a_draft_model_needs_the_tokenizer_and_the_paged_engine(
    demo_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    shutil.copytree(demo_model_dir, other)
    extended = AutoTokenizer.from_pretrained(other)
    extended.add_tokens(["<extra-token>"])
    extended.save_pretrained(other)
    config = make_config(speculate=4, draft_model=str(other))
    with pytest.raises(ConfigError) as info:
        load_draft_model(config, tokenizer)
    assert str(info.value).startswith(
        f"--draft-model {other}: its tokenizer is not the model's ("
        f"{len(tokenizer)} tokens and {len(tokenizer) + 1}; the draft's has tokens"
    )
    llama = make_model_dir(tmp_path / "llama", "llama")
    gpt2 = make_model_dir(tmp_path / "gpt2", "gpt2")
    with pytest.raises(ConfigError, match="a draft model runs on the paged engine, which cannot"):
        load_draft_model(make_config(speculate=2, draft_model=str(gpt2)), tiny_tokenizer())
    draft = load_draft_model(make_config(speculate=2, draft_model=str(llama)), tiny_tokenizer())
    assert draft.kv_bytes_per_token > 0
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_draft_model(make_config(speculate=2, draft_model=str(tmp_path / "none")), tokenizer)


def test_adapters_need_the_paged_engine_and_servable_adapters(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    gpt2 = make_model_dir(tmp_path / "gpt2", "gpt2")
    with pytest.raises(
        ConfigError, match="LoRA adapters runs in the paged engine, which cannot run gpt2"
    ):
        build_service(make_config(lora_adapter_dir=str(tmp_path), warmup_enabled=False), gpt2)
    # An adapter of another model: its shapes are not the demo model's.
    make_lora_adapter(tiny_model("llama"), tmp_path / "other", target_modules=["q_proj"])
    config = make_config(lora_adapters=(("other", str(tmp_path / "other")),), warmup_enabled=False)
    with pytest.raises(ConfigError) as info:
        build_service(config, demo_model_dir)
    assert str(info.value).startswith(
        f"--lora-adapters other={tmp_path / 'other'}: layer 0 q_proj: lora_A is (4, "
    )


def test_start_up_starts_the_grammar_tokenizer_and_logs_its_phases(
    demo_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tokenizer's llguidance form is built from start-up on, in a thread of its own (not
    by the first grammar request, nor holding start-up); start-up logs where its time went.
    The engine's loop is left for the caller to run (start_engine=False, as `tgis serve`)."""
    caplog.set_level("INFO")
    service = build_service(make_config(), demo_model_dir, start_engine=False)
    try:
        grammars = service.engine.grammars
        assert grammars.wait(60)
        assert grammars._ll_tokenizer is not None and grammars.error is None
        messages = [r.getMessage() for r in caplog.records]
        (line,) = [m for m in messages if m.startswith("start-up: ")]
        # The demo model on a CPU: no profiling forward (the pool is sized by --max-batch-
        # total-tokens or the host's memory), warmup runs its plan.
        assert re.fullmatch(
            r"start-up: tokenizer \S+ s, load \S+ s, warmup \S+ s \(plan \S+ s\), "
            r"tokenizer facts \S+ s, engine \S+ s; grammar tokenizer (built in \S+ s|building "
            r"in a thread of its own)",
            line,
        ), line
        ready = "structured output ready: grammar tokenizer built in "
        # This service's build (another test's may still be ending in its own thread).
        assert grammars.build_s is not None
        assert f"{ready}{grammars.build_s:.2f} s" in messages
        assert not service.engine.healthy()  # not started: `tgis serve` runs it on its thread
    finally:
        service.stop()


def test_start_up_times_name_the_parts_of_a_phase() -> None:
    times = StartupTimes()
    times.done("load", {"profile": 0.5, "nothing": 0.0})
    times.done("warmup", {"compile": 1.25, "plan": 0.5})
    times.done("engine")
    text = str(times)
    assert re.fullmatch(
        r"load \S+ s \(profile 0\.50 s\), warmup \S+ s \(compile 1\.25 s, plan 0\.50 s\), "
        r"engine \S+ s",
        text,
    ), text
