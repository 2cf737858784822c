"""`make gpu-check`: what a machine with an NVIDIA GPU proves of tgis, in one command of at most
eight minutes (--budget).

    probe    the GPU, torch, the paths tgis takes there (attention, CUDA graphs), the machine's
             packages and each runtime requirement of tgis they leave unmet
    tests    the suite's CUDA tests: `pytest -m cuda` over the modules that hold them
    kernels  the paged-attention kernels' bandwidth against the device's copy bandwidth
             (scripts/bench_kernels.py: decode at 1, 16 and 64 rows over 512 to 8k tokens of
             context, a 4k-token prefill; Triton, flash where it runs, torch's SDPA)
    profile  one decode step of the 1B shape at 1 and 64 streams, in process (torch.profiler)
    bench    `make bench-gpu`'s loads (--loads MODEL:MODE,...) at 1, 16 and 64 streams
    docs     bench.json's table, with the probe, the tests and the targets, into
             docs/performance.md
    all      probe, tests, kernels, profile, bench, docs, then summary.md, within --budget
             seconds
    wheels   (where pip reaches a package index) the wheels of what tgis needs at run time and
             a GPU image with CUDA torch lacks (--image), for that machine's Python, into --wheels

Everything a stage finds goes under --out, in the files of OUT_FILES (never more than eight), so
the stages can also run as separate commands and `docs` can run where the repository lives, on
the folder fetched back. With wheels in --wheels (`make gpu-wheels`), a stage first installs
them into a private folder (--site), never into the machine's environment, and runs with it
ahead on the path.

    python scripts/gpu_check.py all --out gpu-check
    python scripts/gpu_check.py bench --loads 8b:graphs --out gpu-check
    python scripts/gpu_check.py docs --out gpu-check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
# The packages of the GPU image the wheels are made for (see the file's header).
IMAGE = ROOT / "scripts" / "gpu_image.txt"
# Set once a stage runs with the wheels installed: the re-run must not install them again.
READY = "TGIS_GPU_CHECK_SITE"
# When the command started (before the wheels' install and the re-run): --budget counts from it.
STARTED = "TGIS_GPU_CHECK_STARTED"
# Every file a run writes under --out.
OUT_FILES = (
    "probe.json", "tests.log", "tests.json", "kernels.json", "profile.txt", "bench.json",
    "summary.md",
)  # fmt: skip
# What the CUDA tests run under, beside tgis's runtime requirements (their pins: pyproject's dev).
TEST_TOOLS = ("pytest", "pytest-timeout")
# How a test module marks a test, a parameter or itself `cuda`.
CUDA_MARK = re.compile(r"\bpytest\.mark\.cuda\b")
# bench's loads in order of worth: with too little time left, the last are skipped.
LOADS = "1b:graphs,1b:async,8b:graphs,1b:eager"
# The most seconds the tests and profile stages may take; bench takes what is left, less RESERVE
# for docs and the summary.
CAPS = {"tests": 150.0, "kernels": 60.0, "profile": 90.0}
RESERVE = 15.0
# One load needs about this much beyond its measured seconds, by model: its files written the
# first time, the server's start and warmup, each benchmark's own start.
LOAD_OVERHEAD_S = {"1b": 60.0, "8b": 150.0}
# The profile: warm decode steps before the one recorded, and the table's rows.
PROFILE_BATCHES = (1, 64)
PROFILE_WARM_STEPS = 3
PROFILE_ROWS = 25
# The targets of a GPU run (one H100): ITL p50 at 1 stream (ms), output tokens/s at 64.
TARGETS = {"llama-3.2-1b": (2.0, 10_000), "llama-3.1-8b": (7.0, 3_500)}


class Budget:
    """The seconds left of the command's --budget, counted from its first start."""

    def __init__(self, seconds: float, started: float) -> None:
        self.seconds, self.started = seconds, started

    def left(self) -> float:
        return self.seconds - (time.time() - self.started)

    def cap(self, seconds: float) -> float:
        """At most `seconds`, and never into the reserve kept for docs and the summary."""
        return max(0.0, min(seconds, self.left() - RESERVE))


