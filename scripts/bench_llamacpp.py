"""`make bench` with LLAMA_SERVER set: tgis serve vs llama.cpp's llama-server, same weights.

The runtime's targets are ratios against llama.cpp's server on the same CPU and the same
weights in float32 (converted to GGUF by llama.cpp's own convert_hf_to_gguf.py; llama.cpp is
built and the models converted outside this repository, see docs/performance.md):

- the bundled demo model: ITL p50 at 1 stream, output tokens/s at 16 and 64 streams;
- a random SmolLM2-135M-shaped Llama (scripts/bench_serve.py builds it): ITL p50 at 1 stream,
  tokens/s at 16 streams, and tgis's bare in-process decode step at batch 1 (no server).

Both servers take the same closed-loop load through OpenAI's streaming /v1/completions: 100-token
prompts cut from the standard library with the model's tokenizer, 64 new tokens, greedy, EOS
ignored, one server at a time, nothing else running.

    python scripts/bench_llamacpp.py --llama-server BIN --demo-gguf demo-f32.gguf \
        --smol-gguf smol-f32.gguf --workdir /tmp/tgis-bench --output runtime.json

Quantized weights (docs/quantization.md): with `--quant-gguf int8=smol-q8_0.gguf` (and/or
`int4=smol-q4_0.gguf`), tgis serve --quantize METHOD on the 135M model against llama-server on
the GGUF of that quantization (ITL p50 at 1 stream, tokens/s at 16, peak RSS of each server);
the float runs are skipped where their GGUFs are not given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import (
    ROOT,
    Result,
    bare_decode_ms,
    build_model,
    pct,
    prompts,
    run_server,
    stop,
    wait_ready,
)

DEMO_MODEL = ROOT / "tgis" / "assets" / "demo-model"
# Greedy, and every answer runs to its max_tokens (llama-server and tgis both take ignore_eos).
PARAMETERS = {"temperature": 0.0, "ignore_eos": True}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
            return [f for f in line.split(":", 1)[1].split() if f in wanted]
    return []


def serve_both(
    name: str,
    model_dir: Path,
    gguf: Path,
    llama_server: str,
    loads: list[tuple[int, int]],
    new_tokens: int,
    workdir: Path,
    port: int,
    repeat: int = 1,
    compile: bool = True,
    tgis_flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Each load (streams, requests) on tgis serve, then on llama-server; `repeat` rounds of
    both in turn, each figure the median of its rounds (this kind of machine drifts by tens of
    percent between runs). `compile`: tgis serves as it does with no flag, its compiled decode
    kept in the workdir: the start-ups are timed first (`start_times`: a first start that
    builds the packages, a second that loads them), and the loads run with them loaded;
    False: --no-compile. `tgis_flags`: more flags of tgis serve."""
    texts = prompts(model_dir, sum(n for _, n in loads) + 4, 100, seed=0)
    warm, rest = texts[:4], texts[4:]
    load_texts = []
    for streams, count in loads:
        load_texts.append((streams, rest[:count]))
        rest = rest[count:]
    most = max(s for s, _ in loads)
    url = f"http://127.0.0.1:{port}"
    tgis_cmd = [sys.executable, "-m", "tgis", "serve", "--model-id", str(model_dir), "--port",
                str(port), "--hostname", "127.0.0.1", "--no-grpc", "--dtype", "float32",
                "--max-total-tokens", "512", "--max-batch-size", str(most)]  # fmt: skip
    store = workdir / "compiled"
    tgis_cmd += ["--compile-cache", str(store)] if compile else ["--no-compile"]
    tgis_cmd += list(tgis_flags)
    starts = start_times(tgis_cmd, url, workdir / f"{name}-tgis-start.log") if compile else None
    # One slot per stream, each with room for a prompt and its answer.
    llama_cmd = [llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                 "-np", str(most), "-c", str(most * 512), "-t", str(os.cpu_count() or 1),
                 "--no-webui"]  # fmt: skip
    rounds: dict[str, list[list[dict[str, Any]]]] = {"tgis": [], "llama.cpp": []}
    for _ in range(repeat):
        for server, cmd in (("tgis", tgis_cmd), ("llama.cpp", llama_cmd)):
            results = run_server(
                cmd, url, "/health", workdir / f"{name}-{server}.log", load_texts, "model",
                new_tokens, warm, api="openai-completions", parameters=PARAMETERS,
            )  # fmt: skip
            rounds[server].append(
                [
                    summary(streams, res, rss)
                    for (streams, _), (res, rss) in zip(load_texts, results, strict=True)
                ]
            )
    table: dict[str, Any] = {server: median_rows(runs) for server, runs in rounds.items()}
    if starts is not None:
        table["starts"] = starts
    return table


