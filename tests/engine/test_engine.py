"""The engine end to end over the real cpu backend and the bundled demo model's tokenizer."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engine.test_detokenize import count_vocabulary_walks
from tgis.backends.fallback.backend import TorchDynamicBackend
from tgis.engine.engine import Engine
from tgis.engine.scheduler import SchedulerLimits
from tgis.engine.types import FinishReason, GenerationRequest, TokenEvent
from tgis.errors import GenerationError, InputValidationError, OverloadedError
from tgis.launch import eos_token_ids
from tgis.params import GenerateParameters, GrammarSpec

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Parser:\n    def __init__(self, text):",
    "for i in range(10):",
    "# Copyright",
    "return self._",
    "    if x is None:\n        raise ValueError(",
    "from collections import",
]


@pytest.fixture(scope="module")
def hf_model(demo_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):
    return AutoTokenizer.from_pretrained(demo_model_dir)


def make_engine(
    demo_model_dir: Path,
    tokenizer,
    max_concurrent: int = 64,
    start: bool = True,
    eos: tuple[int, ...] | None = None,
    **limit_kw: object,
) -> Engine:
    """The engine over the demo model; `start`: its loop on a thread of its own; `eos`: EOS
    ids other than the model's."""
    # float32: greedy tokens are compared with transformers' float32 generate.
    backend = TorchDynamicBackend.load(
        demo_model_dir, "cpu", "float32", max_sequences=16, max_sequence_tokens=256
    )
    limits = SchedulerLimits(
        **{
            "max_batch_prefill_tokens": 2048,
            "max_batch_total_tokens": 16 * 256,
            "max_sequences": 16,
            **limit_kw,
        }  # type: ignore[arg-type]
    )
    if eos is None:
        eos = eos_token_ids(demo_model_dir, tokenizer)
    engine = Engine(backend, tokenizer, limits, max_concurrent, eos)
    if start:
        engine.start()
    return engine


@pytest.fixture(scope="module")
def engine(demo_model_dir: Path, tokenizer):
    eng = make_engine(demo_model_dir, tokenizer)
    yield eng
    eng.stop()


def request(tokenizer, prompt: str, rid: str = "r", **params: object) -> GenerationRequest:
    ids = tuple(tokenizer(prompt)["input_ids"])
    p = GenerateParameters(**{"max_new_tokens": 12, **params})  # type: ignore[arg-type]
    return GenerationRequest(rid, ids, p)


