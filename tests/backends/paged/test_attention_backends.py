"""--attention-backend in the paged backend: which attention runs, what is refused and why, and
tgis's Triton kernels serving whole steps (under Triton's interpreter on a CPU: the suite's
conftest sets TRITON_INTERPRET=1 where there is no GPU) with generate()'s greedy tokens."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, greedy_reference
from tests.backends.models.test_families import family_model
from tests.backends.paged.test_backend import NEW as NEW_GRAPHED
from tests.backends.paged.test_backend import assert_decodes_equal
from tests.backends.paged_driver import greedy, scheduler_for
from tests.factories import tiny_model
from tgis.backends.paged import attention as attention_module
from tgis.backends.paged import backend as paged_backend
from tgis.backends.paged.attention import paged_attention_reference
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.backends.paged.graphs import DecodeStep, decode_buckets
from tgis.backends.paged.traits import device_traits
from tgis.backends.paged.triton_attention import interpreted, triton_available
from tgis.errors import ConfigError

NEW = 4
# The kernels' device: a GPU where there is one (`make gpu-check` runs these, compiled, with
# `pytest -m cuda`), else the CPU through Triton's interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not interpreted() else "cpu")
needs_triton = pytest.mark.skipif(
    triton_available(DEVICE) is not None,
    reason=f"the Triton kernels cannot run: {triton_available(DEVICE)}",
)
pytestmark = pytest.mark.cuda


def model(arch: str = "llama", seed: int = 0, **overrides: object) -> PreTrainedModel:
    """Heads of 64 dims (the kernels' smallest tile), two query heads over one KV head."""
    fields = {
        "hidden_size": 128, "intermediate_size": 128, "vocab_size": 256,
        "num_attention_heads": 2, "num_key_value_heads": 1, **overrides,
    }  # fmt: skip
    return tiny_model(arch, seed=seed, **fields)  # type: ignore[arg-type]


def backend(m: PreTrainedModel, kernel: str | None, **kw: object) -> PagedTorchBackend:
    """A paged backend over a copy of `m`, on DEVICE for the Triton kernels (on the CPU
    otherwise)."""
    device = DEVICE if kernel == "triton" else torch.device("cpu")
    return PagedTorchBackend(
        copy.deepcopy(m).to(device),
        **{
            "max_sequences": 4, "max_sequence_tokens": 64, "max_prefill_tokens": 64,
            "kv_tokens": 16 * 8, "block_size": 8, "attention_backend": kernel, **kw,
        },  # type: ignore[arg-type]
    )  # fmt: skip


def test_auto_is_plain_torch_on_a_cpu_and_says_so() -> None:
    chosen = backend(model(), None)
    assert chosen.kernel == "torch" and not chosen.path.pool.flash
    assert chosen.runtime()["attention_backend"] == "torch"
    assert chosen.attention.startswith("plain torch over head-major KV blocks")
    asked = backend(model(), "torch")
    assert asked.attention == "plain torch over head-major KV blocks (--attention-backend torch)"


def test_a_backend_that_cannot_run_here_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match=r"--attention-backend flash: .*needs CUDA; this is cpu"):
        backend(model(), "flash")
    monkeypatch.setattr(paged_backend, "triton_available", lambda *_: "triton is not installed")
    with pytest.raises(ConfigError, match="Triton kernels cannot run here: triton is not install"):
        backend(model(), "triton")


@needs_triton
def test_triton_refuses_masks_it_has_no_form_for() -> None:
    with pytest.raises(ConfigError, match="attend to each other both ways"):
        backend(model(), "triton", bidirectional_images=True)


@needs_triton
def test_the_triton_kernels_give_generates_tokens_alone_batched_chunked_and_cached() -> None:
    """Float32: each prompt alone, all at once, prompts chunked by 5 tokens with prefix-cache
    hits (blocks of 8), over pools filled with NaN where nothing was written (this folder's
    conftest)."""
    m = model(seed=3)
    reference = [greedy_reference(m, p, NEW) for p in PROMPTS]
    shared = tuple(range(40, 56))
    cached = [(*shared, 9), (*shared, 7, 7)]
    cached_reference = [greedy_reference(m, p, NEW) for p in cached]
    served = backend(m, "triton")
    assert served.kernel == "triton" and served.path.pool.triton and served.path.pool.flash
    assert served.runtime()["attention_backend"] == "triton"
    assert served.attention.startswith("tgis's Triton kernels over KV pages")
    assert [greedy(served, [p], NEW)[0] for p in PROMPTS] == reference
    assert greedy(served, PROMPTS, NEW) == reference
    sched = scheduler_for(served, prefill_tokens=5, prefix_caching=True)
    assert greedy(served, cached[:1], NEW, sched) == cached_reference[:1]
    assert greedy(served, cached[1:], NEW, sched) == cached_reference[1:]
    assert sched.blocks.stats.hit_tokens == 16  # two blocks of the first prompt, found


@needs_triton
def test_the_triton_kernels_keep_a_sliding_window_and_soft_capped_scores() -> None:
    """mistral with a 6-token window whose blocks go back to the pool as sequences advance,
    and gemma2's soft-capped scores (which flash attention cannot compute) with layers of
    both kinds."""
    windowed = model("mistral", seed=2, sliding_window=6)
    reference = [greedy_reference(windowed, p, NEW) for p in PROMPTS]
    served = backend(windowed, "triton", block_size=4)
    sched = scheduler_for(served, prefill_tokens=5, sliding_window=True)
    assert greedy(served, PROMPTS, NEW, sched) == reference
    assert sched.blocks.stats.released_blocks > 0
    capped = family_model("gemma2", seed=1, head_dim=64)  # windows of 6 on every other layer
    reference = [greedy_reference(capped, p, NEW) for p in PROMPTS]
    assert greedy(backend(capped, "triton"), PROMPTS, NEW) == reference


