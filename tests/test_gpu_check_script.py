"""scripts/gpu_check.py (`make gpu-check`): what runs on a GPU machine is selected and reported
here without one: the CUDA tests it runs, the table and target verdicts it writes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
assert _spec is not None and _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

DOC = "# Performance\n\n<!-- bench-gpu:start -->\nNot measured.\n<!-- bench-gpu:end -->\n"


def row(model: str, mode: str, streams: int, tok_s: float, itl_ms: float) -> dict[str, object]:
    return {
        "model": model, "mode": mode, "streams": streams, "output_tok_s": tok_s,
        "itl_p50_ms": itl_ms, "ttft_p50_ms": 20.0, "failed": 0,
    }  # fmt: skip


def test_the_cuda_stage_selects_the_cuda_tests() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:randomly", "-m", "cuda",
         "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stdout + listed.stderr
    tests = [line for line in listed.stdout.splitlines() if "::" in line]
    names = " ".join(tests)
    for expected in (
        "paged/test_attention.py::test_flash_paged_equals_the_reference_on_cuda",
        "paged/test_backend.py::test_real_cuda_graphs_equal_eager_on_cuda",
        "test_serve_e2e.py::test_serve_on_cuda_starts_and_answers",
    ):
        assert expected in names
    assert not any("test_serve_binary_starts_and_answers" in t for t in tests)


def test_the_docs_stage_writes_the_table_the_probe_and_the_verdicts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    rows = [
        row("llama-3.2-1b", "graphs", 1, 450.0, 1.8),
        row("llama-3.2-1b", "graphs", 64, 9_000.0, 6.0),
        row("llama-3.2-1b", "eager", 1, 300.0, 3.1),
        row("llama-3.2-1b", "eager", 64, 9_500.0, 6.2),
    ]
    for mode in ("eager", "graphs"):
        data = {
            "device": "NVIDIA H100",
            "torch": "2.13.0",
            "rows": [r for r in rows if r["mode"] == mode],
        }
        (out / f"bench-1b-{mode}.json").write_text(json.dumps(data))
    (out / "probe.json").write_text(json.dumps({"attention_bf16": "flash attention over KV pages"}))
    (out / "tests.json").write_text(json.dumps({"exit_code": 0, "passed": True}))
    doc = tmp_path / "performance.md"
    doc.write_text(DOC)
    gpu_check.docs(out, doc)
    text = doc.read_text()
    assert text.startswith("# Performance") and "Not measured" not in text
    assert "GPU: NVIDIA H100; torch 2.13.0" in text
    lines = [line for line in text.splitlines() if line.startswith("| llama")]
    # graphs before eager, streams in order
    assert [line.split(" | ")[1:3] for line in lines] == [
        ["graphs", "1"], ["graphs", "64"], ["eager", "1"], ["eager", "64"],
    ]  # fmt: skip
    assert "Attention (bf16): flash attention over KV pages." in text
    assert "CUDA tests (`pytest -m cuda`): passed." in text
    assert "llama-3.2-1b: ITL p50 at 1 stream 1.80 ms (target <= 2.0 ms: met)" in text
    assert "llama-3.2-1b: 9,000 tokens/s at 64 streams (target >= 10,000: not met)" in text
    assert "graphs / eager tokens/s at 1 streams 1.50x (target >= 1: met)" in text
    assert "graphs / eager tokens/s at 64 streams 0.95x (target >= 1: not met)" in text


def test_docs_without_results_say_so(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no bench results"):
        gpu_check.docs(tmp_path, tmp_path / "performance.md")


def test_wheels_for_another_python_are_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "python-version").write_text("2.7\n")
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path)
    monkeypatch.delenv(gpu_check.READY, raising=False)

    def no_install(*args: object, **kwargs: object) -> None:
        raise AssertionError("installed wheels of another Python")

    monkeypatch.setattr(gpu_check.subprocess, "run", no_install)
    gpu_check.install_wheels(tmp_path / "site")
    assert "wheels for Python 2.7" in capsys.readouterr().out
