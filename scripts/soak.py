"""`make soak`: a real `tgis serve` held at twice its concurrency limit, nothing lost or hung.

1. Starts `tgis serve` (the bundled demo model unless --model-id says otherwise) on 127.0.0.1
   on a free port, HTTP only, with --max-concurrent-requests LIMIT, and waits for /health.
2. For --duration seconds keeps --concurrency clients (2 x LIMIT by default) busy. Each loops
   over requests drawn from a seeded RNG: /generate, /generate_stream, /v1/completions and
   /v1/chat/completions (both streamed and not), 4..32 new tokens, varied prompts, greedy or
   sampled. A share of the streams (--disconnect-fraction) asks for many tokens and hangs up
   after its first events: the server must give their places back. A client answered 429
   waits a few milliseconds (--backoff-ms) before its next request, as real clients do.
3. Every request has a deadline (--request-timeout) and ends in one class:
     ok            200 and a complete body (JSON with the generated text and a finish reason;
                   a stream up to its final event, or `[DONE]` on OpenAI's routes)
     overloaded    429 with a JSON error body of type "overloaded"
     disconnected  a stream the client cut on purpose
     hung          no complete answer within the deadline
     lost          anything else: a connection error or reset, a 5xx or other status, an
                   error event, a stream that ended early, a body that does not parse
4. After the load: the `tgi_queue_size` and `tgi_batch_current_size` gauges of /metrics must
   be back at 0 within --settle seconds, /health must answer 200, LIMIT requests at once must
   all be admitted (every place is free again), the process must still run, and after SIGTERM
   it must exit with status 0 within --shutdown-timeout seconds.

Prints a table, writes the figures as JSON (--output) and exits 1 when any lost or hung
request, no 429, no ok request, a gauge left up, a refused place or a dead or unclean server
was seen.

    python scripts/soak.py --output soak-results.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tgis.config.env import ALIASES, ENV_NAMES

ROOT = Path(__file__).resolve().parent.parent
CLASSES = ("ok", "overloaded", "disconnected", "hung", "lost")
KINDS = (
    "generate",
    "generate_stream",
    "completions",
    "completions_stream",
    "chat",
    "chat_stream",
)
GAUGES = ("tgi_queue_size", "tgi_batch_current_size")
FINISH_REASONS = {"length", "eos_token", "stop_sequence"}
EXAMPLES_KEPT = 20  # lost and hung requests described in the JSON, per class
# Pieces the prompts are put together from: code and prose, short and long.
FRAGMENTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "What is Deep Learning?",
    "# Parse the configuration file and return a dict",
    "async def fetch(url: str) -> bytes:",
    "The quick brown fox jumps over the lazy dog.",
    "if __name__ == '__main__':",
    "x = [i * i for i in range(",
    "Write a haiku about the sea.",
    "with open('data.csv') as f:",
    "SELECT name, count(*) FROM users GROUP BY",
    "try:\n    result = compute()\nexcept ValueError as exc:",
)


# --- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    """This environment without the variables `tgis serve` reads as settings: the flags the
    soak passes decide alone (a stray API_KEY or MAX_BATCH_SIZE would change what is tested)."""
    settings = set(ENV_NAMES.values()) | {alias.upper() for alias in ALIASES}
    return {key: value for key, value in os.environ.items() if key not in settings}


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    command = [
        sys.executable, "-m", "tgis", "serve",
        "--hostname", "127.0.0.1", "--port", str(port), "--no-grpc", "--no-compile",
        "--max-concurrent-requests", str(args.max_concurrent_requests),
    ]  # fmt: skip
    if args.model_id:
        command += ["--model-id", args.model_id]
    return command


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tgis serve exited with {proc.returncode}:\n{log_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"tgis serve was not healthy after {timeout} s:\n{log_tail(log)}")
        time.sleep(0.25)


def log_tail(log: Path, lines: int = 40) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def log_problems(log: Path) -> list[str]:
    """The server log's lines that report a failure (errors, tracebacks, 5xx answers)."""
    marks = ("ERROR", "Traceback", "CRITICAL", '" 500', '" 502', '" 503', '" 504')
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line for line in text.splitlines() if any(mark in line for mark in marks)]


