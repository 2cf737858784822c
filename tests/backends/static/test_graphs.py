"""Device graphs over the static batch (GraphedStaticModel, which gaudi's HPU graphs run).

On a CPU nothing can be recorded: `RerunningApi` stands in for a device's graph API by running
the step's Python again at each replay asked of it. With it the tests check GraphedStaticModel's
bookkeeping: one recording per bucket, later steps of a bucket copy their inputs into the
tensors the recorded step reads and get a copy of its output, and the tokens equal generate's.
They cannot check that a device replays what it recorded: the cuda-marked test records real
CUDA graphs where a GPU is present (HPU graphs need a Gaudi). The paged engine's CUDA graphs
are tested in paged/test_backend.py."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, greedy_reference
from tests.backends.scenarios import alone_run, random_prompts, staggered_greedy
from tgis.backends.common.warmup import powers_of_two
from tgis.backends.paged.graphs import CudaGraphApi
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


class RerunningApi:
    """A graph API on the CPU, which records nothing: capture runs the step and keeps it with
    the output tensor it returned; each replay asked for runs the same Python step again (on
    the input tensors it was built over) and writes the result into that output tensor, where
    a device graph writes its output. `replays_asked` counts the replays asked for."""

    def __init__(self) -> None:
        self.replays_asked = 0

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        output = step()
        return (step, output), output

    def replay(self, graph: Any) -> None:
        step, output = graph
        output.copy_(step())
        self.replays_asked += 1


def graphed_backend(
    model: PreTrainedModel, slots: int = 8, graph_prefill: bool = False
) -> tuple[StaticBatchBackend, GraphedStaticModel, RerunningApi]:
    api = RerunningApi()
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


def test_decode_records_once_per_bucket_then_refills_its_inputs(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    """Warmup records one decode step per rows bucket; staggered sequences then only ask for
    replays, each after copying the step's inputs into the recorded step's input tensors (a
    step computed from stale inputs would change the tokens, which equal generate's)."""
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
    assert api.replays_asked == graphed.replays > 0
    for seq_id, prompt in enumerate(prompts):
        assert tokens[seq_id] == greedy_reference(model, prompt, budgets[seq_id])


def test_each_step_gets_its_own_copy_of_the_graph_output(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    """The recorded step writes every step's logits into one tensor: GraphedStaticModel hands
    each step a copy, which the next step's replay leaves alone."""
    graphed = GraphedStaticModel(
        StaticLlamaForward(tiny_lm("llama"), 2, MAX_LENGTH), RerunningApi()
    )
    positions = torch.tensor([0, 0])
    first = graphed.decode_static(torch.tensor([5, 9]), positions, 2)
    kept = first.clone()
    second = graphed.decode_static(torch.tensor([7, 11]), positions, 2)
    assert (graphed.captures, graphed.replays) == (1, 1)
    assert not torch.allclose(second, kept)  # the replay wrote other logits...
    assert torch.equal(first, kept)  # ...not into the first step's


def test_prefill_graphs_per_rows_and_length(tiny_lm: Callable[..., PreTrainedModel]) -> None:
    """With prefill graphs on, a prefill is recorded per (rows, length) bucket; prompt
    logprobs (every position's logits) run eagerly and record nothing."""
    model = tiny_lm("llama")
    backend, graphed, _ = graphed_backend(model, slots=4, graph_prefill=True)
    assert alone_run(backend, PROMPTS[2], 4)[0] == greedy_reference(model, PROMPTS[2], 4)
    assert ("prefill", 1, 16) in graphed.graph_keys
    # Prompt logprobs never go through a graph.
    from tgis.engine.backend import PrefillItem

    before = graphed.captures
    backend.prefill([PrefillItem(5, PROMPTS[0], prompt_logprobs=True)])
    assert graphed.captures == before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_graph_replays_the_fixed_shape_decode(
    tiny_lm: Callable[..., PreTrainedModel],
) -> None:
    """GraphedStaticModel over real CUDA graphs (`CudaGraphApi`): the first decode step of a
    bucket records it, the later ones replay the recording on new inputs, and every step's
    logits equal those of a twin eager StaticLlamaForward given the same steps."""
    model = tiny_lm("llama")
    eager, recorded = (
        StaticLlamaForward(copy.deepcopy(model).to("cuda"), 2, MAX_LENGTH) for _ in range(2)
    )
    graphed = GraphedStaticModel(recorded, CudaGraphApi())
    prompts = PROMPTS[:2]
    length = max(len(p) for p in prompts)
    ids = torch.tensor([[*p, *[3] * (length - len(p))] for p in prompts], device="cuda")
    lengths = torch.tensor([len(p) for p in prompts], device="cuda")
    rows = torch.arange(2, device="cuda")
    tokens = eager.prefill_static(ids, lengths, rows).argmax(-1)
    graphed.prefill_static(ids, lengths, rows)  # eager: prefill graphs are off
    for step in range(5):
        expected = eager.decode_static(tokens, lengths + step, 2)
        torch.testing.assert_close(
            graphed.decode_static(tokens, lengths + step, 2), expected, atol=1e-4, rtol=0
        )
        tokens = expected.argmax(-1)
    assert graphed.graph_keys == [("decode", 2)]
    assert (graphed.captures, graphed.replays) == (1, 4)
