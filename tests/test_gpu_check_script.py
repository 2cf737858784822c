"""scripts/gpu_check.py (`make gpu-check`): what runs on a GPU machine is selected, carried and
reported here without one: the CUDA tests it runs (and that they import with only tgis's
runtime requirements), the wheels it carries, the files it writes, the profile it takes, the
bench's budget and the table it writes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


# The scripts import each other by name, as they do when run.
sys.path.insert(0, str(ROOT / "scripts"))
gpu_check = importlib.import_module("gpu_check")
bench_gpu = importlib.import_module("bench_gpu")

DOC = "# Performance\n\n<!-- bench-gpu:start -->\nNot measured.\n<!-- bench-gpu:end -->\n"


def row(
    model: str, mode: str, streams: int, tok_s: float, itl_ms: float, **more: object
) -> dict[str, object]:
    return {
        "model": model, "mode": mode, "streams": streams, "cuda_graphs": mode != "eager",
        "output_tok_s": tok_s, "itl_p50_ms": itl_ms, "ttft_p50_ms": 20.0, "failed": 0,
        "exact": True, **more,
    }  # fmt: skip


def test_the_tests_stage_collects_every_cuda_test_from_its_modules_alone() -> None:
    """The modules the stage hands pytest hold every test marked `cuda` (as pytest itself
    selects them from the whole suite), and none of the modules that need the dev extra."""
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:randomly", "-m", "cuda",
         "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stdout + listed.stderr
    tests = [line for line in listed.stdout.splitlines() if "::" in line]
    files = gpu_check.cuda_test_files()
    assert {t.split("::")[0] for t in tests} <= set(files)
    names = " ".join(tests)
    for expected in (
        "paged/test_attention.py::test_flash_paged_equals_the_reference_on_cuda",
        "paged/test_backend.py::test_real_cuda_graphs_equal_eager_on_cuda",
        "test_serve_e2e.py::test_serve_on_cuda_starts_and_answers",
        "test_sdpa_kernels.py::test_batched_bf16_greedy_equals_alone_under_each_sdpa_kernel_on_cuda",
    ):
        assert expected in names
    assert not any("test_serve_binary_starts_and_answers" in t for t in tests)
    assert "tests/server/test_clients.py" not in files  # openai, text_generation: dev only


def stock_image(dest: Path, names: set[str]) -> None:
    """A folder of the distributions `names` as installed here (links to their files), for an
    interpreter whose path holds nothing else: a GPU image's packages."""
    dest.mkdir()
    for name in sorted(names):
        dist = distribution(name)
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if ".." not in str(f)}:
            if top != "__pycache__" and (base / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(base / top)


def test_the_cuda_tests_collect_beside_torch_with_the_carried_wheels_alone(
    tmp_path: Path,
) -> None:
    """A fresh interpreter that sees torch (and what torch requires), pip, and the packages the
    GPU image is taken to hold: the `wheels` stage's wheels complete tgis's requirements (the
    probe finds none unmet) and the tests stage collects every CUDA test without an error."""
    needs = gpu_check.runtime_needs(HERE)
    carried = {need.name for need in gpu_check.to_carry(needs, gpu_check.image_packages(gpu_check.IMAGE))}  # fmt: skip
    held = (set(needs) - carried) | set(gpu_check.closure(["torch"], HERE)) | {"pip"}
    stock_image(tmp_path / "image", held)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_packages = venv / "lib" / f"python{HERE}" / "site-packages"
    (site_packages / "image.pth").write_text(f"{tmp_path / 'image'}\n")
    wheel_dir = tmp_path / "whl"
    fetched = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "wheels", "--wheels", str(wheel_dir),
         "--python-version", HERE],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = tmp_path / "out"
    common = ["--wheels", str(wheel_dir), "--site", str(tmp_path / "site"), "--out", str(out)]
    for stage in (["probe"], ["tests", "--collect-only"]):
        subprocess.run(
            [str(venv / "bin" / "python"), "scripts/gpu_check.py", *stage, *common],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    facts = json.loads((out / "probe.json").read_text())
    assert facts["cuda"] is False and facts["unmet"] == []
    for name, version in gpu_check.carried_pins(wheel_dir):
        assert facts["packages"][name] == version  # the carried wheel, ahead of the image's
    result = json.loads((out / "tests.json").read_text())
    log = (out / "tests.log").read_text()
    assert result["passed"] and result["collect_only"], log
    assert "error" not in result["summary"].lower() and "tests collected" in result["summary"]
    assert "test_sdpa_kernels.py::test_batched_bf16_greedy_equals_alone" in log
    assert "test_serve_e2e.py::test_serve_on_cuda_starts_and_answers" in log


def test_tgis_needs_its_runtime_requirements_and_the_test_tools_beside_torch() -> None:
    """The closure follows every requirement's requirements (typer's pydantic), leaves out
    torch and what torch requires, the extras' packages and the dev-only clients, and
    evaluates markers for the GPU machine's Python, not this one."""
    needs = gpu_check.runtime_needs(HERE)
    for name in ("transformers", "huggingface-hub", "tokenizers", "typer", "pydantic",
                 "pydantic-core", "jsonschema", "rpds-py", "llguidance", "pytest",
                 "pytest-timeout", "pluggy"):  # fmt: skip
        assert name in needs, name
        assert needs[name].version == distribution(name).version
    for name in ("torch", "sympy", "networkx", "jinja2", "filelock", "fsspec", "openai",
                 "anthropic", "playwright", "cryptography", "text-generation", "peft",
                 "bitsandbytes", "ruff"):  # fmt: skip
        assert name not in needs, name
    assert needs["transformers"].specifier.contains("4.57.6")
    assert not needs["transformers"].specifier.contains("5.0.0")  # tgis's pin
    assert "typer" in needs["pydantic"].by
    old = gpu_check.closure(["pytest>=8"], "3.10")
    assert "exceptiongroup" in old and "tomli" in old  # pytest's `python_version < "3.11"`
    assert "exceptiongroup" not in gpu_check.closure(["pytest>=8"], "3.12")


def test_only_what_the_image_lacks_or_holds_at_another_version_is_carried(tmp_path: Path) -> None:
    needs = gpu_check.closure(["transformers>=4.57.1,<4.58", "numpy>=1.26"], HERE)
    image = tmp_path / "image.txt"
    image.write_text(
        "# a GPU image\nnumpy==2.5.2\ntransformers==5.17.0\nhuggingface_hub\nPyYAML  # no version\n"
    )
    held = gpu_check.image_packages(image)
    assert held["huggingface-hub"] is None and held["pyyaml"] is None
    names = [need.name for need in gpu_check.to_carry(needs, held)]
    assert "transformers" in names  # held, outside tgis's pin
    assert "tokenizers" in names  # not held
    assert "numpy" not in names  # held at a version that meets the requirement
    assert "huggingface-hub" not in names and "pyyaml" not in names  # held, version unknown
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"packages": {"transformers": "4.57.6", "tokenizers": "0.22.2"}}))
    from_probe = gpu_check.to_carry(needs, gpu_check.image_packages(probe))
    assert {"transformers", "tokenizers"}.isdisjoint(need.name for need in from_probe)


