"""`make bench-gpu`: tgis serve on one GPU with Llama-3.2-1B's and Llama-3.1-8B's shapes.

1. Writes random-weight bf16 models from the configs in scripts/bench_models/ (no download)
   with a byte-level BPE tokenizer of the same vocabulary size trained on the Python standard
   library, under --workdir (kept: a second run reuses them).
2. Serves each with `tgis serve --backend cuda --dtype bfloat16` and default flags (the KV pool
   sized from the GPU's memory, CUDA-graph decode where this torch has paged flash attention),
   and again with --no-cuda-graphs (eager), and drives it with `tgis benchmark --ignore-eos` at
   1, 16 and 64 closed-loop streams: 150-token prompts, exactly 128 new tokens (a row says
   whether every answer had them all), through the TGI streaming route. Each row records what
   the server said it ran (/info: attention, CUDA graphs).
3. Writes the JSON of every run under --workdir and the table to docs/performance.md between
   the `bench-gpu` markers, with the GPU's name and torch's version.

    python scripts/bench_gpu.py --workdir /data/tgis-bench-gpu [--models 1b,8b] [--modes graphs,eager]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}
STREAMS = (1, 16, 64)
PROMPT_TOKENS, NEW_TOKENS = 150, 128
START, END = "<!-- bench-gpu:start -->", "<!-- bench-gpu:end -->"


def write_model(workdir: Path, name: str) -> Path:
    """The random bf16 model of scripts/bench_models/NAME.json, written once; its tokenizer is
    trained once per vocabulary size (the 1B and 8B shapes share one)."""
    out = workdir / name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    fields = json.loads((ROOT / "scripts" / "bench_models" / f"{name}.json").read_text())
    vocab = workdir / f"tokenizer-{fields['vocab_size']}"
    if not (vocab / "tokenizer.json").is_file():
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_serve import build_tokenizer

        build_tokenizer(fields["vocab_size"]).save_pretrained(vocab)
    tokenizer = AutoTokenizer.from_pretrained(vocab)
    config = LlamaConfig(
        **fields,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tgis serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"tgis serve at {url} not ready after {timeout}s")


def benchmark_command(url: str, model_dir: Path, streams: int, duration: float, warmup: float,
                      result: Path) -> list[str]:  # fmt: skip
    """`tgis benchmark` at `streams` closed-loop streams, every answer NEW_TOKENS long."""
    return [sys.executable, "-m", "tgis", "benchmark", "--url", url, "--api", "tgi",
            "--tokenizer", str(model_dir), "--prompt-tokens", str(PROMPT_TOKENS),
            "--decode-tokens", str(NEW_TOKENS), "--ignore-eos", "--kind", "throughput",
            "--max-vus", str(streams), "--duration", str(duration), "--warmup", str(warmup),
            "--output", str(result)]  # fmt: skip


def length_problem(step: dict[str, Any], asked: int) -> str | None:
    """Why the answers of a `tgis benchmark` step were not all exactly `asked` tokens long
    (None: they were). Each answer asked for at most `asked`, so the total alone settles it;
    the step's `output_lengths`, where the results record it, says more."""
    ok = step["requests"]["ok"]
    if not ok:
        return "no request succeeded"
    lengths = step.get("output_lengths") or {}
    tokens = lengths.get("tokens") or {}
    if lengths.get("short_requests"):
        return (
            f"{lengths['short_requests']} of {ok} answers shorter than {asked} tokens "
            f"(the shortest {tokens.get('min')})"
        )
    if tokens and (tokens.get("min"), tokens.get("max")) != (asked, asked):
        return f"answers of {tokens.get('min')} to {tokens.get('max')} tokens, {asked} asked"
    if step["output_tokens"] != ok * asked:
        return f"{step['output_tokens']} output tokens in {ok} answers, {ok * asked} asked"
    return None


def row_of(step: dict[str, Any], model: str, mode: str, streams: int, graphs: bool) -> dict:
    """The table's row of one `tgis benchmark` step."""
    problem = length_problem(step, NEW_TOKENS)
    return {
        "model": model,
        "mode": mode,
        "streams": streams,
        "cuda_graphs": graphs,
        "output_tok_s": step["output_tokens_per_s"],
        "itl_p50_ms": (step["itl_s"] or {}).get("p50", float("nan")) * 1000,
        "ttft_p50_ms": (step["ttft_s"] or {}).get("p50", float("nan")) * 1000,
        "failed": step["requests"]["failed"],
        "exact": problem is None,
        **({"length_problem": problem} if problem else {}),
    }


