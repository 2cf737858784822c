"""The batching thread: requests gathered into batches within the limits, each answered in its
own order with what the model gives that input alone; cancelled requests skipped, a failed
batch's requests given its error while the thread serves on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tests.pooling.models import TEXTS, bert_embedder, decoder_embedder
from tgis.errors import InputValidationError
from tgis.hub import read_model_config
from tgis.pooling.model import Encoded, PooledBatch, PoolingModel
from tgis.pooling.runner import PoolingRunner
from tgis.pooling.spec import read_pooling_spec


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> PoolingModel:
    directory = bert_embedder(tmp_path_factory.mktemp("runner") / "bert")
    spec = read_pooling_spec(directory, read_model_config(directory)[0])
    assert spec is not None
    return PoolingModel.load(directory, spec, dtype=torch.float32)


class Gated(PoolingModel):
    """The model, each batch held until the test lets it run, its batches recorded."""

    def __init__(self, inner: PoolingModel) -> None:
        super().__init__(inner.forward, inner.tokenizer, inner.spec, inner.config)
        self.gate = threading.Semaphore(0)
        # Released as a batch reaches the gate: the thread has taken it.
        self.entered = threading.Semaphore(0)
        self.batches: list[int] = []
        self.fail = False

    def run(self, batch: Sequence[Encoded], tokens: bool = False) -> PooledBatch:
        self.entered.release()
        self.gate.acquire(timeout=60)
        self.batches.append(len(batch))
        if self.fail:
            self.fail = False
            raise RuntimeError("the device failed")
        return super().run(batch, tokens)


@pytest.fixture
def gated(model: PoolingModel) -> Iterator[tuple[Gated, PoolingRunner]]:
    double = Gated(model)
    runner = PoolingRunner(double, max_batch_tokens=64 * 4, max_batch_rows=4)
    runner.start()
    yield double, runner
    double.gate.release(100)
    runner.stop()


def test_requests_are_batched_within_the_limits_and_answered_in_order(
    model: PoolingModel, gated: tuple[Gated, PoolingRunner]
) -> None:
    double, runner = gated
    encoded = [model.encode(t) for t in TEXTS]
    alone = [model.run([row]).rows[0] for row in encoded]
    first = runner.submit(encoded[:1])  # taken at once, alone
    assert double.entered.acquire(timeout=60)
    second = runner.submit(encoded)  # five inputs: four, then one with the third request
    third = runner.submit(encoded[2:3])
    double.gate.release(3)
    results = [f.result(60) for f in (first, second, third)]
    assert double.batches == [1, 4, 2]
    for got, want in zip([*results[0], *results[1], *results[2]], [alone[0], *alone, alone[2]], strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_batch_never_pads_past_its_token_budget(model: PoolingModel) -> None:
    widths = []

    runner = PoolingRunner(model, max_batch_tokens=40, max_batch_rows=8)
    runner.on_batch = lambda rows, tokens: widths.append(tokens)
    long = {"input_ids": [5] * 30}
    short = {"input_ids": [5] * 3}
    runner.start()
    try:
        assert len(runner.submit([short, short, long, short]).result(60)) == 4
    finally:
        runner.stop()
    assert all(tokens <= 40 for tokens in widths) and len(widths) >= 2
    with pytest.raises(InputValidationError, match="exceeds a batch's 40"):
        PoolingRunner(model, 40, 8).submit([{"input_ids": [5] * 41}])


def test_a_packed_models_batch_counts_its_tokens_not_its_padding(tmp_path: Path) -> None:
    directory = decoder_embedder(tmp_path / "qwen")
    spec = read_pooling_spec(directory, read_model_config(directory)[0])
    assert spec is not None
    packed = PoolingModel.load(directory, spec, dtype=torch.float32)
    assert packed.packed
    batches: list[tuple[int, int]] = []
    runner = PoolingRunner(packed, max_batch_tokens=40, max_batch_rows=8)
    runner.on_batch = lambda rows, tokens: batches.append((rows, tokens))
    long = {"input_ids": [5] * 30}
    short = {"input_ids": [5] * 3}
    runner.open()
    future = runner.submit([long, short, short, short, short])
    thread = threading.Thread(target=runner.run_loop, daemon=True)
    thread.start()
    try:
        assert len(future.result(60)) == 5
    finally:
        runner.stop()
        thread.join(30)
    # 30 + 3 + 3 + 3 = 39 tokens fit in 40 (padded, two rows would already be 60).
    assert batches == [(4, 39), (1, 3)]


def test_a_cancelled_request_is_skipped_and_a_failed_batch_fails_only_its_own(
    model: PoolingModel, gated: tuple[Gated, PoolingRunner]
) -> None:
    double, runner = gated
    row = model.encode(TEXTS[0])
    held = runner.submit([row])  # its batch waits at the gate
    assert double.entered.acquire(timeout=60)
    cancelled = runner.submit([row])
    assert cancelled.cancel()
    double.fail = True
    double.gate.release()
    with pytest.raises(RuntimeError, match="the device failed"):
        held.result(60)
    after = runner.submit([row])
    double.gate.release()
    assert len(after.result(60)) == 1
    assert double.batches == [1, 1]  # the cancelled request never ran


def test_a_coroutine_that_is_cancelled_cancels_its_request(
    model: PoolingModel, gated: tuple[Gated, PoolingRunner]
) -> None:
    double, runner = gated
    row = model.encode(TEXTS[1])

    async def ask_then_give_up() -> None:
        blocker = runner.submit([row])  # holds the thread at the gate
        assert double.entered.acquire(timeout=60)
        task = asyncio.ensure_future(runner.run([row]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        double.gate.release()
        await asyncio.wrap_future(blocker)

    asyncio.run(ask_then_give_up())
    assert double.batches == [1]


def test_per_token_requests_run_in_batches_of_their_own(
    model: PoolingModel, gated: tuple[Gated, PoolingRunner]
) -> None:
    double, runner = gated
    rows = [model.encode(t) for t in TEXTS[:3]]
    first = runner.submit(rows[:1])  # taken at once, alone
    assert double.entered.acquire(timeout=60)
    pooled = runner.submit(rows[1:2])
    tokens = runner.submit(rows, tokens=True)
    more = runner.submit(rows[2:3])
    double.gate.release(4)
    assert [len(f.result(60)) for f in (first, pooled, tokens, more)] == [1, 1, 3, 1]
    assert double.batches == [1, 1, 3, 1]  # arrival order kept: no pooled row joins the tokens'
    for row, states in zip(rows, tokens.result(), strict=True):
        assert states.shape == (len(row["input_ids"]), 32)
