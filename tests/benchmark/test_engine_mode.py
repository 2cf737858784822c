"""`tgis benchmark --engine`: the demo model driven in-process, its table, results and plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tests.factories import make_model_dir
from tgis.benchmark.engine_mode import (
    MIXED_SAMPLING,
    EngineBenchmark,
    load_backend,
    parse_batch_sizes,
    serving_engines,
)
from tgis.benchmark.results import validate_results
from tgis.cli import app
from tgis.errors import ConfigError
from tgis.params import GenerateParameters

PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["--batch-sizes", "1,2", "--prompt-tokens", "16", "--decode-tokens", "4", "--runs", "2"]
runner = CliRunner()


def test_engine_mode_prints_the_table_and_writes_valid_results_and_a_png(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    out, png = tmp_path / "e.json", tmp_path / "e.png"
    result = runner.invoke(
        app,
        ["benchmark", "--engine", "--model-id", str(demo_model_dir), *TINY,
         "--output", str(out), "--plot", str(png)],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    assert "decode step" in result.output and "p99 ms" in result.output
    data = json.loads(out.read_text())
    validate_results(data)
    assert data["config"]["mode"] == "engine" and data["config"]["interrupted"] is False
    assert data["steps"] == []
    steps = data["engine_steps"]
    assert [s["batch_size"] for s in steps] == [1, 2]
    for step in steps:
        assert step["runs"] == 2
        for phase in ("prefill", "decode"):
            latency = step[f"{phase}_latency_s"]
            assert 0 < latency["p50"] <= latency["p99"]
            assert latency["mean"] > 0 and step[f"{phase}_tokens_per_s"] > 0
        batch, decode_mean = step["batch_size"], step["decode_latency_s"]["mean"]
        assert step["decode_tokens_per_s"] == pytest.approx(batch / decode_mean)
        prefill_mean = step["prefill_latency_s"]["mean"]
        assert step["prefill_tokens_per_s"] == pytest.approx(batch * 16 / prefill_mean)
        # The serving loop's decode steps: the step is its forward and the host work around it.
        loop, forward, host = (
            step[k] for k in ("decode_step_s", "decode_forward_s", "decode_host_s")
        )
        assert 0 < forward["mean"] < loop["mean"]
        assert host["mean"] == pytest.approx(loop["mean"] - forward["mean"])
    assert "loop step" in result.output and "host" in result.output
    assert png.read_bytes().startswith(PNG)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_each_engine_counts_one_sample_per_decode_step(tmp_path: Path, arch: str) -> None:
    """A llama model runs the paged backend, as `tgis serve` does; gpt2 the slot one, whose
    runs release their sequences."""
    model_dir = make_model_dir(tmp_path / arch, arch)  # type: ignore[arg-type]
    backend = load_backend(model_dir, "cpu", None, 3, 8, 3)
    assert (backend.capacity.block_size is None) == (arch == "gpt2")
    bench = EngineBenchmark(
        backend, [3], 8, 3, runs=2, warmups=1, avoid_ids={0, 1, 2},
        engine=serving_engines(backend, model_dir, 3),
    )  # fmt: skip
    bench.execute()
    if arch == "gpt2":
        assert backend.running == 0  # type: ignore[union-attr]
    measure = bench.measures[0]
    assert len(measure.prefill) == 2 and len(measure.decode) == 2 * 3
    # Through the serving loop: the first token comes from the prefill, the next 2 from decode
    # steps of the whole batch.
    assert len(measure.loop) == 2
    assert all(0 < s.forward < s.step and s.device == 0 for s in measure.loop)
    assert not {0, 1, 2} & set(bench.token_pool)


def test_a_simulated_device_times_each_step_and_what_the_host_hid_behind_it(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """--simulated-device-ms 3: the demo model's vocabulary and tokenizer over a timer whose
    steps take at least 3 ms on a device timeline of their own. Each loop step records the
    device's busy time (at least the 3 ms), the host's work and the share of it hidden."""
    out = tmp_path / "e.json"
    result = runner.invoke(
        app,
        ["benchmark", "--engine", "--model-id", str(demo_model_dir), *TINY,
         "--simulated-device-ms", "3", "-o", str(out)],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(out.read_text())
    validate_results(data)
    assert data["config"]["simulated_device_ms"] == 3 and data["config"]["device"] == "simulated"
    for step in data["engine_steps"]:
        device, hidden = step["decode_device_s"], step["decode_hidden_host_s"]
        assert device["p50"] >= 0.003 and step["decode_latency_s"]["p50"] >= 0.003
        assert 0 <= hidden["p50"] <= device["p50"]
        # The loop's step holds the device's time and the host's work not hidden behind it.
        assert step["decode_step_s"]["mean"] >= step["decode_host_s"]["mean"] > 0
    assert "  device" in result.output and "host hidden" in result.output


def test_mixed_sampling_sends_each_kind_in_turns_and_times_the_exposed_host(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--sampling mixed: the loop's requests are greedy, temperature/top-p, repetition penalty
    and stop strings in turns, and each step records the host work the device waited for."""
    from tgis.engine.engine import Engine

    sent: list[GenerateParameters] = []
    original = Engine.generate

    def generate(self: Engine, request: Any) -> Any:
        sent.append(request.params)
        return original(self, request)

    monkeypatch.setattr(Engine, "generate", generate)
    out = tmp_path / "e.json"
    result = runner.invoke(
        app,
        ["benchmark", "--engine", "--model-id", str(demo_model_dir), "--batch-sizes", "4",
         "--prompt-tokens", "8", "--decode-tokens", "4", "--runs", "1",
         "--simulated-device-ms", "1", "--sampling", "mixed", "-o", str(out)],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(out.read_text())
    validate_results(data)
    assert data["config"]["sampling"] == "mixed"
    kinds = [(p.do_sample, p.top_p, p.repetition_penalty, tuple(p.stop)) for p in sent]
    assert kinds == [
        (False, None, None, ()),
        (True, 0.9, None, ()),
        (False, None, 1.2, ()),
        (False, None, None, tuple(MIXED_SAMPLING[3]["stop"])),
    ]
    (step,) = data["engine_steps"]
    exposed = step["decode_exposed_host_s"]
    assert 0 <= exposed["p50"] <= step["decode_step_s"]["p50"]
    assert "host exposed" in result.output


def test_an_unknown_sampling_kind_is_refused(demo_model_dir: Path) -> None:
    result = runner.invoke(
        app, ["benchmark", "--engine", "--model-id", str(demo_model_dir), *TINY,
              "--sampling", "beam"],
    )  # fmt: skip
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    assert str(result.exception).startswith("--sampling 'beam' is not one of greedy, mixed")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--simulated-device-ms", "-1"], "--simulated-device-ms -1.0 must be 0 to 10000"),
        (["--simulated-device-ms", "2", "--compile"], "--compile shapes the model's forward"),
        (["--simulated-device-ms", "2", "--quantize", "int8"], "--quantize shapes the model's"),
    ],
)
def test_a_simulated_device_refuses_what_it_cannot_honour(
    demo_model_dir: Path, flags: list[str], message: str
) -> None:
    result = runner.invoke(
        app, ["benchmark", "--engine", "--model-id", str(demo_model_dir), *TINY, *flags]
    )
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    assert str(result.exception).startswith(message)