@needs_triton
def test_bfloat16_through_the_triton_kernels_batched_equals_alone() -> None:
    served = backend(model(seed=5).to(torch.bfloat16), "triton")
    alone = [greedy(served, [p], NEW)[0] for p in PROMPTS]
    assert greedy(served, PROMPTS, NEW) == alone


class RerunApi:
    """A GraphApi that records nothing: capture runs the step and keeps its output tensor;
    each replay runs the same step again (over the buffers it reads, refilled in place) into
    that tensor. On a CPU it drives `DecodeGraphs` with the real step, Triton kernels and all.
    `replays`: the bucket of each replay."""

    def __init__(self) -> None:
        self.replays: list[int] = []

    def capture(self, step: Any) -> tuple[Any, torch.Tensor]:
        assert isinstance(step, DecodeStep)
        output = step()
        return (step, output), output

    def replay(self, graph: Any) -> None:
        step, output = graph
        output.copy_(step())
        self.replays.append(step.input_ids.shape[0])


def test_decode_buckets_every_8_then_16() -> None:
    assert decode_buckets(1) == (1,) and decode_buckets(6) == (1, 2, 4, 6)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(300)[-5:] == (248, 256, 272, 288, 300)


@needs_triton
def test_decode_graphs_over_the_triton_kernels_equal_eager_steps() -> None:
    """The graphed decode step (persistent buffers, the batch padded to its bucket, padding
    rows writing the scratch block) through the Triton kernels gives an eager twin's logits,
    batch after batch in buckets filled and padded."""
    api = RerunApi()
    m = model(seed=6)
    eager = backend(m, "triton", cuda_graphs=False)
    graphed = backend(m, "triton", graph_api=api)
    assert graphed.graphs is not None and graphed.graphs.buckets == (1, 2, 4)
    graphed.warmup(4, 20)
    assert graphed.graphs.captured == (1, 2, 4)
    prompts = [*PROMPTS, (7, 7, 9, 200, 31)]
    tables = [tuple(range(15 - i, -1, -4)) for i in range(4)]
    for batch, bucket in ((1, 1), (3, 4), (2, 2)):
        api.replays.clear()
        assert_decodes_equal(eager, graphed, prompts[:batch], tables, atol=1e-5)
        assert api.replays == [bucket] * NEW_GRAPHED


def flash_stand_in(*args: Any) -> torch.Tensor:
    """flash attention's call (the step's tensors, scale, max_q, max_k, window) over the same
    pages, computed by the plain-torch reference."""
    *step, scale, _max_q, _max_k, window = args
    return paged_attention_reference(*step, scale, window)


@needs_triton
@pytest.mark.parametrize(("triton_ms", "flash_ms", "fastest"), [(3, 1, "flash"), (1, 3, "triton")])
def test_auto_races_the_triton_kernels_against_flash_and_serves_the_faster(
    monkeypatch: pytest.MonkeyPatch, triton_ms: float, flash_ms: float, fastest: str
) -> None:
    """Where flash attention runs too (a stand-in here: the reference over the same pages),
    `auto` starts on the Triton kernels, times both at warmup over a decode step and a
    prompt chunk (on a clock that charges each kernel its milliseconds), serves with the
    faster, says so in /info's runtime, and gives generate()'s tokens either way."""
    monkeypatch.setattr(paged_backend, "flash_paged_available", lambda *_: True)
    monkeypatch.setattr(attention_module, "paged_attention", flash_stand_in)
    m = model(seed=5)
    reference = [greedy_reference(m, p, NEW) for p in PROMPTS[:2]]
    traits = dataclasses.replace(device_traits(DEVICE), triton_attention=True)
    served = backend(m, None, traits=traits)
    assert served.kernel == "triton" and served.contenders == ("triton", "flash")
    cost = {"triton": triton_ms / 1e3, "flash": flash_ms / 1e3}
    now = [0.0]
    ran: list[str] = []

    def clock() -> float:  # before and after each timed run: the run costs one step
        now[0] += cost[served.kernel]
        ran.append(served.kernel)
        return now[0]

    served._race_attention(clock)
    assert ran == ["triton"] * 6 + ["flash"] * 6  # one unmeasured run each, then 3 timed
    assert served.kernel == fastest and served.path.pool.triton == (fastest == "triton")
    runtime = served.runtime()
    assert runtime["attention_backend"] == fastest
    assert runtime["attention_race_ms"] == {"triton": triton_ms, "flash": flash_ms}
    assert greedy(served, PROMPTS[:2], NEW) == reference


@needs_triton
def test_warmup_runs_the_race_before_any_graph_and_a_chosen_backend_never_races(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paged_backend, "flash_paged_available", lambda *_: True)
    monkeypatch.setattr(attention_module, "paged_attention", flash_stand_in)
    traits = dataclasses.replace(device_traits(DEVICE), triton_attention=True)
    served = backend(model(), None, traits=traits, max_sequence_tokens=32, max_prefill_tokens=32)
    steps = served._race_steps()
    # Context within a sequence's tokens, rows within the batch and the pool's blocks.
    assert [(len(i.token_ids), i.start, len(i.block_table)) for i in steps[0]] == [(1, 31, 4)] * 4
    assert [len(i.token_ids) for i in steps[1]] == [32]
    served.warmup(max_batch_size=2, max_input_tokens=16)
    assert set(served.race_times) == {"triton", "flash"}
    assert served.kernel in ("triton", "flash")
    chosen = backend(model(), "triton", traits=traits)
    chosen.warmup(max_batch_size=1, max_input_tokens=8)
    assert chosen.contenders == () and chosen.race_times == {}
    assert chosen.runtime()["attention_race_ms"] == {}
