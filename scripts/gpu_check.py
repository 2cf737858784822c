"""`make gpu-check`: what a machine with an NVIDIA GPU proves of tgis, in stages of under ten
minutes each.

    probe   the GPU, torch, and the paths tgis takes there: attention, CUDA graphs, dtype
    tests   the suite's CUDA tests (`pytest -m cuda`)
    bench   `make bench-gpu`'s loads for --models (1b, 8b) and --modes (graphs, eager)
    docs    every bench stage's rows, with the probe and the targets, into docs/performance.md
    all     probe, tests, bench (every model and mode), docs
    wheels  (where pip reaches a package index) the wheels tgis needs beside a GPU image's
            torch, into --dest, for a machine that has no index

Each stage writes what it found under --out as JSON, so the stages can run as separate
commands (one per call where a machine limits how long a command runs) and `docs` can run
where the repository lives. With a `.whl/` folder in the repository (from `wheels`), a stage
first installs those wheels into a private folder (`--site`), never into the machine's
environment, and runs with it ahead on the path.

    python scripts/gpu_check.py probe --out gpu-check
    python scripts/gpu_check.py bench --models 8b --modes graphs --out gpu-check
    python scripts/gpu_check.py docs --out gpu-check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
# Set once a stage runs with the wheels installed: the re-run must not install them again.
READY = "TGIS_GPU_CHECK_SITE"
# Runtime dependencies a GPU image with torch may lack or hold at other versions: their
# versions are taken from the environment `wheels` runs in (the one the suite passes in).
CARRIED = (
    "transformers", "huggingface_hub", "tokenizers", "starlette", "uvicorn", "jsonschema",
    "referencing", "rpds-py", "jsonschema-specifications", "llguidance", "grpcio",
    "grpcio-health-checking", "grpcio-reflection", "protobuf", "typer", "openapi-ui-bundles",
    "prometheus-client", "safetensors", "httpx", "httpcore", "h11", "anyio", "sniffio",
    "pytest-timeout",
)  # fmt: skip
# The targets of a GPU run (one H100): ITL p50 at 1 stream (ms), output tokens/s at 64.
TARGETS = {"llama-3.2-1b": (2.0, 10_000), "llama-3.1-8b": (7.0, 3_500)}


def install_wheels(site: Path) -> None:
    """Re-run this stage with the carried wheels installed into `site` (once), when they were
    fetched for this Python (`wheels` notes the version beside them)."""
    if os.environ.get(READY) or not WHEELS.is_dir() or not any(WHEELS.glob("*.whl")):
        return
    noted = WHEELS / "python-version"
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if noted.is_file() and noted.read_text().strip() != here:
        print(f"{WHEELS} holds wheels for Python {noted.read_text().strip()}, this is {here}: "
              "not installed")  # fmt: skip
        return
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, WHEELS.glob("*.whl"))],
        check=True,
    )  # fmt: skip
    env = {
        **os.environ,
        READY: str(site),
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def stage_env() -> dict[str, str]:
    """The environment of the stage's child processes: this checkout importable."""
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        path = os.pathsep.join(p for p in (str(ROOT), path) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def probe(out: Path) -> dict[str, Any]:
    """What the machine is and which paths tgis takes on it."""
    import torch

    from tgis.backends.paged.attention import attention_path, flash_paged_available

    facts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        device = torch.device("cuda")
        props = torch.cuda.get_device_properties(device)
        facts.update(
            gpu=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda_version=torch.version.cuda,
            bf16=torch.cuda.is_bf16_supported(),
            attention_bf16=attention_path(device, torch.bfloat16),
            attention_fp32=attention_path(device, torch.float32),
            cuda_graphs=flash_paged_available(device, torch.bfloat16),
        )
    write(out / "probe.json", facts)
    for key, value in facts.items():
        print(f"{key}: {value}")
    if not facts["cuda"]:
        sys.exit("gpu-check needs a CUDA device; torch sees none")
    return facts


def tests(out: Path, timeout: float) -> int:
    """The CUDA tests; their output goes to out/tests.log too."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
           "-m", "cuda", "-o", f"timeout={int(timeout)}", "tests"]  # fmt: skip
    with (out / "tests.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
    code = proc.wait()
    # pytest exits 5 when it collects nothing: no CUDA test ran, which is a failure here.
    write(out / "tests.json", {"exit_code": code, "passed": code == 0})
    return code


def bench(out: Path, models: list[str], modes: list[str], duration: float, workdir: Path) -> None:
    """bench-gpu's loads for each model and mode, one JSON per pair under `out`."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_gpu

    workdir.mkdir(parents=True, exist_ok=True)
    for key in models:
        model_dir = bench_gpu.write_model(workdir, bench_gpu.MODELS[key])
        for mode in modes:
            started = time.time()
            rows = bench_gpu.run_mode(model_dir, mode, workdir, duration)
            write(
                out / f"bench-{key}-{mode}.json",
                {
                    "device": torch.cuda.get_device_name(0),
                    "torch": torch.__version__,
                    "duration_s": duration,
                    "seconds": round(time.time() - started, 1),
                    "rows": rows,
                },
            )
            for row in rows:
                print(json.dumps(row))


def docs(out: Path, path: Path = ROOT / "docs" / "performance.md") -> str:
    """The table of every bench stage's rows under `out`, with the probe and the targets."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_gpu

    runs = [json.loads(p.read_text()) for p in sorted(out.glob("bench-*.json"))]
    if not runs:
        sys.exit(f"no bench results under {out}: run the bench stage first")
    order = {name: i for i, name in enumerate(bench_gpu.MODELS.values())}
    rows = sorted(
        (row for run in runs for row in run["rows"]),
        key=lambda r: (order.get(r["model"], 99), r["mode"] != "graphs", r["streams"]),
    )
    text = bench_gpu.table(rows, runs[0]["device"], runs[0]["torch"])
    probe_file = out / "probe.json"
    if probe_file.is_file():
        facts = json.loads(probe_file.read_text())
        text += f"\n\nAttention (bf16): {facts.get('attention_bf16', '?')}."
    tests_file = out / "tests.json"
    if tests_file.is_file():
        passed = json.loads(tests_file.read_text())["passed"]
        text += f" CUDA tests (`pytest -m cuda`): {'passed' if passed else 'FAILED'}."
    verdicts = target_verdicts(rows)
    if verdicts:
        text += "\n\n" + "\n".join(f"- {line}" for line in verdicts)
    bench_gpu.write_docs(text, path)
    print(text)
    return text


def target_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Each target met or not, from the rows measured (graphs mode, the default)."""
    lines = []
    by = {(r["model"], r["mode"], r["streams"]): r for r in rows}
    for model, (itl_ms, tok_s) in TARGETS.items():
        one, many = by.get((model, "graphs", 1)), by.get((model, "graphs", 64))
        if one is not None:
            met = one["itl_p50_ms"] <= itl_ms
            lines.append(
                f"{model}: ITL p50 at 1 stream {one['itl_p50_ms']:.2f} ms (target <= {itl_ms} "
                f"ms: {'met' if met else 'not met'})"
            )
        if many is not None:
            met = many["output_tok_s"] >= tok_s
            lines.append(
                f"{model}: {many['output_tok_s']:,.0f} tokens/s at 64 streams (target >= "
                f"{tok_s:,}: {'met' if met else 'not met'})"
            )
        for streams in (1, 16, 64):
            graphs, eager = by.get((model, "graphs", streams)), by.get((model, "eager", streams))
            if graphs is not None and eager is not None and eager["output_tok_s"]:
                ratio = graphs["output_tok_s"] / eager["output_tok_s"]
                lines.append(
                    f"{model}: graphs / eager tokens/s at {streams} streams {ratio:.2f}x "
                    f"(target >= 1: {'met' if ratio >= 0.98 else 'not met'})"
                )
    return lines


def wheels(dest: Path, python_version: str) -> None:
    """Download the CARRIED wheels, at this environment's versions, for a GPU machine's Python
    (manylinux x86_64); a package with no wheel is built into one here."""
    from importlib.metadata import PackageNotFoundError, version

    dest.mkdir(parents=True, exist_ok=True)
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)]
    platforms += ["manylinux2014_x86_64", "manylinux1_x86_64"]
    for name in CARRIED:
        try:
            pin = f"{name}=={version(name)}"
        except PackageNotFoundError:
            sys.exit(f"{name} is not installed here: run `make install` first")
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", python_version,
                    "--implementation", "cp", "-d", str(dest), pin]  # fmt: skip
        for platform in platforms:
            download[-1:-1] = ["--platform", platform]
        if subprocess.run(download, check=False).returncode != 0:
            # No wheel on the index (an sdist only): build a pure-Python one here.
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), pin],
                check=True,
            )
    (dest / "python-version").write_text(python_version + "\n")
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"{len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {dest}")


