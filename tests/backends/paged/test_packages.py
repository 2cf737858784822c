"""tgis.backends.paged.packages: the compiled decode kept as packages on disk. A start builds
them (at warmup, or in a process of its own while it serves eagerly) and a later start loads
them instead of compiling; the packaged decode gives the eager forward's greedy tokens; a store
is keyed by everything its packages depend on; a failed build leaves the server eager. Packages
are built without autotuning here (minutes less; the graphs are the same)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.backends.paged_driver import greedy
from tests.factories import make_model_dir
from tgis.backends.paged import build as build_module
from tgis.backends.paged import packages as packages_module
from tgis.backends.paged.backend import PagedTorchBackend
from tgis.backends.paged.compile import PACKAGE_ROWS, RACE_ROWS, CompiledDecode
from tgis.backends.paged.packages import BuildRecipe, PackageStore, default_root

NEW = 6
# Within the tiny model's 128-token vocabulary; across its 16-token blocks.
PROMPTS = ((5, 17, 42, 99, 7, 63, 120), (100, 11), tuple(range(4, 22)))


def recipe(model_dir: Path, **changes: object) -> BuildRecipe:
    fields = {
        "model_dir": model_dir,
        "dtype": None,
        "quantize": None,
        "group_size": None,
        "kv_cache_dtype": None,
        "block_size": 16,
        "max_sequence_tokens": 64,
        **changes,
    }
    return BuildRecipe(**fields)  # type: ignore[arg-type]


def backend(model_dir: Path, root: Path, compile: bool = True, **kw: object) -> PagedTorchBackend:
    return PagedTorchBackend.load(
        model_dir,
        "cpu",
        max_sequences=4,
        # Longer than the build process's 8-block pool floor: it must hold one sequence.
        max_sequence_tokens=256,
        max_prefill_tokens=64,
        kv_tokens=1024,
        compile=compile,
        compile_cache=root,
        autotune=False,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model") / "llama", "llama", seed=5)


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The eager forward's greedy tokens, each prompt alone."""
    eager = backend(model_dir, tmp_path_factory.mktemp("unused"), compile=False)
    return [greedy(eager, [p], NEW)[0] for p in PROMPTS]


def test_a_store_is_keyed_by_what_its_packages_depend_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model_dir(tmp_path / "llama", "llama")
    root = tmp_path / "root"
    store = PackageStore.of(root, recipe(model))
    assert store == PackageStore.of(root, recipe(model))
    assert store.directory.parent == root and store.directory.name.startswith("llama-")
    for change in ({"dtype": "bfloat16"}, {"block_size": 32}, {"max_sequence_tokens": 128},
                   {"quantize": "int8"}, {"kv_cache_dtype": "float8_e4m3fn"}):  # fmt: skip
        assert PackageStore.of(root, recipe(model, **change)) != store, change
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(1, weights.stat().st_mtime_ns + 1))  # the weights were replaced
    assert PackageStore.of(root, recipe(model)) != store
    monkeypatch.setattr(packages_module.torch, "__version__", "0.0.0")
    assert PackageStore.of(root, recipe(model)).directory != store.directory
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
    assert default_root() == tmp_path / "hf" / "tgis" / "compiled"


def test_a_package_is_in_place_whole_or_not_at_all(tmp_path: Path) -> None:
    store = PackageStore(tmp_path / "store")

    def half(path: Path) -> None:
        path.write_bytes(b"half a package")
        raise RuntimeError("the compiler died")

    with pytest.raises(RuntimeError, match="died"):
        store.save(1, half)
    assert not store.has(1) and list(store.directory.iterdir()) == []
    assert store.save(2, lambda path: path.write_bytes(b"whole")) == store.path(2)
    assert store.has(2) and store.path(2).read_bytes() == b"whole"


