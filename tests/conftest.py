"""Shared fixtures: the bundled demo model and a CLI runner that captures stderr apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tgis.config import DEMO_MODEL

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    path = Path(DEMO_MODEL)
    assert (path / "config.json").is_file(), "the bundled demo model is missing from tgis/assets"
    return path


def run_tgis(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run `python -m tgis ARGS` in a clean environment of launcher variables."""
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("MAX_", "HF_", "TGIS_", "MODEL_"))
    }
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "tgis", *args],
        capture_output=True,
        text=True,
        env=base,
        timeout=timeout,
        cwd=ROOT,
    )
