"""The gaudi backend on the CPU, with a stand-in `habana_frameworks`.

The stand-in has the names and signatures of the real modules (habana_frameworks.torch.core.
mark_step(device_str="", sync=False); habana_frameworks.torch.hpu.HPUGraph with
capture_begin(dry_run=False) / capture_end() / replay(asynchronous=False); the
habana_frameworks.torch.hpu.graph(hpu_graph, stream=None, dry_run=False) context) and their
semantics: a capture runs the ops once and records them; a replay re-runs the recorded ops on
the tensors they were captured with, writing into the same output tensors. So a backend that
forgot to copy new inputs into the captured ones, or to copy a graph's output before the next
replay, gives wrong tokens here.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import PreTrainedModel

from tests.backends.conftest import PROMPTS, greedy_reference
from tests.backends.scenarios import alone_run, random_prompts, staggered_greedy
from tgis.backends.static import gaudi
from tgis.backends.static.batch import EagerOps, StaticBatchBackend
from tgis.backends.static.buckets import Shape, static_policy
from tgis.backends.static.gaudi import (
    DecodeProfiler,
    GaudiBatchBackend,
    Habana,
    HpuGraphModel,
    HpuRuntime,
    build_gaudi_backend,
    load_gaudi_backend,
)
from tgis.backends.static.kv import StaticLlamaForward
from tgis.config import GaudiSettings, LauncherArgs, ModelFacts, build_serve_config
from tgis.engine.backend import PrefillItem
from tgis.errors import BackendUnavailableError, ConfigError

MAX_LENGTH = 64
# Decode buckets 2, 4, 6; prefill rows 2, 4; prompt lengths 16, 32.
SETTINGS = GaudiSettings(
    batch_bucket_size=2,
    prefill_batch_bucket_size=2,
    pad_sequence_to_multiple_of=16,
    decode_batch_size=6,
    prefill_batch_size=4,
    max_input_tokens=32,
)


def settings(**changes: Any) -> GaudiSettings:
    return GaudiSettings(**{**SETTINGS.__dict__, **changes})


class _Recorder(TorchDispatchMode):
    """Records every op run during a capture."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("data-dependent op during an HPU graph capture")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class FakeHabana:
    """habana_frameworks.torch.{core, hpu} on the CPU, counting what the backend calls."""

    def __init__(self) -> None:
        self.mark_steps = 0
        self.captured: list[FakeHabana.HPUGraph] = []
        self.replays = 0
        fake = self

        class HPUGraph:
            def __init__(self) -> None:
                self.recorder: _Recorder | None = None
                self.replays = 0

            def capture_begin(self, dry_run: bool = False) -> None:
                assert self.recorder is None, "an HPUGraph is captured once"
                self.recorder = _Recorder()
                self.recorder.__enter__()
                fake.captured.append(self)

            def capture_end(self) -> None:
                assert self.recorder is not None
                self.recorder.__exit__(None, None, None)

            def replay(self, asynchronous: bool = False) -> None:
                assert self.recorder is not None, "replay before capture"
                for func, args, kwargs, out in self.recorder.ops:
                    new = func(*args, **kwargs)
                    # In-place and view ops already wrote through (or alias) their inputs.
                    if not any(r.alias_info for r in func._schema.returns):
                        for old, value in zip(tree_leaves(out), tree_leaves(new), strict=True):
                            if isinstance(old, torch.Tensor):
                                old.copy_(value)
                self.replays += 1
                fake.replays += 1

        class graph:
            def __init__(self, hpu_graph: HPUGraph, stream: Any = None, dry_run: bool = False):
                self.hpu_graph, self.dry_run = hpu_graph, dry_run

            def __enter__(self) -> None:
                self.hpu_graph.capture_begin(self.dry_run)

            def __exit__(self, *exc: object) -> None:
                self.hpu_graph.capture_end()

        def mark_step(device_str: str = "", sync: bool = False) -> None:
            fake.mark_steps += 1

        self.HPUGraph = HPUGraph
        self.core = types.ModuleType("habana_frameworks.torch.core")
        self.core.mark_step = mark_step  # type: ignore[attr-defined]
        self.hpu = types.ModuleType("habana_frameworks.torch.hpu")
        self.hpu.HPUGraph = HPUGraph  # type: ignore[attr-defined]
        self.hpu.graph = graph  # type: ignore[attr-defined]
        self.hpu.is_available = lambda: True  # type: ignore[attr-defined]
        self.habana = Habana(self.core, self.hpu)

    def modules(self) -> dict[str, types.ModuleType]:
        root = types.ModuleType("habana_frameworks")
        torch_pkg = types.ModuleType("habana_frameworks.torch")
        root.torch = torch_pkg  # type: ignore[attr-defined]
        torch_pkg.core = self.core  # type: ignore[attr-defined]
        torch_pkg.hpu = self.hpu  # type: ignore[attr-defined]
        return {
            "habana_frameworks": root,
            "habana_frameworks.torch": torch_pkg,
            "habana_frameworks.torch.core": self.core,
            "habana_frameworks.torch.hpu": self.hpu,
            "habana_frameworks.torch.activity_profiler": types.ModuleType(
                "habana_frameworks.torch.activity_profiler"
            ),
        }


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeHabana:
    """A FakeHabana installed in sys.modules (removed after the test)."""
    habana = FakeHabana()
    for name, module in habana.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(gaudi, "_WARNED", set())
    return habana