def test_packaged_decode_gives_the_eager_tokens_and_a_second_start_loads_it(
    model_dir: Path, reference: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first start builds both graphs' packages at warmup; decoding then runs every step
    through them and gives the eager tokens, alone and batched. A second start with the same
    settings loads them at warmup and compiles nothing. (The race of batch 2 and up against
    the eager step is the tiny model's noise: here the graph wins it at every batch.)"""
    monkeypatch.setattr(CompiledDecode, "race_rows", lambda self, graph: (PACKAGE_ROWS, {}))
    first = backend(model_dir, tmp_path)
    decode = first.compiled
    assert decode is not None and decode.packages is not None and not decode.packaged()
    first.warmup(4, 16)
    assert decode.packaged() and first.runtime()["compiled_decode"] == ["1", "2-4"]
    assert first.compile_state == "ready" and set(first.warmup_phases) == {"compile", "plan"}
    steps = decode.eager_steps
    assert [greedy(first, [p], NEW)[0] for p in PROMPTS] == reference
    assert greedy(first, PROMPTS, NEW) == reference
    assert decode.eager_steps == steps  # no decode step ran eagerly

    def no_compiling(self: CompiledDecode, graph: int) -> None:
        raise AssertionError(f"graph {graph} was compiled again")

    monkeypatch.setattr(CompiledDecode, "_package", no_compiling)
    second = backend(model_dir, tmp_path)
    assert second.compiled is not None and second.compiled.packages == decode.packages
    second.warmup(4, 16)
    assert second.compile_state == "ready" and "compile" in second.warmup_phases
    assert greedy(second, PROMPTS, NEW) == reference


def test_a_first_start_serves_eagerly_while_a_process_builds_the_packages(
    model_dir: Path, reference: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the store empty, warmup starts the build in a process of its own and returns:
    decode runs eagerly (the same tokens) until the build ends, then through the packages
    it built, from the next step on."""
    monkeypatch.setattr(CompiledDecode, "race_rows", lambda self, graph: (PACKAGE_ROWS, {}))
    server = backend(model_dir, tmp_path, compile_in_background=True)
    decode = server.compiled
    assert decode is not None
    told: list[dict[str, object]] = []  # what /info is told (launch.service_info)
    server.watch_runtime(told.append)
    handed: list[object] = []  # the work handed to the model's thread (the engine's `call`)
    server.run_model_work_on(lambda work: handed.append(work) or work())
    server.warmup(4, 16)
    assert server.compile_state == "building" and decode.graphs == []
    assert greedy(server, PROMPTS, NEW) == reference  # eagerly, while it builds
    assert server.background is not None
    server.background.join(timeout=300)
    assert server.compile_state == "ready", server.background.log.read_text()[-2000:]
    assert decode.graphs == ["1", "2-4"] and decode.packaged()
    assert handed == [decode.load_packages]  # loaded and raced between the engine's steps
    assert [(t["compiled_decode_state"], t["compiled_decode"]) for t in told] == [
        ("ready", ["1", "2-4"])
    ]
    steps = decode.eager_steps
    assert greedy(server, PROMPTS, NEW) == reference
    assert decode.eager_steps == steps
    server.close()


def test_the_batched_graph_serves_the_rows_it_won_and_more_decode_eagerly(
    model_dir: Path, reference: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the graph of batch 2 and up ran faster than the eager step up to 2 rows as it
    loaded, a step of two rows runs through it and one of three eagerly, with the same
    tokens; where it lost at 2, only the batch-1 graph serves."""
    won = {2: {"graph": 1.0, "eager": 2.0}, 3: {"graph": 2.0, "eager": 1.0}}
    monkeypatch.setattr(CompiledDecode, "race_rows", lambda self, graph: (2, won))
    server = backend(model_dir, tmp_path)
    decode = server.compiled
    assert decode is not None
    server.warmup(4, 16)
    assert decode.rows == 2 and decode.race_seconds == won and decode.graphs == ["1", "2-2"]
    steps = decode.eager_steps
    assert greedy(server, PROMPTS[:2], NEW) == reference[:2]
    assert decode.eager_steps == steps
    assert greedy(server, PROMPTS, NEW) == reference
    assert decode.eager_steps >= steps + NEW - 1  # every three-row decode step

    monkeypatch.setattr(CompiledDecode, "race_rows", lambda self, graph: (0, {}))
    lost = backend(model_dir, tmp_path)
    assert lost.compiled is not None
    assert lost.compiled.load_packages() == [1] and lost.compiled.graphs == ["1"]
    assert greedy(lost, PROMPTS, NEW) == reference


def test_the_race_stops_at_the_first_batch_the_eager_step_wins(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`race_rows` times both at RACE_ROWS up to the first batch the eager step wins (or
    RACE_SECONDS) and answers the last the graph won; the race's eager steps are not counted
    as serving's."""
    decode = backend(model_dir, tmp_path).compiled
    assert decode is not None and decode.max_batch == 4
    decode.max_batch = 64  # raced up to the server's largest batch
    now = [0.0]

    def timed(milliseconds: float) -> None:
        now[0] += milliseconds / 1e3

    def race(graph_ms: object, eager_ms: object) -> tuple[int, dict[int, dict[str, float]]]:
        monkeypatch.setattr(decode, "_step", lambda ids, *_: timed(eager_ms(len(ids))))  # type: ignore[operator]
        return decode.race_rows(lambda ids, *_: timed(graph_ms(len(ids))), lambda: now[0])  # type: ignore[operator]

    # A GEMM blocked for a few rows: 1 + rows / 2 against the eager step's 4 + rows / 10.
    rows, seconds = race(lambda r: 1 + r / 2, lambda r: 4 + r / 10)
    assert rows == 6 and list(seconds) == [2, 3, 4, 6, 8]
    assert seconds[8] == {"graph": pytest.approx(5e-3), "eager": pytest.approx(4.8e-3)}
    rows, seconds = race(lambda r: 1.0, lambda r: 2.0)
    assert rows == PACKAGE_ROWS and list(seconds) == list(RACE_ROWS)
    assert race(lambda r: 2.0, lambda r: 1.0)[0] == 0
    # Past RACE_SECONDS (12 s at 2 rows: 4 runs of each), more rows are not timed.
    rows, seconds = race(lambda r: 1000.0, lambda r: 2000.0)
    assert rows == 2 and list(seconds) == [2]
    monkeypatch.undo()

    # Real steps over the scratch pool, the eager step against itself: only the graph's
    # calls (here eager ones too) are counted.
    steps, calls = decode.eager_steps, [0]

    def graph(*inputs: object) -> object:
        calls[0] += 1
        return decode._step(*inputs)

    decode.max_batch = 4
    rows, seconds = decode.race_rows(graph)
    assert decode.eager_steps == steps + calls[0] and calls[0] == 4 * len(seconds)
    assert list(seconds) == [2, 3, 4][: len(seconds)]


def test_a_build_that_fails_leaves_the_server_eager_and_says_where_to_look(
    model_dir: Path, reference: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(self: BuildRecipe, store: PackageStore, autotune: bool = True) -> list[str]:
        return [sys.executable, "-c", "print('out of memory'); raise SystemExit(3)"]

    monkeypatch.setattr(BuildRecipe, "command", failing)
    server = backend(model_dir, tmp_path, compile_in_background=True)
    told: list[dict[str, object]] = []
    server.watch_runtime(told.append)
    server.warmup(4, 16)
    assert server.background is not None
    server.background.join(timeout=60)
    assert server.compile_state == "failed"
    assert [t["compiled_decode_state"] for t in told] == ["failed"]
    assert "out of memory" in server.background.log.read_text()
    assert greedy(server, PROMPTS, NEW) == reference


def test_a_failed_build_is_kept_so_later_starts_serve_eagerly_at_once(
    model_dir: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    """The build process keeps its failure in the store; a later start reads it, starts no
    build and decodes eagerly from the start (`failed`); a package saved clears it."""
    assert build_module.main([str(tmp_path / "no-model"), "--store", str(tmp_path / "s"),
                                 "--block-size", "16", "--max-sequence-tokens", "64"]) == 1  # fmt: skip
    failure = PackageStore(tmp_path / "s").failure
    assert failure is not None and "no-model" in failure
    server = backend(model_dir, tmp_path, compile_in_background=True)
    assert server.compiled is not None and server.compiled.packages is not None
    store = server.compiled.packages
    store.fail("RuntimeError: the export met an op it cannot trace")
    server.warmup(4, 16)
    assert server.background is None and server.compile_state == "failed"
    assert server.compile_failure is not None and "cannot trace" in server.compile_failure
    assert greedy(server, PROMPTS, NEW) == reference
    store.save(1, lambda path: path.write_bytes(b"a package"))
    assert store.failure is None


def test_a_package_that_does_not_load_is_removed_and_decode_stays_eager(
    model_dir: Path, reference: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad copy in the store (truncated, or from elsewhere) does not stop the start: it is
    removed, decode runs eagerly, and the build that would replace it starts."""
    started: list[list[str]] = []

    def recorded(self: BuildRecipe, store: PackageStore, autotune: bool = True) -> list[str]:
        started.append([str(store.directory)])
        return [sys.executable, "-c", "raise SystemExit(3)"]

    monkeypatch.setattr(BuildRecipe, "command", recorded)
    server = backend(model_dir, tmp_path, compile_in_background=True)
    assert server.compiled is not None and server.compiled.packages is not None
    store = server.compiled.packages
    for graph in (1, 2):
        store.save(graph, lambda path: path.write_bytes(b"not a package"))
    server.warmup(4, 16)
    assert not store.has(1) and not store.has(2) and started
    assert server.compiled.graphs == []
    assert greedy(server, PROMPTS, NEW) == reference


def test_the_build_process_is_told_the_pool_dtype_as_torch_names_it(tmp_path: Path) -> None:
    """A float8 KV pool's recipe names its dtype so that the build process finds it."""
    import torch

    store = PackageStore(tmp_path)
    pool = str(torch.float8_e4m3fn).removeprefix("torch.")
    command = recipe(tmp_path, kv_cache_dtype=pool).command(store)
    value = command[command.index("--kv-cache-dtype") + 1]
    assert getattr(torch, value) is torch.float8_e4m3fn