def test_unmet_names_what_is_missing_and_what_is_held_at_another_version() -> None:
    needs = gpu_check.closure(["pytest>=8", "no-such-package-for-tgis>=1"], HERE)
    needs["pluggy"].specifier &= type(needs["pluggy"].specifier)(">=99")
    lines = gpu_check.unmet(needs)
    assert "no-such-package-for-tgis: missing (needed by tgis)" in lines
    assert any(line.startswith("pluggy ") and ">=99" in line for line in lines)
    assert gpu_check.unmet(gpu_check.runtime_needs(HERE)) == []


def test_the_wheels_stage_pins_cleans_notes_and_refuses_too_much(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wheels are this environment's versions, older wheels are removed (two versions of
    one package stop the install), the Python is noted, and a set that would make the
    repository and the wheels weigh more than --carry-mib together is refused."""
    got: list[list[str]] = []

    def fake_download(pins: list[str], dest: Path, python_version: str) -> None:
        got.append(pins)
        for pin in pins:
            name, version = pin.split("==")
            (dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(
                b"x" * 2**20
            )

    monkeypatch.setattr(gpu_check, "download", fake_download)
    monkeypatch.setattr(gpu_check, "repository_bytes", lambda: 10 * 2**20)
    dest = tmp_path / "whl"
    dest.mkdir()
    (dest / "transformers-4.0.0-py3-none-any.whl").write_bytes(b"old")
    pins = gpu_check.wheels(dest, "3.12", gpu_check.IMAGE, carry_mib=64)
    assert ("transformers", distribution("transformers").version) in pins
    assert got == [[f"{n}=={v}" for n, v in pins]]
    assert not (dest / "transformers-4.0.0-py3-none-any.whl").exists()
    assert (dest / "python-version").read_text() == "3.12\n"
    assert gpu_check.carried_pins(dest) == sorted(pins)
    with pytest.raises(SystemExit, match=r"over --carry-mib 12.*the largest: "):
        gpu_check.wheels(dest, "3.12", gpu_check.IMAGE, carry_mib=12)


def test_wheels_for_another_python_are_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "python-version").write_text("2.7\n")
    monkeypatch.delenv(gpu_check.READY, raising=False)

    def no_install(*args: object, **kwargs: object) -> None:
        raise AssertionError("installed wheels of another Python")

    monkeypatch.setattr(gpu_check.subprocess, "run", no_install)
    gpu_check.install_wheels(tmp_path / "site", tmp_path)
    assert "wheels for Python 2.7" in capsys.readouterr().out


def test_arguments() -> None:
    args = gpu_check.parse_args(["all"])
    assert (args.budget, args.loads, args.python_version) == (480.0, gpu_check.LOADS, "3.12")
    assert gpu_check.parse_loads(args.loads) == [
        ("1b", "graphs"), ("1b", "async"), ("8b", "graphs"), ("1b", "eager"),
    ]  # fmt: skip
    assert gpu_check.parse_args(["tests", "--collect-only"]).collect_only
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["bench", "--collect-only"])
    with pytest.raises(SystemExit, match="each load is MODEL:MODE"):
        gpu_check.parse_loads("1b:graphs,70b:eager")
    # The budget: every stage's cap leaves the reserve for docs and the summary.
    budget = gpu_check.Budget(480, time.time() - 400)
    assert 60 < budget.left() <= 80
    assert budget.cap(1000) == pytest.approx(budget.left() - gpu_check.RESERVE, abs=1)
    assert budget.cap(10) == 10
    assert gpu_check.Budget(10, time.time() - 100).cap(50) == 0


def test_a_run_writes_at_most_eight_files_and_no_other() -> None:
    assert len(gpu_check.OUT_FILES) <= 8
    with pytest.raises(ValueError, match="not one of the files"):
        gpu_check.write(Path("/nonexistent"), "bench-1b-graphs.json", {})


def test_a_tests_stage_past_its_time_is_stopped_and_says_so(tmp_path: Path) -> None:
    code = gpu_check.tests(tmp_path, seconds=0.05, per_test=60, collect_only=True)
    result = json.loads((tmp_path / "tests.json").read_text())
    assert code != 0 and result["timed_out"] and not result["passed"]
    assert result["summary"] == "stopped after 0 s"


def test_the_profile_tables_one_decode_step_per_batch_on_the_cpu(tmp_path: Path) -> None:
    """decode_profile drives the backend `tgis benchmark --engine` loads (here the CPU's, on a
    tiny Llama) and tables one decode step per batch size, by CPU time off a GPU."""
    from tests.factories import make_model_dir

    model_dir = make_model_dir(tmp_path / "llama")
    text = gpu_check.decode_profile(model_dir, "cpu", "float32", (1, 4), prompt_tokens=8, rows=10)
    assert text.startswith("llama on cpu in float32; backend: {")
    parts = text.split("One decode step at ")
    assert [p.split(" ")[0] for p in parts[1:]] == ["1", "4"]
    for part in parts[1:]:
        assert "by cpu_time_total" in part and "aten::" in part
        ops = [line for line in part.splitlines() if line.strip().startswith("aten::")]
        assert 0 < len(ops) <= 10  # the rows asked for, no more


def length_step(ok: int, output: int, lengths: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"requests": {"ok": ok}, "output_tokens": output, "output_lengths": lengths}


def test_every_answer_must_be_as_long_as_asked() -> None:
    asked = bench_gpu.NEW_TOKENS
    exact = {"requests": 4, "short_requests": 0, "tokens": {"min": asked, "max": asked}}
    assert bench_gpu.length_problem(length_step(4, 4 * asked, exact), asked) is None
    assert bench_gpu.length_problem(length_step(4, 4 * asked), asked) is None
    short = {"requests": 4, "short_requests": 1, "tokens": {"min": 3, "max": asked}}
    assert bench_gpu.length_problem(length_step(4, 3 * asked + 3, short), asked) == (
        f"1 of 4 answers shorter than {asked} tokens (the shortest 3)"
    )
    assert bench_gpu.length_problem(length_step(4, 4 * asked - 1), asked) == (
        f"{4 * asked - 1} output tokens in 4 answers, {4 * asked} asked"
    )
    assert bench_gpu.length_problem(length_step(0, 0), asked) == "no request succeeded"
    command = bench_gpu.benchmark_command("http://h", Path("/m"), 16, 10, 3, Path("/r.json"))
    assert "--ignore-eos" in command
    assert command[command.index("--decode-tokens") + 1] == str(asked)
    helped = subprocess.run(
        [sys.executable, "-m", "tgis", "benchmark", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert "--ignore-eos" in helped.stdout


def test_the_bench_skips_what_cannot_run_or_finish_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager loads are left out where CUDA graphs cannot run (the graphs load served eagerly
    already), a load is started only with the time to finish it, and every run lands in the
    one bench.json, replacing an earlier run of the same load."""
    import torch

    from tgis.backends.paged import triton_attention

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100")
    monkeypatch.setattr(bench_gpu, "write_model", lambda workdir, name: workdir / name)
    # A machine where neither Triton's kernels nor paged flash attention run (torch 2.11).
    monkeypatch.setattr(triton_attention, "triton_available", lambda *_: "triton is not installed")
    served: list[tuple[str, str]] = []

    def run_mode(model_dir: Path, mode: str, *args: object, **kwargs: object) -> dict:
        served.append((model_dir.name, mode))
        graphs = row(model_dir.name, mode, 1, 100.0, 5.0, cuda_graphs=False)
        return {"runtime": {"cuda_graphs": False}, "rows": [graphs], "skipped": []}

    monkeypatch.setattr(bench_gpu, "run_mode", run_mode)
    loads = gpu_check.parse_loads(gpu_check.LOADS)
    plenty = gpu_check.Budget(10_000, time.time())
    assert gpu_check.bench(tmp_path, loads, 10, 3, tmp_path / "work", plenty)
    runs = json.loads((tmp_path / "bench.json").read_text())["runs"]
    assert served == [
        ("llama-3.2-1b", "graphs"), ("llama-3.2-1b", "async"), ("llama-3.1-8b", "graphs"),
    ]  # fmt: skip
    assert "CUDA graphs do not run here" in runs[3]["skipped"]
    served.clear()
    short = gpu_check.Budget(gpu_check.RESERVE + 60, time.time())
    gpu_check.bench(tmp_path, loads[2:3], 10, 3, tmp_path / "work", short)
    runs = json.loads((tmp_path / "bench.json").read_text())["runs"]
    assert served == [] and len(runs) == 4
    assert "left of the budget" in runs[-1]["skipped"] and runs[-1]["model"] == "llama-3.1-8b"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["bench.json"]


