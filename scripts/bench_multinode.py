"""The cost of a decode step whose two shards sit on two hosts, against two shards on one.

Two network namespaces joined by a veth pair play two hosts on this machine (tests/netns.py;
root and iproute2 needed). For each model, the same `tgis serve --num-shard 2 --backend cpu`
runs
- local: both shards in namespace A, meeting over its loopback (`--nnodes 1`);
- across: node 0 (rank 0, the server) in A, node 1 (rank 1) in B, meeting over the veth pair
  (`--nnodes 2`): every step's broadcast, each layer's two all-reduces, the embedding's
  all-reduce and the logits' all-gather cross the namespace boundary.
Both use the same cores, so the difference is what crossing costs: the kernel's veth path
instead of loopback, and gloo's pair over it. A client inside A streams greedy requests of
--new-tokens tokens (ignore_eos) from /generate_stream: one alone, then --streams at once; the
decode step is the median gap between a request's tokens (the first token, and so the prefill,
left out). Each configuration runs --rounds rounds after one unmeasured round, and the two
configurations alternate so a load from elsewhere falls on both alike.

Models: the bundled demo model (6 layers, hidden 256: a step is mostly overhead) and a random
model of Llama-3.2-1B's shape in bfloat16 (scripts/bench_models, written under --workdir).

    python scripts/bench_multinode.py --workdir /tmp/tgis-multinode-bench --output run.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from tests.netns import Hosts, two_hosts, unavailable  # noqa: E402

DEMO_MODEL = ROOT / "tgis" / "assets" / "demo-model"
PROMPT = "def fibonacci(n):\n    "


def client(port: int, new_tokens: int, streams: int) -> dict[str, Any]:
    """Run inside namespace A: `streams` requests at once; each one's token gaps (seconds)."""
    import httpx

    errors: list[BaseException] = []

    def one(out: list[list[float]]) -> None:
        try:
            asked(out)
        except BaseException as exc:  # the run fails with it
            errors.append(exc)

    def asked(out: list[list[float]]) -> None:
        times: list[float] = []
        body = {
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True},
        }
        with httpx.stream(
            "POST", f"http://127.0.0.1:{port}/generate_stream", json=body, timeout=600
        ) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data:") and '"error"' in line:
                    raise RuntimeError(line)
                if line.startswith("data:"):
                    times.append(time.perf_counter())
        out.append([b - a for a, b in itertools.pairwise(times[1:])])

    gaps: list[list[float]] = []
    threads = [threading.Thread(target=one, args=(gaps,)) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return {"gaps": [g for request in gaps for g in request]}


class Server:
    """One configuration's processes: node 0 in A (and node 1 in B across)."""

    def __init__(
        self, hosts: Hosts, model: Path, dtype: str, across: bool, port: int, logs: Path
    ) -> None:
        self.port = port
        logs.mkdir(parents=True, exist_ok=True)
        master_port = str(port + 1)
        common = [
            sys.executable, "-m", "tgis", "serve", "--model-id", str(model), "--backend", "cpu",
            "--dtype", dtype, "--num-shard", "2", "--max-total-tokens", "512",
            "--max-batch-size", "16", "--port", str(port), "--no-grpc",
            "--master-port", master_port,
        ]  # fmt: skip
        # One OpenMP thread per shard in both configurations: the two hosts share these cores.
        threads = max(1, (os.cpu_count() or 2) // 2)
        env = {**os.environ, "WARMUP_ENABLED": "false", "OMP_NUM_THREADS": str(threads)}
        self.procs: list[subprocess.Popen[bytes]] = []
        if across:
            nodes = ["--nnodes", "2", "--master-addr", hosts.addresses[0]]
            commands = [
                hosts.run(host, [*common, *nodes, "--node-rank", str(host)]) for host in (0, 1)
            ]
        else:
            commands = [hosts.run(0, common)]
        for index, command in enumerate(commands):
            log = (logs / f"{port}-node{index}.log").open("wb")
            self.procs.append(
                subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            )

    def stop(self) -> None:
        """Node 0 first: it drains and stops node 1's shards, and node 1 with them."""
        from bench_serve import stop

        for proc in self.procs:
            stop(proc)


def ask(hosts: Hosts, port: int, new_tokens: int, streams: int, timeout: float) -> list[float]:
    command = hosts.run(0, [sys.executable, __file__, "--client",
                            json.dumps([port, new_tokens, streams])])  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return list(json.loads(done.stdout.strip().splitlines()[-1])["gaps"])


def wait_ready(hosts: Hosts, server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in server.procs):
            raise RuntimeError("a node exited before serving")
        try:
            ask(hosts, server.port, 2, 1, 60)
            return
        except (RuntimeError, subprocess.TimeoutExpired):
            time.sleep(2)
    raise RuntimeError("the server did not start")


def measure(
    hosts: Hosts, model: Path, dtype: str, args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    """Per configuration and batch: each round's median decode step (ms)."""
    results: dict[str, dict[str, list[float]]] = {}
    order = ["local", "across"]
    port = 31000
    for round_ in range(args.rounds + 1):
        for mode in order if round_ % 2 == 0 else order[::-1]:
            port += 2
            server = Server(hosts, model, dtype, mode == "across", port, args.workdir / "logs")
            try:
                wait_ready(hosts, server, 600)
                for streams in (1, args.streams):
                    gaps = ask(hosts, port, args.new_tokens, streams, 900)
                    if round_ == 0:
                        continue  # the unmeasured round
                    key = f"batch {streams}"
                    step = statistics.median(gaps) * 1000
                    results.setdefault(mode, {}).setdefault(key, []).append(step)
                    print(f"{model.name} {dtype} {mode} {key}: {step:.2f} ms", flush=True)
            finally:
                server.stop()
    return results


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tgis-multinode-bench"))
    parser.add_argument("--models", default="demo,1b", help="demo and/or 1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        port, new_tokens, streams = json.loads(args.client)
        print(json.dumps(client(port, new_tokens, streams)))
        return 0
    reason = unavailable()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    models: list[tuple[Path, str]] = []
    for name in args.models.split(","):
        if name == "demo":
            models.append((DEMO_MODEL, "float32"))
        elif name == "1b":
            from bench_gpu import write_model

            models.append((write_model(args.workdir, "llama-3.2-1b"), "bfloat16"))
        else:
            parser.error(f"--models: {name} is not demo or 1b")
    report: dict[str, Any] = {"cpu": cpu_name(), "cores": os.cpu_count(), "models": {}}
    with two_hosts() as hosts:
        for model, dtype in models:
            found = measure(hosts, model, dtype, args)
            summary = {}
            for key in found["local"]:
                local = statistics.median(found["local"][key])
                across = statistics.median(found["across"][key])
                summary[key] = {
                    "local_ms": round(local, 2),
                    "across_ms": round(across, 2),
                    "cost_ms": round(across - local, 2),
                    "ratio": round(across / local, 3),
                }
            report["models"][f"{model.name} ({dtype})"] = {"rounds": found, "summary": summary}
            print(json.dumps(summary, indent=1), flush=True)
    if args.output:
        args.output.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
