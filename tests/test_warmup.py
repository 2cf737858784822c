"""tgis.warmup: the plan a backend gives is what runs, and the report says what it holds."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from tests.backends.conftest import VARIANTS, make_backend
from tests.factories import tiny_model
from tests.server.conftest import make_config
from tgis.backends.static.batch import EagerOps, StaticBatchBackend
from tgis.backends.static.buckets import static_policy
from tgis.backends.static.kv import StaticLlamaForward
from tgis.engine.backend import Shape, ShapeTiming
from tgis.launch import build_service
from tgis.warmup import run_warmup


def llama() -> PreTrainedModel:
    return tiny_model("llama", seed=0, **VARIANTS["llama"][1])  # type: ignore[arg-type]


def test_static_backend_report() -> None:
    backend = StaticBatchBackend(
        StaticLlamaForward(llama(), 4, 64),
        static_policy(4, 64, 40),
        EagerOps(),
        "cpu-static",
    )
    config = make_config(max_input_tokens=40, max_total_tokens=64, compile_cache="/cache")
    plans: list[list[Shape]] = []
    heard: list[ShapeTiming] = []
    report = run_warmup(backend, config, on_plan=plans.append, on_shape=heard.append)
    # Insert mode, 4 slots of 64 positions, prompts of at most 40 tokens: prefill rows 1, 2, 4
    # (powers of two up to the batch) x lengths 16, 32, 40 (powers of two from 16, then the
    # longest prompt), then one decode over the whole static batch.
    assert plans == [
        [
            Shape("prefill", 1, 16),
            Shape("prefill", 1, 32),
            Shape("prefill", 1, 40),
            Shape("prefill", 2, 16),
            Shape("prefill", 2, 32),
            Shape("prefill", 2, 40),
            Shape("prefill", 4, 16),
            Shape("prefill", 4, 32),
            Shape("prefill", 4, 40),
            Shape("decode", 4, 1),
        ]
    ]
    assert [t.shape for t in report.timings] == plans[0] == [t.shape for t in heard]
    assert (report.max_sequences, report.max_sequence_tokens, report.kv_tokens) == (4, 64, 256)
    assert report.kv_budget_tokens is None  # fixed by the static shape
    assert report.compiled == 0 and report.seconds > 0
    data = report.to_dict()
    assert data["max_batch_total_tokens"] == 256
    assert [(s["phase"], s["rows"], s["length"]) for s in data["shapes"]] == [
        (shape.phase, shape.rows, shape.length) for shape in plans[0]
    ]
    assert report.summary().startswith("warmup: 10 shapes in ")
    assert "compile cache /cache" in report.summary()


def test_dynamic_backend_plan_follows_max_batch_size() -> None:
    backend = make_backend(llama(), max_sequences=16, max_sequence_tokens=64)
    report = run_warmup(backend, make_config(max_batch_size=6, max_input_tokens=50))
    assert [t.shape for t in report.timings] == [
        Shape("prefill", 1, 50),
        Shape("prefill", 6, 8),
        Shape("decode", 1, 1),
        Shape("decode", 2, 1),
        Shape("decode", 4, 1),
        Shape("decode", 6, 1),
    ]
    assert report.kv_budget_tokens == 16 * 64
    assert backend.running == 0


def test_serve_warms_up_unless_disabled(demo_model_dir: Path) -> None:
    for enabled in (True, False):
        config = make_config(
            model_id=str(demo_model_dir), warmup_enabled=enabled, max_concurrent_requests=4
        )
        service = build_service(config, demo_model_dir)
        try:
            if enabled:
                assert service.warmup is not None
                # The paged cpu plan for 4 concurrent requests of up to 100 prompt tokens.
                assert [t.shape for t in service.warmup.timings] == [
                    Shape("prefill", 1, 100),
                    Shape("decode", 1, 1),
                    Shape("decode", 2, 1),
                    Shape("decode", 4, 1),
                ]
                assert service.warmup.max_sequences == 4
            else:
                assert service.warmup is None
        finally:
            service.engine.stop()


def test_paged_warmup_fits_sequences_shorter_than_its_decode_prompt(demo_model_dir: Path) -> None:
    """Warmup decodes after a short prompt; where a sequence holds fewer tokens than that
    prompt, it decodes after the longest prompt that fits instead of past the rope tables."""
    config = make_config(
        model_id=str(demo_model_dir), max_input_tokens=4, max_total_tokens=5,
        max_batch_prefill_tokens=8, max_concurrent_requests=2,
    )  # fmt: skip
    service = build_service(config, demo_model_dir, start_engine=False)
    try:
        assert service.warmup is not None
        shapes = [t.shape for t in service.warmup.timings]
        assert shapes[:2] == [Shape("prefill", 1, 4), Shape("decode", 1, 1)]
    finally:
        service.stop()


def test_the_backends_later_model_work_runs_on_the_engines_thread(demo_model_dir: Path) -> None:
    """What the paged backend does on the model after start-up (its compiled decode's
    packages loaded and timed when their build ends) is handed to the engine, which runs it
    between two steps on the thread that runs them: torch keeps one OpenMP team."""
    import threading

    config = make_config(model_id=str(demo_model_dir), max_concurrent_requests=2)
    service = build_service(config, demo_model_dir)
    try:
        ran_on = service.backend._model_thread(threading.current_thread)  # type: ignore[attr-defined]
        assert ran_on is not threading.current_thread() and ran_on.name == "tgis-engine"
    finally:
        service.engine.stop()