def write_bench(out: Path, runs: list[dict[str, Any]]) -> None:
    out.mkdir(exist_ok=True)
    data = {"device": "NVIDIA H100", "torch": "2.13.0", "runs": runs}
    (out / "bench.json").write_text(json.dumps(data))


def test_the_docs_stage_writes_the_table_the_probe_and_the_verdicts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    graphs = [row("llama-3.2-1b", "graphs", 1, 450.0, 1.8), row("llama-3.2-1b", "graphs", 64, 9_000.0, 6.0)]  # fmt: skip
    eager = [
        row("llama-3.2-1b", "eager", 1, 300.0, 3.1),
        row("llama-3.2-1b", "eager", 64, 9_500.0, 6.2, exact=False, length_problem="short"),
    ]
    overlapped = [row("llama-3.2-1b", "async", 64, 10_800.0, 5.0)]
    write_bench(
        out,
        [
            {"model": "llama-3.2-1b", "mode": "eager", "rows": eager},
            {"model": "llama-3.2-1b", "mode": "async", "rows": overlapped},
            {"model": "llama-3.2-1b", "mode": "graphs", "rows": graphs},
            {"model": "llama-3.1-8b", "mode": "graphs", "skipped": "20 s left of the budget"},
            {"model": "llama-3.1-8b", "mode": "eager", "error": "tgis serve exited with 1\nlog"},
        ],
    )
    (out / "probe.json").write_text(json.dumps({"attention_bf16": "flash attention over KV pages"}))
    (out / "tests.json").write_text(json.dumps({"passed": True, "summary": "13 passed in 9s"}))
    doc = tmp_path / "performance.md"
    doc.write_text(DOC)
    gpu_check.docs(out, doc)
    text = doc.read_text()
    assert text.startswith("# Performance") and "Not measured." not in text
    assert "GPU: NVIDIA H100; torch 2.13.0" in text
    lines = [line for line in text.splitlines() if line.startswith("| llama")]
    # graphs, async, eager, streams in order
    assert [line.split(" | ")[1:3] for line in lines] == [
        ["graphs", "1"], ["graphs", "64"], ["async", "64"], ["eager", "1"], ["eager", "64"],
    ]  # fmt: skip
    assert lines[0].endswith("| yes |") and lines[4].endswith("| no: short |")
    assert "Not measured: llama-3.1-8b graphs: 20 s left of the budget." in text
    assert "Failed: llama-3.1-8b eager: tgis serve exited with 1." in text
    assert "Attention (bf16, --attention-backend auto): flash attention over KV pages." in text
    assert "CUDA tests (`pytest -m cuda`): passed (13 passed in 9s)." in text
    assert "llama-3.2-1b: ITL p50 at 1 stream 1.80 ms (target <= 2.0 ms: met)" in text
    assert "llama-3.2-1b: 9,000 tokens/s at 64 streams (target >= 10,000: not met)" in text
    assert "graphs / eager tokens/s at 1 streams 1.50x (target >= 1: met)" in text
    assert "graphs / eager tokens/s at 64 streams 0.95x (target >= 1: not met)" in text
    assert "async scheduling / serial tokens/s at 64 streams 1.20x, ITL p50 5.00 / 6.00 ms" in text
    assert "async scheduling / serial tokens/s at 1 streams" not in text  # not measured


