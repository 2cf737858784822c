"""Device graphs over the static batch (GraphedStaticModel) with a CPU stand-in of a graph API,
and the cuda backend's --cuda-graphs mode (for real only where CUDA is available)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, VARIANTS, greedy_reference
from tests.backends.scenarios import alone_run, random_prompts, staggered_greedy
from tests.factories import make_model_dir, tiny_model
from tests.server.conftest import make_config
from tgis.backends.cuda_graphs import (
    CudaGraphApi,
    fit_slots,
    graph_policy,
    load_cuda_graph_backend,
)
from tgis.backends.graphs import GraphedStaticModel, GraphOps
from tgis.backends.static_batch import EagerOps, StaticBatchBackend
from tgis.backends.static_kv import StaticLlamaForward
from tgis.errors import ConfigError

MAX_LENGTH = 64


class RecordingGraphs:
    """A graph API on the CPU: recording runs the step and keeps it; replay runs it again on
    the recorded input tensors and writes into the recorded output, as a device graph does."""

    def __init__(self) -> None:
        self.recorded: list[Callable[[], torch.Tensor]] = []
        self.replays = 0

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        output = step()
        self.recorded.append(step)
        return (step, output), output

    def replay(self, graph: Any) -> None:
        step, output = graph
        output.copy_(step())
        self.replays += 1


def graphed_backend(
    model: PreTrainedModel, slots: int = 8, graph_prefill: bool = False
) -> tuple[StaticBatchBackend, GraphedStaticModel, RecordingGraphs]:
    api = RecordingGraphs()
    graphed = GraphedStaticModel(
        StaticLlamaForward(model, slots, MAX_LENGTH), api, graph_prefill=graph_prefill
    )
    backend = StaticBatchBackend(
        graphed,
        graph_policy(slots, MAX_LENGTH, 40),
        GraphOps("cpu", graphed),
        "graphs",
        pad_token_id=3,
    )
    return backend, graphed, api


def test_decode_is_recorded_once_per_bucket_and_replayed_exactly(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    model = tiny_lm("llama")
    prompts, budgets = random_prompts(7, seed=9, vocab=256)
    backend, graphed, api = graphed_backend(model)
    timings = backend.warmup(8, 40)
    assert sorted(k for k in graphed.graph_keys) == [("decode", n) for n in (1, 2, 4, 8)]
    assert sum(t.compiled for t in timings) == 4 == graphed.captures
    tokens, _ = staggered_greedy(
        backend, prompts, budgets, {0: range(0, 2), 2: range(2, 5), 5: range(5, 7)}, subsets=False
    )
    assert graphed.captures == 4 and backend.late_compilations == 0
    assert api.replays == graphed.replays > 0
    for seq_id, prompt in enumerate(prompts):
        assert tokens[seq_id] == greedy_reference(model, prompt, budgets[seq_id])


def test_outputs_survive_the_next_replay(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    backend, _, _ = graphed_backend(tiny_lm("llama"), slots=2)
    backend.warmup(2, 40)
    tokens_a, logits_a = alone_run(backend, PROMPTS[0], 5)
    # The logits of every step are distinct tensors, not views of the graph's output.
    assert len({t.data_ptr() for t in logits_a}) == len(logits_a)
    assert tokens_a == greedy_reference(tiny_lm("llama"), PROMPTS[0], 5)


def test_prefill_graphs_per_rows_and_length(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    model = tiny_lm("llama")
    backend, graphed, _ = graphed_backend(model, slots=4, graph_prefill=True)
    assert alone_run(backend, PROMPTS[2], 4)[0] == greedy_reference(model, PROMPTS[2], 4)
    assert ("prefill", 1, 16) in graphed.graph_keys
    # Prompt logprobs never go through a graph.
    from tgis.engine.backend import PrefillItem

    before = graphed.captures
    backend.prefill([PrefillItem(5, PROMPTS[0], prompt_logprobs=True)])
    assert graphed.captures == before


def test_graph_policy_and_slot_fitting() -> None:
    policy = graph_policy(12, 128, 100)
    assert policy.decode_batches == (1, 2, 4, 8, 12)
    assert policy.prefill_lengths == (16, 32, 64, 100)
    assert fit_slots(16, 1000, 10, 60_000) == 5  # six rows: five slots and the scratch row
    assert fit_slots(4, 1000, 10, 60_000) == 4
    with pytest.raises(ConfigError, match="cannot hold one sequence of 1000 tokens"):
        fit_slots(4, 1000, 10, 19_999)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_graphs_without_cuda_is_one_clear_error(tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path / "m", arch="llama")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        load_cuda_graph_backend(make_config(backend="cuda", cuda_graphs=True), model_dir)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_graphs_equal_eager_static() -> None:
    # A model of its own: `.to` moves a module in place, and the session's shared CPU model
    # must stay on the CPU for the tests after this one.
    arch, fields = VARIANTS["llama"]
    model = tiny_model(arch, seed=0, **fields).to("cuda")  # type: ignore[arg-type]
    prompts, budgets = random_prompts(5, seed=4, vocab=256)
    joins = {0: range(0, 2), 3: range(2, 5)}
    eager = StaticBatchBackend(
        StaticLlamaForward(model, 8, MAX_LENGTH),
        graph_policy(8, MAX_LENGTH, 40),
        EagerOps("cuda"),
        "eager",
        pad_token_id=3,
    )
    expected, _ = staggered_greedy(eager, prompts, budgets, joins, subsets=False)
    graphed = GraphedStaticModel(StaticLlamaForward(model, 8, MAX_LENGTH), CudaGraphApi())
    backend = StaticBatchBackend(
        graphed, graph_policy(8, MAX_LENGTH, 40), GraphOps("cuda", graphed), "cuda", pad_token_id=3
    )
    backend.warmup(8, 40)
    tokens, _ = staggered_greedy(backend, prompts, budgets, joins, subsets=False)
    assert tokens == expected and graphed.replays > 0