async def collect(stream: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
    return [event async for event in stream]


async def slots_freed(engine: Engine, failure: str) -> None:
    """Wait (5 s at most) until the engine runs no sequence, has no step in flight (async
    scheduling gives a sequence's blocks back once the step that wrote them is done), and its
    backend holds none (a slot backend's slots; a paged one's blocks are the scheduler's)."""
    for _ in range(100):
        idle = not engine.scheduler.running and not engine.runner.has_work
        if idle and getattr(engine.backend, "running", 0) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(failure)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


def test_greedy_matches_transformers_generate(engine: Engine, tokenizer, hf_model) -> None:
    req = request(tokenizer, PROMPTS[0], max_new_tokens=16, ignore_eos=True)
    events = run(collect(engine.generate(req)))
    ours = [e.token.id for e in events]
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([req.input_ids]),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert ours == ref[0, len(req.input_ids) :].tolist()
    completion = events[-1].completion
    assert completion is not None and completion.finish_reason is FinishReason.LENGTH
    assert completion.generated_tokens == 16
    assert "".join(e.text for e in events) == completion.generated_text
    assert completion.generated_text == tokenizer.decode(ours, skip_special_tokens=True)


def test_ignore_eos_runs_past_an_eos_the_model_picks(
    demo_model_dir: Path, tokenizer, hf_model
) -> None:
    """The model's greedy first token made an EOS id: a request stops on it, one with
    ignore_eos in the same batch takes it as an ordinary token and runs to max_new_tokens, and
    the consumer's side ends each where the loop does."""
    ids = tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        eos = int(hf_model(torch.tensor([ids])).logits[0, -1].argmax())
    engine = make_engine(demo_model_dir, tokenizer, eos=(eos,))

    async def both() -> list[list[TokenEvent]]:
        return await asyncio.gather(
            collect(engine.generate(request(tokenizer, PROMPTS[0], "stops", max_new_tokens=8))),
            collect(
                engine.generate(
                    request(tokenizer, PROMPTS[0], "runs", max_new_tokens=8, ignore_eos=True)
                )
            ),
        )

    try:
        stops, runs = run(both())
    finally:
        engine.stop()
    assert [e.token.id for e in stops] == [eos]
    ended = stops[-1].completion
    assert ended is not None and ended.finish_reason is FinishReason.EOS_TOKEN
    assert ended.generated_tokens == 1
    tokens = [e.token.id for e in runs]
    assert len(tokens) == 8 and tokens[0] == eos
    assert all(e.completion is None for e in runs[:-1])
    completion = runs[-1].completion
    assert completion is not None and completion.finish_reason is FinishReason.LENGTH
    assert completion.generated_tokens == 8
    assert completion.generated_text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_greedy_same_alone_and_in_a_batch_of_16(
    demo_model_dir: Path, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(demo_model_dir, tokenizer, waiting_served_ratio=0.0)
    # The rows of every decode step the backend runs: proof of who shared a step.
    decode_rows: list[int] = []
    real_decode = engine.backend.decode

    def counting_decode(seq_ids, token_ids):
        decode_rows.append(len(seq_ids))
        return real_decode(seq_ids, token_ids)

    monkeypatch.setattr(engine.backend, "decode", counting_decode)
    try:
        # ignore_eos: every sequence runs its 20 tokens, so none leaves before the others join.
        reqs = [
            request(
                tokenizer,
                PROMPTS[i % 8] + " " * (i // 8),
                f"r{i}",
                max_new_tokens=20,
                ignore_eos=True,
            )
            for i in range(16)
        ]
        alone = [[e.token.id for e in run(collect(engine.generate(r)))] for r in reqs]
        assert decode_rows == [1] * 16 * 19  # alone: 19 decode steps of one row each
        decode_rows.clear()

        async def together() -> list[list[int]]:
            results = await asyncio.gather(*(collect(engine.generate(r)) for r in reqs))
            return [[e.token.id for e in events] for events in results]

        assert run(together()) == alone
        assert all(len(tokens) == 20 for tokens in alone)
        # The 16 requests really were batched: at least one decode step carried all of them.
        assert max(decode_rows) == 16, decode_rows
        assert sum(decode_rows) == 16 * 19  # each sequence decoded once per step, no more
    finally:
        engine.stop()


def test_details_logprobs_and_prompt_logprobs(engine: Engine, tokenizer, hf_model) -> None:
    req = request(
        tokenizer,
        PROMPTS[1],
        max_new_tokens=4,
        details=True,
        decoder_input_details=True,
        top_n_tokens=3,
    )
    events = run(collect(engine.generate(req)))
    completion = events[-1].completion
    assert completion is not None
    with torch.no_grad():
        logits = hf_model(torch.tensor([req.input_ids])).logits[0].log_softmax(-1)
    prefill = completion.prefill
    assert [t.id for t in prefill] == list(req.input_ids) and prefill[0].logprob is None
    for j, tok in enumerate(prefill[1:], start=1):
        assert tok.logprob == pytest.approx(logits[j - 1, req.input_ids[j]].item(), abs=1e-4)
    first = events[0]
    assert first.token.logprob == pytest.approx(logits[-1].max().item(), abs=1e-4)
    assert first.token.rank == 1
    assert len(first.top_tokens) >= 3 and first.top_tokens[0].id == first.token.id
    assert len(completion.tokens) == 4


def test_seeded_sampling_is_reproducible(engine: Engine, tokenizer) -> None:
    req = request(tokenizer, PROMPTS[2], do_sample=True, temperature=0.9, top_k=20, seed=42)
    first = [e.token.id for e in run(collect(engine.generate(req)))]
    second = [e.token.id for e in run(collect(engine.generate(req)))]
    assert first == second
    assert run(collect(engine.generate(req)))[-1].completion.seed == 42  # type: ignore[union-attr]
    # The seed is what fixes the tokens: another seed samples another continuation.
    other = dataclasses.replace(req, params=dataclasses.replace(req.params, seed=43))
    assert [e.token.id for e in run(collect(engine.generate(other)))] != first


def test_stop_sequence_cut_and_reason(engine: Engine, tokenizer) -> None:
    probe = run(
        collect(engine.generate(request(tokenizer, PROMPTS[0], max_new_tokens=12, ignore_eos=True)))
    )
    text = probe[-1].completion.generated_text  # type: ignore[union-attr]
    stop = text.strip()[:3]
    assert stop, text
    events = run(
        collect(
            engine.generate(
                request(
                    tokenizer,
                    PROMPTS[0],
                    max_new_tokens=12,
                    stop=(stop,),
                    include_stop_sequence=False,
                )
            )
        )
    )
    completion = events[-1].completion
    assert completion is not None and completion.finish_reason is FinishReason.STOP_SEQUENCE
    assert completion.generated_text == text[: text.index(stop)]
    assert "".join(e.text for e in events) == completion.generated_text


def test_best_of_returns_every_candidate(engine: Engine, tokenizer) -> None:
    req = request(tokenizer, PROMPTS[3], max_new_tokens=6, best_of=3, do_sample=True, details=True)
    events = run(collect(engine.generate(req)))
    finals = {e.index: e.completion for e in events if e.completion is not None}
    assert sorted(finals) == [0, 1, 2]
    seeds = {c.seed for c in finals.values()}  # type: ignore[union-attr]
    assert len(seeds) == 3


def test_cancel_frees_the_slot_at_the_next_step(engine: Engine, tokenizer) -> None:
    async def start_and_abandon() -> None:
        stream = engine.generate(
            request(tokenizer, PROMPTS[4], max_new_tokens=200, ignore_eos=True)
        )
        await stream.__anext__()
        await stream.aclose()
        await slots_freed(engine, "the cancelled sequence still holds its slot")

    run(start_and_abandon())
    assert engine.in_flight == 0


def test_overload_is_refused_at_once(demo_model_dir: Path, tokenizer) -> None:
    engine = make_engine(demo_model_dir, tokenizer, max_concurrent=1)

    async def scenario() -> None:
        held = engine.generate(request(tokenizer, PROMPTS[5], max_new_tokens=100, ignore_eos=True))
        await held.__anext__()
        with pytest.raises(OverloadedError, match="Model is overloaded"):
            await engine.generate(request(tokenizer, PROMPTS[5])).__anext__()
        await held.aclose()

    try:
        run(scenario())
    finally:
        engine.stop()


def test_backend_failure_fails_its_requests_and_engine_keeps_serving(
    engine: Engine, tokenizer, monkeypatch
) -> None:
    real = engine.backend.decode
    calls = {"n": 0}

    def flaky(seq_ids, token_ids):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real(seq_ids, token_ids)

    monkeypatch.setattr(engine.backend, "decode", flaky)
    with pytest.raises(GenerationError, match="device lost"):
        run(
            collect(
                engine.generate(request(tokenizer, PROMPTS[6], max_new_tokens=8, ignore_eos=True))
            )
        )
    monkeypatch.setattr(engine.backend, "decode", real)
    events = run(
        collect(engine.generate(request(tokenizer, PROMPTS[7], max_new_tokens=3, ignore_eos=True)))
    )
    completion = events[-1].completion
    assert completion is not None and completion.generated_tokens == 3
    assert engine.backend.running == 0  # type: ignore[attr-defined]
    logprob = events[-1].token.logprob
    assert logprob is not None and math.isfinite(logprob) and logprob <= 0.0


def test_prompt_logprobs_refused_up_front_where_the_backend_has_none(
    engine: Engine, tokenizer, monkeypatch
) -> None:
    """A backend without prompt logits (neuron) refuses decoder_input_details with a 422-class
    error before anything is queued; other requests are served as usual."""
    capacity = dataclasses.replace(engine.backend.capacity, prompt_logprobs=False)
    monkeypatch.setattr(type(engine.backend), "capacity", property(lambda self: capacity))
    before = engine.in_flight
    with pytest.raises(InputValidationError, match=r"decoder_input_details.*not available"):
        run(collect(engine.generate(request(tokenizer, PROMPTS[0], decoder_input_details=True))))
    assert engine.in_flight == before
    events = run(
        collect(engine.generate(request(tokenizer, PROMPTS[0], max_new_tokens=2, ignore_eos=True)))
    )
    completion = events[-1].completion
    assert completion is not None and completion.finish_reason is FinishReason.LENGTH
    assert completion.generated_tokens == 2


def test_request_beyond_the_engine_budgets_is_refused_and_the_engine_keeps_serving(
    engine: Engine, tokenizer
) -> None:
    """A request validated against limits larger than the engine's KV budget (16 x 256) gets a
    422 naming the budgets; nothing is queued and the next request is served."""
    req = request(tokenizer, PROMPTS[0], rid="huge", max_new_tokens=16 * 256)
    with pytest.raises(InputValidationError, match="can never run within") as info:
        run(collect(engine.generate(req)))
    assert "max_batch_total_tokens=4096" in str(info.value)
    assert engine.healthy() and not engine.scheduler.waiting and engine.in_flight == 0
    events = run(
        collect(engine.generate(request(tokenizer, PROMPTS[1], max_new_tokens=3, ignore_eos=True)))
    )
    assert len(events) == 3 and events[-1].completion is not None


def test_requests_never_walk_the_vocabulary(demo_model_dir: Path) -> None:
    """What requests need of the tokenizer (its special ids, its size, its llguidance form) is
    read once: requests of every kind, streamed text, details, best_of and a grammar, call none
    of its vocabulary walks (`len(tokenizer)` and the like: a tenth of a second each, holding
    the GIL, with a 128k-token vocabulary)."""
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    reqs = [
        request(tok, PROMPTS[0], "a", max_new_tokens=4),
        request(tok, PROMPTS[1], "b", max_new_tokens=4, details=True, top_n_tokens=2,
                decoder_input_details=True, stop=["\n"]),
        request(tok, PROMPTS[2], "c", max_new_tokens=4, best_of=2, do_sample=True, seed=1,
                skip_special_tokens=False),
        request(tok, PROMPTS[3], "d", max_new_tokens=8, grammar=GrammarSpec.regex("[a-z]{2,6}")),
    ]  # fmt: skip
    walks = count_vocabulary_walks(tok)
    engine = make_engine(demo_model_dir, tok)
    try:
        started = sum(walks.values())

        async def all_of_them() -> list[list[TokenEvent]]:
            return list(await asyncio.gather(*(collect(engine.generate(r)) for r in reqs)))

        for _ in range(2):
            answers = run(all_of_them())
            assert [e[-1].completion is not None for e in answers] == [True] * len(reqs)
        assert sum(walks.values()) == started, walks
    finally:
        engine.stop()