def write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["probe", "tests", "bench", "docs", "all", "wheels"])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check")
    parser.add_argument("--models", default="1b,8b", help="bench: comma-separated, 1b and 8b")
    parser.add_argument("--modes", default="graphs,eager", help="bench: graphs and eager")
    parser.add_argument("--duration", type=float, default=20.0, help="bench: seconds per load")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tgis-bench-gpu"))
    parser.add_argument("--test-timeout", type=float, default=300.0, help="tests: per test")
    parser.add_argument("--site", type=Path, default=Path("/tmp/tgis-gpu-check-site"))
    parser.add_argument("--dest", type=Path, default=WHEELS, help="wheels: where to")
    parser.add_argument("--python-version", default="3.12", help="wheels: the GPU's Python")
    args = parser.parse_args()
    if args.stage == "wheels":
        wheels(args.dest, args.python_version)
        return
    if args.stage != "docs":
        install_wheels(args.site)
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.stage in ("probe", "all"):
        probe(args.out)
    code = 0
    if args.stage in ("tests", "all"):
        code = tests(args.out, args.test_timeout)
    if args.stage in ("bench", "all"):
        bench(args.out, models, modes, args.duration, args.workdir)
    if args.stage in ("docs", "all"):
        docs(args.out)
    sys.exit(code)


if __name__ == "__main__":
    main()