def make(
    model: PreTrainedModel,
    fake: FakeHabana,
    **changes: Any,
) -> GaudiBatchBackend:
    return build_gaudi_backend(model, settings(**changes), MAX_LENGTH, fake.habana, device="cpu")


def solo(model: PreTrainedModel) -> StaticBatchBackend:
    """The eager static batch with one slot: a sequence alone."""
    forward = StaticLlamaForward(model, 1, MAX_LENGTH)
    return StaticBatchBackend(forward, static_policy(1, MAX_LENGTH, 40), EagerOps(), "solo", 3)


def count_decodes(backend: GaudiBatchBackend) -> list[int]:
    """Rows of every decode step the model runs from now on."""
    model = backend.model
    assert isinstance(model, HpuGraphModel)
    rows: list[int] = []
    original = model.decode_static

    def spy(input_ids: torch.Tensor, positions: torch.Tensor, size: int) -> torch.Tensor:
        rows.append(size)
        return original(input_ids, positions, size)

    model.decode_static = spy  # type: ignore[method-assign]
    return rows


# 10 sequences over 6 slots: 6 run at once (decode bucket 6), then fewer as they leave.
JOINS = {0: range(0, 3), 1: range(3, 6), 13: range(6, 9), 26: range(9, 10)}


def test_fake_graph_replays_the_captured_ops_on_the_captured_tensors(fake: FakeHabana) -> None:
    """The stand-in behaves like an HPU graph: replay recomputes from the captured inputs
    into the captured output, including in-place writes."""
    x = torch.tensor([1.0, 2.0])
    state = torch.zeros(2)
    g = fake.hpu.HPUGraph()
    with fake.hpu.graph(g):
        state.add_(x)
        out = (x * 3).sum()
    assert float(out) == 9.0 and state.tolist() == [1.0, 2.0]
    x.copy_(torch.tensor([10.0, 20.0]))
    g.replay()
    assert float(out) == 90.0
    assert state.tolist() == [11.0, 22.0]


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("decode graphs", {}),
        ("decode and prefill graphs", {"limit_hpu_graph": False}),
        ("no graphs", {"enable_hpu_graph": False}),
    ],
)
def test_greedy_tokens_equal_generate(
    tiny_lm: Callable[..., PreTrainedModel],
    fake: FakeHabana,
    name: str,
    changes: dict[str, Any],
) -> None:
    model = tiny_lm("llama")
    backend = make(model, fake, **changes)
    for prompt in PROMPTS:
        tokens, _ = alone_run(backend, prompt, 10)
        assert tokens == greedy_reference(model, prompt, 10), name
    graphs = fake.captured
    if changes.get("enable_hpu_graph") is False:
        assert graphs == [] and backend.ops.compilations() == 0
    else:
        assert len(graphs) == backend.ops.compilations() > 0
        assert fake.replays > 0