# --- What tgis needs: its requirements, through the installed distributions' metadata ---------


def canonical(name: str) -> str:
    """A distribution's name as package indexes compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements() -> list[str]:
    """tgis's runtime requirements (pyproject's `dependencies`, no extras) and TEST_TOOLS as the
    dev extra pins them."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dev = project["optional-dependencies"]["dev"]
    tools = [r for r in dev if canonical(Requirement(r).name) in TEST_TOOLS]
    return [*project["dependencies"], *tools]


@dataclass
class Need:
    """One distribution a requirement set needs: every specifier on it, joined; its version
    where the walk ran (None: not installed there); and who asked for it."""

    name: str
    specifier: Any  # packaging.specifiers.SpecifierSet
    version: str | None
    by: set[str] = field(default_factory=set)

    def met_by(self, version: str | None) -> bool:
        return version is not None and self.specifier.contains(version, prereleases=True)


def marker_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of a Linux x86-64 CPython `python_version` (the GPU machine)."""
    from packaging.markers import default_environment

    env: dict[str, str] = dict(default_environment())
    env.update(
        python_version=python_version,
        python_full_version=f"{python_version}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def closure(roots: Iterable[str], python_version: str, stop: Iterable[str] = ()) -> dict[str, Need]:
    """Every distribution the requirements `roots` need, transitively, through the metadata of
    the distributions installed here, with markers evaluated for `python_version` on Linux
    x86-64; the names in `stop` are neither included nor followed."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    env = marker_environment(python_version)
    stopped = {canonical(name) for name in stop}
    needs: dict[str, Need] = {}
    extras: dict[str, set[str]] = {}
    walked: dict[str, frozenset[str]] = {}
    queue: list[tuple[str, str, tuple[str, ...]]] = [(r, "tgis", ("",)) for r in roots]
    while queue:
        text, parent, parent_extras = queue.pop(0)
        req = Requirement(text)
        if req.marker is not None and not any(
            req.marker.evaluate({**env, "extra": extra}) for extra in parent_extras
        ):
            continue
        name = canonical(req.name)
        if name in stopped:
            continue
        need = needs.get(name)
        if need is None:
            try:
                version: str | None = distribution(name).version
            except PackageNotFoundError:
                version = None
            need = needs[name] = Need(name, SpecifierSet(), version)
        need.specifier &= req.specifier
        need.by.add(parent)
        asked = extras.setdefault(name, {""})
        asked.update(req.extras)
        if need.version is None or walked.get(name) == frozenset(asked):
            continue
        walked[name] = frozenset(asked)
        queue += [(r, name, tuple(sorted(asked))) for r in distribution(name).requires or []]
    return needs


def runtime_needs(python_version: str) -> dict[str, Need]:
    """What tgis and its CUDA tests need beside torch: torch and all it requires come with any
    CUDA torch image."""
    torch_needs = closure(["torch"], python_version)
    return closure(project_requirements(), python_version, stop=torch_needs)


def unmet(needs: dict[str, Need]) -> list[str]:
    """One line per need the installed distributions do not meet."""
    lines = []
    for need in sorted(needs.values(), key=lambda n: n.name):
        by = ", ".join(sorted(need.by))
        if need.version is None:
            lines.append(f"{need.name}: missing (needed by {by})")
        elif not need.met_by(need.version):
            lines.append(f"{need.name} {need.version}: needs {need.specifier} (needed by {by})")
    return lines


def image_packages(path: Path) -> dict[str, str | None]:
    """What a GPU image holds, name -> version (None: held, version not recorded): from lines
    `name==version` or `name` (# comments), or from a probe.json (its `packages`)."""
    text = path.read_text()
    if path.suffix == ".json":
        return {canonical(k): v for k, v in json.loads(text)["packages"].items()}
    held: dict[str, str | None] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            held[canonical(name)] = version.strip() or None
    return held


def to_carry(needs: dict[str, Need], image: dict[str, str | None]) -> list[Need]:
    """The needs `image` does not meet: those it lacks, and those it holds at a known version
    outside the requirement (a version not recorded counts as meeting it)."""
    return [
        need
        for name, need in sorted(needs.items())
        if name not in image or (image[name] is not None and not need.met_by(image[name]))
    ]


