"""Time to first token of a one-image request against the same prompt without the image.

1. Builds (once, under --workdir; nothing is downloaded) a randomly initialised model with the
   shapes of HuggingFaceTB/SmolVLM-256M-Instruct (Idefics3): a SigLIP tower of 12 layers at
   hidden 768 (base-patch16-512), pixel shuffle by 4 and a projection to SmolLM2-135M's hidden
   576 (30 layers, 9 heads over 3 KV heads, intermediate 1536, vocab 49280, untied output
   head), and its Idefics3Processor (tiles of 512 pixels, the image resized to a longest edge
   of 2048 first, 64 image tokens per tile). The tokenizer is the bundled demo model's with
   inert tokens to 49152 and the Idefics3 tokens at the ids the real tokenizer gives them.
   Random weights: the times depend on the shapes only.
2. For each dtype, starts `tgis serve --backend cpu` on it, warms up, then sends rounds of
   requests to TGI's `/generate_stream`, one request at a time (max_new_tokens 1, greedy):
   - text: the round's question alone;
   - image: a fresh 512x512 JPEG (markdown image) before the same question;
   - follow-up (the first --follow-ups rounds): the same image again before a different
     question (the prefix cache holds whole blocks: the image's are found only where its last
     block ends before the text that differs);
   - repeat: the image request again, word for word (every block but the last is cached).
   The order of text and image alternates between rounds so that a load from elsewhere on the
   machine falls on both alike. TTFT is taken by the client: from sending the request to the
   first token event of the stream. The server's own TTFT of each request (the change of
   `tgis_request_time_to_first_token_seconds_sum`, which one request at a time makes exact)
   and the images encoded and found cached (`tgis_images_encoded`, `tgis_images_cached`) are
   read from /metrics around every request.
3. With the server stopped, times the image's two costs in this process: the processor
   (decode, resize, tiling, normalization) and the vision tower with the projector
   (`VisionEncoder.encode`), median of --encode-runs.

    python scripts/bench_vision_ttft.py --workdir /tmp/tgis-vision-bench
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / "tgis" / "assets" / "demo-model"
MODEL_NAME = "smolvlm-256m-random"

# HuggingFaceTB/SmolVLM-256M-Instruct's config.json, the fields that shape the compute.
TEXT_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 49280,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": False,
}
VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 512,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
SCALE_FACTOR = 4
IMAGE_SEQ_LEN = 64
# Its preprocessor_config.json: tiles of 512, the image first resized to a longest edge of 2048.
IMAGE_PROCESSOR: dict[str, Any] = {
    "do_image_splitting": True,
    "max_image_size": {"longest_edge": 512},
    "size": {"longest_edge": 2048},
    "resample": 1,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# The real tokenizer: SmolLM2's 49152 ids, then <global-img>, the 36 <row_r_col_c> markers,
# <fake_token_around_image> (49189), <image> (49190), reserved tokens and <end_of_utterance>.
BASE_VOCAB = 49152
RESERVED = 88

QUESTIONS = (
    "Describe this image in detail: what is in it, and what is happening?",
    "What colours stand out, and where in the picture are they?",
    "Is there any text in the picture? If so, what does it say?",
    "How many distinct objects can you see? List them.",
)
KINDS = ("text", "image", "follow-up", "repeat")
# The server's context: a 512x512 image is ~1,140 tokens here; /tokenize refuses inputs over 32
# characters per token of it, data URL included (a 60 KiB JPEG is ~85,000 characters).
MAX_TOTAL_TOKENS = 4096


def idefics3_tokens() -> list[str]:
    """The special tokens of SmolVLM's tokenizer after its base vocabulary, in id order."""
    rows = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(RESERVED)]
    return ["<global-img>", *rows, "<fake_token_around_image>", "<image>", *reserved,
            "<end_of_utterance>"]  # fmt: skip


