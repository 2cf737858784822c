"""`make bench`: tgis serve vs `transformers serve --continuous-batching`, same model, same load.

1. Builds a random Llama with SmolLM2-135M's shape (vocab 49152, hidden 576, 30 layers, 9 heads,
   3 KV heads, intermediate 1536) and a byte-level BPE tokenizer trained on the Python standard
   library (no download), saved under --workdir.
2. Serves it with each server in turn and drives both with the same closed-loop load through
   the OpenAI chat route (the peer batches only that route): N concurrent streaming clients,
   R requests, ~100-token prompts, 64 new tokens, greedy. tgis's requests carry `ignore_eos`,
   so that every answer of the random model runs to its 64 tokens (see TGIS_PARAMETERS).
3. Prints output tokens/s, mean output tokens per answer, TTFT p50/p99, inter-token latency
   p50/p99, peak RSS, and the ratios (with a warning for a server whose answers came back
   shorter than asked);
   plus tgis at 1 and 32 streams, a bare in-process decode loop over the same model, and
   prefix caching: TTFT of the second of two 200-token prompts sharing 150 tokens over the
   first's (5 pairs, one request at a time).
   tgis decodes eagerly here (--no-compile), as the peer does; its compiled decode, the
   default on a CPU, is measured against llama.cpp's server (scripts/bench_llamacpp.py).

    python scripts/bench_serve.py --workdir /tmp/tgis-bench
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PREFIX_PAIRS = 5
# Greedy; a random-weight model picks EOS early, so tgis is asked to run every answer to its
# length (vLLM's `ignore_eos`): the figures then measure the load the script states.
TGIS_PARAMETERS: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
# `transformers serve` refuses a body with a key its OpenAI types lack (422 "Unexpected keys in
# the request"), ignore_eos among them, and its continuous-batching manager takes the EOS from
# the tokenizer for every request: its answers may end at EOS. Their mean length is printed
# with the figures, and tokens/s counts the tokens each server actually produced.
PEER_PARAMETERS: dict[str, Any] = {"temperature": 0.0}
SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 2048,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of exactly `vocab_size` ids trained on the Python standard
    library (no download)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from train_demo_model import corpus_files, train_tokenizer

    texts = [f.read_text(encoding="utf-8", errors="replace") for f in corpus_files()]
    tokenizer = train_tokenizer(texts, vocab_size)
    # The corpus may not yield every merge: fill the vocabulary with inert tokens so ids
    # the random model emits always decode.
    missing = vocab_size - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<|unused_{i}|>" for i in range(missing)])
    return tokenizer


def build_model(workdir: Path) -> Path:
    """The random SmolLM2-135M-shaped Llama and a 49152-token tokenizer (cached in workdir)."""
    out = workdir / "smollm2-135m-random"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(SMOLLM2_135M["vocab_size"])
    torch.manual_seed(0)
    config = LlamaConfig(
        **SMOLLM2_135M,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def prompts(model_dir: Path, count: int, tokens: int, seed: int) -> list[str]:
    """`count` prompts of exactly `tokens` tokens, cut from the standard library's source."""
    from transformers import AutoTokenizer

    from tgis.benchmark.prompts import load_corpus, make_prompt

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng, corpus = random.Random(seed), load_corpus()
    return [make_prompt(tok, tokens, rng, corpus) for _ in range(count)]


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    answers: int = 0  # requests that succeeded
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    wall: float = 0.0


async def closed_loop(
    url: str,
    model: str,
    texts: list[str],
    streams: int,
    new_tokens: int,
    api: str = "openai-chat",
    parameters: dict[str, Any] | None = None,
) -> Result:
    """`streams` clients, each sending the next prompt as soon as its previous one finished,
    through tgis.benchmark's client of `api` (token times taken from the stream), greedy
    unless `parameters` say otherwise."""
    from tgis.benchmark.client import BenchmarkClient
    from tgis.benchmark.prompts import Turn

    res = Result()
    queue = list(texts)
    client = BenchmarkClient(url, api=api, model=model, request_timeout=600.0,
                             stall_timeout=300.0,
                             extra_parameters=parameters or {"temperature": 0.0})  # fmt: skip

    async def user() -> None:
        while queue:
            record = await client.send(Turn(queue.pop(0), 0, new_tokens))
            if not record.ok:
                res.errors += 1
                kind = f"{record.error}: {record.error_message[:80]}"
                res.error_kinds[kind] = res.error_kinds.get(kind, 0) + 1
                continue
            # A server holds back text that is not whole UTF-8 yet (a random model's byte
            # tokens), so an answer may stream fewer chunks than tokens, or none: its tokens
            # are the server's own count where it gives one.
            if record.ttft is not None:
                res.ttft.append(record.ttft)
            times = record.token_times
            res.itl.extend(b - a for a, b in itertools.pairwise(times))
            res.output_tokens += (
                record.usage_tokens if record.usage_tokens is not None else record.output_tokens
            )
            res.answers += 1

    start = time.perf_counter()
    try:
        await asyncio.gather(*(user() for _ in range(streams)))
    finally:
        await client.aclose()
    res.wall = time.perf_counter() - start
    return res