def repository_bytes() -> int:
    """The size of the repository's files as they travel: tracked, and untracked not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = {ROOT / p.decode() for p in listed.split(b"\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def wheels(dest: Path, python_version: str, image: Path, carry_mib: float) -> list[tuple[str, str]]:
    """Download the wheels of `to_carry(runtime_needs, image)`, at this environment's versions
    (those the suite passes with), for a Linux x86-64 CPython `python_version`; a package with
    no wheel on the index is built into a pure-Python one here. Refuses a set that would make
    the repository and the wheels weigh more than `carry_mib` together. Returns the pins."""
    chosen = to_carry(runtime_needs(python_version), image_packages(image))
    absent = [need.name for need in chosen if need.version is None]
    if absent:
        sys.exit(f"not installed here: {', '.join(absent)}: run `make install` first")
    pins = [(need.name, str(need.version)) for need in chosen]
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()  # two versions of one package would stop the install
    download([f"{name}=={version}" for name, version in pins], dest, python_version)
    (dest / "python-version").write_text(python_version + "\n")
    files = sorted(dest.glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
    size = sum(p.stat().st_size for p in files)
    print(f"{len(files)} wheels, {size / 2**20:.1f} MiB in {dest}: {', '.join(n for n, _ in pins)}")
    total = size + repository_bytes()
    if total > carry_mib * 2**20:
        largest = ", ".join(f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in files[:5])
        sys.exit(
            f"the repository and its wheels weigh {total / 2**20:.1f} MiB, over --carry-mib "
            f"{carry_mib:g}; the largest: {largest}. Give --image the machine's packages "
            "(the probe's probe.json) so that only what it lacks is carried"
        )
    return pins


def carried_pins(wheel_dir: Path) -> list[tuple[str, str]]:
    """(name, version) of each wheel in `wheel_dir`, as its file name gives them."""
    return sorted(
        (canonical(wheel.name.split("-")[0]), wheel.name.split("-")[1])
        for wheel in wheel_dir.glob("*.whl")
    )


def download(pins: Sequence[str], dest: Path, python_version: str) -> None:
    platforms = [f"manylinux_2_{n}_x86_64" for n in (5, 17, 24, 27, 28, 31, 34)]
    platforms += ["manylinux2014_x86_64", "manylinux1_x86_64"]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]  # fmt: skip
    for platform in platforms:
        command += ["--platform", platform]
    if subprocess.run([*command, *pins], check=False, capture_output=True).returncode == 0:
        return
    for pin in pins:  # one at a time: those with no wheel on the index are built here
        if subprocess.run([*command, pin], check=False, capture_output=True).returncode == 0:
            continue
        built = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), pin],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        name = canonical(pin.split("==")[0]).replace("-", "_")
        for wheel in dest.glob("*.whl"):
            if canonical(wheel.name.split("-")[0]).replace("-", "_") == name and not (
                wheel.name.endswith("-none-any.whl")
            ):
                sys.exit(f"{pin} has no wheel for Python {python_version}: {built.stdout}")


# --- On the GPU machine -------------------------------------------------------------------------


def install_wheels(site: Path, wheel_dir: Path) -> None:
    """Re-run this stage with the wheels of `wheel_dir` installed into `site` (once), when they
    were fetched for this Python (`wheels` notes the version beside them)."""
    os.environ.setdefault(STARTED, str(time.time()))
    if os.environ.get(READY) or not wheel_dir.is_dir() or not any(wheel_dir.glob("*.whl")):
        return
    noted = wheel_dir / "python-version"
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if noted.is_file() and noted.read_text().strip() != here:
        print(f"{wheel_dir} holds wheels for Python {noted.read_text().strip()}, this is {here}: "
              "not installed")  # fmt: skip
        return
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheel_dir.glob("*.whl"))],
        check=True,
    )  # fmt: skip
    env = {
        **os.environ,
        READY: str(site),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def stage_env() -> dict[str, str]:
    """The environment of the stage's child processes: this checkout importable."""
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        path = os.pathsep.join(p for p in (str(ROOT), path) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def installed_packages() -> dict[str, str]:
    """name -> version of every distribution this Python imports (the first on the path)."""
    from importlib.metadata import distributions

    held: dict[str, str] = {}
    for dist in distributions():
        name = dist.metadata["Name"]
        if name:
            held.setdefault(canonical(name), dist.version)
    return dict(sorted(held.items()))


def probe(out: Path) -> dict[str, Any]:
    """What the machine is, which paths tgis takes on it, and what it lacks of tgis's needs."""
    import torch

    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    facts: dict[str, Any] = {
        "python": here,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "unmet": unmet(runtime_needs(here)),
        "packages": installed_packages(),
    }
    write(out, "probe.json", facts)  # what tgis lacks, before tgis is imported
    from tgis.backends.paged.attention import attention_path, flash_paged_available
    from tgis.backends.paged.triton_attention import triton_available

    if torch.cuda.is_available():
        device = torch.device("cuda")
        props = torch.cuda.get_device_properties(device)
        triton_why = triton_available(device)
        flash = flash_paged_available(device, torch.bfloat16)
        facts.update(
            gpu=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda_version=torch.version.cuda,
            bf16=torch.cuda.is_bf16_supported(),
            triton=triton_why or "runs",
            flash_bf16=flash,
            attention_auto_bf16=(
                "tgis's Triton kernels"
                + (" or flash attention, whichever is faster at warmup" if flash else "")
                if triton_why is None
                else attention_path(device, torch.bfloat16)
            ),
            attention_fp32=attention_path(device, torch.float32),
            cuda_graphs=triton_why is None or flash,
        )
    for key, value in facts.items():
        if key != "packages":
            print(f"{key}: {value}")
    write(out, "probe.json", facts)
    if not facts["cuda"]:
        sys.exit("gpu-check needs a CUDA device; torch sees none")
    return facts


def cuda_test_files() -> list[str]:
    """The test modules that mark a test `cuda`: the tests stage collects these alone (the
    others may import the dev extra's packages, which a GPU machine need not have)."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if CUDA_MARK.search(path.read_text(encoding="utf-8"))
    )


def stop_group(pid: int) -> None:
    """SIGKILL to the process group of `pid` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def tests(out: Path, seconds: float, per_test: float, collect_only: bool = False) -> int:
    """The CUDA tests (or, `collect_only`, their list), stopped after `seconds`; the output goes
    to out/tests.log, the outcome to out/tests.json."""
    files = cuda_test_files()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
           "-m", "cuda", "-o", f"timeout={int(per_test)}", *files]  # fmt: skip
    if collect_only:
        cmd.append("--collect-only")
    last = ""
    with (out / "tests.log").open("w") as log:
        # A session of its own: stopped, pytest takes the servers its tests started with it.
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        timer = threading.Timer(seconds, stop_group, (proc.pid,))
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            if line.strip():
                last = line.strip()
        code = proc.wait()
        timer.cancel()
    timed_out = code == -9
    # pytest exits 5 when it collects nothing: no CUDA test ran, which is a failure here.
    write(
        out,
        "tests.json",
        {
            "exit_code": code,
            "passed": code == 0,
            "timed_out": timed_out,
            "collect_only": collect_only,
            "summary": f"stopped after {seconds:.0f} s" if timed_out else last.strip("= "),
            "files": files,
        },
    )
    return code