def test_a_graphs_load_that_ran_eager_says_so_and_is_not_compared(tmp_path: Path) -> None:
    rows = [
        row("llama-3.2-1b", "graphs", 1, 450.0, 1.8, cuda_graphs=False),
        row("llama-3.2-1b", "eager", 1, 440.0, 1.9),
    ]
    write_bench(tmp_path, [{"model": "llama-3.2-1b", "mode": "x", "rows": rows}])
    text = gpu_check.docs_text(tmp_path)
    assert "| llama-3.2-1b | graphs (ran eager) | 1 |" in text
    assert "graphs / eager at 1 streams not compared (the graphs load served eagerly)" in text
    assert "graphs / eager tokens/s" not in text


def test_docs_without_results_say_so(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no bench results"):
        gpu_check.docs(tmp_path, tmp_path / "performance.md")


def test_the_summary_gathers_the_stages_the_probe_and_the_table(tmp_path: Path) -> None:
    write_bench(tmp_path, [{"model": "llama-3.2-1b", "mode": "graphs", "rows": [row("llama-3.2-1b", "graphs", 1, 450.0, 1.8)]}])  # fmt: skip
    facts = {"gpu": "NVIDIA H100", "torch": "2.11.0", "unmet": ["pydantic: missing (needed by typer)"]}  # fmt: skip
    (tmp_path / "probe.json").write_text(json.dumps(facts))
    text = gpu_check.summary(tmp_path, {"tests": "7 passed, 4 skipped", "seconds": "400 of 480"})
    assert (tmp_path / "summary.md").read_text() == text
    assert "- tests: 7 passed, 4 skipped" in text and "- gpu: NVIDIA H100" in text
    assert "Unmet requirements:\n- pydantic: missing (needed by typer)" in text
    assert "| llama-3.2-1b | graphs | 1 | 450 |" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "probe.json", "summary.md"]