def stop_server(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """SIGTERM, then wait: the exit status and how long it took (killed when it overran)."""
    if proc.poll() is not None:
        return {"exit_code": proc.returncode, "seconds": 0.0, "killed": False, "signalled": False}
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=timeout)
        killed = False
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        killed = True
    seconds = round(time.monotonic() - start, 3)
    return {"exit_code": code, "seconds": seconds, "killed": killed, "signalled": True}


# --- the requests -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One request: its route, its body, and where the client hangs up (None: it does not)."""

    kind: str
    path: str
    body: dict[str, Any]
    cut_after: int | None = None

    @property
    def stream(self) -> bool:
        return self.kind.endswith("_stream")

    @property
    def openai(self) -> bool:
        return self.path.startswith("/v1/")


@dataclass
class Record:
    kind: str
    outcome: str
    status: int | None
    seconds: float
    started_s: float
    detail: str = ""


def make_prompt(rng: random.Random) -> str:
    pieces = rng.choices(FRAGMENTS, k=rng.randint(1, 4))
    prompt = "\n".join(pieces)
    if rng.random() < 0.3:
        prompt = f"{prompt} {rng.randint(0, 10**6)}"
    return prompt


def make_plan(rng: random.Random, disconnect_fraction: float) -> Plan:
    kind = rng.choice(KINDS)
    prompt = make_prompt(rng)
    cut_after = None
    new_tokens = rng.randint(4, 32)
    if kind.endswith("_stream") and rng.random() < disconnect_fraction:
        # Many tokens: a place the server kept after the hang-up would stay busy for long
        # enough to show in the gauges and the capacity check after the load.
        cut_after = rng.randint(1, 3)
        new_tokens = 512
    sampled = rng.random() < 0.5
    if kind.startswith("generate"):
        parameters: dict[str, Any] = {"max_new_tokens": new_tokens, "details": True}
        if sampled:
            parameters.update(
                do_sample=True, temperature=0.8, top_p=0.95, seed=rng.randrange(2**31)
            )
        path = "/generate_stream" if kind == "generate_stream" else "/generate"
        return Plan(kind, path, {"inputs": prompt, "parameters": parameters}, cut_after)
    body: dict[str, Any] = {
        "model": "tgis",
        "max_tokens": new_tokens,
        "temperature": 0.8 if sampled else 0.0,
        "stream": kind.endswith("_stream"),
    }
    if kind.startswith("chat"):
        body["messages"] = [{"role": "user", "content": prompt}]
        return Plan(kind, "/v1/chat/completions", body, cut_after)
    body["prompt"] = prompt
    return Plan(kind, "/v1/completions", body, cut_after)


class Incomplete(Exception):
    """A 200 answer whose body is not a complete generation."""


def check_complete(plan: Plan, body: Any) -> None:
    """Raise Incomplete unless `body` (non-streamed) carries a whole generation."""
    if not isinstance(body, dict):
        raise Incomplete(f"the body is not a JSON object: {str(body)[:200]}")
    if plan.kind == "generate":
        details = body.get("details") or {}
        if not isinstance(body.get("generated_text"), str):
            raise Incomplete(f"no generated_text: {str(body)[:200]}")
        if details.get("finish_reason") not in FINISH_REASONS:
            raise Incomplete(f"no finish reason: {str(body)[:200]}")
        return
    choices = body.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    if plan.kind == "chat":
        text = (choice.get("message") or {}).get("content")
    else:
        text = choice.get("text")
    if not isinstance(text, str) or not choice.get("finish_reason"):
        raise Incomplete(f"no text or finish_reason: {str(body)[:200]}")


def overloaded_body(plan: Plan, text: str) -> bool:
    """429's body is JSON naming the overload, in TGI's shape or OpenAI's."""
    try:
        body = json.loads(text)
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    error = body.get("error")
    if plan.openai:
        return isinstance(error, dict) and error.get("type") == "overloaded"
    return isinstance(error, str) and body.get("error_type") == "overloaded"


