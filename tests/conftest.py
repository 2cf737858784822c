"""Shared fixtures: the bundled demo model and a CLI runner that captures stderr apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tgis.config import DEMO_MODEL

# Triton decides when a kernel is defined (`triton.jit`, as its module is imported) whether it
# is compiled for a GPU or run by Triton's CPU interpreter. Without a CUDA device the paged
# engine's Triton kernels (tgis.backends.paged.triton_attention) are tested through the
# interpreter, so the switch is set here, before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Servers the suite starts decode eagerly unless a test asks for the compiled decode (on by
# default on a CPU): a first start would build its packages for minutes in another process.
os.environ.setdefault("TGIS_COMPILE", "false")

ROOT = Path(__file__).resolve().parent.parent


def _share_of_the_cores() -> None:
    """Under pytest-xdist (`make test` runs a worker per core), each worker keeps to its own
    share of the cores: tgis sizes torch's threads (and its servers' and shards') from the
    affinity mask, which child processes inherit, so workers do not oversubscribe the CPU."""
    worker, count = (
        os.environ.get("PYTEST_XDIST_WORKER"),
        os.environ.get("PYTEST_XDIST_WORKER_COUNT"),
    )
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cores, workers = sorted(os.sched_getaffinity(0)), int(count)
    if workers < 2 or len(cores) < workers:
        return
    share = cores[int(worker.removeprefix("gw")) % workers :: workers]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


_share_of_the_cores()


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    path = Path(DEMO_MODEL)
    assert (path / "config.json").is_file(), "the bundled demo model is missing from tgis/assets"
    return path


def pytest_sessionstart(session: pytest.Session) -> None:
    """Print pytest-randomly's seed under -q too (`make test`): quiet runs hide the header
    that shows it, and an order-dependent failure can only be replayed with it."""
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or config.get_verbosity() >= 0:
        return  # no terminal, or the header already shows the seed
    if config.pluginmanager.hasplugin("randomly"):
        reporter.write_line(f"Using --randomly-seed={config.getoption('randomly_seed')}")


def run_tgis(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run `python -m tgis ARGS` in a clean environment of launcher variables."""
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("MAX_", "HF_", "TGIS_", "MODEL_"))
    }
    base["TGIS_COMPILE"] = "false"  # as the suite's own (above), unless `env` says
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "tgis", *args],
        capture_output=True,
        text=True,
        env=base,
        timeout=timeout,
        cwd=ROOT,
    )