def build_tokenizer() -> Any:
    """The demo model's tokenizer padded to SmolVLM's 49280 ids, its Idefics3 tokens at the
    real tokenizer's ids (<image> = 49190)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    tokenizer.add_tokens([f"<|unused_{i}|>" for i in range(len(tokenizer), BASE_VOCAB)])
    tokenizer.add_special_tokens(
        {"additional_special_tokens": idefics3_tokens()}, replace_additional_special_tokens=False
    )
    tokenizer.model_max_length = TEXT_CONFIG["max_position_embeddings"]
    if len(tokenizer) != TEXT_CONFIG["vocab_size"]:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} ids, not {TEXT_CONFIG['vocab_size']}")
    return tokenizer


def build_model(workdir: Path, seed: int = 0) -> Path:
    """The random SmolVLM-256M-shaped model and its processor (cached in workdir)."""
    out = workdir / MODEL_NAME
    if (out / "model.safetensors").exists() and (out / "processor_config.json").exists():
        return out
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        GenerationConfig,
        Idefics3Config,
        Idefics3ImageProcessor,
        Idefics3Processor,
    )

    tokenizer = build_tokenizer()
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    text = {**TEXT_CONFIG, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    config = Idefics3Config(
        vision_config=dict(VISION_CONFIG), text_config=text, image_token_id=image_id,
        scale_factor=SCALE_FACTOR, tie_word_embeddings=False, pad_token_id=2,
    )  # fmt: skip
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(**IMAGE_PROCESSOR),
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
    )
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).eval()
    # As SmolVLM's generation_config.json: <|im_end|> and <end_of_utterance> end a turn.
    end_of_utterance = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    model.generation_config = GenerationConfig(
        bos_token_id=1, eos_token_id=[2, end_of_utterance], pad_token_id=2
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def model_shapes(model_dir: Path) -> dict[str, Any]:
    """Parameter counts of the saved model: the vision tower, the projector, the language
    model and its output head."""
    from safetensors import safe_open

    counts = {"vision": 0, "connector": 0, "text": 0, "lm_head": 0}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            shape = f.get_slice(name).get_shape()
            size = 1
            for d in shape:
                size *= d
            part = next(
                (k for k, m in (("vision", "vision_model"), ("connector", "connector"),
                                ("lm_head", "lm_head")) if m in name),
                "text",
            )  # fmt: skip
            counts[part] += size
    return counts


def photo_jpeg(seed: int, size: int = 512, quality: int = 90) -> bytes:
    """A photo-like JPEG: a smooth gradient, blurred shapes of random colours and mild noise
    (a photograph's statistics, roughly; random pixels make a JPEG several times larger)."""
    from PIL import Image, ImageDraw, ImageFilter

    rng = random.Random(f"bench-vision:{seed}")
    top = [rng.randrange(256) for _ in range(3)]
    bottom = [rng.randrange(256) for _ in range(3)]
    gradient = bytes(
        int(top[c] + (bottom[c] - top[c]) * y / (size - 1)) for y in range(size) for c in range(3)
    )
    image = Image.frombytes("RGB", (1, size), gradient).resize((size, size))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(size), rng.randrange(size)
        x1, y1 = x0 + rng.randrange(20, size // 2), y0 + rng.randrange(20, size // 2)
        colour = tuple(rng.randrange(256) for _ in range(3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(2))
    noise = Image.frombytes("L", (size, size), rng.randbytes(size * size)).convert("RGB")
    image = Image.blend(image, noise, 0.06)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def markdown_image(jpeg: bytes) -> str:
    return "![](data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii") + ")"


@dataclass
class Sample:
    """One request: its kind, the client's TTFT and the server's, and the images the server
    encoded and found cached while serving it."""

    kind: str
    ttft: float
    server_ttft: float
    encoded: int
    cached: int
    round: int
    input_length: int


@dataclass
class Run:
    dtype: str
    samples: list[Sample] = field(default_factory=list)
    tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    encode: dict[str, float] = field(default_factory=dict)
    # The 1-minute load average before and after the requests (the machine's other work).
    load: list[float] = field(default_factory=list)

    def ttfts(self, kind: str, server: bool = False) -> list[float]:
        return [s.server_ttft if server else s.ttft for s in self.samples if s.kind == kind]


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$")
METRICS = (
    "tgis_request_time_to_first_token_seconds_sum",
    "tgis_request_time_to_first_token_seconds_count",
    "tgis_images_encoded_total",
    "tgis_images_cached_total",
)


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled samples of METRICS in a Prometheus text page (absent ones as 0)."""
    found = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match and match.group(1) in found:
            found[match.group(1)] += float(match.group(2))
    return found


def cpu_description() -> dict[str, Any]:
    """The CPU's model name, its flags that matter for bf16, and the cores this process has."""
    name, flags = "?", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "?":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {
        "model_name": name,
        "flags": [f for f in wanted if f in flags],
        "cores": len(os.sched_getaffinity(0)),
    }


class Client:
    """TGI's routes of one server, one request at a time."""

    def __init__(self, url: str, new_tokens: int) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=600.0)
        self.parameters = {"max_new_tokens": new_tokens, "do_sample": False, "details": True}

    def close(self) -> None:
        self.http.close()

    def metrics(self) -> dict[str, float]:
        response = self.http.get("/metrics")
        response.raise_for_status()
        return parse_metrics(response.text)

    def tokens(self, inputs: str, image_token_id: int) -> dict[str, int]:
        """The prompt's tokens by /tokenize: all of them, and its image tokens."""
        response = self.http.post("/tokenize", json={"inputs": inputs})
        response.raise_for_status()
        tokens = response.json()
        return {
            "prompt": len(tokens),
            "image": sum(1 for t in tokens if t["id"] == image_token_id),
        }

    def first_token(self, inputs: str) -> tuple[float, int]:
        """Seconds from sending `inputs` to /generate_stream to its first token event (the
        stream is read to its end), and the prompt's tokens by the last event's details."""
        body = {"inputs": inputs, "parameters": self.parameters}
        ttft, input_length = None, -1
        start = time.perf_counter()
        with self.http.stream("POST", "/generate_stream", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if ttft is None and event.get("token") is not None:
                    ttft = time.perf_counter() - start
                if event.get("details"):
                    input_length = int(event["details"].get("input_length", -1))
        if ttft is None:
            raise RuntimeError("the stream ended without a token")
        return ttft, input_length

    def measure(self, kind: str, inputs: str, round_: int) -> Sample:
        before = self.metrics()
        ttft, input_length = self.first_token(inputs)
        after = self.metrics()

        def delta(name: str) -> float:
            return after[name] - before[name]

        return Sample(
            kind=kind,
            ttft=ttft,
            server_ttft=delta("tgis_request_time_to_first_token_seconds_sum"),
            encoded=round(delta("tgis_images_encoded_total")),
            cached=round(delta("tgis_images_cached_total")),
            round=round_,
            input_length=input_length,
        )


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"server at {url} not ready after {timeout:.0f}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def round_requests(index: int, seed: int, follow_up: bool) -> list[tuple[str, str]]:
    """The (kind, inputs) of round `index`: text and image in alternating order, then the
    follow-up (if `follow_up`) and the repeat. Each round's question starts with the round's
    number so that no round finds another's text in the prefix cache."""
    image = markdown_image(photo_jpeg(seed * 100_000 + index))
    question = f"Photo {index}. {QUESTIONS[index % len(QUESTIONS)]}"
    other = f"Photo {index}. {QUESTIONS[(index + 1) % len(QUESTIONS)]}"
    text, with_image = ("text", question), ("image", image + question)
    pair = [text, with_image] if index % 2 == 0 else [with_image, text]
    extra = [("follow-up", image + other)] if follow_up else []
    return [*pair, *extra, ("repeat", image + question)]


def serve_and_measure(
    model_dir: Path, dtype: str, args: argparse.Namespace, log: Path, run: Run
) -> None:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "tgis", "serve", "--model-id", str(model_dir), "--backend", "cpu",
           "--dtype", dtype, "--port", str(args.port), "--hostname", "127.0.0.1", "--no-grpc",
           "--max-batch-size", "4", "--max-total-tokens", str(MAX_TOTAL_TOKENS),
           "--no-compile"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    client = Client(url, args.new_tokens)
    try:
        wait_ready(url, proc, 900)
        run.load.append(os.getloadavg()[0])
        image_token_id = json.loads((model_dir / "config.json").read_text())["image_token_id"]
        example = round_requests(0, args.seed, follow_up=False)
        by_kind = dict(example)
        for kind in ("text", "image"):
            run.tokens[kind] = client.tokens(by_kind[kind], image_token_id)
        for i in range(args.warmup):  # first-request costs: kernels, allocator, caches
            for kind, inputs in round_requests(-1 - i, args.seed, follow_up=False)[:2]:
                client.first_token(inputs)
                print(f"  warm-up {kind}", flush=True)
        for index in range(args.rounds):
            follow_up = index < args.follow_ups
            for kind, inputs in round_requests(index, args.seed, follow_up):
                sample = client.measure(kind, inputs, index)
                run.samples.append(sample)
                print(f"  round {index} {kind:<9} TTFT {sample.ttft * 1000:8.1f} ms "
                      f"(server {sample.server_ttft * 1000:8.1f} ms) "
                      f"encoded {sample.encoded} cached {sample.cached}", flush=True)  # fmt: skip
        run.load.append(os.getloadavg()[0])
    finally:
        client.close()
        stop(proc)


def time_encode(model_dir: Path, dtype: str, runs: int, seed: int) -> dict[str, float]:
    """Median seconds of the processor (JPEG decode, resize, tiling, normalization) and of the
    vision tower with its projector for one fresh 512x512 JPEG, in this process."""
    import torch
    from PIL import Image
    from transformers import AutoConfig

    from tgis.vision.encoder import load_vision_lm
    from tgis.vision.families import vision_family_of
    from tgis.vision.processor import ImageProcessor

    config = AutoConfig.from_pretrained(model_dir)
    family = vision_family_of(config.to_dict())
    assert family is not None
    processor = ImageProcessor.load(model_dir, family, config)
    _, encoder = load_vision_lm(model_dir, config, torch.device("cpu"), getattr(torch, dtype))
    process_s, encode_s = [], []
    for i in range(runs + 1):  # the first of each is a warm-up
        jpeg = photo_jpeg(seed * 100_000 + 50_000 + i)
        start = time.perf_counter()
        image = Image.open(io.BytesIO(jpeg)).convert("RGB")
        prompt = processor.process(processor.placeholder + QUESTIONS[0], [image], [b"%d" % i])
        middle = time.perf_counter()
        encoder.encode(prompt.images)
        end = time.perf_counter()
        if i:
            process_s.append(middle - start)
            encode_s.append(end - middle)
    tiles = int(prompt.images[0].pixels["pixel_values"].shape[0])
    return {
        "process_s": statistics.median(process_s),
        "encode_s": statistics.median(encode_s),
        "tiles": tiles,
        "image_tokens": prompt.image_tokens,
    }


def pct(values: list[float], q: float) -> float:
    from tgis.benchmark.metrics import percentile

    return percentile(values, q) if values else float("nan")


def summary(run: Run) -> dict[str, Any]:
    """Median and p90 TTFT of each kind (client and server), the images encoded and cached
    per request of each kind, and the ratios to the text request's median."""
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        values, server = run.ttfts(kind), run.ttfts(kind, server=True)
        samples = [s for s in run.samples if s.kind == kind]
        kinds[kind] = {
            "n": len(values),
            "ttft_p50_s": pct(values, 50),
            "ttft_p90_s": pct(values, 90),
            "server_ttft_p50_s": pct(server, 50),
            "encoded_per_request": sum(s.encoded for s in samples) / max(1, len(samples)),
            "cached_per_request": sum(s.cached for s in samples) / max(1, len(samples)),
        }
    text = kinds["text"]["ttft_p50_s"]
    image = kinds["image"]["ttft_p50_s"]
    ratios = {
        "image_over_text": image / text,
        "follow_up_over_image": kinds["follow-up"]["ttft_p50_s"] / image,
        "repeat_over_image": kinds["repeat"]["ttft_p50_s"] / image,
    }
    # The same ratio within each round (the two requests back to back), then its median.
    by_round: dict[int, dict[str, float]] = {}
    for s in run.samples:
        by_round.setdefault(s.round, {})[s.kind] = s.ttft
    paired = [r["image"] / r["text"] for r in by_round.values() if "image" in r and "text" in r]
    ratios["image_over_text_paired_median"] = statistics.median(paired) if paired else float("nan")
    return {"kinds": kinds, "ratios": ratios}


def report(run: Run, figures: dict[str, Any]) -> None:
    print(f"\n{run.dtype}: prompt tokens {run.tokens}, load average {run.load}")
    print(f"{'request':<11}{'n':>3}{'TTFT p50':>11}{'TTFT p90':>11}{'server p50':>12}"
          f"{'encoded':>9}{'cached':>8}")  # fmt: skip
    for kind, k in figures["kinds"].items():
        print(f"{kind:<11}{k['n']:>3}{k['ttft_p50_s'] * 1000:>9.1f}ms{k['ttft_p90_s'] * 1000:>9.1f}ms"
              f"{k['server_ttft_p50_s'] * 1000:>10.1f}ms{k['encoded_per_request']:>9.2f}"
              f"{k['cached_per_request']:>8.2f}")  # fmt: skip
    for name, value in figures["ratios"].items():
        print(f"{name:<34}{value:>8.2f}x")
    if run.encode:
        e = run.encode
        print(f"in process: processor {e['process_s'] * 1000:.1f} ms, vision tower + projector "
              f"{e['encode_s'] * 1000:.1f} ms ({e['tiles']} tiles, {e['image_tokens']} image "
              "tokens)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tgis-vision-bench"),
                        help="where the model directory and the server logs go")  # fmt: skip
    parser.add_argument("--dtypes", default="auto",
                        help="comma-separated serving dtypes; auto: float32, and bfloat16 too "
                        "where the CPU computes it natively")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds per dtype")
    parser.add_argument("--follow-ups", type=int, default=3,
                        help="rounds that send the follow-up request too")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=1,
                        help="unmeasured text and image requests first (rounds)")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=1, help="max_new_tokens per request")
    parser.add_argument("--encode-runs", type=int, default=3,
                        help="in-process timings of the processor and the vision tower "
                        "(0: skip)")  # fmt: skip
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--seed", type=int, default=0, help="seeds the images")
    parser.add_argument("--output", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if args.dtypes == "auto":
        from tgis.backends.common.device import cpu_has_native_bf16

        dtypes = ["float32", "bfloat16"] if cpu_has_native_bf16() else ["float32"]
    else:
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.workdir.mkdir(parents=True, exist_ok=True)
    cpu = cpu_description()
    print(f"CPU: {cpu['model_name']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}")
    model_dir = build_model(args.workdir)
    shapes = model_shapes(model_dir)
    print(f"model: {model_dir} ({', '.join(f'{k} {v / 1e6:.1f}M' for k, v in shapes.items())})")
    jpeg = photo_jpeg(args.seed * 100_000)
    print(f"image: 512x512 JPEG (gradient, blurred shapes, noise), {len(jpeg) / 1024:.0f} KiB")
    results = []
    for dtype in dtypes:
        run = Run(dtype)
        print(f"\n{dtype}: serving", flush=True)
        serve_and_measure(model_dir, dtype, args, args.workdir / f"serve-{dtype}.log", run)
        if args.encode_runs:
            run.encode = time_encode(model_dir, dtype, args.encode_runs, args.seed)
        figures = summary(run)
        report(run, figures)
        results.append({
            "dtype": dtype, **figures, "tokens": run.tokens, "encode": run.encode, "load": run.load,
            "samples": [vars(s) for s in run.samples],
        })  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(
            {"cpu": cpu, "parameters": shapes, "image_bytes": len(jpeg), "runs": results},
            indent=2,
        ))  # fmt: skip


if __name__ == "__main__":
    main()