def start_times(cmd: list[str], url: str, log: Path) -> dict[str, float]:
    """tgis serve's start-ups with the compiled decode: a first start over an empty store
    (seconds until /health answers, and until /info says the packages a process of its own
    built are loaded), then a second start (seconds until /health answers, its packages
    loaded by then)."""
    import shutil

    store = Path(cmd[cmd.index("--compile-cache") + 1])
    shutil.rmtree(store, ignore_errors=True)
    times: dict[str, float] = {}
    for start in ("first", "second"):
        with log.open("a") as out:
            begun = time.perf_counter()
            env = {**os.environ, "HF_HUB_OFFLINE": "1"}
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            wait_ready(url, proc, 600, "/health")
            times[f"{start}_ready_s"] = time.perf_counter() - begun
            while (state := compiled_state(url)) == "building":
                if time.perf_counter() - begun > 1800:
                    raise RuntimeError("the compiled decode was not built in 30 minutes")
                time.sleep(1)
            if state != "ready":
                raise RuntimeError(f"the compiled decode is {state}; see {store}")
            times[f"{start}_compiled_s"] = time.perf_counter() - begun
        finally:
            stop(proc)
    return times


def compiled_state(url: str) -> str:
    import httpx

    return str(httpx.get(url + "/info", timeout=5).json()["runtime"]["compiled_decode_state"])


def median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per load, each figure's median over the rounds (errors summed), the rounds kept."""
    rows = []
    for per_load in zip(*runs, strict=True):
        row: dict[str, Any] = {"streams": per_load[0]["streams"], "rounds": list(per_load)}
        for key in ("output_tok_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "output_tokens",
                    "peak_rss_mb"):  # fmt: skip
            row[key] = statistics.median(r[key] for r in per_load)
        row["errors"] = sum(r["errors"] for r in per_load)
        rows.append(row)
    return rows


def summary(streams: int, res: Result, rss: float) -> dict[str, Any]:
    return {
        "peak_rss_mb": rss,
        "streams": streams,
        "output_tok_s": res.output_tokens / res.wall if res.wall else 0.0,
        "itl_p50_ms": pct(res.itl, 50) * 1000,
        "itl_p99_ms": pct(res.itl, 99) * 1000,
        "ttft_p50_ms": pct(res.ttft, 50) * 1000,
        "output_tokens": res.output_tokens,
        "errors": res.errors,
        "error_kinds": res.error_kinds,
    }


def at(rows: list[dict[str, Any]], streams: int) -> dict[str, Any]:
    return next(r for r in rows if r["streams"] == streams)


# Targets of the ratios (tgis over llama.cpp): docs/performance.md and docs/quantization.md.
TARGETS = {
    "demo_itl_x1_tgis_over_llama": ("<=", 2.0),
    "demo_tok_s_x16_tgis_over_llama": (">=", 1.0),
    "demo_tok_s_x64_tgis_over_llama": (">=", 1.5),
    "smol_itl_x1_tgis_over_llama": ("<=", 1.2),
    "smol_itl_x1_served_over_bare": ("<=", 1.1),
    "smol_int8_itl_x1_tgis_over_llama": ("<=", 1.0),
    "smol_int8_tok_s_x16_tgis_over_llama": (">=", 1.5),
    "smol_int4_itl_x1_tgis_over_llama": ("<=", 1.0),
}


def itl_ratio(table: dict[str, list[dict[str, Any]]], streams: int) -> float:
    return at(table["tgis"], streams)["itl_p50_ms"] / at(table["llama.cpp"], streams)["itl_p50_ms"]