async def read_stream(plan: Plan, response: httpx.Response) -> str:
    """Read the events: "ok" once the stream ends complete, "disconnected" when the client
    hung up as planned; Incomplete for an error event or a stream that ends early."""
    events = 0
    finished = False  # the final event (TGI) or a finish_reason (OpenAI) came
    done = False  # OpenAI's [DONE]
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if done or (finished and not plan.openai):
            raise Incomplete(f"data after the end of the stream: {data[:200]}")
        if data == "[DONE]" and plan.openai:
            done = True
            continue
        try:
            event = json.loads(data)
        except ValueError:
            raise Incomplete(f"an event that does not parse: {data[:200]}") from None
        if "error" in event:
            raise Incomplete(f"error event: {data[:300]}")
        events += 1
        if plan.openai:
            finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
        elif event.get("generated_text") is not None:
            if (event.get("details") or {}).get("finish_reason") not in FINISH_REASONS:
                raise Incomplete(f"final event without a finish reason: {data[:200]}")
            finished = True
        if plan.cut_after is not None and events >= plan.cut_after and not finished:
            return "disconnected"  # leaving the `stream` block closes the connection
    if plan.openai and not (finished and done):
        raise Incomplete(f"stream ended after {events} events without finish_reason/[DONE]")
    if not plan.openai and not finished:
        raise Incomplete(f"stream ended after {events} events without the final event")
    return "ok"


async def send(client: httpx.AsyncClient, plan: Plan) -> tuple[str, int | None, str]:
    """Send one request: (class, status, detail). Deadlines are the caller's."""
    try:
        async with client.stream("POST", plan.path, json=plan.body) as response:
            status = response.status_code
            if status == 200 and plan.stream:
                return await read_stream(plan, response), status, ""
            text = (await response.aread()).decode(errors="replace")
            if status == 429:
                if overloaded_body(plan, text):
                    return "overloaded", status, ""
                return "lost", status, f"429 without an overload body: {text[:200]}"
            if status != 200:
                return "lost", status, text[:300]
            try:
                check_complete(plan, json.loads(text))
            except ValueError:
                return "lost", status, f"the body does not parse: {text[:200]}"
            return "ok", status, ""
    except Incomplete as exc:
        return "lost", 200, str(exc)
    except httpx.TimeoutException as exc:
        return "hung", None, f"{type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        return "lost", None, f"{type(exc).__name__}: {exc}"


@dataclass
class Load:
    """The clients' shared state: when to stop, and what happened."""

    end: float
    start: float
    request_timeout: float
    backoff_s: float
    disconnect_fraction: float
    records: list[Record] = field(default_factory=list)


async def client_loop(client: httpx.AsyncClient, load: Load, rng: random.Random) -> None:
    while time.monotonic() < load.end:
        plan = make_plan(rng, load.disconnect_fraction)
        began = time.monotonic()
        try:
            outcome, status, detail = await asyncio.wait_for(
                send(client, plan), load.request_timeout
            )
        except asyncio.TimeoutError:
            outcome, status, detail = "hung", None, f"no answer within {load.request_timeout} s"
        seconds = time.monotonic() - began
        load.records.append(
            Record(plan.kind, outcome, status, seconds, round(began - load.start, 3), detail)
        )
        if outcome == "overloaded" and load.backoff_s > 0:
            await asyncio.sleep(rng.uniform(0, 2 * load.backoff_s))


async def run_load(url: str, args: argparse.Namespace) -> tuple[Load, float]:
    """The clients, until --duration is over and each has had its last answer."""
    start = time.monotonic()
    load = Load(
        end=start + args.duration,
        start=start,
        request_timeout=args.request_timeout,
        backoff_s=args.backoff_ms / 1000,
        disconnect_fraction=args.disconnect_fraction,
    )
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    # httpx's own timeouts sit above the per-request deadline, which decides.
    timeout = httpx.Timeout(args.request_timeout + 30)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        rngs = [random.Random(args.seed * 100_003 + i) for i in range(args.concurrency)]
        await asyncio.gather(*(client_loop(client, load, rng) for rng in rngs))
    return load, time.monotonic() - start


# --- after the load ---------------------------------------------------------------------------


def read_gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in GAUGES:
            values[name] = float(value)
    return values


def settle_gauges(url: str, timeout: float) -> tuple[dict[str, float], float | None]:
    """The gauges once all are 0 and how long that took; their last values and None when they
    were not 0 within `timeout` seconds."""
    start = time.monotonic()
    while True:
        try:
            values = read_gauges(url)
        except httpx.HTTPError as exc:
            values = {"error": float("nan")}
            print(f"/metrics failed: {exc}", file=sys.stderr)
        if len(values) == len(GAUGES) and all(v == 0 for v in values.values()):
            return values, round(time.monotonic() - start, 3)
        if time.monotonic() - start > timeout:
            return values, None
        time.sleep(0.25)


