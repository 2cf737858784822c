"""`tgis warmup` end to end on the bundled demo model (cpu backend)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_tgis


def test_warmup_reports_every_shape_and_the_kv_budget(tmp_path: Path) -> None:
    out = tmp_path / "warmup.json"
    result = run_tgis(
        "warmup", "--max-batch-size", "4", "--max-total-tokens", "256", "--output", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert "tgis warmup: cpu on cpu" in result.stdout
    data = json.loads(out.read_text())
    shapes = [(s["phase"], s["rows"], s["length"]) for s in data["shapes"]]
    # The demo model (llama) runs the paged engine: the largest prompt chunk the scheduler
    # sends, then a decode step per batch bucket.
    assert shapes == [("prefill", 1, 255), ("decode", 1, 1), ("decode", 2, 1), ("decode", 4, 1)]
    assert data["block_size"] == 16
    assert data["max_batch_total_tokens"] == 4 * 256 == data["max_sequences"] * 256
    assert data["kv_budget_tokens"] > data["max_batch_total_tokens"]
    assert "KV cache: 1024 tokens in 64 blocks of 16" in " ".join(result.stdout.split())
    assert "the largest --max-batch-total-tokens that fits is" in " ".join(result.stdout.split())


def test_warmup_refuses_what_serve_refuses() -> None:
    result = run_tgis("warmup", "--backend", "tpu", "--compile")
    assert result.returncode == 1
    assert "--compile true applies to the cpu and cuda backends" in result.stderr
    result = run_tgis("warmup", "--prefill-mode", "rebuild")
    assert result.returncode == 1
    assert "applies to the static batch of the tpu and neuron backends, not cpu" in result.stderr


def test_warmup_over_two_shards_runs_their_plan_and_stops_them(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "warmup.json"
    result = run_tgis(
        "warmup", "--num-shard", "2", "--master-port", str(port), "--dtype", "float32",
        "--max-batch-size", "4", "--max-total-tokens", "256", "--output", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert [s["phase"] for s in data["shapes"]] == ["prefill", "decode", "decode", "decode"]
    assert data["max_batch_total_tokens"] == 4 * 256  # the pool every shard agreed on
