"""Compiled decode steps kept on disk: AOTInductor packages that a later start loads in
seconds instead of compiling again.

torch.compile's own caches keep nothing of the decode graphs (paged/compile.py): their
weights are folded in as constants (`freezing`), which inductor's FX graph cache skips, so
every start compiled for minutes. Instead each graph is exported (`torch.export`, the pool's
tensors as inputs whose length is free, the weights as constants) and compiled ahead of time
into a `.pt2` package (`torch._inductor.aoti_compile_and_package`), which
`torch._inductor.aoti_load_package` loads.

    store = PackageStore.of(root, model_dir, recipe)   # a folder per model, settings, torch, CPU
    store.has(1)                                       # is the batch-1 graph there?
    build = BackgroundBuild(recipe.command(store), store.log, on_done)
    build.start()                                      # serve eagerly meanwhile

A store is keyed by what the packages depend on: the model's files (names, sizes, times), the
settings that shape the step (dtype, quantization, KV dtype, block size, rope table length),
torch's version, the CPU's vector capability and this format's version. The default root is a
folder under the Hugging Face cache (`default_root`), `--compile-cache` moves it.

A start that finds its store empty serves eagerly at once and builds the packages in a process
of its own (`python -m tgis.backends.paged.build`, which loads the model as the server did
and compiles through `CompiledDecode.compile`): compiling holds the interpreter for minutes, and
off the serving process it takes none of the engine's time but the CPU's. When the build ends
the server loads the packages and its decode steps run through them from the next step on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import tgis
from tgis.config import default_env

logger = logging.getLogger(__name__)

# The layout of a store and of what its packages take; a change makes earlier stores unused.
FORMAT = 1
# The build process's environment names its server's pid here (it ends with the server).
PARENT_VARIABLE = "TGIS_BUILD_PARENT"
# The model files whose content the packages fold in (fingerprinted by name, size, time).
_MODEL_FILES = ("config.json", "*.safetensors", "*.bin")


def default_root() -> Path:
    """Where stores live unless `--compile-cache` says: `tgis/compiled` under HF_HOME."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "tgis" / "compiled"


@dataclass(frozen=True)
class BuildRecipe:
    """What the build process needs to load the model as the server did: the model's folder
    and the settings that shape its decode step."""

    model_dir: Path
    dtype: str | None
    quantize: str | None
    group_size: int | None
    kv_cache_dtype: str | None
    block_size: int
    max_sequence_tokens: int

    def command(self, store: PackageStore, autotune: bool = True) -> list[str]:
        """The build process's command line."""
        args = [sys.executable, "-m", "tgis.backends.paged.build", str(self.model_dir)]
        args += ["--store", str(store.directory), "--block-size", str(self.block_size)]
        args += ["--max-sequence-tokens", str(self.max_sequence_tokens)]
        # The server's thread count, which the store's key holds and the GEMMs are built for.
        args += ["--threads", str(torch.get_num_threads())]
        for flag, value in (
            ("--dtype", self.dtype),
            ("--quantize", self.quantize),
            ("--group-size", self.group_size),
            ("--kv-cache-dtype", self.kv_cache_dtype),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args if autotune else [*args, "--no-autotune"]


def model_fingerprint(model_dir: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime in ns) of the model's config and weight files."""
    found = {p for pattern in _MODEL_FILES for p in model_dir.glob(pattern) if p.is_file()}
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in found)


def cpu_identity() -> list[str]:
    """What the packages' machine code depends on: the architecture, torch's vector ISA and
    inductor's, and the CPU's model and flags (inductor compiles for this CPU, -march=native:
    a package built on another CPU of the same ISA name may not run here)."""
    from torch._inductor import cpu_vec_isa

    model, flags = "", ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:16]
    return [
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(),
        str(cpu_vec_isa.pick_vec_isa()),
        model,
        flags,
    ]


@dataclass(frozen=True)
class PackageStore:
    """One folder of packages, by graph (paged/compile.py's GRAPHS)."""

    directory: Path

    @classmethod
    def of(cls, root: Path, recipe: BuildRecipe) -> PackageStore:
        """The store for `recipe` under `root`, keyed as the module doc says."""
        parts = {
            "format": FORMAT,
            "tgis": tgis.__version__,
            "torch": torch.__version__,
            "cpu": cpu_identity(),
            # Inductor's CPU GEMMs bake the thread count into their blocking.
            "threads": torch.get_num_threads(),
            "model": model_fingerprint(recipe.model_dir),
            "recipe": {k: str(v) for k, v in asdict(recipe).items() if k != "model_dir"},
        }
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
        name = recipe.model_dir.resolve().name or "model"
        return cls(root / f"{name}-{digest}")

    def path(self, graph: int) -> Path:
        return self.directory / f"decode-{graph}.pt2"

    def has(self, graph: int) -> bool:
        return self.path(graph).is_file()

    @property
    def log(self) -> Path:
        """The build process's output."""
        return self.directory / "build.log"

    @property
    def failure(self) -> str | None:
        """Why the last build for this store failed (its error, kept so that later starts
        do not spend minutes failing again), or None."""
        path = self.directory / "failed"
        return path.read_text(errors="replace") if path.is_file() else None

    def fail(self, why: str) -> None:
        """Keep `why` the build failed (see `failure`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "failed").write_text(why)

    def save(self, graph: int, write: Callable[[Path], None]) -> Path:
        """Write graph's package through `write(path)` to a temporary name, then move it in
        place: a reader never sees half a package, and two builders do not mix theirs."""
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.path(graph)
        partial = final.with_name(f".partial-{os.getpid()}-{final.name}")
        try:
            write(partial)
            os.replace(partial, final)
        finally:
            partial.unlink(missing_ok=True)
        (self.directory / "failed").unlink(missing_ok=True)  # a build that ends well
        return final


class BackgroundBuild:
    """A build of a store's packages in a process of its own; `on_done(returncode)` runs on a
    thread of its own when it ends (0: every package is in the store)."""

    def __init__(self, command: Sequence[str], log: Path, on_done: Callable[[int], None]) -> None:
        self.command, self.log, self.on_done = list(command), log, on_done
        self._process: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.stopped = False  # `stop` ended it (the server is stopping)

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self._process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**default_env(), PARENT_VARIABLE: str(os.getpid())},
            )
        self._thread = threading.Thread(target=self._wait, name="tgis-compile-wait", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        assert self._process is not None
        code = self._process.wait()
        try:
            self.on_done(code)
        except Exception:  # the server serves on eagerly
            logger.exception("loading the compiled decode failed")

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        """End the build (the server is stopping); what it finished stays in the store."""
        self.stopped = True
        if self.running:
            assert self._process is not None
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the build and its `on_done`."""
        if self._thread is not None:
            self._thread.join(timeout)
