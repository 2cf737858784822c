"""The tpu backend: the static batch on a torch-xla device (a TPU, or the CPU with
PJRT_DEVICE=CPU, where the same XLA programs compile and run).

Each step traces the fixed-shape forward (static/kv.py) and ends with a sync (`mark_step`):
XLA compiles one program per bucket the first time it is met and replays it afterwards, so
after warmup no request recompiles (tests_xla count compilations with torch-xla's metrics).
With a compile cache directory, compiled programs persist across processes: `tgis warmup`
fills it and a following `tgis serve` loads instead of compiling.

torch-xla pins its own torch (2.9.0 for torch-xla 2.9.0): install it with the `tpu` extra in
an environment of its own (`make test-xla` builds one).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tgis.errors import BackendUnavailableError

logger = logging.getLogger(__name__)

_CACHE_STATE: dict[str, str] = {}


def import_xla() -> Any:
    """The torch_xla module, or BackendUnavailableError with the install line."""
    try:
        import torch_xla
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the tpu backend needs torch-xla, which is not installed ({exc})",
            "pip install 'tgis[tpu]' in an environment with torch==2.9.0 (see docs/backends.md)",
        ) from None
    return torch_xla


def initialize_compile_cache(directory: Path | None) -> Path | None:
    """Persist compiled XLA programs under `directory` (created). Must run before the first
    XLA computation of the process; a second call with the same directory does nothing, with
    another one it is an error (the runtime keeps the first)."""
    if directory is None:
        return None
    import_xla()
    import torch_xla.runtime as xr

    path = Path(directory).expanduser().resolve()
    previous = _CACHE_STATE.get("dir")
    if previous is not None:
        if previous != str(path):
            raise BackendUnavailableError(
                f"the XLA compile cache is already {previous} in this process, not {path}",
                "use one --compile-cache per process",
            )
        return path
    path.mkdir(parents=True, exist_ok=True)
    xr.initialize_cache(str(path), readonly=False)
    _CACHE_STATE["dir"] = str(path)
    logger.info("XLA compile cache: %s", path)
    return path


class XlaOps:
    """DeviceOps for torch-xla: inputs go to the XLA device, a step ends with a sync."""

    def __init__(self) -> None:
        torch_xla = import_xla()
        import torch_xla.debug.metrics as met

        self._torch_xla = torch_xla
        self._metrics = met
        self.device: torch.device = torch_xla.device()
        self.name = "tpu"

    def sync(self) -> None:
        """Cut the traced graph here and execute it (compiling it the first time)."""
        self._torch_xla.sync()

    def compilations(self) -> int:
        """XLA programs compiled by this process so far (loads from the persistent cache
        are not compilations)."""
        data = self._metrics.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def platform(self) -> str:
        """The PJRT device kind: TPU, CPU, ..."""
        import torch_xla.runtime as xr

        return str(xr.device_type())