def tok_s_ratio(table: dict[str, list[dict[str, Any]]], streams: int) -> float:
    tgis, llama = at(table["tgis"], streams), at(table["llama.cpp"], streams)
    return tgis["output_tok_s"] / llama["output_tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--demo-gguf", type=Path, help="the demo model, f32 GGUF")
    parser.add_argument("--smol-gguf", type=Path, help="the 135M model, f32 GGUF")
    parser.add_argument(
        "--quant-gguf", action="append", default=[], metavar="METHOD=FILE",
        help="tgis --quantize METHOD (int8, int4) against this GGUF of the 135M model",
    )  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tgis-bench"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--repeat", type=int, default=1, help="rounds; figures are medians")
    parser.add_argument(
        "--no-compile", action="store_true", help="tgis serve --no-compile (eager decode)"
    )
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    quantized = dict(item.split("=", 1) for item in args.quant_gguf)
    args.compile = not args.no_compile
    if not quantized and not (args.demo_gguf and args.smol_gguf):
        parser.error("give --demo-gguf and --smol-gguf, or --quant-gguf METHOD=FILE")
    args.workdir.mkdir(parents=True, exist_ok=True)
    smol_dir = build_model(args.workdir)
    started = time.time()
    tables: dict[str, dict[str, list[dict[str, Any]]]] = {}
    ratios: dict[str, float] = {}
    bare_ms = None
    if args.demo_gguf and args.smol_gguf:
        demo = tables["demo"] = serve_both(
            "demo", DEMO_MODEL, args.demo_gguf, args.llama_server,
            [(1, 8), (16, 64), (64, 192)], args.new_tokens, args.workdir, args.port,
            args.repeat, args.compile,
        )  # fmt: skip
        smol = tables["135M"] = serve_both(
            "smol", smol_dir, args.smol_gguf, args.llama_server, [(1, 3), (16, 32)],
            args.new_tokens, args.workdir, args.port, args.repeat, args.compile,
        )  # fmt: skip
        bare_ms = statistics.median(
            bare_decode_ms(
                smol_dir, "float32", compile=args.compile, compile_cache=args.workdir / "compiled"
            )[0]
            for _ in range(args.repeat)
        )
        ratios.update({
            "demo_itl_x1_tgis_over_llama": itl_ratio(demo, 1),
            "demo_tok_s_x16_tgis_over_llama": tok_s_ratio(demo, 16),
            "demo_tok_s_x64_tgis_over_llama": tok_s_ratio(demo, 64),
            "smol_itl_x1_tgis_over_llama": itl_ratio(smol, 1),
            "smol_itl_x1_served_over_bare": at(smol["tgis"], 1)["itl_p50_ms"] / bare_ms,
            "smol_tok_s_x16_tgis_over_llama": tok_s_ratio(smol, 16),
        })  # fmt: skip
    for method, gguf in quantized.items():
        table = tables[f"135M {method}"] = serve_both(
            f"smol-{method}", smol_dir, Path(gguf), args.llama_server, [(1, 3), (16, 32)],
            args.new_tokens, args.workdir, args.port, args.repeat, args.compile,
            ("--quantize", method),
        )  # fmt: skip
        ratios[f"smol_{method}_itl_x1_tgis_over_llama"] = itl_ratio(table, 1)
        ratios[f"smol_{method}_tok_s_x16_tgis_over_llama"] = tok_s_ratio(table, 16)
    print(f"\nCPU: {cpu_name()} ({os.cpu_count()} cores; {' '.join(cpu_flags())})")
    print(f"{'model':<11}{'server':<11}{'streams':>8}{'tok/s':>10}{'ITL p50':>11}{'ITL p99':>11}"
          f"{'TTFT p50':>11}{'RSS MB':>9}{'err':>5}")  # fmt: skip
    for name, table in tables.items():
        for server, rows in table.items():
            if server == "starts":
                print(f"{name}: tgis serve start-up " + ", ".join(
                    f"{k.removesuffix('_s').replace('_', ' ')} {v:.1f} s" for k, v in rows.items()
                ))  # fmt: skip
                continue
            for r in rows:
                print(f"{name:<11}{server:<11}{r['streams']:>8}{r['output_tok_s']:>10.1f}"
                      f"{r['itl_p50_ms']:>9.2f}ms{r['itl_p99_ms']:>9.2f}ms"
                      f"{r['ttft_p50_ms']:>9.1f}ms{r['peak_rss_mb']:>9.0f}{r['errors']:>5}")  # fmt: skip
    if bare_ms is not None:
        print(f"135M bare in-process decode step, batch 1: {bare_ms:.2f} ms")
    if args.repeat > 1:
        print(f"(medians of {args.repeat} rounds, the servers in turn)")
    for key, value in ratios.items():
        target = TARGETS.get(key)
        verdict = ""
        if target is not None:
            op, bound = target
            met = value <= bound if op == "<=" else value >= bound
            verdict = f"  (target {op} {bound}: {'met' if met else 'not met'})"
        print(f"{key:<40}{value:>7.2f}{verdict}")
    if args.output:
        args.output.write_text(json.dumps({
            "cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
            **tables, "smol_bare_step_ms": bare_ms, "ratios": ratios,
            "minutes": (time.time() - started) / 60, "repeat": args.repeat,
            "compile": args.compile,
        }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