async def check_capacity(url: str, places: int, timeout: float) -> dict[str, Any]:
    """`places` requests at once: every one must be admitted (200) now that the load is over."""
    body = {"inputs": "def add(a, b):", "parameters": {"max_new_tokens": 4}}
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:

        async def one() -> int | str:
            try:
                return (await client.post("/generate", json=body)).status_code
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"

        answers = await asyncio.gather(*(one() for _ in range(places)))
    return {
        "requests": places,
        "ok": sum(1 for a in answers if a == 200),
        "answers": dict(Counter(str(a) for a in answers)),
    }


def health_status(url: str) -> int | str:
    try:
        return httpx.get(f"{url}/health", timeout=30).status_code
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


# --- figures ----------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (0 < q <= 100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return round(ordered[rank - 1], 4)


def summarize(
    records: Sequence[Record], elapsed: float, args: argparse.Namespace
) -> dict[str, Any]:
    counts = Counter(r.outcome for r in records)
    by_kind = {
        kind: {c: sum(1 for r in records if r.kind == kind and r.outcome == c) for c in CLASSES}
        for kind in KINDS
    }
    ok_seconds = [r.seconds for r in records if r.outcome == "ok"]
    total = len(records)

    def examples(outcome: str) -> list[dict[str, Any]]:
        chosen = [r for r in records if r.outcome == outcome][:EXAMPLES_KEPT]
        return [
            {
                "kind": r.kind,
                "status": r.status,
                "at_s": r.started_s,
                "seconds": round(r.seconds, 3),
                "detail": r.detail,
            }
            for r in chosen
        ]

    return {
        "duration_s": args.duration,
        "load_s": round(elapsed, 3),
        "concurrency": args.concurrency,
        "server_max_concurrent_requests": args.max_concurrent_requests,
        "seed": args.seed,
        "disconnect_fraction": args.disconnect_fraction,
        "request_timeout_s": args.request_timeout,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "requests": total,
        "counts": {c: counts.get(c, 0) for c in CLASSES},
        "by_kind": by_kind,
        "requests_per_s": round(total / elapsed, 2) if elapsed else 0.0,
        "ok_per_s": round(counts.get("ok", 0) / elapsed, 2) if elapsed else 0.0,
        "overloaded_fraction": round(counts.get("overloaded", 0) / total, 4) if total else 0.0,
        "latency_ok_s": {
            "p50": percentile(ok_seconds, 50),
            "p99": percentile(ok_seconds, 99),
            "max": round(max(ok_seconds), 4) if ok_seconds else None,
        },
        "lost_examples": examples("lost"),
        "hung_examples": examples("hung"),
    }


def verdict(summary: dict[str, Any]) -> list[str]:
    """Why the soak failed; empty when it passed."""
    counts = summary["counts"]
    failures = []
    if counts["lost"]:
        failures.append(f"{counts['lost']} requests lost")
    if counts["hung"]:
        failures.append(f"{counts['hung']} requests hung")
    if not counts["overloaded"]:
        failures.append("no request was answered 429: the load never reached the limit")
    if not counts["ok"]:
        failures.append("no request succeeded")
    if summary["gauges_settled_s"] is None:
        failures.append(f"the gauges did not return to 0: {summary['gauges_after']}")
    if summary["health_after"] != 200:
        failures.append(f"/health answered {summary['health_after']} after the load")
    capacity = summary["capacity_after"]
    if capacity is not None and capacity["ok"] != capacity["requests"]:
        failures.append(f"not every place was free after the load: {capacity['answers']}")
    if not summary["server_alive_after"]:
        failures.append("the server died during the soak")
    shutdown = summary["shutdown"]
    if shutdown["signalled"] and (shutdown["killed"] or shutdown["exit_code"] != 0):
        failures.append(f"SIGTERM did not stop the server cleanly: {shutdown}")
    return failures