def test_staggered_sequences_get_their_alone_tokens_through_replayed_graphs(
    tiny_lm: Callable[..., PreTrainedModel], fake: FakeHabana
) -> None:
    """Sequences join and leave a 6-slot batch; decode runs buckets 2, 4 and 6, each captured
    once and replayed for every later step of that bucket; every sequence gets the tokens
    (and logits) it gets alone."""
    model = tiny_lm("llama")
    prompts, budgets = random_prompts(10, seed=5, vocab=256, max_len=30)
    alone = [alone_run(solo(model), p, n) for p, n in zip(prompts, budgets, strict=True)]
    backend = make(model, fake)
    rows = count_decodes(backend)
    tokens, logits = staggered_greedy(backend, prompts, budgets, JOINS)
    for seq_id in range(10):
        assert tokens[seq_id] == alone[seq_id][0], f"sequence {seq_id}"
        torch.testing.assert_close(
            torch.stack(logits[seq_id]), torch.stack(alone[seq_id][1]), atol=1e-4, rtol=0
        )
    model_ = backend.model
    assert isinstance(model_, HpuGraphModel)
    assert set(rows) == {2, 4, 6}
    assert sorted(model_.graph_keys) == [("decode", 2), ("decode", 4), ("decode", 6)]
    assert len(fake.captured) == 3  # one capture per bucket, no prefill graphs (LIMIT_HPU_GRAPH)
    assert fake.replays == len(rows) - 3
    for graph in fake.captured:
        assert graph.replays > 0


def test_graph_outputs_are_copied_before_the_next_replay(
    tiny_lm: Callable[..., PreTrainedModel], fake: FakeHabana
) -> None:
    model = tiny_lm("llama")
    eager = StaticLlamaForward(model, 2, MAX_LENGTH)
    graphed = HpuGraphModel(
        StaticLlamaForward(model, 2, MAX_LENGTH), HpuRuntime(fake.habana), True, True
    )
    outs, expected = [], []
    for step, token in enumerate((5, 9, 77)):
        ids, pos = torch.tensor([token, token + 1]), torch.tensor([step, step])
        outs.append(graphed.decode_static(ids, pos, 2))
        expected.append(eager.decode_static(ids, pos, 2))
    assert len(fake.captured) == 1 and fake.replays == 2
    for out, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    assert not torch.equal(outs[0], outs[2])


def test_prefill_bypasses_graphs_under_limit_hpu_graph(
    tiny_lm: Callable[..., PreTrainedModel], fake: FakeHabana
) -> None:
    model = tiny_lm("llama")
    items = [PrefillItem(0, PROMPTS[0]), PrefillItem(1, PROMPTS[1]), PrefillItem(2, PROMPTS[2])]

    limited = make(model, fake, limit_hpu_graph=True)
    limited.prefill(items)
    assert fake.captured == []

    full = make(model, fake, limit_hpu_graph=False)
    out = full.prefill(items)
    assert isinstance(full.model, HpuGraphModel)
    assert full.model.graph_keys == [("prefill", 4, 16)]  # 3 prompts -> 4 rows, 13 -> 16
    full.release(0)
    full.release(1)
    full.release(2)
    again = full.prefill(items)
    assert len(fake.captured) == 1 and fake.replays == 1
    torch.testing.assert_close(again.last, out.last)
    # Prompt logprobs: the prefill itself uses its bucket's graph (2 rows: a new one); every
    # position's logits come from an eager pass, never a graph.
    full.prefill([PrefillItem(5, PROMPTS[0], prompt_logprobs=True)])
    assert full.model.graph_keys == [("prefill", 4, 16), ("prefill", 2, 16)]
    assert len(fake.captured) == 2 and fake.replays == 1


def test_disabled_graphs_capture_nothing_and_every_step_marks_once(
    tiny_lm: Callable[..., PreTrainedModel], fake: FakeHabana
) -> None:
    model = tiny_lm("llama")
    backend = make(model, fake, enable_hpu_graph=False)
    assert fake.mark_steps == 1  # the backend materializes the loaded state
    backend.prefill([PrefillItem(0, PROMPTS[0])])
    for step in range(5):
        backend.decode([0], [7 + step])
    assert fake.mark_steps == 1 + 6
    assert fake.captured == [] and backend.ops.compilations() == 0


def test_lazy_mode_off_runs_without_graphs(
    tiny_lm: Callable[..., PreTrainedModel], fake: FakeHabana
) -> None:
    model = tiny_lm("llama")
    backend = make(model, fake, lazy_mode=False)
    tokens, _ = alone_run(backend, PROMPTS[1], 4)
    assert tokens == greedy_reference(model, PROMPTS[1], 4)
    assert fake.captured == []


