"""Device graphs over the static batch (GraphedStaticModel, gaudi's HPU graphs) with a CPU
stand-in of a graph API. The cuda backend's graphs are the paged engine's (paged/test_backend.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, greedy_reference
from tests.backends.scenarios import alone_run, random_prompts, staggered_greedy
from tgis.backends.common.warmup import powers_of_two
from tgis.backends.static.batch import StaticBatchBackend
from tgis.backends.static.buckets import MIN_LENGTH_BUCKET, ShapePolicy
from tgis.backends.static.graphs import GraphedStaticModel, GraphOps
from tgis.backends.static.kv import StaticLlamaForward

MAX_LENGTH = 64


def graph_policy(slots: int, max_length: int, max_input_tokens: int) -> ShapePolicy:
    """Decode over power-of-two row buckets up to `slots`; prefill padded to power-of-two rows
    and lengths."""
    return ShapePolicy(
        slots,
        max_length,
        "insert",
        powers_of_two(MIN_LENGTH_BUCKET, max_input_tokens),
        powers_of_two(1, slots),
        powers_of_two(1, slots),
    )


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
