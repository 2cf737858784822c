"""The tpu backend on XLA:CPU against the cpu backend: same greedy tokens, and after warmup
no serving step compiles (compilations counted with torch-xla's metrics)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.backends.conftest import VARIANTS, greedy_reference, make_backend
from tests.backends.scenarios import alone_run, random_prompts, staggered_greedy
from tests.factories import tiny_model
from tgis.backends.static.batch import StaticBatchBackend
from tgis.backends.static.buckets import static_policy
from tgis.backends.static.kv import StaticLlamaForward
from tgis.backends.static.xla import XlaOps
from tgis.engine.backend import Shape

MAX_LENGTH = 64
MAX_INPUT = 40
# static_policy(4, 64, 40, mode).warmup_plan(40), written out: insert prefills 1, 2 or 4 new
# rows of up to 40 prompt tokens; rebuild re-runs all 4 rows up to 63 positions.
PLANS = {
    "insert": [
        *(Shape("prefill", rows, length) for rows in (1, 2, 4) for length in (16, 32, 40)),
        Shape("decode", 4, 1),
    ],
    "rebuild": [
        *(Shape("prefill", 4, length) for length in (16, 32, 63)),
        Shape("decode", 4, 1),
    ],
}


@pytest.fixture(scope="module")
def ops() -> XlaOps:
    ops = XlaOps()
    assert ops.platform() == "CPU"
    return ops


def llama() -> torch.nn.Module:
    return tiny_model("llama", seed=0, **VARIANTS["llama"][1])  # type: ignore[arg-type]


def xla_backend(ops: XlaOps, mode: str, batch_size: int = 4) -> StaticBatchBackend:
    model = llama().to(ops.device)
    forward = StaticLlamaForward(model, batch_size, MAX_LENGTH)
    policy = static_policy(batch_size, MAX_LENGTH, MAX_INPUT, mode)  # type: ignore[arg-type]
    return StaticBatchBackend(forward, policy, ops, "tpu", pad_token_id=3)


@pytest.fixture(scope="module")
def scenario() -> Iterator[tuple[list[tuple[int, ...]], list[int], dict[int, range]]]:
    prompts, budgets = random_prompts(10, seed=3, vocab=256, max_len=MAX_INPUT)
    # Never more sequences than the 4 slots: joins wait for earlier ones to leave.
    joins = {0: range(0, 3), 1: range(3, 4), 13: range(4, 6), 26: range(6, 8), 39: range(8, 10)}
    yield prompts, budgets, joins


@pytest.mark.parametrize("mode", ["insert", "rebuild"])
def test_greedy_tokens_equal_the_cpu_backend_and_nothing_compiles_after_warmup(
    ops: XlaOps,
    mode: str,
    scenario: tuple[list[tuple[int, ...]], list[int], dict[int, range]],
) -> None:
    prompts, budgets, joins = scenario
    cpu = make_backend(llama(), max_sequences=4, max_sequence_tokens=MAX_LENGTH)
    expected, expected_logits = staggered_greedy(cpu, prompts, budgets, joins, subsets=False)

    backend = xla_backend(ops, mode)
    timings = backend.warmup(4, MAX_INPUT)
    assert [t.shape for t in timings] == PLANS[mode]
    # (Programs are cached per process: a shape an earlier test compiled is not compiled again.)
    compiled = ops.compilations()
    tokens, logits = staggered_greedy(backend, prompts, budgets, joins, subsets=False)
    assert ops.compilations() == compiled, "a serving step compiled after warmup"
    assert backend.late_compilations == 0
    assert tokens == expected
    for seq_id in expected:
        torch.testing.assert_close(
            torch.stack(logits[seq_id]), torch.stack(expected_logits[seq_id]), atol=1e-4, rtol=0
        )


def test_both_prefill_modes_agree_alone(ops: XlaOps) -> None:
    prompt = (5, 17, 42, 99, 7, 63, 120, 9, 8)
    insert = alone_run(xla_backend(ops, "insert", batch_size=2), prompt, 10)[0]
    rebuild = alone_run(xla_backend(ops, "rebuild", batch_size=2), prompt, 10)[0]
    # Both equal transformers' greedy generate, not merely each other.
    assert insert == rebuild == greedy_reference(llama(), prompt, 10)


def test_a_shape_warmup_missed_is_reported(ops: XlaOps) -> None:
    """Prompt logprobs need all-position logits: a graph warmup does not build. It compiles
    at first use, is counted and logged, and the answer is still right."""
    backend = xla_backend(ops, "insert")
    backend.warmup(4, MAX_INPUT)
    from tgis.engine.backend import PrefillItem

    out = backend.prefill([PrefillItem(1, (5, 6, 7), prompt_logprobs=True)])
    assert backend.late_compilations >= 1
    with torch.no_grad():
        full = llama()(torch.tensor([[5, 6, 7]])).logits[0]
    assert out.prompt[0] is not None
    torch.testing.assert_close(out.prompt[0], full, atol=1e-4, rtol=0)