@pytest.mark.parametrize("limit", [True, False])
def test_warmup_runs_every_bucket_and_serving_captures_nothing_new(
    tiny_lm: Callable[..., PreTrainedModel], fake: FakeHabana, limit: bool
) -> None:
    model = tiny_lm("llama")
    backend = make(model, fake, limit_hpu_graph=limit)
    timings = backend.warmup(6, 32)
    plan = backend.policy.warmup_plan(32)
    assert [t.shape for t in timings] == plan
    assert plan == [
        Shape("prefill", 2, 16),
        Shape("prefill", 2, 32),
        Shape("prefill", 4, 16),
        Shape("prefill", 4, 32),
        Shape("decode", 2, 1),
        Shape("decode", 4, 1),
        Shape("decode", 6, 1),
    ]
    for timing in timings:
        graphed = timing.shape.phase == "decode" or not limit
        assert timing.compiled == (1 if graphed else 0), timing.shape.label()
    captured = len(fake.captured)
    assert captured == backend.ops.compilations() == (3 if limit else 7)

    prompts, budgets = random_prompts(10, seed=8, vocab=256, max_len=30)
    marks = fake.mark_steps
    rows = count_decodes(backend)
    staggered_greedy(backend, prompts, budgets, JOINS)
    prefills = len(JOINS)
    assert len(fake.captured) == captured and backend.ops.compilations() == captured
    assert fake.mark_steps - marks == len(rows) + prefills  # one mark_step per step
    assert fake.replays == len(rows) + (0 if limit else prefills)


class ProfileRecorder:
    """Stands in for torch.profiler.profile, recording its arguments and calls."""

    made: ClassVar[list[ProfileRecorder]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[str] = []
        ProfileRecorder.made.append(self)

    def start(self) -> None:
        self.calls.append("start")

    def step(self) -> None:
        self.calls.append("step")

    def stop(self) -> None:
        self.calls.append("stop")


@pytest.fixture
def profiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ProfileRecorder]]:
    ProfileRecorder.made = []

    def handler(dir_name: str, *args: Any, **kwargs: Any) -> Callable[[Any], None]:
        def ready(prof: Any) -> None:
            pass

        ready.dir_name = dir_name  # type: ignore[attr-defined]
        return ready

    monkeypatch.setattr(torch.profiler, "profile", ProfileRecorder)
    monkeypatch.setattr(torch.profiler, "tensorboard_trace_handler", handler)
    yield ProfileRecorder.made


PROFILING = {
    "prof_waitstep": 1,
    "prof_warmupstep": 1,
    "prof_step": 2,
    "prof_path": "/tmp/traces",
    "prof_ranks": (0, 2),
    "prof_record_shapes": True,
}


def test_profiler_records_decode_steps_with_the_prof_schedule(
    tiny_lm: Callable[..., PreTrainedModel], fake: FakeHabana, profiles: list[ProfileRecorder]
) -> None:
    model = tiny_lm("llama")
    backend = make(model, fake, rank=2, **PROFILING)
    backend.warmup(6, 32)
    assert profiles == []  # warmup steps are not profiled
    backend.prefill([PrefillItem(0, PROMPTS[0])])
    assert profiles == []  # nor prefills
    for step in range(7):
        backend.decode([0], [5 + step])
    assert len(profiles) == 1
    prof = profiles[0]
    # started before the first decode, one step per decode, stopped after wait+warmup+active
    assert prof.calls == ["start", "step", "step", "step", "step", "stop"]
    kwargs = prof.kwargs
    activity = torch.profiler.ProfilerActivity
    assert kwargs["activities"] == [activity.CPU, activity.HPU]
    assert kwargs["record_shapes"] is True
    assert kwargs["on_trace_ready"].dir_name == "/tmp/traces"
    action = torch.profiler.ProfilerAction
    assert [kwargs["schedule"](i) for i in range(5)] == [
        action.NONE,
        action.WARMUP,
        action.RECORD,
        action.RECORD_AND_SAVE,
        action.NONE,
    ]


@pytest.mark.parametrize(
    "changes",
    [
        {"rank": 1},  # not in PROF_RANKS
        {"prof_ranks": (1,)},  # RANK defaults to 0
        {"rank": 0, "prof_step": 0},  # profiling off
    ],
)
def test_profiler_only_on_listed_ranks(
    tiny_lm: Callable[..., PreTrainedModel],
    fake: FakeHabana,
    profiles: list[ProfileRecorder],
    changes: dict[str, Any],
) -> None:
    backend = make(tiny_lm("llama"), fake, **{**PROFILING, **changes})
    alone_run(backend, PROMPTS[0], 6)
    assert profiles == []


