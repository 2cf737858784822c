"""Quality of `--quantize` on the bundled demo model, through the API.

For each of float32, int8 and int4 (groups of 64), `tgis serve` runs the demo model on the CPU
and answers:

1. Perplexity of held-out standard-library source (the files `train_demo_model.py` held out of
   training, so the model never saw them): each chunk of CHUNK_TOKENS tokens is sent to
   /generate with `decoder_input_details`, whose prompt logprobs give the loss of every token
   after the first.
2. Greedy continuations (PROMPT_TOKENS new tokens) of 20 fixed prompts: the first lines of 20
   held-out files; each quantized server's text is compared with float32's.

    python scripts/bench_quant_quality.py [--chunks 24] [--json out.json]

Prints a markdown table: perplexity, its change against float32, and identical continuations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import ROOT, stop, wait_ready
from train_demo_model import corpus_files, is_validation

from tgis.benchmark.engine_mode import free_port

DEMO = ROOT / "tgis" / "assets" / "demo-model"
CHUNK_TOKENS = 256
PROMPTS = 20
PROMPT_TOKENS = 32
NEW_TOKENS = 32
METHODS: list[tuple[str, list[str]]] = [
    ("float32", []),
    ("int8", ["--quantize", "int8"]),
    ("int4 (groups of 64)", ["--quantize", "int4", "--quantize-group-size", "64"]),
]


def held_out_texts() -> list[str]:
    return [f.read_text(errors="replace") for f in corpus_files() if is_validation(f)]


def chunks(tokenizer: Any, texts: list[str], count: int) -> list[str]:
    """`count` chunks of CHUNK_TOKENS tokens of the held-out text, in file order."""
    ids = [i for text in texts for i in tokenizer(text)["input_ids"]]
    spans = [ids[i : i + CHUNK_TOKENS] for i in range(0, count * CHUNK_TOKENS, CHUNK_TOKENS)]
    return [tokenizer.decode(span) for span in spans if len(span) == CHUNK_TOKENS]


def prompts(tokenizer: Any, texts: list[str]) -> list[str]:
    """The opening PROMPT_TOKENS tokens of the first PROMPTS held-out files that have them."""
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= PROMPT_TOKENS:
            out.append(tokenizer.decode(ids[:PROMPT_TOKENS]))
        if len(out) == PROMPTS:
            break
    return out


def measure(flags: list[str], texts: list[str], starts: list[str], log: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "tgis", "serve", "--model-id", str(DEMO), "--backend", "cpu",
        "--dtype", "float32", "--port", str(port), "--max-input-tokens", "512",
        "--max-total-tokens", "1024", "--no-compile", *flags,
    ]  # fmt: skip
    with log.open("w") as out:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        wait_ready(url, proc, 600, "/health")
        nll, tokens = 0.0, 0
        with httpx.Client(base_url=url, timeout=600) as client:
            for text in texts:
                body = {"inputs": text, "parameters": {
                    "max_new_tokens": 1, "details": True, "decoder_input_details": True,
                }}  # fmt: skip
                reply = client.post("/generate", json=body)
                reply.raise_for_status()
                prefill = reply.json()["details"]["prefill"]
                logprobs = [t["logprob"] for t in prefill[1:] if t["logprob"] is not None]
                nll -= sum(logprobs)
                tokens += len(logprobs)
            continuations = []
            for start in starts:
                body = {"inputs": start, "parameters": {"max_new_tokens": NEW_TOKENS}}
                reply = client.post("/generate", json=body)
                reply.raise_for_status()
                continuations.append(reply.json()["generated_text"])
            info = client.get("/info").json()
    finally:
        stop(proc)
    return {
        "perplexity": math.exp(nll / tokens),
        "tokens": tokens,
        "continuations": continuations,
        "weight_bytes": info.get("runtime", {}).get("weight_bytes"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=24, help="held-out chunks of 256 tokens")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tgis-quant-quality"))
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    texts = held_out_texts()
    spans, starts = chunks(tokenizer, texts, args.chunks), prompts(tokenizer, texts)
    results = {}
    for name, flags in METHODS:
        log = args.workdir / f"{name.split()[0]}.log"
        results[name] = measure(flags, spans, starts, log)
        print(f"{name}: perplexity {results[name]['perplexity']:.4f}", file=sys.stderr)
    base = results["float32"]
    print(f"held-out tokens scored: {base['tokens']}; greedy prompts: {len(starts)}\n")
    print("| weights | weight bytes | perplexity | vs float32 | continuations identical |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        same = sum(a == b for a, b in zip(r["continuations"], base["continuations"], strict=True))
        change = (r["perplexity"] / base["perplexity"] - 1) * 100
        print(
            f"| {name} | {r['weight_bytes'] / 2**20:.1f} MiB | {r['perplexity']:.4f} | "
            f"{change:+.2f} % | {same} / {len(starts)} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