# What each mode adds to `tgis serve`: graphs (the default on a GPU: CUDA graphs, steps
# planned after the one before), async (also async scheduling: each step planned and launched
# while the one before runs), eager (no CUDA graphs).
MODE_FLAGS: dict[str, list[str]] = {
    "graphs": [],
    "async": ["--async-scheduling"],
    "eager": ["--no-cuda-graphs"],
}


def run_mode(
    model_dir: Path,
    mode: str,
    workdir: Path,
    duration: float,
    warmup: float = 5.0,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Serve `model_dir` in `mode` (MODE_FLAGS) and measure each stream count, starting none
    that would end after `deadline` (time.time()); {"runtime": what /info says the server runs,
    "rows": one per stream count, "skipped": the stream counts left out}."""
    import httpx

    port = 18081
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tgis", "serve", "--model-id", str(model_dir), "--backend",
           "cuda", "--dtype", "bfloat16", "--port", str(port), "--hostname", "127.0.0.1",
           "--max-total-tokens", "2048", "--max-batch-size", str(max(STREAMS))]  # fmt: skip
    cmd += MODE_FLAGS[mode]
    log = workdir / f"{model_dir.name}-{mode}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    end = deadline if deadline is not None else time.time() + 86_400
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    found: dict[str, Any] = {"rows": [], "skipped": []}
    try:
        wait_ready(url, proc, min(1200.0, end - time.time()))
        runtime = httpx.get(url + "/info", timeout=10).json()["runtime"]
        graphs = bool(runtime.get("cuda_graphs"))
        found["runtime"] = {"attention": runtime.get("attention"), "cuda_graphs": graphs}
        for streams in STREAMS:
            if time.time() + duration + warmup + 20 > end:
                found["skipped"].append(streams)
                continue
            result = workdir / f"{model_dir.name}-{mode}-x{streams}.json"
            subprocess.run(
                benchmark_command(url, model_dir, streams, duration, warmup, result),
                check=True, cwd=ROOT, env=env, timeout=duration + warmup + 120,
            )  # fmt: skip
            step = json.loads(result.read_text())["steps"][-1]
            found["rows"].append(row_of(step, model_dir.name, mode, streams, graphs))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return found


def table(rows: list[dict], device: str, torch_version: str) -> str:
    lines = [
        f"GPU: {device}; torch {torch_version}; `python scripts/bench_gpu.py` "
        f"({PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens with ignore_eos, TGI "
        "streaming route).",
        "",
        "| model shape | mode | streams | output tok/s | ITL p50 | TTFT p50 | failed | "
        f"all {NEW_TOKENS} tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mode = r["mode"]
        if mode in ("graphs", "async") and not r.get("cuda_graphs", True):
            mode = f"{mode} (ran eager)"
        exact = "yes" if r.get("exact", True) else f"no: {r.get('length_problem', '?')}"
        lines.append(
            f"| {r['model']} | {mode} | {r['streams']} | {r['output_tok_s']:,.0f} | "
            f"{r['itl_p50_ms']:.2f} ms | {r['ttft_p50_ms']:.0f} ms | {r['failed']} | {exact} |"
        )
    return "\n".join(lines)


def write_docs(text: str, path: Path = ROOT / "docs" / "performance.md") -> None:
    doc = path.read_text()
    start, end = doc.index(START) + len(START), doc.index(END)
    path.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tgis-bench-gpu"))
    parser.add_argument("--models", default="1b,8b", help="comma-separated: 1b, 8b")
    parser.add_argument(
        "--modes", default="graphs,eager", help="comma-separated: graphs, async, eager"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per step")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/performance.md")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench-gpu needs a CUDA device; none is visible")
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for key in args.models.split(","):
        model_dir = write_model(args.workdir, MODELS[key.strip()])
        for mode in args.modes.split(","):
            rows += run_mode(model_dir, mode.strip(), args.workdir, args.duration)["rows"]
    device = torch.cuda.get_device_name(0)
    text = table(rows, device, torch.__version__)
    print(text)
    (args.workdir / "bench-gpu.json").write_text(
        json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=2)
    )
    if not args.no_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