def pct(values: list[float], q: float) -> float:
    from tgis.benchmark.metrics import percentile

    return percentile(values, q) if values else float("nan")


def peak_rss_mb(pid: int) -> float:
    """VmHWM of the server process and its children, in MB."""
    total = 0
    pids = [pid]
    with contextlib.suppress(OSError):
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, path: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server at {url} not ready after {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_server(
    cmd: list[str],
    url: str,
    ready_path: str,
    log: Path,
    loads: list[tuple[int, list[str]]],
    model: str,
    new_tokens: int,
    warm: list[str],
    api: str = "openai-chat",
    parameters: dict[str, Any] | None = None,
) -> list[tuple[Result, float]]:
    with log.open("w") as out:
        # Both servers run offline: the model is local and nothing may be fetched mid-run.
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        wait_ready(url, proc, 600, ready_path)
        # First-request costs.
        asyncio.run(closed_loop(url, model, warm, min(4, len(warm)), 8, api, parameters))
        results = []
        for streams, texts in loads:
            res = asyncio.run(closed_loop(url, model, texts, streams, new_tokens, api, parameters))
            results.append((res, peak_rss_mb(proc.pid)))
        return results
    finally:
        stop(proc)


def bare_decode_ms(
    model_dir: Path,
    dtype: str = "float32",
    steps: int = 64,
    compile: bool = False,
    compile_cache: Path | None = None,
) -> tuple[float, float]:
    """ms per token of in-process greedy decode at batch 1: tgis's backend (the paged one
    `tgis serve --max-total-tokens 512` runs for this Llama; with `compile`, its decode
    compiled first, or loaded from the packages in `compile_cache`), and HF's forward."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from tgis.backends.paged.backend import PagedTorchBackend
    from tgis.engine.backend import PackedItem

    prompt = tuple(range(10, 110))
    backend = PagedTorchBackend.load(
        model_dir, device="cpu", dtype=dtype, max_sequences=1, max_sequence_tokens=512,
        max_prefill_tokens=256, compile=compile, compile_cache=compile_cache,
    )  # fmt: skip
    if compile:
        backend.warmup(1, len(prompt))
    table = tuple(range(backend.capacity.num_blocks))
    out = backend.forward([PackedItem(0, prompt, 0, table)])
    token = int(out.last[0].argmax())
    start = time.perf_counter()
    for step in range(steps):
        out = backend.forward([PackedItem(0, (token,), len(prompt) + step, table)])
        token = int(out.last[0].argmax())
    ours = (time.perf_counter() - start) * 1000 / steps
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        cache = DynamicCache()
        logits = model(torch.tensor([prompt]), past_key_values=cache).logits
        token = int(logits[0, -1].argmax())
        start = time.perf_counter()
        for _ in range(steps):
            logits = model(torch.tensor([[token]]), past_key_values=cache).logits
            token = int(logits[0, -1].argmax())
        hf = (time.perf_counter() - start) * 1000 / steps
    return ours, hf


def row(name: str, res: Result, rss: float) -> dict[str, float | str]:
    return {
        "server": name,
        "output_tok_s": res.output_tokens / res.wall if res.wall else 0.0,
        "mean_output_tokens": res.output_tokens / res.answers if res.answers else 0.0,
        "ttft_p50_s": pct(res.ttft, 50),
        "ttft_p99_s": pct(res.ttft, 99),
        "itl_p50_ms": pct(res.itl, 50) * 1000,
        "itl_p99_ms": pct(res.itl, 99) * 1000,
        "peak_rss_mb": rss,
        "errors": res.errors,
        "error_kinds": res.error_kinds,
        "output_tokens": res.output_tokens,
        "wall_s": res.wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tgis-bench"))
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="compute dtype of both servers; auto: tgis's cpu default (bf16 where native)",
    )
    parser.add_argument(
        "--peer-python",
        default=str(ROOT / ".venv-peer" / "bin" / "python"),
        help="Python of a virtualenv with transformers[serving] >= 5 (4.57's continuous batching "
        "cannot size its cache on a CPU); `make bench` creates it",
    )
    parser.add_argument("--output", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if args.dtype == "auto":
        from tgis.backends.common.device import cpu_has_native_bf16

        args.dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(args.workdir)
    texts = prompts(model_dir, args.requests * 2 + 8, args.prompt_tokens, seed=0)
    main_load, big_load, warm = (
        texts[: args.requests],
        texts[args.requests : 2 * args.requests],
        texts[-8:],
    )
    # Prefix caching: pairs of 200-token prompts sharing their first 150 tokens, sent one at a
    # time (a cold first request, then the second, which finds the shared blocks cached).
    heads = prompts(model_dir, PREFIX_PAIRS, 150, seed=1)
    tails = prompts(model_dir, 2 * PREFIX_PAIRS, 50, seed=2)
    prefix_load = [head + tail for i, head in enumerate(heads) for tail in tails[2 * i : 2 * i + 2]]
    port = 18080
    url = f"http://127.0.0.1:{port}"
    py = sys.executable
    tgis_cmd = [py, "-m", "tgis", "serve", "--model-id", str(model_dir), "--port", str(port), "--hostname", "127.0.0.1",
                "--max-total-tokens", "1024", "--max-batch-size", "32", "--dtype", args.dtype,
                "--no-compile"]  # fmt: skip
    rows = []
    solo = main_load[:8]
    (res16, rss16), (res1, rss1), (res32, rss32), (prefix, _) = run_server(
        tgis_cmd, url, "/health", args.workdir / "tgis.log",
        [(args.streams, main_load), (1, solo), (32, big_load), (1, prefix_load)], "tgis",
        args.new_tokens, warm, parameters=TGIS_PARAMETERS,
    )  # fmt: skip
    rows += [
        row(f"tgis x{args.streams}", res16, rss16),
        row("tgis x1", res1, rss1),
        row("tgis x32", res32, rss32),
    ]
    if not args.skip_peer:
        peer_bin = str(Path(args.peer_python).parent / "transformers")
        peer_cmd = [peer_bin, "serve", str(model_dir), "--continuous-batching", "--dtype", args.dtype,
                    "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        ((peer, peer_rss),) = run_server(
            peer_cmd, url, "/health", args.workdir / "peer.log", [(args.streams, main_load)], str(model_dir), args.new_tokens, warm,
            parameters=PEER_PARAMETERS,
        )  # fmt: skip
        rows.append(row(f"transformers serve x{args.streams}", peer, peer_rss))
    ours_ms, hf_ms = bare_decode_ms(model_dir, args.dtype)
    print(
        f"\n{'server':<28}{'tok/s':>9}{'tok/req':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}{'RSS MB':>9}{'err':>5}"
    )
    for r in rows:
        print(f"{r['server']:<28}{r['output_tok_s']:>9.1f}{r['mean_output_tokens']:>9.1f}{r['ttft_p50_s']:>9.2f}s{r['ttft_p99_s']:>9.2f}s"
              f"{r['itl_p50_ms']:>8.1f}ms{r['itl_p99_ms']:>8.1f}ms{r['peak_rss_mb']:>9.0f}{r['errors']:>5}")  # fmt: skip
    # A row whose answers ended before --new-tokens measured less work than the load states.
    for r in rows:
        if r["mean_output_tokens"] < args.new_tokens:
            print(f"warning: {r['server']}: answers averaged {r['mean_output_tokens']:.1f} tokens of "
                  f"the {args.new_tokens} asked (they ended at EOS): its per-answer figures cover "
                  "shorter answers")  # fmt: skip
    print(
        f"\nbare in-process decode, batch 1: tgis backend {ours_ms:.1f} ms/token, HF forward {hf_ms:.1f} ms/token"
    )
    firsts, seconds = prefix.ttft[0::2], prefix.ttft[1::2]
    print(f"prefix pairs: TTFT first {[round(t, 3) for t in firsts]} s, second "
          f"{[round(t, 3) for t in seconds]} s")  # fmt: skip
    ratios = {
        "itl_x1_over_bare_backend": rows[1]["itl_p50_ms"] / ours_ms,
        "tok_s_x32_over_x16": rows[2]["output_tok_s"] / rows[0]["output_tok_s"],
        "ttft_prefix_second_over_first": pct(seconds, 50) / pct(firsts, 50),
    }
    if not args.skip_peer and rows[3]["output_tok_s"]:
        ratios["tok_s_tgis_over_peer"] = rows[0]["output_tok_s"] / rows[3]["output_tok_s"]
        ratios["ttft_p50_peer_over_tgis"] = rows[3]["ttft_p50_s"] / rows[0]["ttft_p50_s"]
    for k, v in ratios.items():
        print(f"{k:<28}{v:>8.2f}")
    if args.output:
        args.output.write_text(json.dumps({"rows": rows, "ratios": ratios, "bare_ms": {"tgis": ours_ms, "hf": hf_ms},
                                           "cpu_count": os.cpu_count()}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
