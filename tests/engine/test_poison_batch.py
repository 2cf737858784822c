"""A batched step that raises is run again one sequence at a time: the row that poisons it
fails alone, and its 8 neighbours finish with the tokens they get without it — on the paged
engine and the slot engine, for a failing forward and for a failing sampling."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_engine import PROMPTS, request, tokenizer
from tests.engine.test_engine_isolation import outcomes
from tgis.backends.common.device import load_causal_lm
from tgis.backends.fallback.backend import TorchDynamicBackend
from tgis.backends.paged.attention import slots_of
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.engine import live as live_module
from tgis.engine import sampling as sampling_module
from tgis.engine.engine import Engine
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.types import GenerationRequest
from tgis.launch import eos_token_ids

__all__ = ["tokenizer"]

POISON = "poison"
POISON_SEED = 4242


class Counts:
    """An EngineObserver that counts failed steps by kind."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def on_step_failure(self, method: str, kind: str) -> None:
        self.failures.append(method)

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def paged_backend(demo_model_dir: Path) -> PagedTorchBackend:
    model = load_causal_lm(demo_model_dir, torch.device("cpu"), "float32")
    return PagedTorchBackend(
        model, max_sequences=16, max_sequence_tokens=256, max_prefill_tokens=512, kv_tokens=4096
    )


def slot_backend(demo_model_dir: Path) -> TorchDynamicBackend:
    return TorchDynamicBackend.load(
        demo_model_dir, "cpu", "float32", max_sequences=16, max_sequence_tokens=256
    )


BACKENDS: dict[str, Callable[[Path], Any]] = {"paged": paged_backend, "slot": slot_backend}


def make_engine(backend: Any, demo_model_dir: Path, tokenizer: Any, **kw: Any) -> Engine:
    limits = SchedulerLimits(
        max_batch_prefill_tokens=512, max_batch_total_tokens=4096, max_sequences=16
    )
    engine = Engine(backend, tokenizer, limits, 32, eos_token_ids(demo_model_dir, tokenizer), **kw)
    engine.start()
    return engine


def good_requests(tokenizer: Any) -> list[GenerationRequest]:
    """8 greedy requests (the comparison is exact)."""
    return [
        request(tokenizer, PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), f"r{i}",
                max_new_tokens=6, ignore_eos=True)
        for i in range(8)
    ]  # fmt: skip


def poisoned(tokenizer: Any) -> GenerationRequest:
    return request(
        tokenizer, PROMPTS[0], POISON, max_new_tokens=6, ignore_eos=True,
        do_sample=True, seed=POISON_SEED,
    )  # fmt: skip


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def setup(request: Any, demo_model_dir: Path, tokenizer: Any) -> Iterator[tuple[str, Any]]:
    """A backend kind, and the good requests' tokens without any poison."""
    engine = make_engine(BACKENDS[request.param](demo_model_dir), demo_model_dir, tokenizer)
    try:
        expected = outcomes(engine, good_requests(tokenizer))
    finally:
        engine.stop()
    assert all(isinstance(e, list) and len(e) == 6 for e in expected)
    yield request.param, expected


def poison_seq_ids(engine: Engine) -> set[int]:
    return {
        seq_id
        for seq_id, live in list(engine._live.items())
        if live.handle.request.request_id == POISON
    }


def poison_forward(backend: Any, engine_of: Callable[[], Engine]) -> None:
    """The backend's forward raises whenever the poisoned request's sequence is in it."""

    def guard(seq_ids: set[int]) -> None:
        if seq_ids & poison_seq_ids(engine_of()):
            raise RuntimeError("injected: a row poisons its batch")

    if isinstance(backend, PagedTorchBackend):
        forward = backend.forward

        def paged(items: Any) -> Any:
            guard({i.seq_id for i in items})
            return forward(items)

        backend.forward = paged  # type: ignore[method-assign]
    else:
        prefill, decode = backend.prefill, backend.decode

        def slot_prefill(items: Any) -> Any:
            guard({i.seq_id for i in items})
            return prefill(items)

        def slot_decode(seq_ids: Any, token_ids: Any) -> Any:
            guard(set(seq_ids))
            return decode(seq_ids, token_ids)

        backend.prefill, backend.decode = slot_prefill, slot_decode  # type: ignore[method-assign]