def test_the_kernels_stage_measures_each_kernel_against_sdpa_and_the_copy_bandwidth(
    tmp_path: Path,
) -> None:
    """bench_kernels.py on the CPU through Triton's interpreter (a tiny shape): each kernel
    that runs is checked against SDPA and timed in GB/s of K/V read, flash is listed as not
    run with its reason, and the docs table and the bandwidth verdict come from the file."""
    tiny = ["--device", "cpu", "--batches", "1,2", "--contexts", "20,300", "--prefill", "40",
            "--iters", "1", "--copy-mib", "4", "--shape", "4,2,64,16", "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpu_check, "stage_env", lambda: env)
        assert gpu_check.kernels_stage(tmp_path, 300, tiny)
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["device"] == "cpu" and data["copy_gbps"] > 0
    assert data["unavailable"] == {"flash": "needs CUDA; this is cpu"}
    decode = [
        (r["batch"], r["context"], r["kernel"]) for r in data["rows"] if r["kind"] == "decode"
    ]
    assert decode == [(b, c, k) for b in (1, 2) for c in (20, 300) for k in ("triton", "sdpa")]
    assert all(r["max_diff"] < 1e-4 for r in data["rows"]), data["rows"]
    assert all(r["ms"] > 0 and r["gbps"] >= 0 for r in data["rows"] if r["kind"] == "decode")
    assert [r["kernel"] for r in data["rows"] if r["kind"] == "prefill"] == ["triton", "sdpa"]
    text = gpu_check.kernels_text(tmp_path)
    assert "| batch | context | triton | sdpa |" in text and "| 2 | 300 |" in text
    assert "Causal prefill of 40 tokens: triton" in text and "Not run: flash:" in text
    assert "Triton decode attention at batch 64" not in text  # that row was not run


def test_a_failed_kernels_stage_says_why_in_its_file(tmp_path: Path) -> None:
    assert not gpu_check.kernels_stage(tmp_path, 60, ["--batches", "zero"])
    data = json.loads((tmp_path / "kernels.json").read_text())
    assert data["error"] == "failed (1)" and "comma list" in data["log"]
    assert gpu_check.kernels_text(tmp_path) == "Kernel bandwidth: failed (1)."


def test_the_bandwidth_verdict_reads_the_triton_row_at_batch_64_and_2k() -> None:
    bench_kernels = importlib.import_module("bench_kernels")
    row = {"kind": "decode", "batch": 64, "context": 2048, "kernel": "triton", "of_copy": 0.71}
    line = bench_kernels.verdict({"rows": [row]})
    assert line == (
        "Triton decode attention at batch 64, 2,048 context: 71% of the copy bandwidth "
        "(target 60%): met"
    )
    assert bench_kernels.verdict({"rows": [{**row, "of_copy": 0.4}]}).endswith("NOT met")