def test_the_simulated_device_is_for_engine_runs_only() -> None:
    result = runner.invoke(
        app, ["benchmark", "--url", "http://127.0.0.1:9", "--simulated-device-ms", "2"]
    )
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    assert "--simulated-device-ms" in str(result.exception)


def test_an_interrupted_engine_run_keeps_what_it_measured(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = EngineBenchmark.run_once

    def run_once(self: EngineBenchmark, batch: int, measure: object) -> None:
        if batch == 2:
            raise KeyboardInterrupt
        original(self, batch, measure)  # type: ignore[arg-type]

    monkeypatch.setattr(EngineBenchmark, "run_once", run_once)
    out = tmp_path / "e.json"
    result = runner.invoke(
        app, ["benchmark", "--engine", "--model-id", str(demo_model_dir), *TINY, "-o", str(out)]
    )
    assert result.exit_code == 130, (result.output, result.exception)
    data = json.loads(out.read_text())
    validate_results(data)
    assert data["config"]["interrupted"] is True
    assert [s["batch_size"] for s in data["engine_steps"]] == [1]


@pytest.mark.parametrize("text", ["", "0,1", "a,2", "-1"])
def test_bad_batch_sizes_name_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--batch-sizes"):
        parse_batch_sizes(text)


def test_engine_needs_a_model_id() -> None:
    result = runner.invoke(app, ["benchmark", "--engine"])
    assert isinstance(result.exception, ConfigError)
    assert "--model-id" in str(result.exception)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--adapters", "a,b"), ("--json-schema", "s.json"), ("--ignore-eos", None)],
)
def test_load_test_workload_flags_are_refused_with_engine(flag: str, value: str | None) -> None:
    """--ignore-eos too: an --engine run always decodes its --decode-tokens steps."""
    given = [flag] if value is None else [flag, value]
    result = runner.invoke(app, ["benchmark", "--engine", "--model-id", "m", *given])
    assert isinstance(result.exception, ConfigError)
    assert f"{flag} applies to a load test of a server" in str(result.exception)


def test_engine_results_name_their_bad_fields(demo_model_dir: Path) -> None:
    from tgis.benchmark.engine_mode import run_engine

    data, interrupted = run_engine(str(demo_model_dir), [1], 4, 2, 1, None, 0)
    assert not interrupted
    validate_results(data)
    del data["config"]["device"]
    with pytest.raises(ValueError, match="at config: 'device'"):
        validate_results(data)
    data["config"]["device"] = "cpu"
    data["engine_steps"][0]["batch_size"] = 0
    with pytest.raises(ValueError, match="engine_steps/0/batch_size"):
        validate_results(data)