def decode_profile(
    model_dir: Path,
    device: str,
    dtype: str,
    batches: Sequence[int] = PROFILE_BATCHES,
    prompt_tokens: int = 150,
    rows: int = PROFILE_ROWS,
) -> str:
    """torch.profiler's table (the `rows` ops of most device time; CPU time on a CPU) of one
    decode step at each of `batches` streams, of `model_dir` loaded and warmed up as `tgis
    benchmark --engine` loads it (the backend serve would run, CUDA graphs recorded): the
    largest batch's prompts prefilled at once, then PROFILE_WARM_STEPS steps before the one
    recorded, at each batch in turn."""
    from torch.profiler import ProfilerActivity, profile

    from tgis.benchmark.engine_mode import load_backend
    from tgis.engine.backend import PackedItem

    most = max(batches)
    decode_tokens = len(batches) * (PROFILE_WARM_STEPS + 1)
    backend = load_backend(model_dir, device, dtype, most, prompt_tokens, decode_tokens)
    paged: Any = backend
    size = paged.capacity.block_size or 1
    per_seq = -(-(prompt_tokens + decode_tokens + 1) // size)
    tables = [tuple(range(r * per_seq, (r + 1) * per_seq)) for r in range(most)]
    rng = random.Random(0)
    vocab = min(int(paged.vocab_size), 32_000)
    prompts = [tuple(rng.randrange(4, vocab) for _ in range(prompt_tokens)) for _ in range(most)]
    out = paged.forward([PackedItem(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    tokens = out.last.argmax(dim=-1).tolist()
    positions = [prompt_tokens] * most

    def step(batch: int) -> None:
        items = [PackedItem(i, (tokens[i],), positions[i], tables[i]) for i in range(batch)]
        chosen = paged.forward(items).last.argmax(dim=-1).tolist()  # waits for the device
        for i, token in enumerate(chosen):
            tokens[i], positions[i] = token, positions[i] + 1

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    sort = "device_time_total" if cuda else "cpu_time_total"
    sections = []
    for batch in batches:
        for _ in range(PROFILE_WARM_STEPS):
            step(batch)
        with profile(activities=activities) as prof:
            step(batch)
        table = prof.key_averages().table(sort_by=sort, row_limit=rows)
        sections.append(f"One decode step at {batch} stream(s), by {sort}:\n\n{table}")
    runtime = getattr(paged, "runtime", None)
    facts = json.dumps(runtime() if callable(runtime) else {}, default=str)
    return f"{model_dir.name} on {device} in {dtype}; backend: {facts}\n\n" + "\n\n".join(sections)


def kernels_stage(out: Path, seconds: float, argv: Sequence[str] = ()) -> bool:
    """scripts/bench_kernels.py into out/kernels.json, in a child process stopped after
    `seconds`; a failure's reason goes into the file instead. `argv`: more of its flags."""
    target = out / "kernels.json"
    command = [sys.executable, str(ROOT / "scripts" / "bench_kernels.py"), "--out", str(target)]
    try:
        done = subprocess.run(
            [*command, *argv], cwd=ROOT, env=stage_env(), capture_output=True, text=True,
            timeout=seconds,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        write(
            out,
            "kernels.json",
            {"error": f"stopped after {seconds:.0f} s", "log": tail(exc.stderr)},
        )
        return False
    if done.returncode != 0:
        write(
            out, "kernels.json", {"error": f"failed ({done.returncode})", "log": tail(done.stderr)}
        )
        print(tail(done.stderr))
        return False
    print(done.stdout)
    return True


def kernels_text(out: Path) -> str:
    """kernels.json's table and the bandwidth target's verdict ("" without results)."""
    import bench_kernels

    path = out / "kernels.json"
    if not path.is_file():
        return ""
    data = json.loads(path.read_text())
    if "error" in data:
        return f"Kernel bandwidth: {data['error']}."
    line = bench_kernels.verdict(data)
    return bench_kernels.table(data) + (f"\n\n- {line}" if line else "")


def profile_stage(out: Path, workdir: Path, seconds: float) -> bool:
    """decode_profile of the 1B shape into out/profile.txt, in a child process stopped after
    `seconds` (its memory is the bench's afterwards)."""
    code = (
        "import sys; from pathlib import Path; sys.path[:0] = [sys.argv[1], sys.argv[1] + "
        "'/scripts']; import bench_gpu, gpu_check; d = bench_gpu.write_model(Path(sys.argv[2]), "
        "bench_gpu.MODELS['1b']); print(gpu_check.decode_profile(d, 'cuda', 'bfloat16', "
        "prompt_tokens=bench_gpu.PROMPT_TOKENS))"
    )
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(ROOT), str(workdir)], cwd=ROOT, env=stage_env(),
            capture_output=True, text=True, timeout=seconds,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        text = f"stopped after {seconds:.0f} s\n\n{tail(exc.stderr)}"
        ok = False
    else:
        ok = done.returncode == 0
        text = done.stdout if ok else f"failed ({done.returncode})\n\n{tail(done.stderr)}"
    write(out, "profile.txt", text)
    print(text[:4000])
    return ok


def tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def parse_loads(text: str) -> list[tuple[str, str]]:
    """`"1b:graphs,8b:eager"` -> [("1b", "graphs"), ("8b", "eager")]; exits naming a bad one."""
    import bench_gpu

    loads = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        model, _, mode = part.partition(":")
        if model not in bench_gpu.MODELS or mode not in bench_gpu.MODE_FLAGS:
            sys.exit(
                f"--loads {part!r}: each load is MODEL:MODE, MODEL one of "
                f"{', '.join(bench_gpu.MODELS)}, MODE one of {', '.join(bench_gpu.MODE_FLAGS)}"
            )
        loads.append((model, mode))
    return loads


def bench(
    out: Path,
    loads: Sequence[tuple[str, str]],
    duration: float,
    warmup: float,
    workdir: Path,
    budget: Budget,
) -> bool:
    """bench-gpu's loads in order, each started only with the time to finish it; every run
    (rows, what the server said it ran, what was skipped and why) into out/bench.json, beside
    those of earlier bench commands on other loads. False when a load failed or an answer
    was not exactly as long as asked."""
    import bench_gpu
    import torch

    from tgis.backends.paged.attention import flash_paged_available
    from tgis.backends.paged.triton_attention import triton_available

    path = out / "bench.json"
    data = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    data.update(device=torch.cuda.get_device_name(0), torch=torch.__version__)
    cuda = torch.device("cuda")
    # Decode graphs run over attention on KV pages: tgis's Triton kernels or flash attention.
    graphs_run = triton_available(cuda) is None or flash_paged_available(cuda, torch.bfloat16)
    workdir.mkdir(parents=True, exist_ok=True)
    ok = True
    for key, mode in loads:
        name = bench_gpu.MODELS[key]
        run: dict[str, Any] = {"model": name, "mode": mode, "duration_s": duration}
        need = LOAD_OVERHEAD_S[key] + len(bench_gpu.STREAMS) * (duration + warmup + 5)
        if mode == "eager" and not graphs_run:
            run["skipped"] = (
                "CUDA graphs do not run here (neither Triton nor paged flash attention), so the "
                "graphs load already served eagerly"
            )
        elif budget.cap(need) < need:
            run["skipped"] = f"{budget.left():.0f} s left of the budget, about {need:.0f} needed"
        else:
            started = time.time()
            try:
                model_dir = bench_gpu.write_model(workdir, name)
                run.update(
                    bench_gpu.run_mode(
                        model_dir, mode, workdir, duration, warmup,
                        deadline=time.time() + budget.cap(1e9),
                    )
                )  # fmt: skip
            except Exception as exc:  # the next load still runs
                log = workdir / f"{name}-{mode}.log"
                run["error"] = f"{exc}\n{tail(log.read_text() if log.is_file() else '')}"
            run["seconds"] = round(time.time() - started, 1)
        ok = ok and "error" not in run and all(r["exact"] for r in run.get("rows", []))
        data["runs"] = [r for r in data["runs"] if (r["model"], r["mode"]) != (name, mode)] + [run]
        write(out, "bench.json", data)
        print(json.dumps({k: v for k, v in run.items() if k != "rows"}))
        for row in run.get("rows", []):
            print(json.dumps(row))
    return ok


def bench_rows(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """bench.json's rows in the table's order (1B first, graphs, async, eager, by streams)."""
    import bench_gpu

    path = out / "bench.json"
    data = json.loads(path.read_text()) if path.is_file() else {"runs": []}
    order = {name: i for i, name in enumerate(bench_gpu.MODELS.values())}
    rows = sorted(
        (row for run in data["runs"] for row in run.get("rows", [])),
        key=lambda r: (
            order.get(r["model"], 99),
            list(bench_gpu.MODE_FLAGS).index(r["mode"]),
            r["streams"],
        ),
    )
    return rows, data


def docs_text(out: Path) -> str:
    """The table of bench.json's rows, with the probe, the CUDA tests and the targets."""
    import bench_gpu

    rows, data = bench_rows(out)
    if not rows:
        sys.exit(f"no bench results under {out}: run the bench stage first")
    text = bench_gpu.table(rows, data["device"], data["torch"])
    skipped = [f"{r['model']} {r['mode']}: {r['skipped']}" for r in data["runs"] if "skipped" in r]
    failed = [f"{r['model']} {r['mode']}: {r['error'].splitlines()[0]}" for r in data["runs"]
              if "error" in r]  # fmt: skip
    for label, lines in (("Not measured", skipped), ("Failed", failed)):
        if lines:
            text += f"\n\n{label}: " + "; ".join(lines) + "."
    probe_file = out / "probe.json"
    if probe_file.is_file():
        facts = json.loads(probe_file.read_text())
        how = facts.get("attention_auto_bf16", facts.get("attention_bf16", "?"))
        text += f"\n\nAttention (bf16, --attention-backend auto): {how}."
    tests_file = out / "tests.json"
    if tests_file.is_file():
        result = json.loads(tests_file.read_text())
        outcome = "passed" if result["passed"] else "FAILED"
        text += f" CUDA tests (`pytest -m cuda`): {outcome} ({result.get('summary', '')})."
    verdicts = target_verdicts(rows)
    if verdicts:
        text += "\n\n" + "\n".join(f"- {line}" for line in verdicts)
    kernels = kernels_text(out)
    return text + (f"\n\n{kernels}" if kernels else "")


def docs(out: Path, path: Path = ROOT / "docs" / "performance.md") -> str:
    """docs_text into `path`, between the bench-gpu markers."""
    import bench_gpu

    text = docs_text(out)
    bench_gpu.write_docs(text, path)
    print(text)
    return text


def target_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Each target met or not, from the rows measured with the default flags (graphs mode);
    graphs against eager only where the graphs load really replayed CUDA graphs."""
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
            if graphs is None or eager is None or not eager["output_tok_s"]:
                continue
            if not graphs.get("cuda_graphs", True):
                lines.append(
                    f"{model}: graphs / eager at {streams} streams not compared (the graphs "
                    "load served eagerly)"
                )
                continue
            ratio = graphs["output_tok_s"] / eager["output_tok_s"]
            lines.append(
                f"{model}: graphs / eager tokens/s at {streams} streams {ratio:.2f}x "
                f"(target >= 1: {'met' if ratio >= 0.98 else 'not met'})"
            )
        for streams in (1, 16, 64):
            serial, overlapped = (
                by.get((model, "graphs", streams)),
                by.get((model, "async", streams)),
            )
            if serial is None or overlapped is None or not serial["output_tok_s"]:
                continue
            ratio = overlapped["output_tok_s"] / serial["output_tok_s"]
            lines.append(
                f"{model}: async scheduling / serial tokens/s at {streams} streams {ratio:.2f}x, "
                f"ITL p50 {overlapped['itl_p50_ms']:.2f} / {serial['itl_p50_ms']:.2f} ms "
                "(async scheduling becomes the GPU's default where it is >= 1)"
            )
    return lines


def summary(out: Path, outcomes: dict[str, str]) -> str:
    """summary.md: each stage's outcome, the probe's facts, and the docs table where bench ran."""
    lines = ["# gpu-check", ""]
    lines += [f"- {stage}: {outcome}" for stage, outcome in outcomes.items()]
    probe_file = out / "probe.json"
    if probe_file.is_file():
        facts = json.loads(probe_file.read_text())
        keys = ("gpu", "memory_gib", "python", "torch", "cuda_version", "attention_auto_bf16",
                "flash_bf16", "cuda_graphs")  # fmt: skip
        lines += ["", *(f"- {k}: {facts[k]}" for k in keys if k in facts)]
        if facts.get("unmet"):
            lines += ["", "Unmet requirements:", *(f"- {u}" for u in facts["unmet"])]
    if bench_rows(out)[0]:
        lines += ["", docs_text(out)]
    text = "\n".join(lines) + "\n"
    write(out, "summary.md", text)
    return text


def write(out: Path, name: str, data: dict[str, Any] | str) -> None:
    """out/name, one of OUT_FILES: a run writes nothing else under --out."""
    if name not in OUT_FILES:
        raise ValueError(f"{name} is not one of the files a run writes: {', '.join(OUT_FILES)}")
    out.mkdir(parents=True, exist_ok=True)
    text = data if isinstance(data, str) else json.dumps(data, indent=2)
    (out / name).write_text(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "stage",
        choices=["probe", "tests", "kernels", "profile", "bench", "docs", "all", "wheels"],
    )
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for the command")
    parser.add_argument("--loads", default=LOADS, help="bench: MODEL:MODE,... (1b, 8b; graphs, async, eager)")  # fmt: skip
    parser.add_argument("--duration", type=float, default=10.0, help="bench: seconds per step")
    parser.add_argument("--warmup", type=float, default=3.0, help="bench: unmeasured seconds")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tgis-bench-gpu"))
    parser.add_argument("--test-timeout", type=float, default=120.0, help="tests: per test")
    parser.add_argument("--collect-only", action="store_true", help="tests: list, do not run")
    parser.add_argument("--site", type=Path, default=Path("/tmp/tgis-gpu-check-site"))
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="the carried wheels")
    parser.add_argument("--python-version", default="3.12", help="wheels: the GPU's Python")
    parser.add_argument("--image", type=Path, default=IMAGE, help="wheels: the GPU's packages")
    parser.add_argument(
        "--carry-mib", type=float, default=64.0,
        help="wheels: the most the repository and its wheels may weigh together",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.collect_only and args.stage != "tests":
        parser.error("--collect-only lists the tests stage's tests: use it with `tests`")
    return args


def main() -> None:
    args = parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    if args.stage == "wheels":
        wheels(args.wheels, args.python_version, args.image, args.carry_mib)
        return
    if args.stage != "docs":
        install_wheels(args.site, args.wheels)
    loads = parse_loads(args.loads)
    budget = Budget(args.budget, float(os.environ.get(STARTED, time.time())))
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes: dict[str, str] = {}
    failed = False
    if args.stage in ("probe", "all"):
        facts = probe(args.out)
        failed = bool(facts["unmet"])
        outcomes["probe"] = f"{len(facts['unmet'])} unmet requirements" if failed else "ok"
    if args.stage in ("tests", "all"):
        seconds = budget.cap(CAPS["tests"]) if args.stage == "all" else budget.cap(1e9)
        code = tests(args.out, seconds, args.test_timeout, args.collect_only)
        failed = failed or code != 0
        outcomes["tests"] = json.loads((args.out / "tests.json").read_text())["summary"]
    if args.stage in ("kernels", "all"):
        seconds = budget.cap(CAPS["kernels"]) if args.stage == "all" else budget.cap(1e9)
        ok = kernels_stage(args.out, seconds)
        failed = failed or not ok
        outcomes["kernels"] = "kernels.json" if ok else "failed: see kernels.json"
    if args.stage in ("profile", "all"):
        seconds = budget.cap(CAPS["profile"]) if args.stage == "all" else budget.cap(1e9)
        ok = profile_stage(args.out, args.workdir, seconds)
        failed = failed or not ok
        outcomes["profile"] = "profile.txt" if ok else "failed: see profile.txt"
    if args.stage in ("bench", "all"):
        ok = bench(args.out, loads, args.duration, args.warmup, args.workdir, budget)
        failed = failed or not ok
        outcomes["bench"] = "ok" if ok else "a load failed or an answer was cut: see bench.json"
    if args.stage == "docs" or (args.stage == "all" and bench_rows(args.out)[0]):
        docs(args.out)
    if args.stage == "all":
        outcomes["seconds"] = f"{time.time() - budget.started:.0f} of {args.budget:.0f}"
        print("\n" + summary(args.out, outcomes))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