def test_decode_profiler_from_settings() -> None:
    assert DecodeProfiler.from_settings(settings(**PROFILING, rank=3)) is None
    prof = DecodeProfiler.from_settings(settings(**PROFILING, rank=0))
    assert prof is not None
    assert (prof.wait, prof.warmup, prof.active, prof.total) == (1, 1, 2, 4)
    assert (prof.path, prof.record_shapes) == ("/tmp/traces", True)


def test_ignored_flash_attention_settings_warn_once(
    tiny_lm: Callable[..., PreTrainedModel],
    fake: FakeHabana,
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = tiny_lm("llama")
    with caplog.at_level(logging.WARNING, logger="tgis.backends.static.gaudi"):
        make(model, fake)
        assert caplog.records == []
        make(model, fake, use_flash_attention=False)
        make(model, fake, use_flash_attention=False)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("USE_FLASH_ATTENTION=false has no effect")


def gaudi_config(env: dict[str, str] | None = None, **flags: Any) -> Any:
    base = {"backend": "gaudi", "max_input_tokens": 32, "max_total_tokens": MAX_LENGTH}
    return build_serve_config(
        LauncherArgs(**{**base, "max_batch_size": 4, **flags}),
        ModelFacts("llama", 128),
        {
            "BATCH_BUCKET_SIZE": "2",
            "PREFILL_BATCH_BUCKET_SIZE": "2",
            "PAD_SEQUENCE_TO_MULTIPLE_OF": "16",
            **(env or {}),
        },
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.backends.conftest import VARIANTS
    from tests.factories import tiny_model

    path = tmp_path_factory.mktemp("llama")
    arch, fields = VARIANTS["llama"]
    tiny_model(arch, seed=0, **fields).save_pretrained(path)  # type: ignore[arg-type]
    return path


def test_load_gaudi_backend_serves_the_saved_model(
    tiny_lm: Callable[..., PreTrainedModel], fake: FakeHabana, llama_dir: Path
) -> None:
    backend = load_gaudi_backend(gaudi_config(dtype="float32"), llama_dir, device="cpu")
    assert isinstance(backend, StaticBatchBackend) and backend.name == "gaudi"
    policy = backend.policy
    assert (policy.decode_batches, policy.prefill_rows, policy.prefill_lengths) == (
        (2, 4),
        (2, 4),
        (16, 32),
    )
    model = tiny_lm("llama")
    for prompt in PROMPTS[:2]:
        assert alone_run(backend, prompt, 6)[0] == greedy_reference(model, prompt, 6)
    assert backend.ops.compilations() == len(fake.captured) > 0


def test_load_gaudi_backend_defaults_to_bfloat16(fake: FakeHabana, llama_dir: Path) -> None:
    backend = load_gaudi_backend(gaudi_config(), llama_dir, device="cpu")
    assert isinstance(backend.model, HpuGraphModel)
    assert backend.model.forward.embed.dtype == torch.bfloat16


def test_load_without_habana_is_one_line(monkeypatch: pytest.MonkeyPatch, llama_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)
    with pytest.raises(BackendUnavailableError) as err:
        load_gaudi_backend(gaudi_config(), llama_dir, device="cpu")
    text = str(err.value)
    assert "\n" not in text
    assert "habana_frameworks" in text and "Dockerfile.gaudi" in text
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_quant_config_is_refused(fake: FakeHabana, llama_dir: Path) -> None:
    config = gaudi_config({"QUANT_CONFIG": "./quantization_config/maxabs_quant.json"})
    with pytest.raises(ConfigError) as err:
        load_gaudi_backend(config, llama_dir, device="cpu")
    text = str(err.value)
    assert "QUANT_CONFIG" in text and "FP8" in text and "unset QUANT_CONFIG" in text


def test_a_non_gaudi_config_is_refused(fake: FakeHabana, llama_dir: Path) -> None:
    config = build_serve_config(LauncherArgs(backend="cpu"), ModelFacts("llama", 128), {})
    with pytest.raises(ConfigError, match="gaudi settings"):
        load_gaudi_backend(config, llama_dir, device="cpu")