def check(
    kind: str,
    expected: list[list[int] | str],
    demo_model_dir: Path,
    tokenizer: Any,
    bad: GenerationRequest,
    message: str,
    forward_poisoned: bool = False,
) -> None:
    """`bad` among the 8 good requests, all at once: it fails with `message`, the 8 finish as
    without it, and the engine serves on."""
    backend = BACKENDS[kind](demo_model_dir)
    counts = Counts()
    engine = make_engine(backend, demo_model_dir, tokenizer, observer=counts)
    if forward_poisoned:
        poison_forward(backend, lambda: engine)
    try:
        reqs = good_requests(tokenizer)
        got = outcomes(engine, [*reqs[:4], bad, *reqs[4:]])
        assert message in str(got[4]), got[4]
        assert got[:4] + got[5:] == expected
        # Only the bad row's own step failed (alone); the batches it was in were rescued.
        assert len(counts.failures) == (0 if bad.params.decoder_input_details else 1)
        assert engine.healthy() and engine.in_flight == 0
        assert outcomes(engine, good_requests(tokenizer)) == expected  # still serving
    finally:
        engine.stop()


Setup = tuple[str, list[list[int] | str]]


def test_a_row_whose_forward_fails_fails_alone(
    setup: Setup, demo_model_dir: Path, tokenizer: Any
) -> None:
    bad = poisoned(tokenizer)
    check(*setup, demo_model_dir, tokenizer, bad, "RuntimeError: injected", forward_poisoned=True)


def test_a_row_whose_sampling_fails_fails_alone(
    setup: Setup, demo_model_dir: Path, tokenizer: Any, monkeypatch: Any
) -> None:
    launch = sampling_module.SamplingBatch.launch

    def failing_launch(self: Any, logits: Any) -> Any:
        if any(row.seed == POISON_SEED for row in self.rows):
            raise ValueError("injected: a row's sampling fails")
        return launch(self, logits)

    monkeypatch.setattr(sampling_module.SamplingBatch, "launch", failing_launch)
    check(*setup, demo_model_dir, tokenizer, poisoned(tokenizer), "ValueError: injected")


def test_a_request_whose_prompt_details_fail_fails_alone(
    setup: Setup, demo_model_dir: Path, tokenizer: Any, monkeypatch: Any
) -> None:
    record = live_module.LiveSequence.record_prefill

    def failing_record(self: Any, logits: Any, *start: int) -> None:
        if self.handle.request.request_id == POISON:
            raise IndexError("injected: prompt details fail")
        record(self, logits, *start)

    monkeypatch.setattr(live_module.LiveSequence, "record_prefill", failing_record)
    bad = request(tokenizer, PROMPTS[1], POISON, max_new_tokens=6, decoder_input_details=True)
    check(*setup, demo_model_dir, tokenizer, bad, "IndexError: injected")


def test_a_row_whose_forward_gives_nan_fails_alone_and_no_block_it_wrote_is_reused(
    demo_model_dir: Path, tokenizer: Any
) -> None:
    """The poisoned request's first forward leaves NaN in its logits and in every slot it
    wrote (a fault the same prompt would not meet twice): it fails alone, naming why, its
    8 neighbours get their tokens, and the same prompt asked again after it finds none of
    the blocks it filled in the prefix cache (they were full blocks, cached as computed)."""
    prompt = " ".join([PROMPTS[0]] * 4)
    again = request(tokenizer, prompt, "again", max_new_tokens=6, ignore_eos=True)
    assert len(again.input_ids) > 2 * 16  # two full blocks of the CPU's 16 tokens
    clean = make_engine(paged_backend(demo_model_dir), demo_model_dir, tokenizer)
    try:
        (reference,) = outcomes(clean, [again])
        expected = outcomes(clean, good_requests(tokenizer))
    finally:
        clean.stop()
    backend = paged_backend(demo_model_dir)
    counts = Counts()
    engine = make_engine(backend, demo_model_dir, tokenizer, observer=counts, prefix_caching=True)
    forward = backend.forward
    poisoned_once: list[int] = []

    def nan_forward(items: Any) -> Any:
        out = forward(items)
        bad = poison_seq_ids(engine) - set(poisoned_once)
        sampling = [i for i in items if i.sample]
        for item in items:
            if item.seq_id not in bad:
                continue
            poisoned_once.append(item.seq_id)
            slots = slots_of(item.block_table, 0, item.start + len(item.token_ids), 16)
            with torch.inference_mode():
                for cache in (*backend.path.pool.keys, *backend.path.pool.values):
                    cache.view(cache.shape[0], -1, cache.shape[-1])[:, slots] = float("nan")
                out.last[sampling.index(item)] = float("nan")
        return out

    backend.forward = nan_forward  # type: ignore[method-assign]
    try:
        bad = request(tokenizer, prompt, POISON, max_new_tokens=6, ignore_eos=True)
        reqs = good_requests(tokenizer)
        got = outcomes(engine, [*reqs[:4], bad, *reqs[4:]])
        assert "not finite" in str(got[4]), got[4]
        assert got[:4] + got[5:] == expected
        assert counts.failures == ["prefill"]
        assert outcomes(engine, [again]) == [reference]
        assert engine.healthy() and engine.in_flight == 0
    finally:
        engine.stop()