def print_table(summary: dict[str, Any]) -> None:
    width = max(len(k) for k in KINDS)
    header = f"{'kind':<{width}}  " + "  ".join(f"{c:>12}" for c in CLASSES)
    print(header)
    print("-" * len(header))
    for kind, row in summary["by_kind"].items():
        print(f"{kind:<{width}}  " + "  ".join(f"{row[c]:>12}" for c in CLASSES))
    print("-" * len(header))
    counts = summary["counts"]
    print(f"{'total':<{width}}  " + "  ".join(f"{counts[c]:>12}" for c in CLASSES))
    latency = summary["latency_ok_s"]
    lines = [
        ("cpu", f"{summary['cpu_model']} ({summary['cpu_count']} cores)"),
        ("load", f"{summary['load_s']} s, {summary['concurrency']} clients, server limit "
                 f"{summary['server_max_concurrent_requests']}"),
        ("requests", f"{summary['requests']} ({summary['requests_per_s']}/s, ok "
                     f"{summary['ok_per_s']}/s, 429 share {summary['overloaded_fraction']:.1%})"),
        ("ok latency", f"p50 {latency['p50']} s, p99 {latency['p99']} s, max {latency['max']} s"),
        ("gauges after", f"{summary['gauges_after']} (settled in {summary['gauges_settled_s']} s)"),
        ("health after", str(summary["health_after"])),
        ("capacity after", str(summary["capacity_after"])),
        ("server alive", str(summary["server_alive_after"])),
        ("shutdown", str(summary["shutdown"])),
        ("server log", f"{summary['server_log']} ({len(summary['server_log_problems'])} "
                       "error lines)"),
    ]  # fmt: skip
    print()
    for name, value in lines:
        print(f"{name + ':':<16}{value}")
    for example in summary["lost_examples"] + summary["hung_examples"]:
        print(f"  {example}")
    print()
    print("PASS" if summary["passed"] else "FAIL: " + "; ".join(summary["failures"]))


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=8,
        help="the server's limit (its --max-concurrent-requests)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=None, help="clients (default: 2 x the server's limit)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' RNGs")
    parser.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.2,
        help="share of the streamed requests the client cuts after its first events",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=60.0, help="seconds before a request is hung"
    )
    parser.add_argument(
        "--backoff-ms", type=float, default=20.0, help="mean pause of a client after a 429"
    )
    parser.add_argument(
        "--settle", type=float, default=10.0, help="seconds the gauges get to return to 0"
    )
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--shutdown-timeout", type=float, default=60.0)
    parser.add_argument("--model-id", default=None, help="default: the bundled demo model")
    parser.add_argument("--server-log", type=Path, default=None, help="default: a temp file")
    parser.add_argument("--output", type=Path, default=Path("soak-results.json"))
    args = parser.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = 2 * args.max_concurrent_requests
    if args.max_concurrent_requests < 1 or args.concurrency < 1:
        parser.error("--max-concurrent-requests and --concurrency must be at least 1")
    if args.duration <= 0 or args.request_timeout <= 0:
        parser.error("--duration and --request-timeout must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    log = args.server_log or Path(tempfile.mkdtemp(prefix="tgis-soak-")) / "serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            server_command(args, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=server_env(),
            cwd=ROOT,
        )
    try:
        wait_healthy(url, proc, args.startup_timeout, log)
        print(
            f"tgis serve on {url} (limit {args.max_concurrent_requests}, log {log}); "
            f"{args.concurrency} clients for {args.duration:g} s",
            flush=True,
        )
        load, elapsed = asyncio.run(run_load(url, args))
        summary = summarize(load.records, elapsed, args)
        alive = proc.poll() is None
        gauges, settled = settle_gauges(url, args.settle) if alive else ({}, None)
        summary["gauges_after"] = gauges
        summary["gauges_settled_s"] = settled
        summary["health_after"] = health_status(url) if alive else None
        summary["capacity_after"] = (
            asyncio.run(check_capacity(url, args.max_concurrent_requests, args.request_timeout))
            if alive
            else None
        )
        summary["server_alive_after"] = alive and proc.poll() is None
        summary["shutdown"] = stop_server(proc, args.shutdown_timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary["server_log"] = str(log)
    summary["server_log_problems"] = log_problems(log)[:EXAMPLES_KEPT]
    summary["failures"] = verdict(summary)
    summary["passed"] = not summary["failures"]
    args.output.write_text(json.dumps(summary, indent=2) + "\n")
    print_table(summary)
    print(f"figures: {args.output}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
